"""The CPU tiled path of relational attention (`TiledRelationalAttentionFunction`, `tiled_relational_attention`).

- function level (float64): outputs and gradients of every input against a slow, obviously correct implementation
  (explicit softmax, explicit `[b, R, q, kv]` relations), for causal (also kv > q, prefill after a cache), full,
  bool masks (per batch row and broadcast over the batch), additive float masks, GQA and batch-1 symbol values, at
  several tile sizes; `torch.autograd.gradcheck` of the raw autograd Function and of the wrapper;
- model level (fp32): logits and parameter gradients with the tiled path forced equal those of the fused path
  (`RelationalAttention.use_tiled_kernel = False`), over GQA / symmetric relations / shared attention parameters /
  relation counts and dims / positional symbols / padding (left, right; bool and additive masks) / causal biases,
  activation checkpointing, chunked prefill with a cache, greedy generation, the encoder, vision and seq2seq models;
  bf16 autocast training (routed to the fused path);
- dispatch: the tiled path is taken when forced and not for `use_tiled_kernel=False`, `output_attentions`, bf16,
  one-token decoding, non-identity relation activations, position-relative symbols, attention dropout in training,
  compilation, non-CPU tensors, and below `TILED_MIN_PAIRS`;
- parity with the authors' `dual_attention` language models with the tiled path forced.

Tiles are forced small (`TILE_SCORE_ELEMENTS`) so that every batch row is split into several tiles.
"""

import contextlib

import pytest
import torch
from conftest import tiny_config

import dat_hf
import dat_hf.dual_attention as da
from dat_hf import (DATEncoderConfig, DATForCausalLM, DATForImageClassification, DATForSeq2SeqLM,
                    DATForTokenClassification, DATSeq2SeqConfig, DATVisionConfig)
from dat_hf.dual_attention import RelationalAttention, TiledRelationalAttentionFunction, tiled_relational_attention
from dat_hf.masking_dat import AttentionMask

ATOL64 = 1e-10
ATOL = 1e-5


# ---- helpers -----------------------------------------------------------------------------------------------------
class CallCounter:
    """Wraps `dual_attention.<name>` (looked up at call time by `RelationalAttention.forward`) and counts calls."""

    def __init__(self, monkeypatch, name="tiled_relational_attention"):
        self.calls = 0
        original = getattr(da, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(da, name, counted)

    @contextlib.contextmanager
    def counting(self):
        """Yields a one-element list that holds the number of tiled calls made inside the block, on exit."""
        result, start = [None], self.calls
        yield result
        result[0] = self.calls - start


@pytest.fixture
def force_tiled(monkeypatch):
    """Tiled path for every eligible call (the compiled CPU kernel off: it has its own tests), small tiles; returns a
    `CallCounter`."""
    monkeypatch.setattr(RelationalAttention, "use_cpu_kernel", False)
    monkeypatch.setattr(da, "TILED_MIN_PAIRS", 0)
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", 48)
    return CallCounter(monkeypatch)


@contextlib.contextmanager
def fused_path():
    """The pre-tiled paths (`use_tiled_kernel=False`) inside the block."""
    previous = RelationalAttention.use_tiled_kernel
    RelationalAttention.use_tiled_kernel = False
    try:
        yield
    finally:
        RelationalAttention.use_tiled_kernel = previous


def tiled_and_fused(counter, fn, expect_tiled=True):
    """fn() with the tiled path (asserting it was taken, or not) and with the fused path (asserting it was not)."""
    with counter.counting() as n_tiled:
        tiled = fn()
    with fused_path(), counter.counting() as n_fused:
        fused = fn()
    assert n_fused[0] == 0, "use_tiled_kernel=False must never take the tiled path"
    if expect_tiled:
        assert n_tiled[0] > 0, "the tiled path was not taken"
    return tiled, fused


def assert_close(got, expected, atol=ATOL, rtol=0.0, what=""):
    diff = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= atol + rtol * scale, f"{what}: max |diff| {diff:.3g} (scale {scale:.3g})"


def assert_grads_close(got, expected, names, atol=ATOL, rtol=1e-4):
    assert len(got) == len(expected) == len(names)
    for g, e, name in zip(got, expected, names):
        if e is None:
            assert g is None, name
            continue
        assert g is not None, name
        assert_close(g, e, atol=atol, rtol=rtol, what=f"grad of {name}")


# ---- function level ----------------------------------------------------------------------------------------------
def reference_relational_attention(query, key, values, q_rel, k_rel, mask: AttentionMask, scaling, relation_scaling,
                                   groups):
    """Slow and explicit: softmax(q k^T * scale + mask), relations [b, R, q, kv], einsums."""
    b, h, q_len, _ = query.shape
    kv_len, num_relations = key.shape[2], q_rel.shape[2]
    key = key.repeat_interleave(groups, dim=1)
    values = values.expand(b, -1, -1, -1).repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhid,bhjd->bhij", query, key) * scaling
    if mask.mask is None:
        if mask.is_causal:  # receiver i sits at position kv_len - q_len + i
            allowed = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
            scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask.mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask.mask, float("-inf"))
    else:
        scores = scores + mask.mask
    probs = torch.softmax(scores, dim=-1)
    symbols = torch.einsum("bhij,bhjd->bihd", probs, values)
    k_rel = k_rel.view(b, kv_len, num_relations, -1)
    relations = torch.einsum("bird,bjrd->brij", q_rel, k_rel) * relation_scaling
    return symbols, torch.einsum("bhij,brij->bihr", probs, relations)


