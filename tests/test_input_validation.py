"""Bad forward inputs of every family raise one ValueError naming the argument (with what was expected and what was
received) before reaching torch; valid but unusual inputs (left padding, all-padding rows, isolated graph nodes,
fp16 / bf16, int32 ids, bool / float masks) pass and give finite, correct outputs. The checks are installed by
`import dat_hf` into the model files' hook point and are not part of a saved folder's remote code, which runs
unchecked and gives the same outputs. Config errors and the older input errors (mask shapes, positions, graphs,
caches) are in test_errors.py."""

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import WHERE, tiny_config
from remote_code import run_without_dat_hf
from safetensors.torch import load_file, save_file
from test_seq2seq import seq2seq_config
from test_vision import vision_config
from torch.testing import assert_close

import dat_hf
from dat_hf import (
    DATEncoderConfig,
    DATForCausalLM,
    DATForImageClassification,
    DATForSeq2SeqLM,
    DATForSequenceClassification,
    DATForTokenClassification,
    input_validation,
)
from dat_hf.kernel_hooks import INPUT_CHECKS

VOCAB, SEQ2SEQ_VOCAB, SOURCE_VOCAB, NUM_NODE_FEATURES = 97, 50, 40, 5


def seeded(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture(scope="module")
def models():
    return {
        "lm": seeded(DATForCausalLM, tiny_config(position_embedding_type="learned")),
        "seq_cls": seeded(DATForSequenceClassification, tiny_config(num_labels=3, pad_token_id=0)),
        "multi_label": seeded(DATForSequenceClassification, tiny_config(
            num_labels=3, pad_token_id=0, problem_type="multi_label_classification")),
        "regression": seeded(DATForSequenceClassification, tiny_config(num_labels=1, pad_token_id=0)),
        "token_cls": seeded(DATForTokenClassification, DATEncoderConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
            intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, relational_bias="graph",
            position_embedding_type="none", num_node_features=NUM_NODE_FEATURES, num_labels=3)),
        "vision": seeded(DATForImageClassification, vision_config()),
        "seq2seq": seeded(DATForSeq2SeqLM, seq2seq_config(share_embeddings=False, tie_word_embeddings=False,
                                                          encoder_vocab_size=SOURCE_VOCAB)),
    }


def ids(batch=2, length=5, high=VOCAB, dtype=torch.long):
    return torch.randint(1, high, (batch, length), generator=torch.Generator().manual_seed(0)).to(dtype)


def ones(*shape, dtype=torch.long):
    return torch.ones(*shape, dtype=dtype)


def full_graph(batch=1, n=4):
    return torch.ones(batch, n, n, dtype=torch.bool)


def src(batch=2, length=5):
    return ids(batch, length, SOURCE_VOCAB)


def tgt(batch=2, length=3):
    return ids(batch, length, SEQ2SEQ_VOCAB)


