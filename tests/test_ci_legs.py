"""tests/ci_legs.txt, the list of which CI legs run each test module (.ci/run reads its floor and newest legs from it),
holds every test module, each in a leg CI runs, and agrees with the module's markers: `integration` where the module
marks tests `integration` (or runs them in a fresh interpreter through `remote_code.WHERE`), `slow` where it marks
tests `slow`, `tested` unless the whole module is marked out of the default suite."""

import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LEGS_FILE = REPO_ROOT / "tests" / "ci_legs.txt"
LEGS = {"floor", "newest", "tested", "integration", "slow"}
RUN_BY_CI = LEGS - {"slow"}


def listed() -> dict[str, list[str]]:
    rows = {}
    for line in LEGS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, *legs = line.split()
            assert module not in rows, f"{module} is listed twice in {LEGS_FILE.name}"
            rows[module] = legs
    return rows


def test_every_module_is_listed_in_a_leg_ci_runs():
    rows = listed()
    modules = {path.name for path in (REPO_ROOT / "tests").glob("test_*.py")}
    assert modules - set(rows) == set(), f"add these modules to tests/ci_legs.txt: {sorted(modules - set(rows))}"
    assert set(rows) - modules == set(), f"listed, but no such module: {sorted(set(rows) - modules)}"
    for module, legs in rows.items():
        assert set(legs) <= LEGS, f"{module}: unknown legs {sorted(set(legs) - LEGS)}"
        assert set(legs) & RUN_BY_CI, f"{module} runs in no CI leg (only {legs})"


def code_of(path: Path) -> str:
    """The module's code without its strings and comments (where marker names may be mentioned, not used)."""
    with tokenize.open(path) as f:
        tokens = [token for token in tokenize.generate_tokens(f.readline)
                  if token.type not in (tokenize.STRING, tokenize.COMMENT)]
    return tokenize.untokenize((token.type, token.string) for token in tokens)


def test_the_legs_agree_with_the_markers():
    for module, legs in listed().items():
        source = code_of(REPO_ROOT / "tests" / module)
        whole = re.search(r"^pytestmark *= *\[? *pytest *\. *mark *\. *(slow|integration)\b", source, re.M)
        expected = {"integration": bool(re.search(r"mark *\. *integration\b|\bWHERE\b", source)),
                    "slow": bool(re.search(r"mark *\. *slow\b", source)), "tested": whole is None}
        for leg, marked in expected.items():
            assert (leg in legs) == marked, (f"{module}: {'add' if marked else 'remove'} the leg `{leg}` in "
                                             "tests/ci_legs.txt (its markers say so)")


def test_ci_reads_its_legs_from_the_file():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "tests/ci_legs.txt" in ci and "VERSION_MODULES=(" not in ci
