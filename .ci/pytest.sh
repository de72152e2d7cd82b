#!/usr/bin/env bash
# The test command (make test, .ci/run). pytest's exit 5 ("no tests collected") is a failure.
# Two pytest-xdist workers (PYTEST_WORKERS=0 for one process), one test file at a time each, in the
# order tests/conftest.py sets (the file of the one whole-DAG build first); built trees are shared
# between the workers (tests/repo_copies.py). A passing test's tmp_path is removed when it ends
# (many tests copy the 1.3 GB built tree: kept, a run left ~30 GB in /tmp); a failing one's stays.
# The 25 slowest items are listed at the end (docs/testing.md: the time budget).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  -o tmp_path_retention_policy=failed --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests -- fix: check tests/ and the -k/-m selection" >&2
  exit 1
fi
exit "$rc"