# (model, inputs, argument named in the message, more of the message)
BAD_INPUTS = {
    # causal LM: ids, embeddings, labels, masks, positions
    "lm-id-too-large": ("lm", lambda: dict(input_ids=ids().index_fill(1, torch.tensor([2]), VOCAB)), "input_ids",
                        r"token ids in \[0, 96\] \(`vocab_size` = 97\), got values in \[\d+, 97\]"),
    "lm-id-negative": ("lm", lambda: dict(input_ids=ids().index_fill(1, torch.tensor([0]), -3)), "input_ids",
                       r"got values in \[-3, "),
    "lm-float-ids": ("lm", lambda: dict(input_ids=ids().float()), "input_ids", "got dtype torch.float32"),
    "lm-bool-ids": ("lm", lambda: dict(input_ids=ids() > 3), "input_ids", "got dtype torch.bool"),
    "lm-int16-ids": ("lm", lambda: dict(input_ids=ids(dtype=torch.int16)), "input_ids", "torch.long or torch.int"),
    "lm-ids-3d": ("lm", lambda: dict(input_ids=ids()[None]), "input_ids", r"\[batch, seq_len\], got shape \[1, 2, 5\]"),
    "lm-ids-list": ("lm", lambda: dict(input_ids=[[1, 2, 3]]), "input_ids", "a tensor .*got list"),
    "lm-empty-batch": ("lm", lambda: dict(input_ids=ids(0, 5)), "input_ids", r"is empty \(shape \[0, 5\]"),
    "lm-empty-sequence": ("lm", lambda: dict(input_ids=ids(2, 0)), "input_ids", r"is empty \(shape \[2, 0\]"),
    "lm-embeds-wrong-width": ("lm", lambda: dict(inputs_embeds=torch.randn(2, 5, 31)), "inputs_embeds",
                              r"\[batch, seq_len, 32\] \(`hidden_size` = 32\), got shape \[2, 5, 31\]"),
    "lm-embeds-integer": ("lm", lambda: dict(inputs_embeds=ones(2, 5, 32)), "inputs_embeds", "floating.*torch.int64"),
    "lm-embeds-2d": ("lm", lambda: dict(inputs_embeds=torch.randn(5, 32)), "inputs_embeds", r"got shape \[5, 32\]"),
    "lm-embeds-empty": ("lm", lambda: dict(inputs_embeds=torch.randn(2, 0, 32)), "inputs_embeds", "is empty"),
    "lm-labels-wrong-shape": ("lm", lambda: dict(input_ids=ids(), labels=ids(2, 4)), "labels",
                              r"of shape \[2, 5\].*got shape \[2, 4\]"),
    "lm-labels-too-large": ("lm", lambda: dict(input_ids=ids(), labels=ids().index_fill(1, torch.tensor([1]), 200)),
                            "labels", r"\[0, 96\] \(`vocab_size` = 97\) or -100 \(ignored\), got label 200"),
    "lm-labels-negative": ("lm", lambda: dict(input_ids=ids(), labels=ids().index_fill(1, torch.tensor([1]), -5)),
                           "labels", "got label -5"),
    "lm-labels-negative-beside-ignored": (
        "lm", lambda: dict(input_ids=ids(), labels=ids().index_fill(1, torch.tensor([0]), -100).index_fill(
            1, torch.tensor([3]), -2)), "labels", "got label -2"),
    "lm-labels-float": ("lm", lambda: dict(input_ids=ids(), labels=ids().float()), "labels", "torch.long.*float32"),
    "lm-labels-int32": ("lm", lambda: dict(input_ids=ids(), labels=ids(dtype=torch.int32)), "labels",
                        "torch.long.*int32"),
    "lm-mask-holds-2": ("lm", lambda: dict(input_ids=ids(), attention_mask=ones(2, 5).index_fill(1, torch.tensor([4]), 2)),
                        "attention_mask", r"0/1 values \(1 = token, 0 = padding\), got values \[2\]"),
    "lm-mask-negative": ("lm", lambda: dict(input_ids=ids(), attention_mask=-ones(2, 5)), "attention_mask",
                         r"got values \[-1\]"),
    "lm-mask-fractional": ("lm", lambda: dict(input_ids=ids(), attention_mask=ones(2, 5, dtype=torch.float) / 2),
                           "attention_mask", r"got values \[0.5\]"),
    "lm-mask-complex": ("lm", lambda: dict(input_ids=ids(), attention_mask=ones(2, 5, dtype=torch.complex64)),
                        "attention_mask", "bool, integer or float mask, got dtype torch.complex64"),
    "lm-positions-float": ("lm", lambda: dict(input_ids=ids(), position_ids=torch.arange(5.0)[None]), "position_ids",
                           "integer tensor .*got dtype torch.float32"),
    "lm-positions-negative": ("lm", lambda: dict(input_ids=ids(), position_ids=torch.arange(5)[None] - 2),
                              "position_ids", "non-negative positions, got position -2"),
    "lm-positions-wrong-batch": ("lm", lambda: dict(input_ids=ids(), position_ids=torch.arange(5).expand(3, 5)),
                                 "position_ids", r"got shape \[3, 5\]"),
    # sequence classification: labels for each problem type
    "seq-cls-label-too-large": ("seq_cls", lambda: dict(input_ids=ids(), labels=torch.tensor([0, 3])), "labels",
                                r"\[0, 2\] \(`num_labels` = 3\).*got label 3"),
    "seq-cls-one-label-too-many": ("seq_cls", lambda: dict(input_ids=ids(), labels=torch.tensor([0, 1, 2])), "labels",
                                   r"one class index per example \(\[2\]\), got shape \[3\]"),
    "seq-cls-int32-labels": ("seq_cls", lambda: dict(input_ids=ids(), labels=torch.tensor([0, 1], dtype=torch.int32)),
                             "labels", "torch.long"),
    "multi-label-wrong-shape": ("multi_label", lambda: dict(input_ids=ids(), labels=torch.ones(2, 2)), "labels",
                                r"\[2, 3\] .*multi-label classification, got shape \[2, 2\]"),
    "multi-label-integer-targets": ("multi_label", lambda: dict(input_ids=ids(), labels=ones(2, 3)), "labels",
                                    "float targets for multi label classification, got dtype torch.int64"),
    "seq-cls-id-too-large": ("seq_cls", lambda: dict(input_ids=ids() + VOCAB), "input_ids", "vocab_size"),
    "regression-integer-targets": ("regression", lambda: dict(input_ids=ids(), labels=torch.tensor([1, 2])), "labels",
                                   "float targets for regression, got dtype torch.int64"),
    "regression-wrong-count": ("regression", lambda: dict(input_ids=ids(), labels=torch.randn(3)), "labels",
                               r"2 regression targets.*got shape \[3\]"),
    # token (node) classification
    "token-cls-node-features-wrong-width": (
        "token_cls", lambda: dict(node_features=torch.randn(1, 4, 7), graph_adjacency=full_graph()), "node_features",
        r"\[batch, seq_len, 5\] \(`num_node_features` = 5\), got shape \[1, 4, 7\]"),
    "token-cls-node-features-integer": (
        "token_cls", lambda: dict(node_features=ones(1, 4, 5), graph_adjacency=full_graph()), "node_features",
        "floating"),
    "token-cls-node-features-2d": ("token_cls", lambda: dict(node_features=torch.randn(4, 5)), "node_features",
                                   r"got shape \[4, 5\]"),
    "token-cls-no-nodes": ("token_cls", lambda: dict(node_features=torch.randn(1, 0, 5),
                                                     graph_adjacency=full_graph(1, 0)), "node_features", "is empty"),
    "token-cls-node-features-and-ids": ("token_cls", lambda: dict(input_ids=ids(1, 4), node_features=torch.randn(1, 4, 5)),
                                        "node_features", "only one of `input_ids`, `inputs_embeds` or"),
    "token-cls-label-too-large": (
        "token_cls", lambda: dict(node_features=torch.randn(1, 4, 5), graph_adjacency=full_graph(),
                                  labels=torch.tensor([[0, 1, 2, 3]])), "labels", r"\[0, 2\].*got label 3"),
    "token-cls-labels-wrong-shape": (
        "token_cls", lambda: dict(node_features=torch.randn(1, 4, 5), graph_adjacency=full_graph(),
                                  labels=torch.tensor([0, 1, 2, 0])), "labels", r"\[1, 4\].*got shape \[4\]"),
    "token-cls-adjacency-wrong-shape": (
        "token_cls", lambda: dict(node_features=torch.randn(1, 4, 5), graph_adjacency=full_graph(1, 3)),
        "graph_adjacency", r"\[1, 4, 4\], got \[1, 3, 3\]"),
    "token-cls-id-too-large": ("token_cls", lambda: dict(input_ids=ids(1, 4) + VOCAB, graph_adjacency=full_graph()),
                               "input_ids", "vocab_size"),
    # vision
    "vision-uint8-pixels": ("vision", lambda: dict(pixel_values=ones(2, 1, 16, 16, dtype=torch.uint8)),
                            "pixel_values", "floating-point tensor .*got dtype torch.uint8"),
    "vision-3d-pixels": ("vision", lambda: dict(pixel_values=torch.randn(1, 16, 16)), "pixel_values",
                         r"\[batch, channels, height, width\], got shape \[1, 16, 16\]"),
    "vision-no-pixels": ("vision", lambda: dict(pixel_values=None), "pixel_values", "got None"),
    "vision-empty-batch": ("vision", lambda: dict(pixel_values=torch.randn(0, 1, 16, 16)), "pixel_values",
                           r"is empty \(shape \[0, 1, 16, 16\]"),
    "vision-image-without-pixels": ("vision", lambda: dict(pixel_values=torch.randn(1, 1, 0, 16),
                                                           interpolate_pos_encoding=True), "pixel_values",
                                    "not divisible by the patch size 4x4"),
    "vision-labels-wrong-count": ("vision", lambda: dict(pixel_values=torch.randn(2, 1, 16, 16),
                                                         labels=torch.tensor([0, 1, 2])), "labels",
                                  r"\(\[2\]\), got shape \[3\]"),
    "vision-labels-float-wrong-shape": ("vision", lambda: dict(pixel_values=torch.randn(2, 1, 16, 16),
                                                               labels=torch.tensor([0.0, 1.0])), "labels",
                                        "multi-label"),
    # seq2seq: source, target, labels, masks, encoder outputs
    "seq2seq-source-id-too-large": ("seq2seq", lambda: dict(input_ids=src() + SOURCE_VOCAB, decoder_input_ids=tgt()),
                                    "input_ids", r"\[0, 39\] \(`encoder_vocab_size` = 40\)"),
    "seq2seq-source-float-ids": ("seq2seq", lambda: dict(input_ids=src().float(), decoder_input_ids=tgt()),
                                 "input_ids", "dtype torch.float32"),
    "seq2seq-target-id-too-large": ("seq2seq", lambda: dict(input_ids=src(), decoder_input_ids=tgt() + SEQ2SEQ_VOCAB),
                                    "decoder_input_ids", r"\[0, 49\] \(`vocab_size` = 50\)"),
    "seq2seq-target-float-ids": ("seq2seq", lambda: dict(input_ids=src(), decoder_input_ids=tgt().double()),
                                 "decoder_input_ids", "dtype torch.float64"),
    "seq2seq-empty-source": ("seq2seq", lambda: dict(input_ids=src(2, 0), decoder_input_ids=tgt()), "input_ids",
                             r"is empty \(shape \[2, 0\]"),
    "seq2seq-empty-target": ("seq2seq", lambda: dict(input_ids=src(), decoder_input_ids=tgt(2, 0)),
                             "decoder_input_ids", r"is empty \(shape \[2, 0\]"),
    "seq2seq-empty-batch": ("seq2seq", lambda: dict(input_ids=src(0, 5), decoder_input_ids=tgt(0, 3)), "input_ids",
                            "is empty"),
    "seq2seq-empty-labels": ("seq2seq", lambda: dict(input_ids=src(), labels=tgt(2, 0)), "labels", "is empty"),
    "seq2seq-label-too-large": ("seq2seq", lambda: dict(input_ids=src(), labels=tgt() + SEQ2SEQ_VOCAB), "labels",
                                r"\[0, 49\] \(`vocab_size` = 50\) or -100"),
    "seq2seq-float-labels": ("seq2seq", lambda: dict(input_ids=src(), labels=tgt().float()), "labels", "torch.long"),
    "seq2seq-labels-1d": ("seq2seq", lambda: dict(input_ids=src(), labels=tgt()[0]), "labels",
                          r"\[batch, target_len\], got shape \[3\]"),
    "seq2seq-source-mask-holds-2": ("seq2seq", lambda: dict(input_ids=src(), attention_mask=2 * ones(2, 5),
                                                            decoder_input_ids=tgt()), "attention_mask", "0/1 values"),
    "seq2seq-target-mask-holds-2": ("seq2seq", lambda: dict(input_ids=src(), decoder_input_ids=tgt(),
                                                            decoder_attention_mask=2 * ones(2, 3)),
                                    "decoder_attention_mask", "0/1 values"),
    "seq2seq-source-embeds-wrong-width": ("seq2seq", lambda: dict(inputs_embeds=torch.randn(2, 5, 16),
                                                                  decoder_input_ids=tgt()), "inputs_embeds",
                                          r"got shape \[2, 5, 16\]"),
    "seq2seq-target-embeds-wrong-width": ("seq2seq", lambda: dict(input_ids=src(),
                                                                  decoder_inputs_embeds=torch.randn(2, 3, 16)),
                                          "decoder_inputs_embeds", r"got shape \[2, 3, 16\]"),
    "seq2seq-encoder-outputs-wrong-width": ("seq2seq", lambda: dict(encoder_outputs=(torch.randn(2, 5, 16),),
                                                                    decoder_input_ids=tgt()), "encoder_outputs",
                                            r"got shape \[2, 5, 16\]"),
    "seq2seq-target-positions-float": ("seq2seq", lambda: dict(input_ids=src(), decoder_input_ids=tgt(),
                                                               decoder_position_ids=torch.arange(3.0)[None]),
                                       "decoder_position_ids", "integer tensor"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_value_error_naming_the_argument(models, case):
    family, make_inputs, argument, details = BAD_INPUTS[case]
    with pytest.raises(ValueError) as error:
        models[family](**make_inputs())
    message = str(error.value)
    assert f"`{argument}`" in message, message
    assert re.search(details, message), message


@pytest.mark.parametrize("family, call, argument", [
    ("lm", lambda m: m.generate(ids(1, 4) + VOCAB, max_new_tokens=2), "input_ids"),
    ("lm", lambda m: m.generate(ids(1, 4), attention_mask=2 * ones(1, 4), max_new_tokens=2), "attention_mask"),
    ("seq2seq", lambda m: m.generate(src(1, 0), max_new_tokens=2), "input_ids"),
    ("seq2seq", lambda m: m.generate(src(1, 4) + SOURCE_VOCAB, max_new_tokens=2), "input_ids"),
])
def test_generate_checks_the_prompt(models, family, call, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        call(models[family])


def test_validation_off_lets_bad_input_through_to_torch(models, monkeypatch):
    """The switch used by scripts/benchmark_validation.py: with it off, the same input fails inside torch."""
    monkeypatch.setattr(input_validation, "ENABLED", False)
    with pytest.raises(IndexError):
        models["lm"](input_ids=ids() + VOCAB)


def test_mask_with_2s_is_refused(models):
    """A mask of 2s would count every token twice in the positions (wrong logits without an error): refused."""
    x = ids(1, 5)
    with pytest.raises(ValueError, match="`attention_mask` must be 0/1 values"):
        models["lm"](input_ids=x, attention_mask=2 * ones(1, 5))


# ---- valid but unusual inputs ------------------------------------------------------------------------------------
@torch.no_grad()
def test_left_padding_and_all_padding_rows(models):
    """Left padding gives the unpadded logits; a row of padding only is finite and changes no other row; bool,
    integer and float masks agree; int32 ids equal int64 ones."""
    model = models["lm"]
    x = ids(1, 4)
    alone = model(input_ids=x).logits
    batch = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), x], 1), ids(1, 6)])
    for mask_dtype in (torch.long, torch.bool, torch.float32):
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=mask_dtype)
        logits = model(input_ids=batch, attention_mask=mask).logits
        assert_close(logits[0, 2:], alone[0], atol=1e-5, rtol=1e-4)
        assert torch.isfinite(logits).all()
    assert torch.equal(model(input_ids=x.int()).logits, alone)
    classifier = models["seq_cls"]
    assert torch.isfinite(classifier(input_ids=batch, attention_mask=mask.long()).logits).all()


