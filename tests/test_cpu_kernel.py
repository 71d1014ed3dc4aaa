"""The compiled CPU kernels (`dat_hf/kernels/`: `csrc/*.cpp`, `cpu.py`, `mlp.py`), at the level of their ops.

- they build on this machine (CI has a C++ compiler); `DAT_HF_CPU_KERNEL=0` turns them off without compiling;
- the relational attention op: float32 outputs and the gradients of all five inputs against the package's reference
  (`eager_relational_attention`, float64) split into its two aggregations, for causal (also kv > q), full, GQA,
  batch-1 symbol values, bool masks, strided (transposed) queries, and sizes that cross the kernel's 64-receiver /
  256-sender blocks; receivers without senders get zeros; both threading schemes give the single-thread result;
  bad inputs raise errors that name the tensor; `torch.compile` graphs call the op and give eager's gradients;
- the decoding op (one receiver per row, W_r applied) against the reference, for GQA, batch-1 symbol values, widths
  that are not multiples of the vector length, masks and strided views of a packed cache; greedy generation with
  the `cpu` backend equals generation with the reference;
- the SwiGLU and RoPE ops against PyTorch in float64, and the registered kernels taking them in training;
- the input-projection op of decoding against float64 products, and a decoding step taking it (logits as the
  reference's), while gradients, biases, hooks and long inputs keep the reference.
(Backend-level comparisons of every backend over the shared case matrix: `test_relational_backends.py`.)
"""

import functools
import shutil

import pytest
import torch
from conftest import set_kernels_aside, tiny_config
from torch import nn
from relational_cases import (Heads, assert_close, call_backend, causal_and, count_backend_calls, make_inputs,
                              random_bool_mask, reference_parts, right_padding)

import dat_hf.dual_attention as da
import dat_hf.kernels.cpu as kernel
import dat_hf.kernels.projections as projections
from dat_hf import DATForCausalLM
from dat_hf.kernels import cpu_build
from dat_hf.kernel_hooks import registered_kernels
from dat_hf.masking_dat import AttentionMask
from dat_hf.transformers_compat import output_cache


def test_kernel_builds_on_this_machine():
    if shutil.which("c++") is None:  # no compiler: the PyTorch backends stand in
        assert not kernel.load_cpu_kernel()
        return
    assert kernel.load_cpu_kernel(), cpu_build._STATE["error"]
    assert kernel.cpu_kernel_ready()


@pytest.fixture
def loaded():
    assert kernel.load_cpu_kernel(), f"the CPU kernel did not build: {cpu_build._STATE['error']}"


def test_disabled_by_environment_without_compiling(monkeypatch):
    monkeypatch.setenv("DAT_HF_CPU_KERNEL", "0")
    monkeypatch.setattr(cpu_build, "_STATE", {"loaded": False, "tried": False, "error": None})
    monkeypatch.setattr(kernel, "_READY", [False])
    assert not cpu_build.cpu_kernel_enabled()
    assert not kernel.load_cpu_kernel()
    assert not cpu_build._STATE["tried"]  # nothing was attempted
    from dat_hf.relational_attention import RelationalCall

    call = RelationalCall("cpu", torch.float32, 4, True, False, "identity", False, 0.0, AttentionMask(None, None, True),
                          False, False)
    assert "not built" in kernel.supports_cpu(call)


# ---- function level ----------------------------------------------------------------------------------------------
CASES = {
    "causal": dict(causal=True),
    "causal-kv-longer": dict(causal=True, kv_len=23),
    "full": dict(causal=False),
    "full-kv-shorter": dict(causal=False, kv_len=7),
    "gqa": dict(causal=True, h_kv=2),
    "gqa-1-kv-head-symbols-batch-1": dict(causal=True, h_kv=1, symbol_batch=1),
    "batch-3-one-relation": dict(causal=True, b=3, R=1, d_r=7),
    "crosses-blocks-causal": dict(causal=True, q_len=150, kv_len=300, d=8, R=2, d_r=4),
    "crosses-blocks-full": dict(causal=False, b=1, q_len=130, kv_len=270, d=8, R=2, d_r=4),
}


def run_kernel_and_reference(spec, seed=0, transpose_query=False, mask=None):
    """mask: None or bool `[b|1, 1, q, kv]` (True = attend), on top of `causal`."""
    spec = dict(spec)
    causal = spec.pop("causal")
    spec.setdefault("h_kv", 4)
    spec.setdefault("q_len", 10)
    inputs64 = make_inputs(seed=seed, **spec)
    b, q_len, kv_len = inputs64[0].shape[0], inputs64[0].shape[2], inputs64[1].shape[2]
    scaling, relation_scaling = 0.37, 0.61
    # the op's causal order: receiver i at position kv - q + i (explicit for the reference)
    allowed = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool) if mask is None else mask
    reference_mask = AttentionMask(causal_and(allowed, q_len, kv_len) if causal else mask, None, causal)
    expected = reference_parts(*inputs64, reference_mask, scaling, relation_scaling)
    inputs = [t.detach().float().requires_grad_() for t in inputs64]
    query = inputs[0]
    if transpose_query:  # the model's layout: [b, q, h, d] storage viewed as [b, h, q, d]
        query = query.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        inputs[0] = query
    values = inputs[2].expand(b, -1, -1, -1)
    got = kernel.relational_attention_op(query, inputs[1], values, inputs[3], inputs[4], causal, scaling,
                                         relation_scaling, mask)
    gen = torch.Generator().manual_seed(11)
    grads_out = [torch.randn(e.shape, generator=gen, dtype=torch.float64) for e in expected]
    grads = torch.autograd.grad(got, inputs, [g.float() for g in grads_out])
    grads64 = torch.autograd.grad(expected, inputs64, grads_out)
    return got, expected, grads, grads64