def make_inputs(b=2, h=4, h_kv=4, q_len=10, kv_len=10, d=6, R=3, d_r=5, symbol_batch=None, seed=0,
                dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    return (randn(b, h, q_len, d), randn(b, h_kv, kv_len, d), randn(symbol_batch or b, h_kv, kv_len, d),
            randn(b, q_len, R, d_r), randn(b, kv_len, R * d_r))


def random_bool_mask(b, q_len, kv_len, seed=0, p=0.4):
    """True = attend; every receiver keeps at least one sender (rows without senders are unmasked upstream)."""
    g = torch.Generator().manual_seed(100 + seed)
    mask = torch.rand(b, 1, q_len, kv_len, generator=g) > p
    mask[..., torch.arange(q_len), torch.randint(0, kv_len, (q_len,), generator=g)] = True
    assert not mask.all()
    return mask


def additive_from_bool(mask, dtype=torch.float64, with_bias=True, seed=0):
    """An additive float mask: finfo.min where dropped, plus (optionally) a finite bias where kept."""
    g = torch.Generator().manual_seed(200 + seed)
    bias = torch.randn(mask.shape, generator=g, dtype=dtype) if with_bias else torch.zeros(mask.shape, dtype=dtype)
    return bias.masked_fill(~mask, torch.finfo(dtype).min)


CASES = {
    "causal": dict(mask=lambda b, q, kv: AttentionMask(None, None, True)),
    "causal-prefill-after-cache": dict(kv_len=15, mask=lambda b, q, kv: AttentionMask(None, None, True)),
    "full": dict(mask=lambda b, q, kv: AttentionMask(None, None, False)),
    "full-cross-kv-shorter": dict(kv_len=7, mask=lambda b, q, kv: AttentionMask(None, None, False)),
    "bool-mask": dict(kv_len=12, mask=lambda b, q, kv: AttentionMask(random_bool_mask(b, q, kv), None, False)),
    "bool-mask-causal-flag": dict(mask=lambda b, q, kv: AttentionMask(random_bool_mask(b, q, kv, 1), None, True)),
    "bool-mask-batch-broadcast": dict(
        kv_len=12, mask=lambda b, q, kv: AttentionMask(random_bool_mask(1, q, kv, 2), None, False)),
    "additive-mask": dict(
        kv_len=12, mask=lambda b, q, kv: AttentionMask(additive_from_bool(random_bool_mask(b, q, kv, 3)), None, False)),
    "additive-mask-fp32-batch-broadcast": dict(mask=lambda b, q, kv: AttentionMask(
        additive_from_bool(random_bool_mask(1, q, kv, 4), torch.float32, with_bias=False), None, True)),
    "gqa": dict(h_kv=2, groups=2, mask=lambda b, q, kv: AttentionMask(None, None, True)),
    "gqa-bool-mask": dict(h_kv=1, groups=4, kv_len=12,
                          mask=lambda b, q, kv: AttentionMask(random_bool_mask(b, q, kv, 5), None, False)),
    "symbols-batch-1": dict(symbol_batch=1, mask=lambda b, q, kv: AttentionMask(None, None, True)),
    "symbols-batch-1-gqa-additive": dict(
        symbol_batch=1, h_kv=2, groups=2, kv_len=13,
        mask=lambda b, q, kv: AttentionMask(additive_from_bool(random_bool_mask(b, q, kv, 6)), None, False)),
    "one-relation-batch-3": dict(b=3, R=1, d_r=7, mask=lambda b, q, kv: AttentionMask(None, None, True)),
}


# TILE_SCORE_ELEMENTS: 1 receiver per tile, 3-6 receivers (mostly not dividing q_len=10), one tile per row
@pytest.mark.parametrize("tile", [1, 3 * 4 * 15, 1 << 20])
@pytest.mark.parametrize("case", list(CASES))
def test_function_matches_reference(case, tile, monkeypatch):
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", tile)
    spec = dict(CASES[case])
    make_mask, groups = spec.pop("mask"), spec.pop("groups", 1)
    spec.setdefault("h_kv", 4)
    b, q_len, kv_len = spec.get("b", 2), 10, spec.get("kv_len", 10)
    inputs = make_inputs(**spec)
    mask = make_mask(b, q_len, kv_len)
    scaling, relation_scaling = 0.37, 0.61
    got = tiled_relational_attention(*inputs, mask, scaling, relation_scaling, groups)
    expected = reference_relational_attention(*inputs, mask, scaling, relation_scaling, groups)
    for g, e, name in zip(got, expected, ["attended symbols", "attended relations"]):
        assert g.shape == e.shape, name
        assert torch.isfinite(g).all(), name
        assert_close(g, e, atol=ATOL64, what=name)

    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(e.shape, generator=gen, dtype=e.dtype) for e in expected]
    grads = torch.autograd.grad(got, inputs, upstream)
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    for g, x in zip(grads, inputs):
        assert g.shape == x.shape
    assert_grads_close(grads, expected_grads, ["query", "key", "symbol values", "q_rel", "k_rel"], atol=ATOL64,
                       rtol=0.0)


