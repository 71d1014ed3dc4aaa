#!/usr/bin/env python
"""The carried wheels that a machine needs (`scripts/gpu_checks.sh` installs only these):

    python3 scripts/wheels_to_install.py DIR      prints the paths of DIR/*.whl to install, one a line

A wheel is needed where its distribution is missing or installed at an older version than the wheel's; a package the
machine already has at that version or newer is not installed again (its own build, e.g. a CUDA torch, stays). Each
decision is printed on stderr. Standard library only (and `packaging` where installed, for version order).
"""

import re
import sys
from importlib import metadata
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str):
    try:
        from packaging.version import Version

        return Version(version)
    except ImportError:  # (without packaging: numeric release parts)
        return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:4])


def installed_versions() -> dict:
    return {canonical(dist.metadata["Name"]): dist.version for dist in metadata.distributions()
            if dist.metadata["Name"]}


def decide(wheel: Path, installed: dict) -> tuple[bool, str]:
    """(install?, why) for one wheel file (name-version-...whl, PEP 427)."""
    parts = wheel.name[:-len(".whl")].split("-")
    if len(parts) < 5:
        return False, f"{wheel.name}: not a wheel file name (name-version-python-abi-platform.whl): skipped"
    name, version = parts[0], parts[1]
    have = installed.get(canonical(name))
    if have is None:
        return True, f"{name} {version}: missing here, installing"
    if version_key(have) < version_key(version):
        return True, f"{name} {version}: here {have} (older), installing"
    return False, f"{name} {version}: here {have}, not installed"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    installed = installed_versions()
    for wheel in sorted(Path(argv[0]).glob("*.whl")):
        needed, why = decide(wheel, installed)
        print(f"[wheels] {why}", file=sys.stderr)
        if needed:
            print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