@pytest.mark.parametrize("case", list(CASES))
def test_function_matches_reference(case, loaded):
    got, expected, grads, grads64 = run_kernel_and_reference(CASES[case])
    for g, e, name in zip(got, expected, ["attended symbols", "attended relations"]):
        assert g.shape == e.shape and g.dtype == torch.float32, name
        assert_close(g.double(), e, atol=2e-5, rtol=2e-5, what=name)
    for g, e, name in zip(grads, grads64, ["query", "key", "symbol values", "relation queries", "relation keys"]):
        assert g.shape == e.shape, name
        assert_close(g.double(), e, atol=2e-5, rtol=2e-5, what=f"grad of {name}")


MASKED_CASES = {  # (spec, mask builder)
    "causal-right-padding": (dict(causal=True, b=3, q_len=10), lambda: right_padding(3, 10, [10, 6, 1])),
    "causal-kv-longer-padding": (dict(causal=True, b=2, kv_len=23), lambda: right_padding(2, 23, [23, 15])),
    "full-random": (dict(causal=False, b=2), lambda: random_bool_mask(2, 10, 10)),
    "full-random-shared-over-batch": (dict(causal=False, b=2, h_kv=2), lambda: random_bool_mask(1, 10, 10, seed=1)),
    "crosses-blocks-causal-padding": (dict(causal=True, b=2, q_len=150, kv_len=300, d=8, R=2, d_r=4),
                                      lambda: right_padding(2, 300, [300, 170])),
    "crosses-blocks-full-random": (dict(causal=False, b=1, q_len=130, kv_len=270, d=8, R=2, d_r=4),
                                   lambda: random_bool_mask(1, 130, 270, seed=2)),
}


@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_function_with_mask_matches_reference(case, loaded):
    spec, make_mask = MASKED_CASES[case]
    got, expected, grads, grads64 = run_kernel_and_reference(spec, mask=make_mask())
    for g, e, name in zip(got, expected, ["attended symbols", "attended relations"]):
        assert_close(g.double(), e, atol=2e-5, rtol=2e-5, what=name)
    for g, e, name in zip(grads, grads64, ["query", "key", "symbol values", "relation queries", "relation keys"]):
        assert_close(g.double(), e, atol=2e-5, rtol=2e-5, what=f"grad of {name}")


def test_receivers_without_senders_get_zeros_and_zero_gradients(loaded):
    b, h, q_len, d, R, d_r = 2, 4, 9, 6, 3, 5
    inputs = [t.detach().float().requires_grad_() for t in make_inputs(b=b, q_len=q_len, kv_len=q_len)]
    mask = torch.ones(b, 1, q_len, q_len, dtype=torch.bool)
    mask[1, :, 4] = False  # receiver 4 of row 1 has no sender
    symbols, relations = kernel.relational_attention_op(*inputs, False, 0.3, 0.7, mask)
    assert torch.isfinite(symbols).all() and torch.isfinite(relations).all()
    assert (symbols[1, 4] == 0).all() and (relations[1, 4] == 0).all()
    grads = torch.autograd.grad((symbols.sum() + relations.sum()), inputs)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][1, :, 4] == 0).all() and (grads[3][1, 4] == 0).all()  # its query and relation query


