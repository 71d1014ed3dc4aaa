"""Relational attention backends against the one reference (`dat_hf.relational_attention`).

- the reference (`eager_relational_attention`) against a per-pair Python loop of the formula, blocked or not, in
  training (checkpointed blocks) and with every feature: masks, GQA, relation activations, 1-D and 2-D
  position-relative symbols, attention weights and relations;
- every registered backend against the reference over one case matrix: values and gradients in float64 where the
  backend runs float64 (`sdpa`: 1e-10), float32 backends (`cpu`, `flex_attention`) within 2e-5 of the float64
  reference, bfloat16 `sdpa` within 3e-2; what a backend declares unsupported is exactly what the matrix expects;
- selection: which backend runs for CPU float32 training and decoding, bfloat16, autocast, `output_attentions`,
  `attn_implementation="eager"`/`"flex_attention"`, explicit choices (and their errors), `DAT_HF_CPU_KERNEL=0`;
- models: logits and parameter gradients of every family equal across the backends that support them.
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import set_kernels_aside, tiny_config
from relational_cases import (RELATION_SCALING, SCALING, Heads, additive_from_bool, assert_close, call_backend,
                              causal_and, make_inputs, random_bool_mask, right_padding)
from torch.nn.attention.flex_attention import create_block_mask
from transformers import DynamicCache, StaticCache

import dat_hf
import dat_hf.relational_attention as relational_attention
import dat_hf.relational_attention_fused as relational_attention_fused
import dat_hf.sensory_attention as sensory_attention
from dat_hf import (DATEncoderConfig, DATForCausalLM, DATForImageClassification, DATForSeq2SeqLM,
                    DATForTokenClassification, DATSeq2SeqConfig, DATVisionConfig)
from dat_hf.masking_dat import AttentionMask
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalCall
from dat_hf.relational_attention_fused import flex_value_chunks
from dat_hf.transformers_compat import output_cache


# ---- the reference against the formula ---------------------------------------------------------------------------
def formula(module, query, key, symbols, q_rel, k_rel, allowed, relative_index=None):
    """A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h), one (row, receiver, head) at a time. allowed: bool
    `[b, q, kv]`; symbols: per sender `[b|1, h_kv, kv, d]` or a table `[P, h_kv, d]` read at `relative_index`."""
    b, h, q_len, d = query.shape
    groups = module.num_key_value_groups
    out = torch.zeros(b, q_len, h, d, dtype=query.dtype)
    for n in range(b):
        for i in range(q_len):
            senders = allowed[n, i].nonzero().flatten()
            relations = torch.einsum("rd,jrd->jr", q_rel[n, i], k_rel[n, senders]) * RELATION_SCALING  # [j, R]
            if module.relation_act is not None:
                relations = module.relation_act(relations)
            for head in range(h):
                kv = head // groups
                weights = torch.softmax(key[n, kv, senders] @ query[n, head, i] * SCALING, dim=0)  # [j]
                if relative_index is None:
                    sender_symbols = symbols[min(n, symbols.shape[0] - 1), kv, senders]
                else:
                    sender_symbols = symbols[relative_index[i, senders], kv]
                messages = relations @ module.relation_proj[head].T + sender_symbols  # [j, d]
                out[n, i, head] = weights @ messages
    return out


@pytest.mark.parametrize("block_elements", [1 << 22, 40], ids=["one-block", "blocks-of-1-2-receivers"])
@pytest.mark.parametrize("case", ["causal-gqa", "bool-mask-relu", "relative-1d-tanh", "relative-2d-index"])
def test_reference_is_the_formula(case, block_elements, monkeypatch):
    monkeypatch.setattr(relational_attention, "BLOCK_ELEMENTS", block_elements)
    b, h, q_len, kv_len, d, R = 2, 4, 6, 8, 5, 3
    relative = case.startswith("relative")
    module = Heads(h=h, h_kv=2 if case == "causal-gqa" else 4, d=d, R=R,
                   activation={"bool-mask-relu": "relu", "relative-1d-tanh": "tanh"}.get(case, "identity"),
                   relative=relative, max_relative_position=2)
    P = 5 if case == "relative-1d-tanh" else 11
    inputs = make_inputs(b, h, module.relation_proj.shape[0] // module.num_key_value_groups, q_len, kv_len, d, R, 4,
                         relative_rows=P if relative else None)
    allowed = causal_and(torch.ones(b, q_len, kv_len, dtype=torch.bool), q_len, kv_len)  # after a cache
    mask = AttentionMask(allowed[:, None], None, True)
    index = None
    if case == "bool-mask-relu":
        allowed = random_bool_mask(b, q_len, kv_len)[:, 0]
        mask = AttentionMask(allowed[:, None], None, False)
    elif case == "relative-1d-tanh":  # offsets j - i clipped to [-2, 2], receiver i at position kv - q + i
        index = (torch.arange(kv_len)[None] - torch.arange(q_len)[:, None] - (kv_len - q_len)).clamp(-2, 2) + 2
    elif case == "relative-2d-index":
        index = torch.randint(0, P, (q_len, kv_len), generator=torch.Generator().manual_seed(3))
        allowed = torch.ones(b, q_len, kv_len, dtype=torch.bool)
        mask = AttentionMask(None, None, False)
    expected = formula(module, *inputs, allowed, index)
    module.train()  # several blocks: checkpointed
    got, weights, relations = call_backend(
        "eager", module, *inputs, mask, SCALING, RELATION_SCALING,
        relative_position_index=index if case == "relative-2d-index" else None)
    assert weights is None and relations is None
    assert_close(got, expected, atol=1e-12, what="messages")
    grads = torch.autograd.grad(got.sum(), [*inputs, module.relation_proj])
    expected_grads = torch.autograd.grad(expected.sum(), [*inputs, module.relation_proj])
    for g, e in zip(grads, expected_grads):
        assert_close(g, e, atol=1e-12, what="gradient")
    # weights and relations: explicit, [b, h, q, kv] and [b, R, q, kv]
    module.eval()
    with torch.no_grad():
        again, weights, relations = call_backend(
            "eager", module, *inputs, mask, SCALING, RELATION_SCALING, output_attentions=True,
            relative_position_index=index if case == "relative-2d-index" else None)
    assert_close(again, expected, atol=1e-12)
    assert weights.shape == (b, h, q_len, kv_len) and relations.shape == (b, R, q_len, kv_len)
    assert (weights[~allowed[:, None].expand_as(weights)] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(b, h, q_len, dtype=weights.dtype))


# ---- every backend against the reference -------------------------------------------------------------------------
def _mask(kind, b, q_len, kv_len):
    """(AttentionMask without a BlockMask, allowed bool `[b|1, 1, q, kv]` or None for no masking)."""
    if kind == "causal":  # implicit (Transformers leaves it so when kv == q, or for one receiver)
        assert kv_len == q_len or q_len == 1
        return AttentionMask(None, None, True), causal_and(torch.ones(1, 1, q_len, kv_len, dtype=torch.bool),
                                                           q_len, kv_len)
    if kind == "causal-after-cache":  # a prefill after a cache: explicit, receiver i at position kv - q + i
        allowed = causal_and(torch.ones(1, 1, q_len, kv_len, dtype=torch.bool), q_len, kv_len)
        return AttentionMask(allowed, None, True), allowed
    if kind == "none":
        return AttentionMask(None, None, False), None
    if kind == "bool":
        allowed = random_bool_mask(b, q_len, kv_len)
        return AttentionMask(allowed, None, False), allowed
    if kind == "bool-causal":
        allowed = causal_and(random_bool_mask(b, q_len, kv_len, seed=1), q_len, kv_len)
        allowed[..., 0] = True
        return AttentionMask(allowed, None, True), allowed
    if kind == "bool-broadcast":
        allowed = random_bool_mask(1, q_len, kv_len, seed=2)
        return AttentionMask(allowed, None, False), allowed
    if kind == "padding":  # right padding, causal: row 2 sees 3 senders only
        allowed = causal_and(right_padding(b, kv_len, [kv_len, kv_len - 4, 3]), q_len, kv_len)
        allowed[..., 0] = True
        return AttentionMask(allowed, None, True), allowed
    if kind == "additive":
        allowed = random_bool_mask(b, q_len, kv_len, seed=3)
        return AttentionMask(additive_from_bool(allowed), None, False), allowed
    raise ValueError(kind)


def with_block_mask(mask: AttentionMask, allowed, b, q_len, kv_len):
    """The same graph as a FlexAttention BlockMask (read from the dense mask), for masks FlexAttention can take."""
    if mask.mask is not None and mask.mask.dtype != torch.bool:
        return mask  # additive masks have no BlockMask
    if allowed is None:
        return mask
    dense = allowed.expand(b, 1, q_len, kv_len)
    block = create_block_mask(lambda n, h, i, j: dense[n, 0, i, j], b, None, q_len, kv_len, device="cpu")
    return AttentionMask(mask.mask, mask.row_valid, mask.is_causal, block)


CASES = {
    "causal": dict(mask="causal"),
    "causal-after-cache": dict(kv_len=15, mask="causal-after-cache"),
    "full": dict(mask="none"),
    "full-kv-shorter": dict(kv_len=7, mask="none"),
    "bool-mask": dict(kv_len=12, mask="bool"),
    "bool-mask-causal": dict(mask="bool-causal"),
    "bool-mask-batch-broadcast": dict(kv_len=12, mask="bool-broadcast"),
    "right-padding": dict(b=3, kv_len=13, mask="padding"),
    "additive-mask": dict(kv_len=12, mask="additive"),
    "gqa": dict(h_kv=2, mask="causal"),
    "gqa-1-bool": dict(h_kv=1, kv_len=12, mask="bool"),
    "symbols-batch-1": dict(symbol_batch=1, mask="causal"),
    "one-relation-batch-3": dict(b=3, R=1, d_r=7, mask="causal"),
    "crosses-kernel-blocks": dict(b=1, q_len=150, kv_len=300, d=8, R=2, d_r=4, mask="causal-after-cache"),
    "decoding-step": dict(q_len=1, kv_len=17, mask="causal"),
    "decoding-step-padding": dict(b=3, q_len=1, kv_len=13, mask="padding"),
    "relu-relations": dict(activation="relu", mask="causal"),
    "tanh-relations-bool": dict(activation="tanh", mask="bool"),
    "relative-symbols": dict(relative=True, mask="causal"),
    "output-attentions": dict(output_attentions=True, mask="bool"),
}
FP32_ONLY = {"cpu", "flex_attention", "triton"}


def expected_unsupported(backend, spec):
    """Whether `backend` should decline the case (the matrix's own statement of each backend's scope)."""
    fused = spec.get("activation", "identity") == "identity" and not spec.get("relative") and not spec.get(
        "output_attentions")
    if backend == "eager":
        return False
    if backend == "sdpa":
        return not fused
    if backend in ("cpu", "flex_attention"):  # bool masks only (flex: as a BlockMask)
        return not fused or spec["mask"] == "additive"
    if backend == "triton":  # CUDA; CPU tensors only under the interpreter (`test_triton_kernel.py` runs that)
        from dat_hf.kernels.triton_relational import INTERPRETED

        return not fused or spec["mask"] == "additive" or not INTERPRETED
    raise AssertionError(f"the case matrix has no expectation for backend {backend!r}")


def run_case(backend, case, dtype=torch.float64, grad=True):
    spec = dict(CASES[case])
    kind, activation = spec.pop("mask"), spec.pop("activation", "identity")
    relative, output_attentions = spec.pop("relative", False), spec.pop("output_attentions", False)
    b, q_len, kv_len = spec.get("b", 2), spec.get("q_len", 10), spec.get("kv_len", 10)
    h, h_kv = 4, spec.get("h_kv", 4)
    inputs64 = make_inputs(relative_rows=7 if relative else None, **spec)
    module64 = Heads(h, h_kv, inputs64[0].shape[-1], inputs64[3].shape[2], activation, relative)
    mask, allowed = _mask(kind, b, q_len, kv_len)
    if backend == "flex_attention":
        mask = with_block_mask(mask, allowed, b, q_len, kv_len)
    inputs = [t.detach().to(dtype).requires_grad_(grad) for t in inputs64]
    module = Heads(h, h_kv, inputs64[0].shape[-1], inputs64[3].shape[2], activation, relative,
                   relation_proj=module64.relation_proj.detach().to(dtype))
    call = RelationalCall("cpu", dtype, q_len, grad, output_attentions, activation, relative, 0.0, mask, False, False)
    return module64, module, inputs64, inputs, mask, call, output_attentions


BACKENDS = ["eager", "sdpa", "flex_attention", "cpu"]
BACKENDS += ["triton"] if "triton" in RELATIONAL_ATTENTION_FUNCTIONS else []  # registered when triton imports


def test_every_registered_backend_is_in_the_matrix():
    assert set(RELATIONAL_ATTENTION_FUNCTIONS) == set(BACKENDS)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference(backend, case):
    dtype = torch.float32 if backend in FP32_ONLY else torch.float64
    grad = backend != "flex_attention"  # FlexAttention has no CPU backward
    module64, module, inputs64, inputs, mask, call, output_attentions = run_case(backend, case, dtype, grad)
    reason = RELATIONAL_ATTENTION_FUNCTIONS[backend].supports(call)
    assert (reason is not None) == expected_unsupported(backend, CASES[case]), reason
    if reason is not None:
        return
    expected, weights64, relations64 = call_backend(
        "eager", module64, *inputs64, mask, SCALING, RELATION_SCALING, output_attentions=output_attentions)
    with torch.set_grad_enabled(grad):
        got, weights, relations = call_backend(backend, module, *inputs, mask, SCALING, RELATION_SCALING,
                                               output_attentions=output_attentions)
    atol = 2e-5 if dtype == torch.float32 else 1e-10
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert_close(got, expected, atol=atol, rtol=atol, what=f"{backend} messages")
    if output_attentions:
        assert_close(weights, weights64, atol=atol, what="weights")
        assert_close(relations, relations64, atol=atol, what="relations")
    if not grad:
        return
    gen = torch.Generator().manual_seed(7)
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    params, params64 = [*inputs, module.relation_proj], [*inputs64, module64.relation_proj]
    grads = torch.autograd.grad(got, params, upstream.to(dtype))
    grads64 = torch.autograd.grad(expected, params64, upstream)
    for g, e, name in zip(grads, grads64, ["query", "key", "symbol values", "relation queries", "relation keys",
                                           "W_r"]):
        assert_close(g, e, atol=atol, rtol=atol, what=f"{backend} gradient of {name}")


@pytest.mark.parametrize("case", ["causal", "right-padding", "gqa", "decoding-step"])
def test_sdpa_in_bfloat16(case):
    module64, module, inputs64, inputs, mask, call, _ = run_case("sdpa", case, torch.bfloat16)
    expected, _, _ = call_backend("eager", module64, *inputs64, mask, SCALING, RELATION_SCALING)
    got, _, _ = call_backend("sdpa", module, *inputs, mask, SCALING, RELATION_SCALING)
    assert got.dtype == torch.bfloat16
    assert_close(got, expected, atol=3e-2, rtol=3e-2, what="bf16 sdpa")


# ---- selection ---------------------------------------------------------------------------------------------------
def backends_used(model):
    return {m.relational_attention_backend for m in model.modules()
            if isinstance(m, dat_hf.dual_attention.RelationalAttention)}


def one_decoding_step(model, x):
    with torch.no_grad():
        cache = output_cache(model(x, use_cache=True))
        model(x[:, :1], cache=cache)


def test_selection():
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config())
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    model.train()
    model(x, labels=x).loss.backward()
    assert backends_used(model) == {"cpu"}, "CPU float32 training"
    model.eval()
    one_decoding_step(model, x)
    assert backends_used(model) == {"cpu"}, "CPU float32 decoding"
    with torch.no_grad():
        model(x, output_attentions=True)
    assert backends_used(model) == {"eager"}, "output_attentions"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()(x, labels=x).loss.backward()
    assert backends_used(model) == {"sdpa"}, "bfloat16 autocast training"
    model.eval().to(torch.bfloat16)
    with torch.no_grad():
        model(x)
        assert backends_used(model) == {"sdpa"}, "bfloat16 prefill"
        one_decoding_step(model, x)
        assert backends_used(model) == {"eager"}, "bfloat16 decoding: the explicit step"
    model.float()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        model(x)
    assert backends_used(model) == {"eager"}, "attn_implementation='eager'"


def test_selection_of_non_identity_relations_and_relative_symbols():
    for overrides in (dict(relation_activation="relu"), dict(symbol_retrieval="position_relative")):
        model = DATForCausalLM(tiny_config(**overrides)).eval()
        with torch.no_grad():
            model(torch.randint(0, 97, (2, 9)))
        assert backends_used(model) == {"eager"}, overrides


def test_flex_attention_selection():
    model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=3))
    model.set_attn_implementation("flex_attention")
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        expected = model.eval()(x).logits
        assert backends_used(model) == {"flex_attention"}
        model.config.relational_attn_implementation = "eager"
        assert_close(model(x).logits, expected, atol=1e-5)


def test_flex_attention_relational_heads_beside_sdpa_sensory_heads():
    """Only the relational heads on FlexAttention: the sensory heads (sdpa) take the dense mask, not the BlockMask."""
    model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=3)).eval()
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        expected = model(x).logits
        model.config.relational_attn_implementation = "flex_attention"
        assert_close(model(x).logits, expected, atol=1e-5)
        assert backends_used(model) == {"flex_attention"}


@pytest.mark.parametrize("bias", ["causal", "sliding_window"])
def test_flex_attention_over_a_static_cache(bias):
    """Every head on FlexAttention with a static cache: the prefill (keys sized for every slot, as the BlockMask is)
    and greedy decoding give the tokens and scores of SDPA without a cache, and so does a step whose masks were built
    ahead by `create_masks_for_generate` (as compiled decoding gets them: dense masks, made BlockMasks in the
    forward; a bool tensor given to FlexAttention would be added to the scores)."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(relational_bias=bias, sliding_window_size=3)).eval()
    prompt = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=False, output_scores=True,
                                  return_dict_in_generate=True)
        full = model(torch.cat([prompt, prompt[:, :1]], 1)).logits[:, -1:]
        model.set_attn_implementation("flex_attention")
        model.config.relational_attn_implementation = "flex_attention"  # (decoding steps would pick `cpu`)
        got = model.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation="static",
                             output_scores=True, return_dict_in_generate=True)
        assert backends_used(model) == {"flex_attention"}
        assert torch.equal(got.sequences, expected.sequences)
        assert_close(torch.stack(got.scores), torch.stack(expected.scores), atol=1e-5, what="static cache scores")
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(prompt, cache=cache)
        masks = model.create_masks_for_generate(model.config, torch.empty(2, 1, 0), torch.ones(2, 9, dtype=torch.long),
                                                cache)
        step = model(prompt[:, :1], attention_mask=masks, cache=cache, position_ids=torch.full((2, 1), 8))
        assert backends_used(model) == {"flex_attention"}
        assert_close(step.logits, full, atol=1e-5, what="a step with masks built ahead")


