"""Remote code without dat_hf: `without_dat_hf()` makes this process one where dat_hf is not installed, for loading a
saved folder's code in the default suite; `run_without_dat_hf` runs a script that way, or (the integration run) in a
fresh interpreter that blocks `import dat_hf`, as a Hub user without dat_hf runs it (`conftest.WHERE` parametrizes a
test by the two)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


def _from_dat_hf(obj) -> bool:
    if isinstance(obj, (tuple, list)):
        return any(_from_dat_hf(item) for item in obj)
    return getattr(obj, "__module__", None) is not None and obj.__module__.split(".")[0] == "dat_hf"


def _auto_mappings():
    """Transformers' Auto mappings (configs, models, processors): where `import dat_hf` registers its classes."""
    from transformers.models.auto import auto_factory, configuration_auto, image_processing_auto, modeling_auto

    seen = []
    for module in (configuration_auto, image_processing_auto, modeling_auto, auto_factory):
        for value in vars(module).values():
            if isinstance(getattr(value, "_extra_content", None), dict) and not any(value is m for m in seen):
                seen.append(value)
    return seen


@contextlib.contextmanager
def without_dat_hf():
    """Within the block `import dat_hf` (or any of its modules) fails, and what `import dat_hf` registered with
    Transformers' Auto mappings is unregistered, so Transformers takes a folder's code as it does where dat_hf is not
    installed (a registered class would win over `trust_remote_code`). Both are restored afterwards; objects made
    before keep working (they hold their modules)."""
    modules = {name: module for name, module in sys.modules.items() if name == "dat_hf" or name.startswith("dat_hf.")}
    registered = [(mapping, {key: value for key, value in mapping._extra_content.items()
                             if _from_dat_hf(key) or _from_dat_hf(value)}) for mapping in _auto_mappings()]
    for name in modules:
        del sys.modules[name]
    sys.modules["dat_hf"] = None  # (`import dat_hf` raises ImportError)
    for mapping, entries in registered:
        for key in entries:
            del mapping._extra_content[key]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if name == "dat_hf" or name.startswith("dat_hf.")]:
            del sys.modules[name]
        sys.modules.update(modules)
        for mapping, entries in registered:
            mapping._extra_content.update(entries)


def run_without_dat_hf(where: str, code: str, args, cwd, env: dict | None = None, timeout: float = 300) -> str:
    """Run the script `code` (it reads `sys.argv[1:]`, the str of each of `args`, and prints its results) where dat_hf
    cannot be imported: in this process (`where="in-process"`: `without_dat_hf`, cwd `cwd`, stdout captured) or in a
    fresh interpreter that blocks `import dat_hf` (`"fresh-interpreter"`: `env`, default this one's without
    PYTHONPATH). -> its stdout; a failure raises AssertionError with its output (in-process: the exception itself)."""
    argv = [str(arg) for arg in args]
    if where == "in-process":
        from snippets import isolated

        saved_argv, out = sys.argv, io.StringIO()
        sys.argv = ["-c", *argv]
        try:
            with isolated(Path(cwd)), without_dat_hf(), contextlib.redirect_stdout(out):
                exec(compile(code, "<script>", "exec"), {"__name__": "__main__"})
        finally:
            sys.argv = saved_argv
        return out.getvalue()
    assert where == "fresh-interpreter", where
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    block = 'import sys; sys.modules["dat_hf"] = None  # (`import dat_hf` fails, installed or not)\n'
    proc = subprocess.run([sys.executable, "-c", block + code, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    sys.stderr.write(proc.stderr)  # (as the in-process run's would be: a test may capture it)
    return proc.stdout