def test_strided_query(loaded):
    got, expected, grads, grads64 = run_kernel_and_reference(CASES["gqa"], transpose_query=True)
    assert_close(got[0].double(), expected[0], atol=2e-5, rtol=2e-5)
    assert_close(grads[0].double(), grads64[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("batch", [1, 3])  # 1 < threads: per-thread key-gradient buffers; 3 >= threads: rows
def test_threads_give_the_single_thread_result(batch, loaded):
    spec = dict(CASES["crosses-blocks-causal"], b=batch)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel_and_reference(spec, seed=3)
        torch.set_num_threads(2)
        two = run_kernel_and_reference(spec, seed=3)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip([*one[0], *one[2]], [*two[0], *two[2]]):
        assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_bad_inputs_name_the_problem(loaded):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    qr, kr = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    op = torch.ops.dat_hf.relational_attention_forward
    with pytest.raises(RuntimeError, match="query must be a float32 CPU tensor"):
        op(q.double(), k, v, qr, kr, None, True, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="symbol values"):
        op(q, k, v[:1], qr, kr, None, True, 0, 1.0, 1.0)  # a batch-1 view must be expanded first
    with pytest.raises(RuntimeError, match="relation queries"):
        op(q, k, v, qr[:, :4], kr, None, True, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="h divisible by h_kv"):
        op(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), qr, kr, None, True, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="causal attention needs kv_len >= q_len"):
        op(q, k[:, :, :3], v[:, :, :3], qr, kr[:, :3], None, True, -2, 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"the mask must be bool \[b or 1, q or 1, kv\] = \[2 or 1, 5 or 1, 5\]"):
        op(q, k, v, qr, kr, torch.ones(2, 5, 4, dtype=torch.bool), True, 0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="the mask must be bool"):
        op(q, k, v, qr, kr, torch.ones(2, 5, 5), True, 0, 1.0, 1.0)


# ---- torch.compile -------------------------------------------------------------------------------------------
def test_torch_compile_calls_the_op(loaded):
    """The op is opaque to the compiler: the traced graph contains it, and compiled gradients equal eager ones."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config()).train()
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(x, labels=x).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert any("dat_hf.relational_attention_forward" in g for g in graphs)
    expected_loss = model(x, labels=x).loss
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    assert_close(loss.detach(), expected_loss.detach(), atol=1e-6)
    for g, e in zip(grads, expected):
        assert_close(g, e, atol=1e-6, rtol=1e-5)


# ---- decoding op -------------------------------------------------------------------------------------------------
DECODE_CASES = {
    "default": dict(),
    "gqa-2": dict(h_kv=2),
    "gqa-1-symbols-batch-1": dict(h_kv=1, symbol_batch=1),
    "batch-3-one-relation-odd-widths": dict(b=3, R=1, d_r=7, d=40),
    "wide-head-long-cache": dict(d=70, R=2, d_r=33, kv_len=600),
}


def decode_reference(inputs64, relation_proj, scaling, relation_scaling, mask=None):
    """float64: the reference's messages of one receiver that sees every (unmasked) sender (a receiver without
    senders gets zeros)."""
    query, key = inputs64[0], inputs64[1]
    module = Heads(query.shape[1], key.shape[1], query.shape[3], relation_proj.shape[2], relation_proj=relation_proj)
    allowed = None if mask is None else mask[:, None, None]
    row_valid = None if mask is None else mask.any(-1)[:, None, None, None]
    if row_valid is not None:
        allowed = allowed | ~row_valid
    out, _, _ = call_backend("eager", module, *inputs64, AttentionMask(allowed, None, False), scaling,
                             relation_scaling)
    return out if row_valid is None else out * row_valid.transpose(1, 2)


def run_decode(spec, seed=0, mask=None):
    spec = dict(spec, q_len=1)
    spec.setdefault("kv_len", 37)
    inputs64 = [t.detach() for t in make_inputs(seed=seed, **spec)]
    b, h, _, d = inputs64[0].shape
    R = inputs64[3].shape[2]
    relation_proj = torch.randn(h, d, R, generator=torch.Generator().manual_seed(seed + 5), dtype=torch.float64)
    expected = decode_reference(inputs64, relation_proj, 0.37, 0.61, None if mask is None else mask.expand(b, -1))
    q, k, v, qr, kr = (t.float() for t in inputs64)
    got = kernel.relational_decode_op(q, k, v.expand(b, -1, -1, -1), qr, kr, relation_proj.float(), 0.37, 0.61,
                                      None if mask is None else mask[:, None, None])
    return got, expected


def left_padding(b, kv_len):
    """bool [b, kv]: row i drops its first i * 3 senders (True = attend)."""
    return torch.arange(kv_len)[None] >= 3 * torch.arange(b)[:, None]


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference(case, loaded):
    got, expected = run_decode(DECODE_CASES[case])
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert_close(got.double(), expected, atol=2e-5, rtol=2e-5, what="decoded relational heads")


@pytest.mark.parametrize("mask_kind", ["left-padding", "shared-window", "random", "row-without-senders"])
def test_decode_with_mask_matches_reference(mask_kind, loaded):
    b, kv_len = 3, 37
    if mask_kind == "left-padding":
        mask = left_padding(b, kv_len)
    elif mask_kind == "shared-window":  # one [1, kv] mask for the batch (a sliding window)
        mask = torch.arange(kv_len)[None] >= kv_len - 8
    else:
        mask = torch.rand(b, kv_len, generator=torch.Generator().manual_seed(1)) > 0.5
        if mask_kind == "row-without-senders":
            mask[1] = False
    got, expected = run_decode(dict(b=b, h_kv=2, kv_len=kv_len), mask=mask)
    assert torch.isfinite(got).all()
    assert_close(got.double(), expected, atol=2e-5, rtol=2e-5, what=f"decoded heads, {mask_kind} mask")
    if mask_kind == "row-without-senders":
        assert (got[1] == 0).all()


def test_decode_reads_strided_views_of_a_packed_cache(loaded):
    """Keys `[b, h_kv, capacity, d]` and one flat value row `[symbol values | relation keys]` per sender, as the
    in-place cache layers hold them: prefix views, nothing copied."""
    b, h, h_kv, kv_len, capacity, d, R, d_r = 2, 4, 2, 29, 64, 16, 3, 8
    g = torch.Generator().manual_seed(4)
    key_buffer = torch.randn(b, h_kv, capacity, d, generator=g)
    value_buffer = torch.randn(b, 1, capacity, h_kv * d + R * d_r, generator=g)
    query = torch.randn(b, 1, h, d, generator=g).transpose(1, 2)  # [b, h, 1, d] view of the projection output
    q_rel = torch.randn(b, 1, R, d_r, generator=g)
    relation_proj = torch.randn(h, d, R, generator=g)
    key = key_buffer[:, :, :kv_len]
    flat = value_buffer[:, 0, :kv_len]
    values = flat[..., : h_kv * d].view(b, kv_len, h_kv, d).transpose(1, 2)
    k_rel = flat[..., h_kv * d:].view(b, kv_len, R, d_r)
    got = kernel.relational_decode_op(query, key, values, q_rel, k_rel, relation_proj, 0.25, 0.5)
    copies = [t.contiguous().double() for t in (query, key, values, q_rel, k_rel)]
    expected = decode_reference(copies, relation_proj.double(), 0.25, 0.5)
    assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


def test_decode_reads_only_the_senders_from_the_first_to_the_last_allowed(loaded):
    """A row reads its senders from the first to the last its mask allows (a static cache's empty slots, a sliding
    window, left padding cost nothing): NaN outside that range leaves the messages as without it; a masked sender
    inside the range is read and weighted zero."""
    b, h, h_kv, kv_len, d, R, d_r = 3, 4, 2, 40, 16, 3, 8
    g = torch.Generator().manual_seed(7)
    query, key, values = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h_kv, kv_len, d, generator=g), \
        torch.randn(b, h_kv, kv_len, d, generator=g)
    q_rel, k_rel = torch.randn(b, 1, R, d_r, generator=g), torch.randn(b, kv_len, R, d_r, generator=g)
    relation_proj = torch.randn(h, d, R, generator=g)
    mask = torch.zeros(b, kv_len, dtype=torch.bool)
    mask[0, 5:21] = True  # a window, then a static cache's empty slots
    mask[1, 3:30] = True
    mask[1, 10:14] = False  # a hole inside the range
    mask[2, :] = False  # no sender
    decode = functools.partial(kernel.relational_decode_op, relation_proj=relation_proj, scaling=0.3,
                               relation_scaling=0.7, mask=mask[:, None, None])
    expected = decode(query, key, values, q_rel, k_rel)
    outside = torch.ones(b, kv_len, dtype=torch.bool)
    outside[0, 5:21] = outside[1, 3:30] = False
    nan = float("nan")
    key[outside[:, None, :, None].expand_as(key)] = nan
    values[outside[:, None, :, None].expand_as(values)] = nan
    k_rel[outside[:, :, None, None].expand_as(k_rel)] = nan
    got = decode(query, key, values, q_rel, k_rel)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected) and (got[2] == 0).all()
    reference = decode_reference([t.double() for t in (query, key.nan_to_num(), values.nan_to_num(), q_rel,
                                                       k_rel.nan_to_num())], relation_proj.double(), 0.3, 0.7, mask)
    assert_close(got.double(), reference, atol=2e-5, rtol=2e-5)


def test_decode_threads_give_the_single_thread_result(loaded):
    spec = dict(b=2, kv_len=700, d=24, R=2, d_r=12)  # enough senders to split the relation pass across threads
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_decode(spec, seed=2)
        torch.set_num_threads(2)
        two, _ = run_decode(spec, seed=2)
    finally:
        torch.set_num_threads(previous)
    assert_close(two, one, atol=1e-6, rtol=1e-6)


def test_decode_bad_inputs_name_the_problem(loaded):
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    qr, kr, w = torch.randn(1, 1, 3, 4), torch.randn(1, 5, 3, 4), torch.randn(2, 8, 3)
    op = torch.ops.dat_hf.relational_attention_decode
    with pytest.raises(RuntimeError, match="one receiver per row"):
        op(torch.randn(1, 2, 2, 8), k, v, torch.randn(1, 2, 3, 4), kr, w, None, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="relation_proj must be a contiguous float32"):
        op(q, k, v, qr, kr, w[:, :, :2], None, 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"relation queries \[b, q, R, d_r\] and keys"):
        op(q, k, v, qr, kr[:, :4], w, None, 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"the mask must be bool \[b or 1, q or 1, kv\]"):
        op(q, k, v, qr, kr, w, torch.ones(1, 1, 4, dtype=torch.bool), 1.0, 1.0)
    with pytest.raises(RuntimeError, match="the mask must be bool"):
        op(q, k, v, qr, kr, w, torch.zeros(1, 1, 5), 1.0, 1.0)


def greedy(model, prompt, **kwargs):
    out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.scores)


GENERATION_CASES = {
    "default": (dict(), False),
    "gqa": (dict(num_relational_key_value_heads=1, num_relations=3, relation_dim=5), False),
    "left-padded-batch": (dict(), True),
    "sliding-window": (dict(relational_bias="sliding_window", sliding_window_size=4), False),
}


@pytest.mark.parametrize("case", list(GENERATION_CASES))
def test_generation_with_decode_op_equals_reference(case, loaded, monkeypatch):
    """Through the relational backend (the decoding-step ops set aside), greedy generation over the relational
    decoding op gives the eager backend's tokens and scores."""
    without_step(monkeypatch)
    overrides, padded = GENERATION_CASES[case]
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(**overrides)).eval()
    prompt = torch.randint(1, model.config.vocab_size, (2, 9))
    kwargs = {}
    if padded:  # the first prompt is 3 tokens shorter, padded on the left
        kwargs = dict(attention_mask=torch.ones_like(prompt).index_fill_(1, torch.arange(3), 0)
                      .index_fill_(0, torch.tensor([1]), 1), pad_token_id=0)
    with count_backend_calls("cpu") as calls:
        tokens, scores = greedy(model, prompt, **kwargs)
    assert calls[0] == model.config.num_hidden_layers * 12  # the prefill and every later step, every layer
    model.config.relational_attn_implementation = "eager"
    tokens_ref, scores_ref = greedy(model, prompt, **kwargs)
    assert torch.equal(tokens, tokens_ref)
    assert_close(scores, scores_ref, atol=1e-5)