@pytest.mark.parametrize("dtype", ["bool", "additive"])
def test_flex_attention_with_a_users_4d_mask(dtype):
    """A user's 4-D mask (Transformers hands it on as is, also for FlexAttention) reaches FlexAttention heads as a
    `BlockMask` (a tensor would be added to the scores: a bool one wrongly, an additive one crashed PyTorch's CPU
    kernel): every head on FlexAttention gives the logits of SDPA, a row with one sender included."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config()).eval()
    x = torch.randint(0, 97, (2, 6))
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None].repeat(2, 1, 1, 1)
    allowed[1, 0, 2:, 0] = False
    mask = allowed if dtype == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo().min)
    with torch.no_grad():
        expected = model(x, attention_mask=mask).logits
        model.set_attn_implementation("flex_attention")
        model.config.relational_attn_implementation = "flex_attention"
        got = model(x, attention_mask=mask).logits
    assert backends_used(model) == {"flex_attention"}
    assert_close(got, expected, atol=1e-5, what=f"flex_attention with a {dtype} 4-D mask")


def test_flex_value_chunks():
    """Off CPU FlexAttention gets the fused values in chunks no wider than 128 (or the query width rounded up to a
    power of two); the CPU kernel takes them whole."""
    assert flex_value_chunks(576, 64, "cuda") == [128, 128, 128, 128, 64]  # the 343M config: 64 + 8 x 64
    assert flex_value_chunks(576, 64, "cpu") == [576]
    assert flex_value_chunks(100, 64, "cuda") == [100]
    assert flex_value_chunks(600, 160, "cuda") == [256, 256, 88]
    assert flex_value_chunks(128, 32, "xpu") == [128]


def test_flex_attention_narrow_heads_on_cpu():
    """Inductor's C++ FlexAttention (PyTorch 2.13 and 2.14.1) gives wrong or non-finite outputs for head dimensions
    under 32 at lengths that are not a multiple of 16 (d_h = 8 and 16 at 8, 24 and 40 tokens failed, each with and
    without a mask): dat_hf's FlexAttention call pads queries and keys with zero columns, and matches SDPA."""
    torch.manual_seed(0)
    for d, length in [(16, 24), (8, 40), (16, 8)]:
        query, key, value = torch.randn(1, 4, length, d), torch.randn(1, 2, length, d), torch.randn(1, 2, length, 12)
        causal = create_block_mask(lambda b, h, q, kv: kv <= q, 1, None, length, length, device="cpu")
        got, _ = sensory_attention.flex_attention_forward(None, query, key, value, causal, scaling=d ** -0.5)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=True)
        assert torch.isfinite(got).all(), f"head dimension {d}, {length} tokens"
        assert_close(got, expected.transpose(1, 2), 1e-5, what=f"head dimension {d}, {length} tokens")


