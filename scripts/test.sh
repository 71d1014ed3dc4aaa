#!/usr/bin/env bash
# The test suite on two workers (pytest-xdist; DAT_HF_TEST_WORKERS=N for another count, 0 for one process), in the
# virtual environment scripts/install.sh sets up (.venv/, or DAT_HF_VENV=PATH; see there for DAT_HF_CONSTRAINTS).
# Default: the fast suite (neither marker below). `bash scripts/test.sh -m integration` runs the tests that start
# processes (torchrun, servers, whole scripts, fresh interpreters, kernel rebuilds, wheel installs; CI runs them),
# `-m slow` the on-demand quality runs; any other pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/venv.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -n "${DAT_HF_TEST_WORKERS:-2}" --dist loadgroup "$@"