# ---- the MLP's SwiGLU ops ----------------------------------------------------------------------------------------
def test_swiglu_ops_match_autograd_in_fp64(loaded):
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(3, 7, 37, generator=g, dtype=torch.float64) * 4  # 37: a vector-width tail
    up, grad = torch.randn_like(gate), torch.randn_like(gate)
    gate_leaf, up_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    expected = torch.nn.functional.silu(gate_leaf) * up_leaf
    expected_grads = torch.autograd.grad(expected, (gate_leaf, up_leaf), grad)
    out = kernel.swiglu_op(gate.float(), up.float())
    grads = kernel.swiglu_backward_op(grad.float(), gate.float(), up.float())
    assert out.dtype == torch.float32 and out.shape == gate.shape
    assert (out.double() - expected).abs().max() < 1e-5
    for got, want in zip(grads, expected_grads):
        assert (got.double() - want).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="swiglu: gate and up must be contiguous float32"):
        kernel.swiglu_op(gate, up)  # float64


def test_mlp_training_takes_the_fused_swiglu(loaded, monkeypatch):
    """A float32 CPU training step of the MLP runs the registered recomputing kernel with the one-pass SwiGLU forward
    (also its recomputation) and backward, and its gradients match the reference `activation_down_projection`."""
    import dat_hf.kernels.mlp as mlp_kernels
    import dat_hf.modeling_dat as modeling

    assert registered_kernels("activation_down_projection") == [
        mlp_kernels.recomputed_activation_down_projection, mlp_kernels.fused_swiglu_down_projection]
    torch.manual_seed(0)
    mlp = modeling.DATMLP(tiny_config(intermediate_size=96)).train()
    x = torch.randn(2, 5, 32, requires_grad=True)
    grad = torch.randn(2, 5, 32)
    params = [x, *mlp.parameters()]
    calls = []
    for name in ("swiglu_op", "swiglu_backward_op"):
        original = getattr(mlp_kernels, name)
        monkeypatch.setattr(mlp_kernels, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    got = torch.autograd.grad(mlp(x), params, grad)
    assert calls == ["swiglu_op", "swiglu_op", "swiglu_backward_op"]  # forward, recomputation, gradients
    up, gate = mlp.up_proj(x), mlp.gate_proj(x)
    expected_out = modeling.activation_down_projection.reference(mlp.act_fn, gate, up, mlp.down_proj)
    expected = torch.autograd.grad(expected_out, params, grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cos_batch", [1, 3])
def test_rope_op_matches_pytorch_in_fp64(cos_batch, loaded):
    """The one-pass RoPE (and its transpose, the gradient) equals `x cos + rotate_half(x) sin` computed in float64, on
    strided views: the fused projection's output, a transposed gradient."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(3, 7, 5 * 36 + 11, generator=g, dtype=torch.float64)  # 36: a vector-width tail in each half
    x = fused[..., : 5 * 36].view(3, 7, 5, 36)
    cos, sin = (torch.randn(cos_batch, 7, 36, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(3, 7, 5, 36, generator=g, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    expected = leaf * cos[:, :, None] + da.rotate_half(leaf) * sin[:, :, None]
    (expected_grad,) = torch.autograd.grad(expected, leaf, grad)
    x32 = fused.float()[..., : 5 * 36].view(3, 7, 5, 36)
    assert not x32.is_contiguous()
    out = kernel.rope_op(x32, cos.float(), sin.float())
    assert out.is_contiguous() and out.shape == x.shape
    assert (out.double() - expected).abs().max() < 1e-5
    # the gradient arrives as a transposed view (`[b, h, n, d]` memory), which the op reads in place
    grad32 = grad.float().transpose(1, 2).contiguous().transpose(1, 2)
    got_grad = kernel.rope_op(grad32, cos.float(), sin.float(), transpose=True)
    assert (got_grad.double() - expected_grad).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match=r"rope: x must be float32 \[b, n, heads, d\] \(even d\) with a contiguous"):
        kernel.rope_op(x32.transpose(-1, -2), cos.float(), sin.float())  # last dim not contiguous
    with pytest.raises(RuntimeError, match=r"rope: cos and sin must be contiguous float32 \[b or 1, n, d\]"):
        kernel.rope_op(x32, cos.float()[:, :5], sin.float()[:, :5])


def record_calls(monkeypatch, name, what):
    """Wrap the op `kernel.<name>` so that each call appends `what(*args, **kwargs)` to the returned list."""
    calls, original = [], getattr(kernel, name)

    def recorded(*args, **kwargs):
        calls.append(what(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, name, recorded)
    return calls


def test_attention_training_takes_the_one_pass_rope(loaded, monkeypatch):
    """A float32 CPU training step of dual attention rotates keys and queries with the registered one-pass op (forward
    and the transposed rotation backward), and its output and gradients match the reference `apply_rotary`."""
    assert registered_kernels("rotary") == [kernel.cpu_rotary]
    torch.manual_seed(0)
    config = tiny_config()
    model = DATForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 9))
    calls = record_calls(monkeypatch, "rope_op", lambda *a, **k: k.get("transpose", False))
    loss = model(ids, labels=ids).loss
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert calls == [False] * config.num_hidden_layers + [True] * config.num_hidden_layers
    monkeypatch.setattr(kernel, "accepts_rotary", lambda *args: False)
    set_kernels_aside(monkeypatch)  # the reference only
    expected_loss = model(ids, labels=ids).loss
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    assert len(calls) == 2 * config.num_hidden_layers
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,d", [(1, 256), (3, 20), (projections.FUSED_PROJECTION_MIN_ROWS - 1, 37)])
def test_multi_linear_op_matches_the_projections_in_fp64(rows, d, loaded):
    """One op for a decoding step's input projections gives `cat([x W_i^T])` computed in float64, for widths that are
    not multiples of its 4-row groups and inputs that are not multiples of the vector length; two threads give the
    one-thread result exactly; bad inputs name the problem."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g, dtype=torch.float64)
    weights = [torch.randn(out, d, generator=g, dtype=torch.float64) for out in (5, 13, 8, 1, 64)]
    expected = torch.cat([x @ w.T for w in weights], dim=-1)
    got = kernel.multi_linear_op(x.float(), [w.float() for w in weights])
    assert got.shape == (rows, 91) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() < 1e-5 * d**0.5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernel.multi_linear_op(x.float(), [w.float() for w in weights]), got)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match=r"multi_linear: each weight must be a contiguous float32 CPU tensor \["):
        kernel.multi_linear_op(x.float(), [weights[0].float()[:, :-1]])  # one column short
    with pytest.raises(RuntimeError, match=r"multi_linear: x must be a contiguous float32 CPU tensor \[rows, d\]"):
        kernel.multi_linear_op(x, [w.float() for w in weights])