@pytest.mark.parametrize("case", ["causal", "gqa-1-bool", "decoding-step-padding"])
def test_flex_attention_in_value_chunks_matches_reference(case, monkeypatch):
    """The chunked calls (off CPU) run here on CPU tensors: values 21 wide (d 6 + 3 x 5) in chunks of at most 8
    (queries 6 wide, rounded up), each FlexAttention call gets one chunk, and the messages equal the reference."""
    monkeypatch.setattr(relational_attention_fused, "WHOLE_VALUE_DEVICES", frozenset())
    monkeypatch.setattr(relational_attention_fused, "FLEX_VALUE_CHUNK", 4)
    flex, widths = relational_attention_fused.flex_attention_forward, []

    def counted(module, query, key, value, *args, **kwargs):
        widths.append(value.shape[-1])
        return flex(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(relational_attention_fused, "flex_attention_forward", counted)
    module64, module, inputs64, inputs, mask, call, _ = run_case("flex_attention", case, torch.float32, grad=False)
    assert RELATIONAL_ATTENTION_FUNCTIONS["flex_attention"].supports(call) is None
    expected = call_backend("eager", module64, *inputs64, mask, SCALING, RELATION_SCALING)[0]
    with torch.no_grad():
        got = call_backend("flex_attention", module, *inputs, mask, SCALING, RELATION_SCALING)[0]
    assert widths == [8, 8, 5]
    assert_close(got, expected, atol=2e-5, rtol=2e-5, what="flex_attention messages from value chunks")


def test_explicit_choice_and_its_errors():
    model = DATForCausalLM(tiny_config(relational_attn_implementation="sdpa")).eval()
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        model(x)
        assert backends_used(model) == {"sdpa"}
        with pytest.raises(ValueError, match=r"relational_attn_implementation='sdpa'.*does not return attention"):
            model(x, output_attentions=True)
        model.config.relational_attn_implementation = "cpu"
        with pytest.raises(ValueError, match="relational_attn_implementation='cpu'.*float32 on CPU"):
            model.double()(x)
        model.config.relational_attn_implementation = "triton-on-the-moon"
        with pytest.raises(ValueError, match="Unknown relational attention backend 'triton-on-the-moon'; registered"):
            model(x)
    with pytest.raises(Exception, match="relational_attn_implementation"):  # the strict dataclass's type check
        tiny_config(relational_attn_implementation=3)


@pytest.mark.integration
def test_without_the_cpu_kernel_the_pytorch_backends_run():
    """`DAT_HF_CPU_KERNEL=0` (or no compiler): nothing is compiled; training runs `sdpa`, decoding `eager`."""
    code = """
import torch, dat_hf
from dat_hf.kernels.cpu_build import _STATE
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS
from dat_hf.transformers_compat import output_cache
from dat_hf import DATConfig, DATForCausalLM
model = DATForCausalLM(DATConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_sensory_heads=2,
                                 num_relational_heads=2, num_symbols=8, symbolic_attention_heads=2))
x = torch.randint(0, 50, (2, 8))
model(x, labels=x).loss.backward()
relational = model.model.layers[0].dual_attn.relational
training = relational.relational_attention_backend
with torch.no_grad():
    cache = output_cache(model.eval()(x, use_cache=True))
    model(x[:, :1], cache=cache)
print(training, relational.relational_attention_backend, _STATE["tried"], "cpu" in RELATIONAL_ATTENTION_FUNCTIONS)
"""
    env = dict(os.environ, DAT_HF_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sdpa", "eager", "False", "True"]


# ---- models: every family, every backend that supports the call ----------------------------------------------------
def logits_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.logits.float().logsumexp(-1).mean().backward()
    return out.logits.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def assert_backends_agree(model, inputs, backends=("cpu", "sdpa")):
    model.train()
    model.config.relational_attn_implementation = "eager"
    expected, expected_grads = logits_and_grads(model, inputs)
    for backend in backends:
        model.config.relational_attn_implementation = backend
        logits, grads = logits_and_grads(model, inputs)
        assert backends_used(model) == {backend}
        assert_close(logits, expected, atol=2e-5, what=f"{backend} logits")
        for g, e in zip(grads, expected_grads):
            if e is not None:
                assert_close(g, e, atol=2e-5, rtol=1e-4, what=f"{backend} gradient")
    model.config.relational_attn_implementation = None


LM_CONFIGS = {
    "default": dict(),
    "gqa": dict(num_relational_key_value_heads=1, num_sensory_key_value_heads=1),
    "symmetric": dict(symmetric_relations=True, num_relations=4),
    "shared-attention-params": dict(share_attention_params=True),
    "sliding-window-padded": dict(relational_bias="sliding_window", sliding_window_size=5),
    "sparse-relational-padded": dict(relational_heads_bias="sparse", sparse_block_size=4, sparse_global_tokens=1),
}


@pytest.mark.parametrize("name", list(LM_CONFIGS))
def test_causal_lm_backends_agree(name):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(**LM_CONFIGS[name]))
    x = torch.randint(0, model.config.vocab_size, (3, 29))
    inputs = {"input_ids": x}
    if name.endswith("padded"):  # rows padded on the left by 0, 5 and 11 tokens
        inputs["attention_mask"] = (torch.arange(29)[None] >= torch.tensor([0, 5, 11])[:, None]).long()
    assert_backends_agree(model, inputs)


def test_encoder_backends_agree():
    torch.manual_seed(1)
    config = DATEncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2,
                              num_relational_heads=2, intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
                              max_position_embeddings=64, num_labels=3, relational_bias="graph")
    model = DATForTokenClassification(config)
    adjacency = torch.rand(2, 21, 21, generator=torch.Generator().manual_seed(0)) > 0.6
    adjacency[1, 4] = False  # an isolated node
    assert_backends_agree(model, {"input_ids": torch.randint(0, 50, (2, 21)), "graph_adjacency": adjacency})


