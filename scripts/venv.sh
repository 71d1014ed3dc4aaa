# Sourced by scripts/install.sh, test.sh and demo.sh: the virtual environment dat_hf runs in, made if missing, then
# activated. Default: .venv/ in the checkout (its own); DAT_HF_VENV=PATH names another (made there if missing).
DAT_HF_VENV="${DAT_HF_VENV:-$PWD/.venv}"
if [ ! -x "$DAT_HF_VENV/bin/python" ]; then
  echo "[install] creating the virtual environment $DAT_HF_VENV (set DAT_HF_VENV to use another)"
  python3 -m venv "$DAT_HF_VENV" || {
    echo "[install] 'python3 -m venv' failed: install Python's venv module (Debian/Ubuntu: apt-get install" \
         "python3-venv) or set DAT_HF_VENV to an existing virtual environment" >&2
    exit 1
  }
fi
# shellcheck disable=SC1091
source "$DAT_HF_VENV/bin/activate"