def test_function_non_contiguous_inputs(monkeypatch):
    """Transposed / sliced views (as the models pass them: heads transposed, cache splits) give the same results."""
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", 100)
    g = torch.Generator().manual_seed(3)
    b, h, n, d, R, d_r = 2, 2, 9, 4, 2, 3
    q_base = torch.randn(b, n, h, d, generator=g, dtype=torch.float64, requires_grad=True)
    k_base = torch.randn(b, n, h, d, generator=g, dtype=torch.float64, requires_grad=True)
    packed = torch.randn(b, n, h * d + R * d_r + 5, generator=g, dtype=torch.float64, requires_grad=True)
    q_rel = torch.randn(b, n, R, d_r, generator=g, dtype=torch.float64, requires_grad=True)
    views = (q_base.transpose(1, 2), k_base.transpose(1, 2), packed[..., :h * d].view(b, n, h, d).transpose(1, 2),
             q_rel, packed[..., h * d:h * d + R * d_r])
    assert not views[0].is_contiguous() and not views[4].is_contiguous()
    mask = AttentionMask(None, None, True)
    got = tiled_relational_attention(*views, mask, 0.5, 0.7)
    expected = reference_relational_attention(*views, mask, 0.5, 0.7, 1)
    for x, y in zip(got, expected):
        assert_close(x, y, atol=ATOL64)
    leaves = (q_base, k_base, packed, q_rel)
    upstream = [torch.randn(e.shape, generator=g, dtype=e.dtype) for e in expected]
    assert_grads_close(torch.autograd.grad(got, leaves, upstream), torch.autograd.grad(expected, leaves, upstream),
                       ["query", "key", "packed values", "q_rel"], atol=ATOL64, rtol=0.0)


