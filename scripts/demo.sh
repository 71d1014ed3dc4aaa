#!/usr/bin/env bash
# The main job: install (scripts/install.sh: its own virtual environment, the tested versions), train a tiny DAT
# language model on Shakespeare, save it, reload it with AutoModelForCausalLM and generate with
# pipeline("text-generation"). A first run takes about 8 minutes on 2 idle CPU cores (README.md, "Install and run").
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[demo] a first run installs (about 4 minutes), builds the CPU kernels once (1-2), then trains (2-3; later runs" \
     "only this); busy cores take longer"
bash scripts/install.sh
source scripts/venv.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python scripts/demo.py "$@"
