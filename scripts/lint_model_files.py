#!/usr/bin/env python
"""Lint the model files that go to the Hub as remote code with `transformers-mlinter` (the TRF rules of
Transformers' model files).

    python scripts/lint_model_files.py [--keep_dir DIR] [--json FILE]

Which files: what `save_pretrained` copies beside the weights, for every family. For each dat_hf class registered
for an Auto class (configs, models, the image processor) or as a custom pipeline, that is its module and every module
it imports as `from .module import X`, recursively (Transformers' `custom_object_save`); nothing is listed by hand.
`configuration_*`, `modeling_*` and `image_processing_*` files are linted under their own names; the modules they
import (attention, symbols, masks, cache, kernel hooks, the pipeline) are copied as `modeling_<name>.py`, so that
mlinter applies the modeling rules to them too.

The license header is the one documented exception. dat_hf is MIT-licensed and every model file starts with the MIT
header (`Licensed under the MIT License ...`); TRF028 asks for the Apache-2.0 warranty paragraph ("You may obtain a
copy of the License at ... limitations under the License."), which has no place in an MIT header. So TRF028 stays in
the report, once per file, and is accepted for a file that carries the MIT header. Any other finding (or a TRF028 on
a file without the MIT header) fails the check: the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # lint this checkout's dat_hf, not an installed copy

ACCEPTED_RULE = "TRF028"
MIT_HEADER = "Licensed under the MIT License"
LINTED_AS_IS = ("configuration_", "modeling_", "image_processing_")


def remote_code_files() -> list[Path]:
    """Every file that `save_pretrained` copies for some dat_hf class, sorted."""
    import dat_hf
    from transformers.dynamic_module_utils import get_relative_import_files

    files = set()
    for name in dat_hf.__all__:
        cls = getattr(dat_hf, name)
        if not isinstance(cls, type):
            continue
        if getattr(cls, "_auto_class", None) is None and getattr(cls, "_registered_impl", None) is None:
            continue
        module_file = Path(sys.modules[cls.__module__].__file__).resolve()
        files.add(module_file)
        files.update(Path(path).resolve() for path in get_relative_import_files(module_file))
    return sorted(files)


def lint_name(path: Path) -> str:
    """The name a file is linted under: its own for model files, `modeling_<name>.py` for the modules they import."""
    return path.name if path.name.startswith(LINTED_AS_IS) else f"modeling_{path.name}"


def has_mit_header(path: Path) -> bool:
    return MIT_HEADER in "".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[:25])


def lint(folder: Path) -> list[dict]:
    """mlinter's findings (`{"path", "line", "rule", "message"}`) for every model file in `folder`."""
    report = folder / "mlinter.json"
    command = [sys.executable, "-m", "mlinter", "--no-progress", "--no-cache", "--output-json", str(report),
               str(folder)]
    result = subprocess.run(command, capture_output=True, text=True)
    if not report.is_file():
        raise RuntimeError(f"mlinter did not run (exit {result.returncode}):\n{result.stdout}{result.stderr}")
    return json.loads(report.read_text(encoding="utf-8"))["findings"]


def lint_files(files: list[Path], keep_dir: str | None = None) -> tuple[list[dict], list[dict], dict[str, Path]]:
    """Copy `files` into one folder under their lint names and lint them -> (accepted findings, failing findings,
    {linted name: source file}). Each finding gets `source`, the file it is about."""
    folder = Path(keep_dir or tempfile.mkdtemp(prefix="dat_hf_lint_"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        sources = {}
        for path in files:
            name = lint_name(path)
            shutil.copyfile(path, folder / name)
            sources[name] = path
        accepted, failing = [], []
        for finding in lint(folder):
            source = sources.get(Path(finding["path"]).name)
            finding["source"] = _shown(source) if source else finding["path"]
            if finding["rule"] == ACCEPTED_RULE and source is not None and has_mit_header(source):
                accepted.append(finding)
            else:
                failing.append(finding)
        return accepted, failing, sources
    finally:
        if keep_dir is None:
            shutil.rmtree(folder, ignore_errors=True)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def check(keep_dir: str | None = None) -> tuple[list[dict], list[dict], dict[str, Path]]:
    """Lint the remote-code files (see `lint_files`)."""
    return lint_files(remote_code_files(), keep_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep_dir", default=None, help="Lint in this folder and keep it (default: a temp folder).")
    parser.add_argument("--json", default=None, help="Also write the findings to this JSON file.")
    args = parser.parse_args(argv)
    accepted, failing, sources = check(args.keep_dir)
    print(f"Linted {len(sources)} files: " + ", ".join(sorted(_shown(path) for path in sources.values())))
    for finding in sorted(accepted + failing, key=lambda f: (f["source"], f["line"], f["rule"])):
        status = "accepted" if finding in accepted else "FAIL"
        print(f"{finding['source']}:{finding['line']}: [{status}] {finding['message']}")
    counts = {}
    for finding in accepted + failing:
        counts[finding["rule"]] = counts.get(finding["rule"], 0) + 1
    print("Per rule: " + (", ".join(f"{rule} x{n}" for rule, n in sorted(counts.items())) or "none"))
    if args.json:
        Path(args.json).write_text(json.dumps({"accepted": accepted, "failing": failing}, indent=2), encoding="utf-8")
    if failing:
        print(f"{len(failing)} finding(s) besides the MIT license header ({ACCEPTED_RULE}).")
        return 1
    print(f"OK: only {ACCEPTED_RULE} (MIT license header, documented exception) on {len(accepted)} file(s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