def test_function_symmetric_relations_share_one_tensor(monkeypatch):
    """q_rel and k_rel from one tensor (symmetric relations): both gradient contributions reach it."""
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", 50)
    query, key, values, rel, _ = make_inputs(h=2, h_kv=2, R=2, d_r=4, seed=4)
    mask = AttentionMask(None, None, True)
    b, n = rel.shape[:2]
    got = tiled_relational_attention(query, key, values, rel, rel.reshape(b, n, -1), mask, 0.4, 0.5)
    expected = reference_relational_attention(query, key, values, rel, rel.reshape(b, n, -1), mask, 0.4, 0.5, 1)
    upstream = [torch.randn_like(e) for e in expected]
    leaves = (query, key, values, rel)
    assert_grads_close(torch.autograd.grad(got, leaves, upstream), torch.autograd.grad(expected, leaves, upstream),
                       ["query", "key", "symbol values", "relations"], atol=ATOL64, rtol=0.0)


def test_function_fp32_close_to_fp64(monkeypatch):
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", 64)
    inputs64 = make_inputs(seed=9)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    mask = AttentionMask(None, None, True)
    got = tiled_relational_attention(*inputs32, mask, 0.4, 0.5)
    assert all(t.dtype == torch.float32 for t in got)
    expected = reference_relational_attention(*inputs64, mask, 0.4, 0.5, 1)
    for x, y in zip(got, expected):
        assert_close(x.double(), y, atol=1e-5)


def test_function_without_grad():
    """no_grad / inference mode: outputs only (no graph), same values."""
    inputs = [x.detach() for x in make_inputs(seed=5)]
    mask = AttentionMask(None, None, True)
    expected = reference_relational_attention(*inputs, mask, 0.4, 0.5, 1)
    with torch.inference_mode():
        got = tiled_relational_attention(*inputs, mask, 0.4, 0.5)
    assert not got[0].requires_grad
    for x, y in zip(got, expected):
        assert_close(x, y, atol=ATOL64)


def test_function_gradcheck_raw_function(monkeypatch):
    """Finite differences through the raw autograd Function on a tiny causal case, inputs contiguous and of the
    documented shapes: query `[b, h, q, d_h]`, key and symbol values `[b, h, kv, d_h]`, relation queries
    `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`, mask None, causal, scaling, relation scaling."""
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", 2 * 2 * 4)  # 2 receivers per tile
    g = torch.Generator().manual_seed(11)
    b, h, q_len, kv_len, d, R, d_r = 2, 2, 4, 4, 3, 2, 2

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    inputs = (randn(b, h, q_len, d), randn(b, h, kv_len, d), randn(b, h, kv_len, d), randn(b, q_len, R, d_r),
              randn(b, kv_len, R, d_r))
    assert torch.autograd.gradcheck(
        lambda *xs: TiledRelationalAttentionFunction.apply(*xs, None, True, 0.7, 0.6), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["causal", "causal-kv-longer", "bool-mask", "additive-mask-gqa-symbols-batch-1"])
def test_function_gradcheck(case, monkeypatch):
    """Finite differences through `tiled_relational_attention` (the Function plus its GQA / mask / layout glue)."""
    kv_len = {"causal": 4, "causal-kv-longer": 6}.get(case, 5)
    monkeypatch.setattr(da, "TILE_SCORE_ELEMENTS", 2 * 2 * kv_len)  # 2 receivers per tile
    g = torch.Generator().manual_seed(12)
    b, h, q_len, d, R, d_r = 2, 2, 4, 3, 2, 2
    h_kv, symbol_batch, groups = (1, 1, 2) if case.endswith("batch-1") else (h, b, 1)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    inputs = (randn(b, h, q_len, d), randn(b, h_kv, kv_len, d), randn(symbol_batch, h_kv, kv_len, d),
              randn(b, q_len, R, d_r), randn(b, kv_len, R * d_r))
    if case.startswith("causal"):
        mask = AttentionMask(None, None, True)
    elif case == "bool-mask":
        mask = AttentionMask(random_bool_mask(b, q_len, kv_len, seed=8), None, False)
    else:
        mask = AttentionMask(additive_from_bool(random_bool_mask(1, q_len, kv_len, seed=9)), None, False)
    assert torch.autograd.gradcheck(
        lambda *xs: tiled_relational_attention(*xs, mask, 0.7, 0.6, groups), inputs, eps=1e-6, atol=1e-7)