def step_matches_the_reference(model, ids, calls, monkeypatch):
    """The prompt `ids[:, :-1]` (no recorded op call), then one decoding step (one call per layer of `[b, d]` rows):
    its logits are those of the reference alone over the whole of `ids`."""
    with torch.no_grad():
        out = model(ids[:, :-1], use_cache=True)
        assert calls == []
        step = model(ids[:, -1:], cache=output_cache(out)).logits
    assert calls == [(ids.shape[0], model.config.hidden_size)] * model.config.num_hidden_layers
    set_kernels_aside(monkeypatch)  # the reference only
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits[:, -1:]
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)


class SubclassedWeight(torch.Tensor):
    pass


def test_decoding_projections_take_the_one_op(loaded, monkeypatch):
    """Without gradients, a float32 decoding step of dual attention projects its input with the registered op (once
    per layer), and its logits match the reference's one matrix product per projection; wrapped or biased projections,
    long inputs and inputs that need gradients keep the reference."""
    assert set(registered_kernels("fused_linear")) == {kernel.cpu_fused_linear, projections.concatenated_linear}
    torch.manual_seed(0)
    config = tiny_config()
    model = DATForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 41))
    calls = record_calls(monkeypatch, "multi_linear_op", lambda x, weights: x.shape)
    step_matches_the_reference(model, ids, calls, monkeypatch)  # (the prompt: 80 rows, one matrix product)
    relational = model.model.layers[0].dual_attn.relational
    linears = [relational.q_attn_proj, relational.q_rel_proj]
    x = torch.randn(1, 1, config.hidden_size)
    with torch.no_grad():
        assert kernel.accepts_fused_linear(linears, x)
        assert not kernel.accepts_fused_linear(linears, torch.randn(projections.FUSED_PROJECTION_MIN_ROWS, config.hidden_size))
        assert not kernel.accepts_fused_linear(linears, x.double())
        assert not kernel.accepts_fused_linear([*linears, nn.Linear(config.hidden_size, 3)], x)  # a bias
        hook = linears[0].register_forward_hook(lambda *args: None)
        assert not kernel.accepts_fused_linear(linears, x)
        hook.remove()
        subclass = nn.Linear(config.hidden_size, 3, bias=False)
        subclass.weight = nn.Parameter(torch.Tensor._make_subclass(SubclassedWeight, subclass.weight.detach()))
        assert not kernel.accepts_fused_linear([*linears, subclass], x)  # (e.g. a quantized weight)
    assert not kernel.accepts_fused_linear(linears, x)  # gradients wanted for the weights