def test_vision_backends_agree():
    torch.manual_seed(2)
    config = DATVisionConfig(image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2,
                             num_sensory_heads=2, num_relational_heads=2, intermediate_size=64, num_symbols=8,
                             symbolic_attention_heads=2, num_labels=3)
    model = DATForImageClassification(config)
    assert_backends_agree(model, {"pixel_values": torch.randn(2, 1, 16, 16)})


def test_seq2seq_backends_agree():
    torch.manual_seed(3)
    config = DATSeq2SeqConfig(vocab_size=40, hidden_size=32, encoder_layers=2,
                              num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2, cross_attention="dual",
                              intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
                              decoder_start_token_id=1, pad_token_id=0)
    model = DATForSeq2SeqLM(config)
    source = torch.randint(2, 40, (2, 11))
    attention_mask = torch.ones_like(source).index_fill_(1, torch.arange(8, 11), 0)
    assert_backends_agree(model, {"input_ids": source, "attention_mask": attention_mask,
                                  "decoder_input_ids": torch.randint(2, 40, (2, 7))})


def test_seq2seq_flex_attention_over_a_static_cache():
    """The decoder's heads on FlexAttention (self and dual cross-attention) with a static cache: the scores and tokens
    of SDPA without a cache, for a padded source (its prefill and its steps with masks built ahead, as the causal LM
    in `test_flex_attention_over_a_static_cache`)."""
    torch.manual_seed(3)
    config = DATSeq2SeqConfig(vocab_size=40, hidden_size=32, encoder_layers=2, num_hidden_layers=2,
                              num_sensory_heads=2, num_relational_heads=2, cross_attention="dual",
                              intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
                              decoder_start_token_id=1, pad_token_id=0, eos_token_id=None)
    model = DATForSeq2SeqLM(config).eval()
    source = torch.randint(2, 40, (2, 11))
    attention_mask = torch.ones_like(source).index_fill_(1, torch.arange(8, 11), 0)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(source, use_cache=False, **kwargs)
        model.set_attn_implementation("flex_attention")
        model.config.relational_attn_implementation = "flex_attention"
        model.config.get_text_config(decoder=True).relational_attn_implementation = "flex_attention"
        got = model.generate(source, cache_implementation="static", **kwargs)
    assert backends_used(model) == {"flex_attention"}
    assert torch.equal(got.sequences, expected.sequences)
    assert_close(torch.stack(got.scores), torch.stack(expected.scores), atol=1e-5, what="seq2seq static cache scores")