# ---- model level: tiled vs fused ---------------------------------------------------------------------------------
def lm(seed=0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("initializer_range", 0.2)  # large weights: every path moves the outputs clearly
    return DATForCausalLM(tiny_config(**overrides))


def tokens(batch=2, n=12, seed=0, vocab=97):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def logits_and_grads(model, input_ids, **kwargs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    return out.logits.detach(), grads


def assert_model_tiled_equals_fused(counter, model, input_ids, **kwargs):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    (logits_t, grads_t), (logits_f, grads_f) = tiled_and_fused(
        counter, lambda: logits_and_grads(model, input_ids, **kwargs))
    assert torch.isfinite(logits_t).all()
    assert_close(logits_t, logits_f, what="logits")
    assert_grads_close(grads_t, grads_f, names)
    # the relational parameters do get gradient through the tiled path
    rel = [g for n, g in zip(names, grads_t) if "relational.q_rel_proj" in n]
    assert rel and all(g is not None and g.abs().max() > 0 for g in rel)


MODEL_CONFIGS = {
    "default": {},
    "gqa": dict(num_relational_key_value_heads=1, num_sensory_key_value_heads=1),
    "gqa-4-heads-nrel-6-reldim-5": dict(hidden_size=48, num_sensory_heads=2, num_relational_heads=4,
                                        num_relational_key_value_heads=2, num_relations=6, relation_dim=5),
    "symmetric-nrel-4": dict(symmetric_relations=True, num_relations=4),
    "shared-attention-params": dict(share_attention_params=True),
    "shared-gqa-symmetric": dict(share_attention_params=True, num_relational_key_value_heads=1,
                                 num_sensory_key_value_heads=1, symmetric_relations=True),
    "positional-symbols-learned-positions-kv-bias": dict(symbol_retrieval="positional",
                                                         position_embedding_type="learned", attention_bias=True,
                                                         attention_out_bias=True),
    "only-relational-heads-per-layer-retrievers": dict(num_sensory_heads=0, num_relational_heads=4,
                                                       shared_symbol_retriever=False),
    "sliding-window": dict(relational_bias="sliding_window", sliding_window_size=3),
    "relational-heads-sliding-window": dict(relational_heads_bias="sliding_window", sliding_window_size=2),
    "sparse-per-layer": dict(relational_bias=["sparse", "causal"], sparse_block_size=4, sparse_global_tokens=1),
}


@pytest.mark.parametrize("name", list(MODEL_CONFIGS))
def test_lm_tiled_equals_fused(name, force_tiled):
    model = lm(**MODEL_CONFIGS[name])
    assert_model_tiled_equals_fused(force_tiled, model, tokens())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])  # bool masks / additive float masks
@pytest.mark.parametrize("bias", ["causal", "sliding_window"])
def test_lm_padded_batch_tiled_equals_fused(impl, bias, force_tiled):
    model = lm(seed=1, relational_bias=bias, sliding_window_size=3)
    model.set_attn_implementation(impl)
    x = tokens(batch=3, n=11, seed=1)
    attention_mask = torch.ones_like(x)
    attention_mask[0, :4] = 0  # left padding
    attention_mask[1, 7:] = 0  # right padding
    assert_model_tiled_equals_fused(force_tiled, model, x, attention_mask=attention_mask)


def test_lm_fp64_tiled_equals_fused(force_tiled):
    model = lm(seed=2).double()
    x = tokens(seed=2)
    (logits_t, grads_t), (logits_f, grads_f) = tiled_and_fused(force_tiled, lambda: logits_and_grads(model, x))
    assert logits_t.dtype == torch.float64
    assert_close(logits_t, logits_f, atol=1e-10)
    assert_grads_close(grads_t, grads_f, [n for n, _ in model.named_parameters()], atol=1e-10, rtol=1e-9)


def test_lm_gradient_checkpointing_tiled_equals_fused(force_tiled):
    """The tiled forward is re-run by activation checkpointing; gradients are unchanged."""
    model = lm(seed=9)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with force_tiled.counting() as calls:
        logits_and_grads(model, tokens(seed=9))
    assert calls[0] == 2 * model.config.num_hidden_layers  # forward, then recomputed in backward
    assert_model_tiled_equals_fused(force_tiled, model, tokens(seed=9))