def symbolic_module(d, heads, symbols, scale=None, bias=True, seed=0):
    from dat_hf.symbol_retrieval import SymbolicAttention

    config = tiny_config(hidden_size=d, symbolic_attention_heads=heads, num_symbols=symbols,
                         symbolic_attention_scale=scale)
    module = SymbolicAttention(config).eval()
    if not bias:
        module.q_proj = nn.Linear(d, d, bias=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g))
    return module


@pytest.mark.parametrize("d,heads,symbols,rows,scale,bias", [(128, 2, 32, 1, None, True), (24, 3, 7, 5, 0.3, False),
                                                               (40, 4, 50, 63, None, True)])
def test_symbolic_attention_op_matches_the_reference_in_fp64(d, heads, symbols, rows, scale, bias, loaded):
    """One op for a decoding step's symbol retrieval (query projection, each head's softmax over the templates, sum
    of the library) gives the reference module computed in float64, for head widths that are not multiples of the
    vector length; two threads give the one-thread result exactly; bad inputs name the problem."""
    from dat_hf.symbol_retrieval import symbolic_attention

    module = symbolic_module(d, heads, symbols, scale, bias)
    x = torch.randn(1, rows, d, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = symbolic_attention.reference(module.double(), x.double(), module.symbol_library)
        module.float()
        got = kernel.cpu_symbolic_attention(module, x, module.symbol_library)
        assert got.shape == (1, rows, d) and got.dtype == torch.float32
        assert (got.double() - expected).abs().max() < 1e-5
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert torch.equal(kernel.cpu_symbolic_attention(module, x, module.symbol_library), got)
        finally:
            torch.set_num_threads(threads)
        op, weight = torch.ops.dat_hf.symbolic_attention, module.q_proj.weight
        with pytest.raises(RuntimeError, match=r"symbolic_attention: the templates must be a contiguous float32 CPU "):
            op(x[0], weight, None, module.template_features[:, :-1], module.symbol_library, heads, 1.0)
        with pytest.raises(RuntimeError, match=r"heads dividing d"):
            op(x[0], weight, None, module.template_features, module.symbol_library, d + 1, 1.0)
        with pytest.raises(RuntimeError, match=r"the query bias must be a contiguous float32 CPU tensor"):
            op(x[0], weight, torch.zeros(d + 1), module.template_features, module.symbol_library, heads, 1.0)


def test_decoding_symbols_take_the_one_op(loaded, monkeypatch):
    """Without gradients, a float32 decoding step retrieves each layer's symbols with the registered op, and its
    logits match the reference's; a hooked or wrapped query projection, gradients, dropout in training, more rows
    than `SYMBOLIC_OP_MAX_ROWS`, several rows over large tables and other dtypes keep the reference."""
    assert registered_kernels("symbolic_attention") == [kernel.cpu_symbolic_attention]
    torch.manual_seed(0)
    config = tiny_config(symbol_retrieval="symbolic_attention", shared_symbol_retriever=False)
    model = DATForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 41))
    calls = record_calls(monkeypatch, "symbolic_attention_op", lambda x, *args: x.shape)
    step_matches_the_reference(model, ids, calls, monkeypatch)  # (the prompt: 80 rows, the reference)

    module = model.model.symbol_retrievers.retrievers[0]
    library, x = module.symbol_library, torch.randn(2, 1, config.hidden_size)
    accepts = kernel.accepts_symbolic_attention
    with torch.no_grad():
        assert accepts(module, x, library)
        assert accepts(module, torch.randn(1, kernel.SYMBOLIC_OP_MAX_ROWS, config.hidden_size), library)
        assert not accepts(module, torch.randn(1, kernel.SYMBOLIC_OP_MAX_ROWS + 1, config.hidden_size), library)
        assert not accepts(module, x.double(), library)
        hook = module.q_proj.register_forward_hook(lambda *args: None)
        assert not accepts(module, x, library)
        hook.remove()
        module.train()
        assert accepts(module, x, library)  # (no symbol dropout)
        module.dropout = 0.1
        assert not accepts(module, x, library)
        module.eval()
        assert accepts(module, x, library)
        large = symbolic_module(64, 2, kernel.SYMBOLIC_TABLE_ELEMENTS_FOR_ROWS // 64 + 1)
        assert accepts(large, torch.randn(1, 1, 64), large.symbol_library)  # one row: one pass over the tables
        assert not accepts(large, torch.randn(2, 1, 64), large.symbol_library)  # rows: the reference's products
    assert not accepts(module, x, library)  # gradients


# ---- a decoder layer's (or its dual attention's) decoding step in one op ---------------------------------------------
STEP_CASES = {
    "default": dict(),
    "gqa": dict(num_relational_key_value_heads=1, num_sensory_key_value_heads=1),
    "symmetric-relations": dict(symmetric_relations=True),
    "positional-symbols": dict(symbol_retrieval="positional"),
    "learned-positions": dict(position_embedding_type="learned"),
    "output-and-symbol-biases": dict(attention_out_bias=True),
}
STEP_KERNELS = ("layer_step", "dual_attention_step")
STEP_OPS = {"layer_step": "layer_step_op", "dual_attention_step": "decoding_step_op"}


def without_step(monkeypatch, names=STEP_KERNELS):
    """The registered kernels without the decoding-step ops `names` (the layers then compute those steps part by
    part)."""
    set_kernels_aside(monkeypatch, names)


def greedy_with_and_without(model, ids, steps=8, aside=(), **kwargs):
    """Greedy generation with the registered kernels (less those in `aside`) and with neither decoding-step op ->
    (sequences and logits of each, {op: its calls' row shapes})."""
    calls = {name: [] for name in STEP_OPS.values()}
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        for name in calls:
            original = getattr(kernel, name)
            patch.setattr(kernel, name, lambda *args, _o=original, _n=name: calls[_n].append(args[0].shape) or _o(*args))
        without_step(patch, aside)
        got = model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
        without_step(patch)
        expected = model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, **kwargs)
    return got, expected, calls


