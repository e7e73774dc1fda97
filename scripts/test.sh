#!/usr/bin/env bash
# Set up and run the tests (what CI runs). Exit status is pytest's; "no tests ran" (5) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5)" >&2
  exit 1
fi
exit $rc
