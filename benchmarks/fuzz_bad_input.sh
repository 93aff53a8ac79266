#!/usr/bin/env bash
# More bad input than `make test` draws (150 cases per test there): N cases per test, default 5000.
#   bash benchmarks/fuzz_bad_input.sh 5000
set -euo pipefail
cd "$(dirname "$0")/.."
ULTRASCALE_BAD_INPUT_EXAMPLES="${1:-5000}" .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_bad_input.py