# ---- masks that let receiver blocks skip senders -------------------------------------------------------------------
def test_receiver_blocks_of_a_sliding_window_match_the_whole_mask(monkeypatch):
    """A sliding window over 1100 tokens runs block by block (each block of 256 receivers against the senders it may
    see): same logits and gradients as one call over the whole mask."""
    import dat_hf.masking_dat as masking_dat

    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=40,
                                       max_position_embeddings=2048))
    x = torch.randint(0, 97, (2, 1100))
    attention_mask = torch.ones_like(x).index_fill_(1, torch.arange(7), 0)
    mask = masking_dat.build_masks(["sliding_window"], model.config, torch.zeros(2, 1100, 32),
                                   attention_mask.bool())["sliding_window"]
    assert mask.receiver_blocks == ((0, 256, 7, 256), (256, 512, 216, 512), (512, 768, 472, 768),  # 7 padded
                                    (768, 1024, 728, 1024), (1024, 1100, 984, 1100))
    plain_causal = masking_dat.build_masks(["causal"], model.config, torch.zeros(2, 1100, 32), attention_mask.bool())
    assert plain_causal["causal"].receiver_blocks is None  # padding alone skips too little
    for backend in ("cpu", "sdpa"):
        model.config.relational_attn_implementation = backend
        blocked = logits_and_grads(model, {"input_ids": x, "attention_mask": attention_mask})
        monkeypatch.setattr(masking_dat, "MIN_SKIPPED_SHARE", 2.0)  # never in blocks
        whole = logits_and_grads(model, {"input_ids": x, "attention_mask": attention_mask})
        monkeypatch.undo()
        assert_close(blocked[0], whole[0], atol=1e-5, what=f"{backend} logits")
        for g, e in zip(blocked[1], whole[1]):
            assert_close(g, e, atol=1e-5, rtol=1e-4, what=f"{backend} gradient")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["cpu", "sdpa", "eager"])
