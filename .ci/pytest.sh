#!/usr/bin/env bash
# The test command (make test, .ci/run). pytest's exit 5 ("no tests collected") is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests -- fix: check tests/ and the -k/-m selection" >&2
  exit 1
fi
exit "$rc"
