#!/usr/bin/env bash
# The test command (make test, .ci/run). pytest's exit 5 ("no tests collected") is a failure.
# Two pytest-xdist workers (PYTEST_WORKERS=0 for one process), one test file at a time each, the
# files that build whole trees first (tests/conftest.py); built trees are shared between the
# workers (tests/repo_copies.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests -- fix: check tests/ and the -k/-m selection" >&2
  exit 1
fi
exit "$rc"
