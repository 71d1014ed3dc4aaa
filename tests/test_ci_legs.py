"""tests/ci_legs.txt, the list of which CI legs run each test module (.ci/run runs each leg with `--ci-leg`, which
selects by it), holds every test module, each in a leg CI runs, and agrees with the module's markers: one of
`integration`, `floor-integration`, `newest-integration` where the module marks tests `integration` (or runs them in a
fresh interpreter through `conftest.WHERE`), `slow` where it marks tests `slow`, `tested` unless the whole module is
marked out of the default suite; and `--ci-leg` selects as the file says."""

import re
import tokenize
import types
from pathlib import Path

from conftest import ci_legs, in_ci_leg

REPO_ROOT = Path(__file__).resolve().parents[1]
INTEGRATION_LEGS = {"integration", "floor-integration", "newest-integration"}
LEGS = {"floor", "newest", "tested", "slow"} | INTEGRATION_LEGS
RUN_BY_CI = LEGS - {"slow"}


def test_every_module_is_listed_in_a_leg_ci_runs():
    rows = ci_legs()
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
    for module, legs in ci_legs().items():
        source = code_of(REPO_ROOT / "tests" / module)
        whole = re.search(r"^pytestmark *= *\[? *pytest *\. *mark *\. *(slow|integration)\b", source, re.M)
        integration = bool(re.search(r"mark *\. *integration\b|\bWHERE\b", source))
        assert bool(set(legs) & INTEGRATION_LEGS) == integration, (
            f"{module}: {'add' if integration else 'remove'} a leg of its integration tests (`integration`, "
            "`floor-integration` or `newest-integration`) in tests/ci_legs.txt (its markers say so)")
        expected = {"slow": bool(re.search(r"mark *\. *slow\b", source)), "tested": whole is None}
        for leg, marked in expected.items():
            assert (leg in legs) == marked, (f"{module}: {'add' if marked else 'remove'} the leg `{leg}` in "
                                             "tests/ci_legs.txt (its markers say so)")


def test_a_ci_leg_selects_as_the_file_says():
    item = types.SimpleNamespace(path=Path("tests/test_x.py"), get_closest_marker=lambda name: None)
    integration = types.SimpleNamespace(path=item.path, get_closest_marker=lambda name: name == "integration" or None)
    legs = {"test_x.py": ["floor", "tested", "newest-integration"]}
    assert in_ci_leg(item, "floor", legs) and not in_ci_leg(item, "newest", legs)
    assert not in_ci_leg(item, "integration", legs)
    assert in_ci_leg(integration, "newest", legs) and not in_ci_leg(integration, "floor", legs)
    assert not in_ci_leg(integration, "integration", legs)  # (once: in the newest leg)
    assert in_ci_leg(integration, "integration", {"test_x.py": ["tested", "integration"]})


def test_ci_runs_each_leg_by_the_file():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "tests/ci_legs.txt" in ci and "VERSION_MODULES=(" not in ci
    for leg in ("floor", "newest", "integration"):
        assert f"--ci-leg {leg}" in ci, leg
