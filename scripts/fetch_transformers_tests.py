#!/usr/bin/env python
"""Fetch Transformers' common model tests (`ModelTesterMixin`, `ConfigTester`) for the installed Transformers version.

    python scripts/fetch_transformers_tests.py            # into .cache/transformers-tests/<version>/
    python scripts/fetch_transformers_tests.py --force    # fetch again

The files come from the source distribution of that version on the package index
(`pip download --no-deps --no-binary :all: transformers==<version>`); the test files that
`tests/test_transformers_common.py` imports are extracted into a package `transformers_tests` under the cache folder
(outside git). Quick when they are already there.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version as installed_version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = REPO_ROOT / ".cache" / "transformers-tests"
PACKAGE = "transformers_tests"
# the sdist's `tests/` files the common tests need
TEST_FILES = ("test_modeling_common.py", "test_configuration_common.py")


def tests_package_dir(version: str | None = None) -> Path:
    """The folder of the `transformers_tests` package for `version` (default: the installed Transformers)."""
    return CACHE_ROOT / (version or installed_version("transformers")) / PACKAGE


def is_fetched(version: str | None = None) -> bool:
    package = tests_package_dir(version)
    return all((package / name).is_file() for name in ("__init__.py", *TEST_FILES))


def download_sdist(version: str, folder: Path) -> Path:
    """Download the source distribution of `transformers==version` into `folder` -> the archive's path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-binary", ":all:", f"transformers=={version}", "-d", str(folder)],
        check=True,
    )
    archives = sorted(folder.glob(f"transformers-{version}.tar.gz"))
    if not archives:
        raise FileNotFoundError(f"pip downloaded no transformers-{version}.tar.gz into {folder}.")
    return archives[0]


def extract_tests(archive: Path, version: str, package: Path):
    """Write the sdist's `tests/<name>` for every name in TEST_FILES, plus an empty `__init__.py`, into `package`.
    The folder appears whole or not at all (written aside, then renamed)."""
    staging = package.with_name(package.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for name in TEST_FILES:
            member = tar.extractfile(f"transformers-{version}/tests/{name}")
            if member is None:
                raise FileNotFoundError(f"`tests/{name}` is not in {archive.name}.")
            (staging / name).write_bytes(member.read())
    (staging / "__init__.py").write_text("")
    shutil.rmtree(package, ignore_errors=True)
    staging.rename(package)


def fetch(version: str | None = None, force: bool = False) -> Path:
    """Make sure the common tests of `version` are in the cache -> the package folder."""
    version = version or installed_version("transformers")
    package = tests_package_dir(version)
    where = package.parent.relative_to(REPO_ROOT)
    if is_fetched(version) and not force:
        print(f"Transformers {version} common tests: already in {where}")
        return package
    print(f"Transformers {version} common tests: downloading the sdist from the package index into {where}")
    with tempfile.TemporaryDirectory() as tmp:
        extract_tests(download_sdist(version, Path(tmp)), version, package)
    return package


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="Transformers version (default: the installed one)")
    parser.add_argument("--force", action="store_true", help="fetch again even when the files are there")
    args = parser.parse_args(argv)
    fetch(args.version, args.force)


if __name__ == "__main__":
    main()