def test_bf16_autocast_training_tiled_path(force_tiled):
    """CPU bf16 autocast (RoPE queries stay fp32 while relation queries are bf16) goes to the fused path: runs and
    matches (a regression test: the tiled kernel once crashed here)."""
    model = lm(seed=8)  # default RoPE

    def run():
        model.train()
        model.zero_grad(set_to_none=True)
        x = tokens(seed=8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return loss.detach().float(), grads

    (loss_t, grads_t), (loss_f, grads_f) = tiled_and_fused(force_tiled, run, expect_tiled=False)
    assert torch.isfinite(loss_t) and torch.isfinite(grads_t).all()
    assert abs(loss_t.item() - loss_f.item()) < 2e-2 * abs(loss_f.item())
    assert torch.nn.functional.cosine_similarity(grads_t, grads_f, dim=0) > 0.99


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_chunked_prefill_with_cache(impl, force_tiled):
    """Prefill in chunks of several tokens after a cache (kv_len > q_len): tiled == fused == one full forward."""
    model = lm(seed=3).eval()
    model.set_attn_implementation(impl)
    x = tokens(batch=2, n=14, seed=3)

    def chunked():
        with torch.no_grad():
            out = model(x[:, :5], use_cache=True)
            steps, cache = [out.logits], out.past_key_values
            for start, end in [(5, 9), (9, 14)]:
                out = model(x[:, start:end], past_key_values=cache, use_cache=True)
                steps.append(out.logits)
        return torch.cat(steps, 1)

    tiled, fused = tiled_and_fused(force_tiled, chunked)
    with fused_path(), torch.no_grad():
        full = model(x).logits
    assert_close(tiled, fused)
    assert_close(tiled, full)


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_tiled_equals_fused(padded, force_tiled):
    model = lm(seed=4).eval()
    x = tokens(batch=2, n=8, seed=4)
    attention_mask = torch.ones_like(x)
    if padded:
        attention_mask[1, :3] = 0  # left padding, as for batched generation

    def generate():
        with force_tiled.counting() as calls:
            out = model.generate(x, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        return out, calls[0]

    (tiled, n_tiled), (fused, n_fused) = tiled_and_fused(force_tiled, generate)
    # only the prefill (one call per layer) takes the tiled path; one-token decoding steps do not
    assert n_tiled == model.config.num_hidden_layers and n_fused == 0
    assert tiled.sequences.shape == (2, 14)
    assert torch.equal(tiled.sequences, fused.sequences)
    # the decoding steps read the keys of later layers from the cache the tiled prefill filled
    assert len(tiled.logits) == len(fused.logits) == 6
    for step_tiled, step_fused in zip(tiled.logits, fused.logits):
        assert_close(step_tiled, step_fused, what="generation logits")


# ---- dispatch: when the tiled path is (not) taken ----------------------------------------------------------------
def count_forward(counter, model, x, **kwargs):
    with counter.counting() as calls, torch.no_grad():
        out = model(x, **kwargs)
    return calls[0], out


def test_tiled_path_taken_when_forced(force_tiled):
    model = lm().eval()
    n, _ = count_forward(force_tiled, model, tokens())
    assert n == model.config.num_hidden_layers
    with fused_path():
        assert count_forward(force_tiled, model, tokens())[0] == 0
    # a per-module override (instance attribute) keeps that layer on the fused path
    model.model.layers[0].dual_attn.relational.use_tiled_kernel = False
    assert count_forward(force_tiled, model, tokens())[0] == model.config.num_hidden_layers - 1
    del model.model.layers[0].dual_attn.relational.use_tiled_kernel
    model.double()
    assert count_forward(force_tiled, model, tokens())[0] == model.config.num_hidden_layers


def test_tiled_path_not_taken_for_output_attentions(force_tiled):
    model = lm().eval()
    n, out = count_forward(force_tiled, model, tokens(), output_attentions=True)
    assert n == 0
    assert out.relational_attentions is not None and out.relational_attentions[0] is not None
    n_plain, plain = count_forward(force_tiled, model, tokens())
    assert n_plain > 0
    assert_close(plain.logits, out.logits)


def test_tiled_path_not_taken_in_bf16(force_tiled):
    model = lm().eval().to(torch.bfloat16)
    n, out = count_forward(force_tiled, model, tokens())
    assert n == 0
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()


def test_tiled_path_not_taken_for_one_token_decoding(force_tiled):
    model = lm().eval()
    x = tokens(n=6)
    with torch.no_grad():
        prefill = count_forward(force_tiled, model, x[:, :5], use_cache=True)
        assert prefill[0] == model.config.num_hidden_layers
        n, out = count_forward(force_tiled, model, x[:, 5:], past_key_values=prefill[1].past_key_values, use_cache=True)
        assert n == 0
        assert_close(out.logits[:, -1], model(x).logits[:, -1])


@pytest.mark.parametrize("overrides", [dict(relation_activation="relu"), dict(symbol_retrieval="position_relative")],
                         ids=["relu-relations", "position-relative-symbols"])
def test_tiled_path_not_taken_off_the_fused_path(overrides, force_tiled):
    model = lm(**overrides).eval()
    assert count_forward(force_tiled, model, tokens())[0] == 0


def test_tiled_path_and_attention_dropout(force_tiled):
    """Training with attention dropout is not tiled (no dropout there); eval with the same config is."""
    model = lm(attention_dropout=0.1)
    model.train()
    with force_tiled.counting() as calls:
        model(tokens(), labels=tokens()).loss.backward()
    assert calls[0] == 0
    model.eval()
    assert count_forward(force_tiled, model, tokens())[0] == model.config.num_hidden_layers


def test_tiled_min_pairs_threshold(monkeypatch):
    monkeypatch.setattr(RelationalAttention, "use_cpu_kernel", False)
    counter = CallCounter(monkeypatch)
    monkeypatch.setattr(da, "TILED_MIN_PAIRS", 100)
    model = lm().eval()
    assert count_forward(counter, model, tokens(n=10))[0] == model.config.num_hidden_layers  # 10 * 10 pairs
    assert count_forward(counter, model, tokens(n=9))[0] == 0  # 81 pairs
    # the default threshold leaves tiny sequences on the fused path
    monkeypatch.setattr(da, "TILED_MIN_PAIRS", 1 << 16)
    assert count_forward(counter, model, tokens(n=12))[0] == 0


def test_takes_tiled_path_conditions(monkeypatch):
    """The decision itself: compiling, non-CPU tensors, fp16, and one receiver are excluded."""
    monkeypatch.setattr(da, "TILED_MIN_PAIRS", 0)
    module = RelationalAttention(tiny_config(), 0).eval()
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    assert module._takes_tiled_path(q, k, False)
    assert not module._takes_tiled_path(q, k, True)
    assert not module._takes_tiled_path(q.half(), k.half(), False)
    assert not module._takes_tiled_path(q[:, :, :1], k, False)
    assert not module._takes_tiled_path(q.to("meta"), k.to("meta"), False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not module._takes_tiled_path(q, k, False)


# ---- encoder, vision, seq2seq ------------------------------------------------------------------------------------
def assert_task_model_tiled_equals_fused(counter, model, loss_of, inputs, atol=ATOL):
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def run():
        model.train()
        out = model(**inputs)
        params = [p for p in model.parameters() if p.requires_grad]
        return out.logits.detach(), torch.autograd.grad(loss_of(out), params, allow_unused=True)

    (logits_t, grads_t), (logits_f, grads_f) = tiled_and_fused(counter, run)
    assert_close(logits_t, logits_f, atol=atol, what="logits")
    assert_grads_close(grads_t, grads_f, names)


@pytest.mark.parametrize("bias", ["full", "sliding_window_bidirectional", "sparse", "graph"])
def test_encoder_tiled_equals_fused(bias, force_tiled):
    torch.manual_seed(5)
    config = DATEncoderConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
        intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64,
        initializer_range=0.2, relational_bias=bias, sliding_window_size=2, sparse_block_size=3,
        sparse_global_tokens=1, num_labels=3, num_relational_key_value_heads=1)
    model = DATForTokenClassification(config)
    x = tokens(batch=3, n=10, seed=5)
    attention_mask = torch.ones_like(x)
    attention_mask[0, 6:] = 0
    attention_mask[2, :2] = 0
    labels = torch.randint(0, 3, x.shape, generator=torch.Generator().manual_seed(6))
    labels = labels.masked_fill(attention_mask == 0, -100)
    inputs = dict(input_ids=x, attention_mask=attention_mask, labels=labels)
    if bias == "graph":  # a random per-instance graph with self-loops (some receivers see only themselves)
        adjacency = torch.rand(3, 10, 10, generator=torch.Generator().manual_seed(7)) < 0.3
        inputs["graph_adjacency"] = adjacency | torch.eye(10, dtype=torch.bool)
    assert_task_model_tiled_equals_fused(force_tiled, model, lambda out: out.loss, inputs)


@pytest.mark.parametrize("symbols", ["symbolic_attention", "positional"])
def test_vision_tiled_equals_fused(symbols, force_tiled):
    torch.manual_seed(6)
    config = DATVisionConfig(
        image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2,
        num_relational_heads=2, intermediate_size=48, num_symbols=8, symbolic_attention_heads=2, num_labels=3,
        max_relative_position=3, initializer_range=0.2, symbol_retrieval=symbols)
    model = DATForImageClassification(config)
    pixels = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(6))
    labels = torch.tensor([0, 2, 1])
    assert_task_model_tiled_equals_fused(
        force_tiled, model, lambda out: out.loss, dict(pixel_values=pixels, labels=labels))


@pytest.mark.parametrize("overrides", [dict(), dict(num_cross_relational_heads=2, num_cross_attention_heads=0,
                                                    symmetric_relations=True)], ids=["dual-cross", "only-relational"])
def test_seq2seq_tiled_equals_fused(overrides, force_tiled):
    torch.manual_seed(7)
    config = DATSeq2SeqConfig(
        vocab_size=50, hidden_size=32, encoder_layers=2, decoder_layers=2, num_sensory_heads=2,
        num_relational_heads=2, intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
        max_position_embeddings=32, encoder_max_position_embeddings=24, max_relative_position=4, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=2, initializer_range=0.2, cross_attention="dual", **overrides)
    model = DATForSeq2SeqLM(config)
    g = torch.Generator().manual_seed(7)
    x = torch.randint(3, 50, (3, 9), generator=g)
    attention_mask = torch.ones_like(x)
    attention_mask[1, 6:] = 0
    attention_mask[2, 4:] = 0
    y = torch.randint(3, 50, (3, 7), generator=g)  # target longer than some sources, shorter than others
    with force_tiled.counting() as calls, torch.no_grad():
        model.eval()(input_ids=x, attention_mask=attention_mask, decoder_input_ids=y)
    # encoder self-attention, decoder self-attention and cross-attention: 3 relational modules per layer pair
    assert calls[0] == 3 * 2
    assert_task_model_tiled_equals_fused(
        force_tiled, model, lambda out: out.loss,
        dict(input_ids=x, attention_mask=attention_mask, decoder_input_ids=y, labels=y))


# ---- parity with the authors' reference ----------------------------------------------------------------------------
ELIGIBLE_REFERENCE_CONFIGS = ["symbolic-rope-swiglu-layernorm-prenorm", "learned-positions-gelu", "positional-symbols",
                              "gqa-nrel8-symmetric", "shared-attn-rmsnorm-postnorm",
                              "unshared-tied-symbol-library-kv-bias"]


@pytest.mark.parametrize("name", ELIGIBLE_REFERENCE_CONFIGS)
def test_reference_parity_on_tiled_path(name, force_tiled):
    pytest.importorskip("dual_attention")
    from dual_attention.language_models import DualAttnTransformerLM
    from test_parity import CONFIGS, _logits_close

    torch.manual_seed(hash(name) % 1000)
    reference = DualAttnTransformerLM(**CONFIGS[name]).eval()
    ours = dat_hf.from_reference_model(reference)
    assert ours.config.relation_activation == "identity" and ours.config.symbol_retrieval != "position_relative"
    with force_tiled.counting() as calls:
        diff = _logits_close(reference, ours)
    assert calls[0] == ours.config.num_hidden_layers
    assert diff < 1e-5
    with force_tiled.counting() as calls:
        diff = _logits_close(reference, ours, seq_len=32, batch=1, seed=1)
    assert calls[0] == ours.config.num_hidden_layers
    assert diff < 1e-5


def test_every_eligible_reference_config_is_covered():
    pytest.importorskip("dual_attention")
    from test_parity import CONFIGS

    eligible = [name for name, kwargs in CONFIGS.items()
                if kwargs.get("n_heads_ra", 2) > 0 and kwargs["symbol_retrieval"] != "position_relative"
                and (kwargs.get("ra_kwargs") or {}).get("rel_activation", "identity") == "identity"]
    assert sorted(eligible) == sorted(ELIGIBLE_REFERENCE_CONFIGS)