def test_a_decoding_step_reads_only_the_senders_its_mask_allows(monkeypatch, backend, cache):
    """A decoding step is one block of receivers: with a sliding window over a long cache of full layers (a user's, or
    where the window is on one head type of some layer; a static cache's empty slots beyond it) both head types read
    only the senders the window allows, with the tokens and logits of attending over the whole cache."""
    import dat_hf.attention_plan as attention_plan
    import dat_hf.masking_dat as masking_dat

    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=16,
                                       max_position_embeddings=512, relational_attn_implementation=backend)).eval()
    prompt = torch.randint(1, 97, (2, 200))
    attention_mask = torch.ones_like(prompt).index_fill_(1, torch.arange(3), 0)  # (the first row is left padded)
    attention_mask[1] = 1
    senders = []  # (head type, receivers, senders) of every attention call
    run_sensory = attention_plan.PlannedSensory._run

    def sensory(self, module, query, key, *args, **kwargs):
        senders.append(("SensoryAttention", query.shape[2], key.shape[2]))
        return run_sensory(self, module, query, key, *args, **kwargs)

    registered = RELATIONAL_ATTENTION_FUNCTIONS[backend]

    def relational(query, key, *args, **kwargs):
        senders.append(("RelationalAttention", query.shape[2], key.shape[2]))
        return registered.function(query, key, *args, **kwargs)

    monkeypatch.setattr(attention_plan.PlannedSensory, "_run", sensory)
    monkeypatch.setitem(RELATIONAL_ATTENTION_FUNCTIONS, backend, registered._replace(function=relational))

    def generate():
        # full cache layers (the model's own would keep only the window: `DATConfig.layer_types`)
        full_cache = StaticCache(tiny_config(), max_cache_len=206) if cache == "static" else DynamicCache()
        out = model.generate(prompt, attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             cache=full_cache)
        return out.sequences, torch.stack(out.logits)

    tokens, logits = generate()
    steps = [(head, kv) for head, q, kv in senders if q == 1]
    assert {head for head, _ in steps} == {"SensoryAttention", "RelationalAttention"}
    assert {kv for _, kv in steps} == {17}, steps  # 16 previous tokens and itself, of 201-205 (static: 206) slots
    senders.clear()
    monkeypatch.setattr(masking_dat, "MIN_SKIPPED_SHARE", 2.0)  # never in blocks: every step over the whole cache
    whole_tokens, whole_logits = generate()
    assert min(kv for _, q, kv in senders if q == 1) > 200
    assert torch.equal(tokens, whole_tokens)
    assert_close(logits, whole_logits, atol=1e-5, what="decoding logits")


