"""The fused input projection: one matrix product for every projection of a DAT layer's input gives what the
projections give one by one (values and gradients), and wrapped projections (hooks, adapters) run one by one."""

import pytest
import torch
from conftest import tiny_config
from torch import nn

import dat_hf.kernels.projections as projections
from dat_hf import DATForCausalLM
from dat_hf.dual_attention import fused_linear

CONFIGS = {
    "default": {},
    "shared-qk": dict(share_attention_params=True),
    "symmetric-relations": dict(symmetric_relations=True),
    "kv-bias-gqa": dict(attention_bias=True, num_sensory_key_value_heads=1, num_relational_key_value_heads=1),
    "relational-only": dict(num_sensory_heads=0, num_relational_heads=4),
    "sensory-only": dict(num_sensory_heads=4, num_relational_heads=0),
    "relative-symbols-no-rope": dict(symbol_retrieval="position_relative", position_embedding_type="learned"),
    "relation-activation-eager": dict(relation_activation="tanh", attn_implementation="eager"),
}


@pytest.mark.parametrize("biases", [(False, False), (True, False), (True, True)])
def test_fused_linear_matches_the_linears_one_by_one(biases):
    torch.manual_seed(0)
    linears = [nn.Linear(8, out, bias=bias).double() for out, bias in zip((5, 3), biases)]
    x = torch.randn(2, 40, 8, dtype=torch.float64, requires_grad=True)  # 80 rows: fused
    fused = fused_linear(linears, x)
    grad = torch.randn_like(fused)
    got = torch.autograd.grad(fused, [x, *[p for m in linears for p in m.parameters()]], grad)
    separate = torch.cat([m(x) for m in linears], dim=-1)
    expected = torch.autograd.grad(separate, [x, *[p for m in linears for p in m.parameters()]], grad)
    assert fused.shape == (2, 40, 8) and (fused - separate).abs().max() < 1e-12
    for g, e in zip(got, expected):
        assert g.shape == e.shape and (g - e).abs().max() < 1e-12


def test_fused_linear_runs_wrapped_and_short_inputs_one_by_one():
    linears = [nn.Linear(8, 4), nn.Linear(8, 4)]
    calls = []
    linears[1].register_forward_hook(lambda module, args, out: calls.append(args[0].shape) or out * 0)
    x = torch.randn(100, 8)
    out = fused_linear(linears, x)
    assert calls == [(100, 8)] and out[:, 4:].abs().max() == 0  # the hook ran and its output was used
    linears = [nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)]
    weight_cat = []
    original_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        weight_cat.append(any(t is linears[0].weight for t in tensors))
        return original_cat(tensors, *args, **kwargs)

    torch.cat = counting_cat
    try:
        fused_linear(linears, torch.randn(projections.FUSED_PROJECTION_MIN_ROWS - 1, 8))  # short: outputs concatenated
        fused_linear(linears, torch.randn(projections.FUSED_PROJECTION_MIN_ROWS, 8))  # long enough: weights concatenated
    finally:
        torch.cat = original_cat
    assert weight_cat == [False, True]


def test_the_reference_runs_the_projections_one_by_one():
    """Remote code alone (`fused_linear`'s reference): the projections one by one, outputs concatenated, the values
    of the installed one-matrix-product kernel."""
    torch.manual_seed(0)
    linears = [nn.Linear(8, 5), nn.Linear(8, 3, bias=False)]
    x = torch.randn(3, 40, 8)
    assert torch.allclose(fused_linear.reference(linears, x), projections.concatenated_linear(linears, x), atol=1e-6)


def assert_fused_equals_one_by_one(model, inputs, monkeypatch):
    """Logits and every parameter gradient agree whether projections run fused or one by one (counted with a hook:
    the one-by-one run calls more linears)."""

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(**inputs).logits
        logits.pow(2).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    linear_calls = []
    hook = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: linear_calls.append(module) if isinstance(module, nn.Linear) else None)
    try:
        fused_logits, fused_grads = run()
        fused_calls = len(linear_calls)
        monkeypatch.setattr(projections, "FUSED_PROJECTION_MIN_ROWS", 10**9)
        linear_calls.clear()
        logits, grads = run()
    finally:
        hook.remove()
    assert (fused_logits - logits).abs().max() < 1e-10
    assert fused_grads.keys() == grads.keys()
    for key in grads:
        assert (fused_grads[key] - grads[key]).abs().max() < 1e-10, key
    return len(linear_calls) - fused_calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_fused_equals_one_by_one(name, monkeypatch):
    overrides = dict(CONFIGS[name])
    attn = overrides.pop("attn_implementation", "sdpa")
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.2, **overrides, attn_implementation=attn)).double()
    input_ids = torch.randint(0, 97, (2, 40))  # 80 rows: above FUSED_PROJECTION_MIN_ROWS
    extra_calls = assert_fused_equals_one_by_one(model, dict(input_ids=input_ids), monkeypatch)
    projections = len(model.model.layers[0].dual_attn.input_projections.projections)
    assert extra_calls == model.config.num_hidden_layers * projections  # the fused product calls no module


@pytest.mark.parametrize("name", ["default", "dual-cross", "only-cross-relational", "unshared-untied-gqa"])
def test_seq2seq_fused_equals_one_by_one(name, monkeypatch):
    """Self-attention and cross-attention projections (target queries, source keys and values) of DATForSeq2SeqLM."""
    from test_seq2seq import CONFIGS as SEQ2SEQ_CONFIGS
    from test_seq2seq import padded_batch, seq2seq_config

    from dat_hf import DATForSeq2SeqLM

    torch.manual_seed(0)
    config = seq2seq_config(**SEQ2SEQ_CONFIGS[name], encoder_max_position_embeddings=40, max_position_embeddings=40)
    model = DATForSeq2SeqLM(config).double()
    source, source_mask = padded_batch(config.encoder_vocab_size or config.vocab_size, lengths=(40, 33))
    target, _ = padded_batch(config.vocab_size, lengths=(36, 36), seed=1)
    inputs = dict(input_ids=source, attention_mask=source_mask, decoder_input_ids=target)
    assert assert_fused_equals_one_by_one(model, inputs, monkeypatch) > 0
