"""The model files pass `transformers-mlinter` (scripts/lint_model_files.py): nothing but the documented MIT-header
exception (TRF028) on any file `save_pretrained` copies as remote code, and the docstrings `auto_docstring` generates
from them are complete (importing prints no undocumented-argument error) and read right."""

import os
import re
import subprocess
import sys

import pytest
import torch

from lm_helpers import REPO_ROOT, import_script
from conftest import WHERE
from remote_code import run_without_dat_hf

from dat_hf import (
    DATConfig,
    DATEncoderConfig,
    DATForCausalLM,
    DATForImageClassification,
    DATForSeq2SeqLM,
    DATForTokenClassification,
    DATImageProcessor,
    DATModel,
    DATSeq2SeqConfig,
    DATVisionConfig,
)
from dat_hf.modeling_dat import DATCausalLMOutputWithPast

lint = import_script("lint_model_files")
publish = import_script("publish")

TINY = dict(hidden_size=32, num_hidden_layers=1, num_sensory_heads=2, num_relational_heads=2, intermediate_size=64,
            num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=16)


def saved_python_files(tmp_path) -> set[str]:
    """The `.py` files that saving a tiny model of every family (and the image processor) writes."""
    torch.manual_seed(0)
    objects = [
        DATForCausalLM(DATConfig(vocab_size=16, **TINY)),
        DATForTokenClassification(DATEncoderConfig(vocab_size=16, num_labels=2, **TINY)),
        DATForImageClassification(DATVisionConfig(image_size=8, patch_size=4, num_channels=1, num_labels=2, **TINY)),
        DATForSeq2SeqLM(DATSeq2SeqConfig(vocab_size=16, encoder_layers=1, **TINY)),
        DATImageProcessor(size={"height": 8, "width": 8}),
    ]
    names = set()
    for i, obj in enumerate(objects):
        folder = tmp_path / str(i)
        obj.save_pretrained(folder)
        names |= {path.name for path in folder.glob("*.py")}
    return names


def test_linted_files_are_the_remote_code(tmp_path):
    files = lint.remote_code_files()
    names = {path.name for path in files}
    assert all(path.parent == REPO_ROOT / "dat_hf" for path in files), files
    # what saving every family writes, plus the pipeline module (written by `pipeline.save_pretrained`)
    assert names == saved_python_files(tmp_path) | {"pipeline_text2text.py"}
    assert set(publish.remote_code_files()) <= names
    assert lint.lint_name(REPO_ROOT / "dat_hf" / "dual_attention.py") == "modeling_dual_attention.py"
    assert lint.lint_name(REPO_ROOT / "dat_hf" / "image_processing_dat.py") == "image_processing_dat.py"


def test_model_files_report_only_the_mit_header():
    accepted, failing, sources = lint.check()
    assert not failing, "\n".join(f"{f['source']}:{f['line']}: {f['message']}" for f in failing)
    # one TRF028 per file: every file was linted and carries the MIT header
    assert len(sources) >= 15
    assert sorted(f["source"] for f in accepted) == sorted(lint._shown(path) for path in sources.values())
    assert {f["rule"] for f in accepted} == {"TRF028"}


def test_lint_fails_on_other_rules_and_on_files_without_the_mit_header(tmp_path):
    header = (REPO_ROOT / "dat_hf" / "modeling_dat.py").read_text().split('"""')[0]
    assert "Licensed under the MIT License" in header
    legacy = tmp_path / "legacy_attention.py"  # linted as modeling_legacy_attention.py
    legacy.write_text(header + "import torch\n\n\nclass LegacyAttention(torch.nn.Module):\n"
                      "    def forward(self, hidden_states, output_attentions=False):\n        return hidden_states\n")
    no_header = tmp_path / "no_header.py"
    no_header.write_text('"""A module without a license header."""\n\nX = 1\n')
    accepted, failing, _ = lint.lint_files([legacy, no_header])
    assert [(f["rule"], f["source"]) for f in accepted] == [("TRF028", str(legacy))]
    assert sorted((f["rule"], f["source"]) for f in failing) == [("TRF028", str(no_header)),
                                                                 ("TRF045", str(legacy))]


