"""Every Python block of the documentation runs: README.md, docs/**/*.md and the other Markdown files of the repository
(model card templates excepted: `tests/test_model_cards.py` renders and runs those).

Each Markdown file's blocks run in order in one namespace, like a doctest session: a block may use names defined by
an earlier block of the same file, never of another file. The README's blocks are the exception: each runs alone,
since a reader copies any one of them. The default suite runs them in this process (`snippets.run_in_process`: a new
namespace per file, an empty temporary folder as cwd, the generators and the bias registry restored after), the
integration run in a fresh interpreter each, as a reader runs them: in an empty temporary folder, with the Hub offline
(`HF_HUB_OFFLINE=1`), one thread, stdin closed (an interactive `trust_remote_code` prompt fails) and this checkout's
`dat_hf` first on the path. A failure names the Markdown file and the line of the failing block.

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
STANDALONE = {"README.md"}  # files whose every block runs alone
RUNNABLE = sorted(name for name, snippets in DOCS.items() if any(s.run for s in snippets) and name not in STANDALONE)
ALONE = [s for name in sorted(STANDALONE) for s in DOCS.get(name, []) if s.run]
NO_RUN = [s for snippets in DOCS.values() for s in snippets if not s.run]


def test_the_documentation_is_collected():
    assert "README.md" in DOCS and any(name.startswith("docs/") for name in DOCS)
    assert len([s for s in ALONE if s.path == "README.md"]) >= 5  # the quick start and the Examples


@pytest.mark.parametrize("name", RUNNABLE)
def test_markdown_python_blocks_run_in_process(name, tmp_path):
    snippets = [s for s in DOCS[name] if s.run]
    namespace = run_in_process(snippets, tmp_path)
    assert namespace["__name__"] == "__main__" and len(namespace) > 2


@pytest.mark.parametrize("snippet", ALONE, ids=[s.where for s in ALONE])
def test_block_runs_alone_in_process(snippet, tmp_path):
    """A README block in a namespace of its own, with no earlier block run: its imports and objects are its own."""
    run_in_process([snippet], tmp_path)


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
@pytest.mark.parametrize("name", RUNNABLE)
def test_markdown_python_blocks_run(name, tmp_path):
    snippets = [s for s in DOCS[name] if s.run]
    proc = run_snippets(snippets, tmp_path, offline_env(str(REPO_ROOT)))
    assert proc.returncode == 0 and "@@ all snippets ran" in proc.stdout, failure_message(proc)
    assert proc.stdout.count("@@ running ") == len(snippets)


@pytest.mark.integration
@pytest.mark.parametrize("snippet", ALONE, ids=[s.where for s in ALONE])
def test_block_runs_alone(snippet, tmp_path):
    """A README block in a fresh interpreter, with no earlier block run: its imports and objects are its own."""
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
