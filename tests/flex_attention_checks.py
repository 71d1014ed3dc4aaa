"""Checks of the `flex_attention` backends on CUDA, where FlexAttention compiles to Triton and has a backward (PyTorch
has none on CPU, so the default suite checks FlexAttention's forward only). Run by `scripts/gpu_checks.sh flex`, or on
a CUDA machine `python -m pytest tests/flex_attention_checks.py`:

- tiny decoders and encoders with `attn_implementation="flex_attention"` (sensory and relational heads on
  FlexAttention) give the `eager` models' outputs and parameter gradients in float32 for every relational bias
  (causal, one- and two-sided sliding windows, sparse blocks with global tokens, a per-instance graph, GQA), with
  padding and a node without neighbours (outputs finite everywhere);
- greedy generation with a KV cache equals eager generation, and so does compiled decoding over a static cache
  (one graph, CUDA graphs on CUDA; its BlockMasks made inside the step from the masks built ahead);
- DAT-343M's attention shapes (8 sensory + 8 relational heads over 4 kv heads, relational values of width
  64 + 8 x 64 = 576, which go to FlexAttention in chunks of 128, 128, 128, 128 and 64 on CUDA) compile and run forward
  and backward in bfloat16 at 2048 tokens, within bfloat16 rounding of float32 eager; the first call's compile time
  is printed.

`DAT_HF_FLEX_CHECKS_DEVICE=cpu` runs the file on CPU to check the file itself without a GPU: forwards only (no
FlexAttention backward there), static shapes (PyTorch's CPU FlexAttention kernels fail to compile for dynamic ones),
the large shapes at 256 tokens.
"""

import os
import time
import warnings

import pytest
import torch
from conftest import set_torch_config

from dat_hf import DATConfig, DATEncoderConfig, DATEncoderModel, DATForCausalLM, DATModel
from dat_hf.dual_attention import RelationalAttention
from dat_hf.training import load_preset_config

DEVICE = torch.device(os.environ.get("DAT_HF_FLEX_CHECKS_DEVICE", "cuda"))
GRADIENTS = DEVICE.type == "cuda"
ATOL = 2e-5

BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
            intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64,
            initializer_range=0.2)


@pytest.fixture(autouse=True)
def _compiler_settings(request):
    """For each test only (CI runs this file in one process with other modules): every configuration below compiles
    FlexAttention again (Dynamo recompiles per shape and mask; past the recompile limit it would run it uncompiled);
    on CPU static shapes only (PyTorch 2.13's inductor fails to compile FlexAttention's CPU kernel for dynamic ones,
    `CppCompileError: 'cur_qSplitSize6' was not declared`, which Dynamo makes after a second shape)."""
    set_torch_config(request, torch._dynamo.config, "recompile_limit", 64)
    if DEVICE.type == "cpu":
        set_torch_config(request, torch._dynamo.config, "automatic_dynamic_shapes", False)


@pytest.fixture(autouse=True)
def _a_device():
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("no CUDA device (DAT_HF_FLEX_CHECKS_DEVICE=cpu checks the forwards on CPU)")


@pytest.fixture(autouse=True)
def _compiled_flex_attention_only(monkeypatch):
    """Every FlexAttention call runs compiled: an uncompiled call (the unfused fallback, which materializes the
    scores) makes FlexAttention warn, and the warning fails the test."""
    from torch.nn.attention import flex_attention

    monkeypatch.setattr(flex_attention, "_WARNINGS_SHOWN", set(), raising=False)  # (it warns once per process)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    uncompiled = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert not uncompiled, uncompiled[0]


def pair(cls, make_config):
    """(eager model, flex_attention model) of `make_config()` with the same weights, on DEVICE, float32, training."""
    models = []
    for impl in ("eager", "flex_attention"):
        torch.manual_seed(0)
        config = make_config()
        config._attn_implementation = impl
        models.append(cls(config).to(DEVICE).train())
    return models


def backends(model):
    return {m.relational_attention_backend for m in model.modules() if isinstance(m, RelationalAttention)}


