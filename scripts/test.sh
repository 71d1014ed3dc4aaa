#!/usr/bin/env bash
# The test suite (default: fast tests; `bash scripts/test.sh -m slow` runs the on-demand quality runs), in the
# virtual environment scripts/install.sh sets up (.venv/, or DAT_HF_VENV=PATH; see there for DAT_HF_CONSTRAINTS).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/venv.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
