#!/usr/bin/env bash
# The main job: install (scripts/install.sh: its own virtual environment, the tested versions), train a tiny DAT
# language model on Shakespeare (a couple of CPU minutes), save it, reload it with AutoModelForCausalLM and generate
# with pipeline("text-generation").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/venv.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python scripts/demo.py "$@"
