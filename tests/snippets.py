"""Python code blocks of Markdown files, and running them in a fresh interpreter (`run_snippets`: the user's view, in
the integration run) or in this process (`run_in_process`: the default suite; no interpreter start, ~6 s each) (shared
by the documentation and model card tests).

A block is a fenced ```python block (also `py`, `python3`). Its info string may add `no-run`
(```` ```python no-run ````): the block is only compiled, never run (GPU code, multi-node launches, placeholders).
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import random
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

PYTHON_LANGUAGES = {"python", "py", "python3"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass
class Snippet:
    path: str  # the Markdown file, as shown in messages
    line: int  # 1-based line of the block's first code line
    code: str
    run: bool  # False for `no-run` blocks

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def extract_snippets(text: str, path: str) -> list[Snippet]:
    """The Python blocks of a Markdown text, in order. Raises ValueError on an unclosed fence."""
    snippets, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, words = match["fence"], match["info"].strip().split()
        start, i = i + 1, i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start}: unclosed code fence")
        if words and words[0].lower() in PYTHON_LANGUAGES:
            indent = len(match["indent"])
            code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[start:i])
            snippets.append(Snippet(path, start + 1, code + "\n", run="no-run" not in words[1:]))
        i += 1
    return snippets


# Runs a file's blocks one after the other in one namespace (like a doctest session). Each block is compiled under
# the Markdown file's name with its own line numbers, so a traceback points into the Markdown file.
RUNNER = r'''
import json, linecache, sys, traceback
snippets = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for snippet in snippets:
    print(f"@@ running {snippet['where']}", flush=True)
    source = "\n" * (snippet["line"] - 1) + snippet["code"]
    linecache.cache[snippet["path"]] = (len(source), None, source.splitlines(True), snippet["path"])
    try:
        exec(compile(source, snippet["path"], "exec"), namespace)
    except BaseException:
        print(f"@@ FAILED {snippet['where']}", flush=True)
        traceback.print_exc()
        sys.exit(1)
print("@@ all snippets ran", flush=True)
'''


def offline_env(pythonpath: str | None, **extra) -> dict:
    """The environment of a snippet process: offline Hub, one thread, no display; `pythonpath` replaces
    PYTHONPATH (None: no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", **extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def run_snippets(snippets: list[Snippet], workdir: Path, env: dict, prelude: str = "", timeout: float = 600):
    """Run `snippets` in order in one fresh interpreter with cwd `workdir` and stdin closed (an interactive prompt
    fails instead of waiting). `prelude` runs first (e.g. to make `import dat_hf` fail). Returns the
    CompletedProcess; its stdout says `@@ FAILED <file>:<line>` before the traceback of a failing block."""
    workdir.mkdir(parents=True, exist_ok=True)
    blocks = [{"path": s.path, "line": s.line, "code": s.code, "where": s.where} for s in snippets]
    (workdir / "snippets.json").write_text(json.dumps(blocks))
    (workdir / "run_snippets.py").write_text(prelude + RUNNER)
    return subprocess.run([sys.executable, str(workdir / "run_snippets.py"), str(workdir / "snippets.json")],
                          cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def failure_message(proc) -> str:
    failed = re.search(r"^@@ FAILED (.+)$", proc.stdout, re.M)
    where = failed.group(1) if failed else "(before the first snippet)"
    return f"snippet at {where} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@contextlib.contextmanager
def isolated(workdir: Path):
    """This process as a fresh interpreter would leave it, as far as snippets reach: cwd `workdir`, and afterwards
    the previous cwd, the environment, the torch/numpy/random generators and dat_hf's relational-bias registry."""
    import numpy as np
    import torch

    from dat_hf.relational_biases import RELATIONAL_BIASES

    workdir.mkdir(parents=True, exist_ok=True)
    cwd, environ, biases = os.getcwd(), dict(os.environ), dict(RELATIONAL_BIASES)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    os.chdir(workdir)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        RELATIONAL_BIASES.clear()
        RELATIONAL_BIASES.update(biases)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def run_in_process(snippets: list[Snippet], workdir: Path, within=contextlib.nullcontext) -> dict:
    """Run `snippets` in order in one new `__main__` namespace in this process, `isolated` in `workdir`, inside the
    context `within()` (e.g. `remote_code.without_dat_hf`); each block compiled under its Markdown file's name and line
    numbers (tracebacks point into the file). Returns the namespace; a failing block raises AssertionError naming
    `<file>:<line>` with the traceback."""
    namespace = {"__name__": "__main__"}
    with isolated(workdir), within():
        for snippet in snippets:
            source = "\n" * (snippet.line - 1) + snippet.code
            linecache.cache[snippet.path] = (len(source), None, source.splitlines(True), snippet.path)
            try:
                exec(compile(source, snippet.path, "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"snippet at {snippet.where} failed:\n{traceback.format_exc()}") from error
    return namespace