@pytest.mark.parametrize("case", list(STEP_CASES))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("level", STEP_KERNELS)
def test_decoding_step_op_gives_the_layer_by_layer_step(case, batch, level, loaded):
    """Greedy generation whose decoding steps run each decoder layer (norms, dual attention, residuals, SwiGLU MLP)
    or each dual attention (projections, RoPE, symbol values, the cache write, both head types, output projections)
    as one op gives the tokens and logits of the layer computed part by part, for GQA, symmetric relations,
    positional symbols, learned positions and output biases."""
    assert registered_kernels(level) == [getattr(kernel, {"layer_step": "cpu_layer_step",
                                                          "dual_attention_step": "cpu_decoding_step"}[level])]
    torch.manual_seed(0)
    config = tiny_config(initializer_range=0.2, **STEP_CASES[case])
    model = DATForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (batch, 12))
    got, expected, calls = greedy_with_and_without(model, ids, aside=() if level == "layer_step" else ("layer_step",))
    assert calls == {op: [(batch, config.hidden_size)] * (7 * config.num_hidden_layers) if name == level else []
                     for name, op in STEP_OPS.items()}  # every decoding step, every layer, at one level
    assert torch.equal(got.sequences, expected.sequences)
    for step, reference in zip(got.logits, expected.logits):
        torch.testing.assert_close(step, reference, rtol=1e-5, atol=1e-5)
    assert model.model.layers[0].dual_attn.relational.relational_attention_backend == "cpu"