def outputs_and_gradients(model, x, **kwargs):
    """(last hidden state, {parameter name: gradient}) of a sum-of-squares loss over the unpadded rows."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(GRADIENTS):
        out = model(inputs_embeds=x, **kwargs).last_hidden_state
        if GRADIENTS:
            weights = kwargs.get("attention_mask", torch.ones(x.shape[:2], device=DEVICE))[..., None]
            (out.square() * weights).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def padding(n, lengths, left):
    """long `[len(lengths), n]`: row r holds lengths[r] tokens, after its padding (left) or before it (right)."""
    positions, lengths = torch.arange(n), torch.tensor(lengths)[:, None]
    return (positions >= n - lengths if left else positions < lengths).long().to(DEVICE)


CASES = {  # (encoder, config overrides, padding lengths of the 3 rows)
    "causal-left-padding": (False, dict(), [40, 33, 1]),
    "sliding-window-gqa": (False, dict(relational_bias="sliding_window", sliding_window_size=6,
                                       num_sensory_key_value_heads=1, num_relational_key_value_heads=1), [40, 40, 29]),
    "sparse-global-tokens": (False, dict(relational_bias="sparse", sparse_block_size=8, sparse_global_tokens=2),
                             [40, 36, 40]),
    "relational-window-sensory-causal": (False, dict(relational_heads_bias="sliding_window", sliding_window_size=3),
                                         [40, 40, 40]),
    "encoder-full-right-padding": (True, dict(relational_bias="full"), [40, 25, 0]),
    "encoder-two-sided-window": (True, dict(relational_bias="sliding_window_bidirectional", sliding_window_size=4),
                                 [40, 38, 12]),
    "encoder-graph": (True, dict(relational_bias="graph"), [40, 40, 30]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_models_equal_eager(case):
    encoder, overrides, lengths = CASES[case]
    config_cls = DATEncoderConfig if encoder else DATConfig
    eager, flex = pair(DATEncoderModel if encoder else DATModel, lambda: config_cls(**dict(BASE, **overrides)))
    b, n = len(lengths), 40
    x = torch.randn(b, n, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kwargs = dict(attention_mask=padding(n, lengths, left=not encoder))
    if overrides.get("relational_bias") == "graph":
        adjacency = torch.rand(b, n, n, generator=torch.Generator().manual_seed(2)) < 0.2
        adjacency[0, 5] = False  # node 5 of row 0 has no neighbours
        kwargs["graph_adjacency"] = adjacency.to(DEVICE)
    expected, expected_grads = outputs_and_gradients(eager, x, **kwargs)
    got, grads = outputs_and_gradients(flex, x, **kwargs)
    assert backends(flex) == {"flex_attention"} and backends(eager) == {"eager"}
    assert torch.isfinite(got).all()
    valid = kwargs["attention_mask"].bool()
    assert (got[valid] - expected[valid]).abs().max() < ATOL, case
    if GRADIENTS:
        assert grads.keys() == expected_grads.keys() and len(grads) > 10
        for name, grad in grads.items():
            assert torch.isfinite(grad).all(), name
            torch.testing.assert_close(grad, expected_grads[name], atol=ATOL, rtol=1e-4, msg=name)


def test_greedy_generation_equals_eager():
    """With a dynamic cache; the relational heads on FlexAttention in the decoding steps too (chosen automatically,
    those steps take the explicit decoding step)."""
    models = [model.eval() for model in pair(DATForCausalLM, lambda: DATConfig(**BASE))]
    models[1].config.relational_attn_implementation = "flex_attention"
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    tokens = [m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False) for m in models]
    assert torch.equal(tokens[0], tokens[1]), tokens
    assert backends(models[1]) == {"flex_attention"}


def test_compiled_static_cache_decoding_equals_eager(request):
    """Every head on FlexAttention, greedy decoding over a static cache compiled as one graph (`CompileConfig`, with
    CUDA graphs on CUDA; the BlockMasks are made inside the step, the keys are head slices of the cache): the tokens
    and logits of the eager model without a cache."""
    from transformers import CompileConfig

    if DEVICE.type == "cpu":  # (inductor's C++ FlexAttention template takes no fused epilogue)
        set_torch_config(request, torch._inductor.config, "epilogue_fusion", False)
    eager, flex = (model.eval() for model in pair(DATForCausalLM, lambda: DATConfig(
        **dict(BASE, num_sensory_key_value_heads=1, relational_attn_implementation="flex_attention"))))
    eager.config.relational_attn_implementation = "eager"
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = eager.generate(ids, use_cache=False, **kwargs)
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    got = flex.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    assert backends(flex) == {"flex_attention"}
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-4, rtol=0)


def test_343m_shapes_compile_and_run_in_bfloat16():
    """One DAT-343M layer (d 1024, 8 + 8 heads over 4 kv heads, R 8, d_r 64, 1024 symbols) on FlexAttention: the
    kernels compile for relational values of width 576 (in chunks off CPU: `flex_value_chunks`), forward and backward
    run in bfloat16 under autocast, and the outputs are within bfloat16 rounding of float32 eager."""
    n = 2048 if DEVICE.type == "cuda" else 256
    eager, flex = pair(DATModel, lambda: load_preset_config("dat-343m", num_hidden_layers=1, vocab_size=256,
                                                             max_position_embeddings=n))
    x = torch.randn(1, n, 1024, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        expected = eager(inputs_embeds=x).last_hidden_state
    times = []
    for _ in range(2):  # the first call compiles
        start = time.perf_counter()
        with torch.set_grad_enabled(GRADIENTS), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            out = flex(inputs_embeds=x).last_hidden_state
        if GRADIENTS:
            out.float().square().mean().backward()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"DAT-343M layer on FlexAttention, {n} tokens, bf16 forward{' + backward' if GRADIENTS else ''}: first call "
          f"(compiles) {times[0]:.1f} s, second {times[1] * 1000:.0f} ms")
    assert backends(flex) == {"flex_attention"}
    error = (out.float() - expected).norm() / expected.norm()
    assert error < 2e-2, error
    if GRADIENTS:
        grads = [p.grad for p in flex.parameters() if p.grad is not None]
        assert len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)