@torch.no_grad()
def test_source_row_of_padding_only(models):
    model = models["seq2seq"]
    x, y = src(2, 5), tgt(2, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    logits = model(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
    assert torch.isfinite(logits).all()
    alone = model(input_ids=x[:1, :3], decoder_input_ids=y[:1]).logits
    assert_close(logits[:1], alone, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_isolated_graph_nodes(models):
    """A node without any edge (not even to itself) gets finite logits, and its features reach no other node."""
    model = models["token_cls"]
    adjacency = full_graph(1, 4).clone()
    adjacency[0, 3, :] = adjacency[0, :, 3] = False
    features = torch.randn(1, 4, NUM_NODE_FEATURES)
    logits = model(node_features=features, graph_adjacency=adjacency).logits
    assert torch.isfinite(logits).all()
    moved = features.clone()
    moved[0, 3] += 10
    assert_close(model(node_features=moved, graph_adjacency=adjacency).logits[0, :3], logits[0, :3])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.no_grad()
def test_half_precision_inputs(models, dtype):
    """fp16 / bf16 models take their own dtype's embeddings, pixels and masks: finite, close to fp32."""
    lm = models["lm"]
    x, mask = ids(2, 5), torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=dtype)
    expected = lm(input_ids=x, attention_mask=mask.long()).logits
    half = seeded(DATForCausalLM, lm.config).to(dtype)
    got = half(inputs_embeds=half.get_input_embeddings()(x), attention_mask=mask).logits
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert_close(got.float(), expected, atol=0.1, rtol=0.1)
    vision = seeded(DATForImageClassification, models["vision"].config).to(dtype)
    assert torch.isfinite(vision(pixel_values=torch.randn(2, 1, 16, 16, dtype=dtype)).logits).all()
    seq2seq = seeded(DATForSeq2SeqLM, models["seq2seq"].config).to(dtype)
    out = seq2seq(input_ids=src(), attention_mask=mask, decoder_input_ids=tgt())
    assert torch.isfinite(out.logits).all()


def test_compiled_forward_skips_value_checks_only():
    """Under torch.compile (full graph) the checks of shapes and dtypes are traced and the value checks skipped:
    no graph break, same loss as eager."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(position_embedding_type="learned")).train()
    x, mask = ids(2, 8), ones(2, 8)
    mask[0, :2] = 0
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert_close(compiled(input_ids=x, attention_mask=mask, labels=x).loss,
                 model(input_ids=x, attention_mask=mask, labels=x).loss)


# ---- where the checks live: installed by `import dat_hf`, not in the remote code ---------------------------------
PACKAGE_DIR = Path(dat_hf.__file__).parent
MODEL_FILES = ("modeling_dat.py", "modeling_dat_encoder.py", "modeling_dat_vision.py", "modeling_dat_seq2seq.py",
               "cache_dat.py")


def called_checks() -> set[str]:
    """The names of the checks the model files call (`check_inputs("name", ...)`)."""
    names = set()
    for name in MODEL_FILES:
        for node in ast.walk(ast.parse((PACKAGE_DIR / name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_inputs":
                names.add(node.args[0].value)
    return names


def test_every_called_check_is_installed():
    """A name the model files call but `import dat_hf` does not install would skip its check silently."""
    assert called_checks() == set(INPUT_CHECKS), called_checks() ^ set(INPUT_CHECKS)
    assert INPUT_CHECKS["text_inputs"] is input_validation.validate_text_inputs


REMOTE_CHILD = r'''
import json, sys
from pathlib import Path
sys.modules["dat_hf"] = None  # `import dat_hf` fails: everything comes from the saved folders' code
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSeq2SeqLM

work = Path(sys.argv[1])
inputs = load_file(work / "inputs.safetensors")
outputs, report = {}, {}
with torch.no_grad():
    lm = AutoModelForCausalLM.from_pretrained(work / "lm", trust_remote_code=True).eval()
    vision = AutoModelForImageClassification.from_pretrained(work / "vision", trust_remote_code=True).eval()
    seq2seq = AutoModelForSeq2SeqLM.from_pretrained(work / "seq2seq", trust_remote_code=True).eval()
    report["classes"] = [type(m).__module__ for m in (lm, vision, seq2seq)]
    outputs["lm"] = lm(input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits
    outputs["vision"] = vision(pixel_values=inputs["pixels"]).logits
    outputs["seq2seq"] = seq2seq(input_ids=inputs["source"], decoder_input_ids=inputs["target"]).logits
    try:  # unchecked: a mask of 2s is not refused
        lm(input_ids=inputs["ids"], attention_mask=2 * inputs["mask"])
        report["mask_of_2s"] = "ran"
    except ValueError as error:
        report["mask_of_2s"] = str(error)
report["modules"] = sorted(name.rsplit(".", 1)[-1] for name in sys.modules if name.startswith("transformers_modules."))
save_file(outputs, str(work / "outputs.safetensors"))
(work / "report.json").write_text(json.dumps(report))
'''


@torch.no_grad()
@pytest.mark.parametrize("where", WHERE)
def test_remote_code_runs_unchecked_with_the_same_outputs(models, tmp_path, where):
    """A saved folder's remote code holds no input checks (input_validation.py is not copied); loaded in a process
    without dat_hf it runs every family with the same logits as dat_hf's classes, and takes a bad input unchecked,
    as Transformers' own models do. In this process (dat_hf imported) the same input is refused."""
    inputs = {"ids": ids(2, 5), "mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
              "pixels": torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)),
              "source": src(), "target": tgt()}
    for family in ("lm", "vision", "seq2seq"):
        models[family].save_pretrained(tmp_path / family)
        copied = {path.name for path in (tmp_path / family).glob("*.py")}
        assert "kernel_hooks.py" in copied and "input_validation.py" not in copied, copied
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    run_without_dat_hf(where, REMOTE_CHILD, [tmp_path], cwd=tmp_path, env=env)
    report, outputs = json.loads((tmp_path / "report.json").read_text()), load_file(tmp_path / "outputs.safetensors")
    assert all(module.startswith("transformers_modules.") for module in report["classes"]), report["classes"]
    assert "kernel_hooks" in report["modules"] and "input_validation" not in report["modules"], report["modules"]
    expected = {"lm": models["lm"](input_ids=inputs["ids"], attention_mask=inputs["mask"]).logits,
                "vision": models["vision"](pixel_values=inputs["pixels"]).logits,
                "seq2seq": models["seq2seq"](input_ids=inputs["source"], decoder_input_ids=inputs["target"]).logits}
    for family, logits in expected.items():
        # (float32: here dat_hf's CPU kernels may run, there the PyTorch references, which sum in other orders)
        assert_close(outputs[family], logits, atol=1e-5, rtol=1e-5)
    assert report["mask_of_2s"] == "ran"
    with pytest.raises(ValueError, match="`attention_mask` must be 0/1 values"):
        models["lm"](input_ids=inputs["ids"], attention_mask=2 * inputs["mask"])