FALLBACK_CASES = {  # what the step needs that the case lacks -> (config overrides, generate arguments, level still taken)
    "padding (an explicit mask)": (dict(), "padded", None),
    "a sliding window (a ring cache layer)": (dict(relational_bias="sliding_window", sliding_window_size=4), None,
                                              None),
    "a requested relational backend": (dict(relational_attn_implementation="eager"), None, None),
    "eager sensory heads": (dict(attn_implementation="eager"), None, None),
    "relative symbols": (dict(symbol_retrieval="position_relative"), None, None),
    "shared query and key projections": (dict(share_attention_params=True), None, None),
    "biased input projections": (dict(attention_bias=True), None, None),
    "a relation activation": (dict(relation_activation="relu"), None, None),
    "a static cache": (dict(), "static", None),
    "a hooked attention projection (PEFT, accelerate)": (dict(), "hook-attention", None),
    "layer norms": (dict(norm_type="layernorm"), None, "dual_attention_step"),
    "post-norm layers": (dict(pre_norm=False), None, "dual_attention_step"),
    "an MLP without a gate": (dict(hidden_act="gelu"), None, "dual_attention_step"),
    "MLP biases": (dict(mlp_bias=True), None, "dual_attention_step"),
    "a hooked MLP projection": (dict(), "hook-mlp", "dual_attention_step"),
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_decoding_step_ops_leave_other_steps_to_the_layer(case, loaded):
    """A step an op does not cover runs part by part (or, where only the layer's norms or MLP stop it, through the
    dual attention's op): the same generation."""
    overrides, how, taken = FALLBACK_CASES[case]
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.2, **overrides)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 10))
    kwargs = {}
    if how == "padded":
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["attention_mask"][0, :3] = 0
    elif how == "static":
        kwargs["cache_implementation"] = "static"
    elif how == "hook-attention":
        model.model.layers[1].dual_attn.relational.q_rel_proj.register_forward_hook(lambda *args: None)
    elif how == "hook-mlp":
        model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *args: None)
    got, expected, calls = greedy_with_and_without(model, ids, steps=4, **kwargs)
    row = (2, model.config.hidden_size)
    if how == "hook-attention":  # (layer 0 still takes the layer's op)
        assert calls == {"layer_step_op": [row] * 3, "decoding_step_op": []}
    elif how == "hook-mlp":  # (layer 0 the layer's op, layer 1 its dual attention's)
        assert calls == {"layer_step_op": [row] * 3, "decoding_step_op": [row] * 3}
    else:
        layers = model.config.num_hidden_layers
        assert calls == {op: [row] * (3 * layers) if name == taken else [] for name, op in STEP_OPS.items()}
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("level", STEP_KERNELS)
def test_decoding_step_ops_threads_and_bad_inputs(level, loaded):
    """Two threads give the one-thread result (and cache write) exactly; inputs that do not fit name the problem."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.2)).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    op = STEP_OPS[level]
    recorded, original = [], getattr(kernel, op)

    def record(*args):
        recorded.append([arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args])
        return original(*args)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, op, record)
        without_step(patch, () if level == "layer_step" else ("layer_step",))
        model.generate(ids, max_new_tokens=3, do_sample=False)
    args = recorded[-1]  # (the buffers as they were before the call)
    at = 2 if level == "layer_step" else 0  # (the layer op takes the input norm's weight and eps after x)
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            call = [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]
            results.append((original(*call), call[at + 7], call[at + 8]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(RuntimeError, match=r"the input projections give \d+ features, the heads need \d+"):
        original(*args[:at + 1], args[at + 1][:-1], *args[at + 2:])
    with pytest.raises(RuntimeError, match=r"do not fit the cache buffers"):
        original(*args[:at + 9], args[at + 7].shape[2], *args[at + 10:])  # no room after the last slot
    with pytest.raises(RuntimeError, match=r"the symbol projection must give"):
        original(*args[:at + 3], args[at + 3][:-1], *args[at + 4:])
    if level == "layer_step":
        with pytest.raises(RuntimeError, match=r"the MLP's weights must be \[f, d\], \[f, d\] and \[d, f\]"):
            original(*args[:-2], args[-2][:-1], args[-1])
        with pytest.raises(RuntimeError, match=r"a norm weight must be a contiguous float32 CPU tensor"):
            original(args[0], args[1][:-1], *args[2:])


@pytest.mark.parametrize("rows,kv,heads,kv_heads,d", [(5, 40, 4, 2, 32), (32, 300, 2, 2, 24), (1, 17, 2, 1, 16)])
def test_sensory_rows_op_matches_sdpa(rows, kv, heads, kv_heads, d, loaded):
    """Sensory heads over a few receivers of one sequence with a bool mask (continuous batching's packed rows), each
    reading only the senders from the first to the last its mask allows (the relational decoding op without
    relations), give SDPA's output (GQA included); other inputs keep SDPA."""
    from dat_hf.sensory_attention import sdpa_attention_forward

    class Module:
        num_key_value_groups, is_causal, training = heads // kv_heads, False, False

    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, rows, heads, d, generator=g).transpose(1, 2)  # (the model's layout)
    key, value = (torch.randn(1, kv_heads, kv, d, generator=g) for _ in range(2))
    mask = torch.rand(1, 1, rows, kv, generator=g) > 0.6
    mask[..., rows % kv] = True  # (every receiver has a sender: the plan opens the others' rows)
    accepts = kernel.accepts_sdpa_rows
    with torch.no_grad():
        assert accepts(Module, query, key, value, mask, scaling=0.2)
        got = kernel.cpu_sdpa_rows(Module, query, key, value, mask, scaling=0.2)[0]
        expected = sdpa_attention_forward.reference(Module, query, key, value, mask, scaling=0.2)[0]
        assert got.shape == expected.shape == (1, rows, heads, d)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not accepts(Module, query, key, value, mask.float(), scaling=0.2)  # an additive mask
        assert not accepts(Module, query, key, value, None, scaling=0.2, is_causal=True)
        assert not accepts(Module, query, key, value, mask, scaling=0.2, dropout=0.1)
        assert not accepts(Module, query.expand(2, -1, -1, -1), key.expand(2, -1, -1, -1),
                           value.expand(2, -1, -1, -1), mask.expand(2, -1, -1, -1), scaling=0.2)  # a batch
        long = torch.randn(1, heads, projections.FUSED_PROJECTION_MIN_ROWS, d)
        assert not accepts(Module, long, key, value, mask[:, :, :1].expand(1, 1, long.shape[2], kv), scaling=0.2)
    assert not accepts(Module, query, key, value, mask, scaling=0.2)  # gradients