PADDINGS = {"none": None, "left": ((0, 0, 300), (1, 0, 7)), "right": ((0, -300, None), (2, -5, None)),
            "middle": ((0, 100, 500),)}


@pytest.mark.parametrize("padding", sorted(PADDINGS))
@pytest.mark.parametrize("bias, window", [("sliding_window", 40), ("sliding_window", 100),
                                          ("sliding_window_bidirectional", 40), ("sliding_window_bidirectional", 255)])
def test_long_sliding_window_masks_come_from_index_arithmetic(monkeypatch, bias, window, padding):
    """A long sliding window keeps its index arithmetic (`SlidingWindow`): its receiver blocks, isolated receivers,
    every block's mask and the dense mask (built only on request) equal those read from Transformers' dense mask."""
    import dat_hf.masking_dat as masking_dat

    config = tiny_config(relational_bias="sliding_window", sliding_window_size=window, max_position_embeddings=2048)
    b, n, two_sided = 3, 1100, bias == "sliding_window_bidirectional"
    attention_mask = None
    if PADDINGS[padding] is not None:
        attention_mask = torch.ones(b, n, dtype=torch.bool)
        for row, start, stop in PADDINGS[padding]:
            attention_mask[row, start:stop] = False
    inputs_embeds = torch.zeros(b, n, 32)
    arithmetic = masking_dat.build_attention_mask(bias, config, inputs_embeds, attention_mask, causal=not two_sided)
    monkeypatch.setattr(masking_dat, "long_window_mask", lambda *args: None)  # (Transformers' dense mask)
    dense = masking_dat.build_attention_mask(bias, config, inputs_embeds, attention_mask, causal=not two_sided)
    assert arithmetic.window is not None and arithmetic._mask is None
    assert arithmetic.receiver_blocks == dense.receiver_blocks is not None
    assert arithmetic.is_causal == dense.is_causal
    assert (arithmetic.row_valid is None) == (dense.row_valid is None)
    assert padding != "none" or arithmetic.row_valid is None
    if dense.row_valid is not None:
        assert torch.equal(arithmetic.row_valid, dense.row_valid)
    for receivers in arithmetic.receiver_blocks:
        assert torch.equal(arithmetic.block(*receivers).mask.expand(b, -1, -1, -1),
                           dense.block(*receivers).mask.expand(b, -1, -1, -1))
    assert torch.equal(arithmetic.dense(n, n, "cpu", 300, 700).expand(b, -1, -1, -1),
                       dense.dense(n, n, "cpu", 300, 700).expand(b, -1, -1, -1))
    assert torch.equal(arithmetic.mask.expand(b, -1, -1, -1), dense.mask)