@pytest.mark.integration
def test_import_prints_no_docstring_errors():
    """`auto_docstring` prints `[ERROR] ... not documented` for every undocumented argument when the modules load."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", "import dat_hf"], capture_output=True, text=True, env=env,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == "", result.stdout + result.stderr


def test_generated_docstrings():
    config_doc = DATConfig.__doc__
    assert config_doc.startswith("Configuration of [`DATModel`] and [`DATForCausalLM`]")
    for line in ("num_relational_heads (`int`, *optional*, defaults to `4`):",
                 "relational_attn_implementation (`str`, *optional*):",
                 "hidden_act (`str`, *optional*, defaults to `swiglu`):",
                 "vocab_size (`int`, *optional*, defaults to `32000`):"):
        assert line in config_doc
    assert ">>> model = DATForCausalLM(config)" in config_doc
    # the shared fields show each config's own defaults
    vision_doc = DATVisionConfig.__doc__
    assert "hidden_act (`str`, *optional*, defaults to `gelu`):" in vision_doc
    assert "relative_symbols_2d (`bool`, *optional*, defaults to `False`):" in vision_doc
    assert "encoder_layers (`int`, *optional*, defaults to `4`):" in DATSeq2SeqConfig.__doc__

    forward_doc = DATModel.forward.__doc__
    for line in ("input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):",
                 "graph_adjacency (`torch.BoolTensor` of shape `(batch_size, sequence_length, sequence_length)`",
                 "[`DATModelOutputWithPast`] (a tuple with `return_dict=False`)"):
        assert line in forward_doc
    assert "Targets of the next-token loss" in DATForCausalLM.forward.__doc__
    assert "node_features (`torch.FloatTensor`" in DATForTokenClassification.forward.__doc__
    output_doc = DATCausalLMOutputWithPast.__doc__
    # Transformers' own text for the inherited field: `torch.FloatTensor` in 5.17, `torch.Tensor` in 5.23
    assert re.search(r"loss \(`torch\.(Float)?Tensor` of shape `\(1,\)`, \*optional\*, returned when `labels` is "
                     r"provided\):", output_doc)
    assert "relations (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):" in output_doc
    assert "num_sensory_heads +\n" in output_doc  # `attentions` cover every head
    assert "do_convert_grayscale (`bool`" in DATImageProcessor.__doc__
    for doc in (config_doc, vision_doc, forward_doc, output_doc, DATModel.__doc__, DATImageProcessor.__doc__):
        # what the generic texts give for a model outside Transformers' model folders (no model name, config class
        # or checkpoint to fill in): the custom intros and `Returns` sections replace them
        for generic in ("[`None`]", "None Model", "{model_name}", "image_processor_class", "huggingface.co/None"):
            assert generic not in doc


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", ["DATConfig", "DATModel", "DATForCausalLM"])
def test_docstrings_of_remote_code_copies(name, where, tmp_path, capfd):
    """The remote-code copies (a package of the copied files, no dat_hf) generate the same docstrings, silently."""
    package = f"remote_dat_{name.lower()}"  # (a package name of its own: in this process, modules stay imported)
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    for path in lint.remote_code_files():
        (tmp_path / package / path.name).write_text(path.read_text())
    module = "configuration_dat" if name.endswith("Config") else "modeling_dat"
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {package}.{module} as m; "
            f"sys.path.remove({str(tmp_path)!r}); print(m.{name}.__doc__, end='')")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    capfd.readouterr()
    stdout = run_without_dat_hf(where, code, [], cwd=tmp_path, env=env)
    assert capfd.readouterr().err == ""
    import dat_hf

    assert stdout == getattr(dat_hf, name).__doc__
