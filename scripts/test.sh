#!/usr/bin/env bash
# The test suite (default: fast tests; `bash scripts/test.sh -m slow` runs the on-demand quality runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