def test_training_with_a_long_sliding_window_never_forms_the_dense_mask(monkeypatch):
    """Forward and backward over 1100 left-padded tokens with a sliding window: Transformers' dense window mask is
    never built, and no mask of more than one receiver block is formed (the step is O(n * window))."""
    import dat_hf.masking_dat as masking_dat

    def refuse(*args, **kwargs):
        raise AssertionError("the dense n x n sliding-window mask was built")

    monkeypatch.setattr(masking_dat, "create_sliding_window_causal_mask", refuse)
    shapes, allowed = [], masking_dat.SlidingWindow.allowed
    monkeypatch.setattr(masking_dat.SlidingWindow, "allowed",
                        lambda self, q0, q1, kv0, kv1, row_valid=None: shapes.append((q1 - q0, kv1 - kv0)) or allowed(
                            self, q0, q1, kv0, kv1, row_valid))
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=40,
                                       max_position_embeddings=2048)).train()
    x = torch.randint(0, 97, (2, 1100))
    attention_mask = torch.ones_like(x).index_fill_(1, torch.arange(7), 0)
    model(input_ids=x, attention_mask=attention_mask, labels=x).loss.backward()
    assert shapes and max(q for q, _ in shapes) <= masking_dat.RECEIVER_BLOCK
    assert max(kv for _, kv in shapes) <= masking_dat.RECEIVER_BLOCK + 40
