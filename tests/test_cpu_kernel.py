"""The compiled CPU kernel for relational attention (`dat_hf/relational_kernel_cpu.py`).

- it builds on this machine (CI has a C++ compiler); `DAT_HF_CPU_KERNEL=0` turns it off without compiling;
- function level: fp32 outputs and the gradients of all five inputs against the slow, explicit fp64 implementation
  of `test_tiled_kernel.py`, for causal (also kv > q), full, GQA, batch-1 symbol values, strided (transposed)
  queries, and sizes that cross the kernel's 64-receiver / 256-sender blocks; both threading schemes (whole batch
  rows per thread; receiver blocks split with per-thread key-gradient buffers) give the single-thread result;
- bad inputs raise errors that name the tensor;
- model level: logits and parameter gradients equal those of the fused path, for GQA, symmetric relations and shared
  attention parameters, and for the (full-attention) encoder; it is taken exactly for fp32 causal/unmasked CPU
  calls (not for padding masks, fp64, `use_cpu_kernel=False`);
- `torch.compile` graphs call the op (fake kernel + autograd formula) and give eager's gradients;
- the decoding op (one receiver per row, W_r applied): against the explicit fp64 implementation for GQA, batch-1
  symbol values, widths that are not multiples of the vector length and strided views of a packed cache; 1 vs 2
  threads; greedy generation equals generation without the kernel; taken only without gradients, masks or autocast.
"""

import shutil

import pytest
import torch
from conftest import tiny_config
from test_tiled_kernel import CallCounter, assert_close, make_inputs, reference_relational_attention

import dat_hf.dual_attention as da
import dat_hf.relational_kernel_cpu as kernel
from dat_hf import DATEncoderConfig, DATForCausalLM, DATForTokenClassification
from dat_hf.dual_attention import RelationalAttention
from dat_hf.masking_dat import AttentionMask


def test_kernel_builds_on_this_machine():
    if shutil.which("c++") is None:  # no compiler: the PyTorch paths stand in, with a warning
        assert not kernel.load_cpu_kernel()
        return
    assert kernel.load_cpu_kernel(), kernel._STATE["error"]
    assert kernel.cpu_kernel_ready()


@pytest.fixture
def loaded():
    assert kernel.load_cpu_kernel(), f"the CPU kernel did not build: {kernel._STATE['error']}"


def test_disabled_by_environment_without_compiling(monkeypatch):
    monkeypatch.setenv("DAT_HF_CPU_KERNEL", "0")
    monkeypatch.setattr(kernel, "_STATE", {"loaded": False, "tried": False, "error": None})
    assert not kernel.cpu_kernel_enabled()
    assert not kernel.load_cpu_kernel()
    assert not kernel._STATE["tried"]  # nothing was attempted
    module = RelationalAttention(tiny_config(), 0)
    assert not module._takes_cpu_kernel(torch.zeros(1, 2, 4, 8), AttentionMask(None, None, True), False)


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


def run_kernel_and_reference(spec, seed=0, transpose_query=False):
    spec = dict(spec)
    causal = spec.pop("causal")
    h, h_kv = 4, spec.setdefault("h_kv", 4)
    spec.setdefault("q_len", 10)
    inputs64 = make_inputs(seed=seed, **spec)
    b, q_len, kv_len = inputs64[0].shape[0], inputs64[0].shape[2], inputs64[1].shape[2]
    R = inputs64[3].shape[2]
    scaling, relation_scaling = 0.37, 0.61
    expected = reference_relational_attention(*inputs64, AttentionMask(None, None, causal), scaling,
                                              relation_scaling, h // h_kv)
    inputs = [t.detach().float().requires_grad_() for t in inputs64]
    query = inputs[0]
    if transpose_query:  # the model's layout: [b, q, h, d] storage viewed as [b, h, q, d]
        query = query.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        inputs[0] = query
    values = inputs[2].expand(b, -1, -1, -1)
    got = kernel.cpu_relational_attention(query, inputs[1], values, inputs[3], inputs[4].view(b, kv_len, R, -1),
                                          causal, scaling, relation_scaling)
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
        op(q.double(), k, v, qr, kr, True, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="symbol values"):
        op(q, k, v[:1], qr, kr, True, 1.0, 1.0)  # a batch-1 view must be expanded first
    with pytest.raises(RuntimeError, match="relation queries"):
        op(q, k, v, qr[:, :4], kr, True, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="h divisible by h_kv"):
        op(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), qr, kr, True, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="causal attention needs kv_len >= q_len"):
        op(q, k[:, :, :3], v[:, :, :3], qr, kr[:, :3], True, 1.0, 1.0)


# ---- model level -------------------------------------------------------------------------------------------------
def KernelCalls(monkeypatch):
    return CallCounter(monkeypatch, "cpu_relational_attention")


def logits_and_grads(model, input_ids, **kwargs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids, **kwargs)
    out.logits.float().logsumexp(-1).mean().backward()
    return out.logits.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def kernel_and_fused(monkeypatch, fn):
    """fn() on the compiled kernel (asserting it ran) and on the fused path (kernel and tiled path off)."""
    calls = KernelCalls(monkeypatch)
    got = fn()
    assert calls.calls > 0, "the CPU kernel was not taken"
    monkeypatch.setattr(RelationalAttention, "use_cpu_kernel", False)
    monkeypatch.setattr(RelationalAttention, "use_tiled_kernel", False)
    before = calls.calls
    expected = fn()
    assert calls.calls == before
    return got, expected


@pytest.mark.parametrize("overrides", [dict(), dict(num_relational_key_value_heads=1, num_sensory_key_value_heads=1),
                                       dict(symmetric_relations=True, num_relations=4),
                                       dict(share_attention_params=True)],
                         ids=["default", "gqa", "symmetric", "shared-attention-params"])
def test_lm_kernel_equals_fused(overrides, loaded, monkeypatch):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(**overrides))
    x = torch.randint(0, model.config.vocab_size, (2, 37))
    (logits_k, grads_k), (logits_f, grads_f) = kernel_and_fused(monkeypatch, lambda: logits_and_grads(model, x))
    assert_close(logits_k, logits_f, atol=1e-5)
    for g, e in zip(grads_k, grads_f):
        assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_encoder_kernel_equals_fused(loaded, monkeypatch):
    torch.manual_seed(1)
    config = DATEncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2,
                              num_relational_heads=2, intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
                              max_position_embeddings=64, num_labels=3)
    model = DATForTokenClassification(config)
    x = torch.randint(0, 50, (2, 21))
    (logits_k, grads_k), (logits_f, grads_f) = kernel_and_fused(monkeypatch, lambda: logits_and_grads(model, x))
    assert_close(logits_k, logits_f, atol=1e-5)
    for g, e in zip(grads_k, grads_f):
        if e is not None:
            assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_dispatch(loaded, monkeypatch):
    calls = KernelCalls(monkeypatch)
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config()).eval()
    layers = model.config.num_hidden_layers
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        model(x)
        assert calls.calls == layers
        model(x, attention_mask=torch.ones_like(x).index_fill_(1, torch.tensor([0]), 0))  # padding: tiled path
        assert calls.calls == layers
        model.double()(x)  # fp64: tiled path
        assert calls.calls == layers
        model.float()
        monkeypatch.setattr(RelationalAttention, "use_cpu_kernel", False)
        model(x)
        assert calls.calls == layers


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


def decode_reference(inputs64, relation_proj, scaling, relation_scaling, groups):
    """fp64: the full relational attention of one receiver that sees every sender, then `+ relations W_r`."""
    symbols, relations = reference_relational_attention(*inputs64, AttentionMask(None, None, False), scaling,
                                                        relation_scaling, groups)
    return symbols + torch.einsum("bqhr,hdr->bqhd", relations, relation_proj)


def run_decode(spec, seed=0):
    spec = dict(spec, q_len=1)
    spec.setdefault("kv_len", 37)
    inputs64 = [t.detach() for t in make_inputs(seed=seed, **spec)]
    b, h, _, d = inputs64[0].shape
    h_kv, kv_len, R = inputs64[1].shape[1], inputs64[1].shape[2], inputs64[3].shape[2]
    relation_proj = torch.randn(h, d, R, generator=torch.Generator().manual_seed(seed + 5), dtype=torch.float64)
    expected = decode_reference(inputs64, relation_proj, 0.37, 0.61, h // h_kv)
    q, k, v, qr, kr = (t.float() for t in inputs64)
    got = kernel.cpu_relational_decode(q, k, v.expand(b, -1, -1, -1), qr, kr.view(b, kv_len, R, -1),
                                       relation_proj.float(), 0.37, 0.61)
    return got, expected


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference(case, loaded):
    got, expected = run_decode(DECODE_CASES[case])
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert_close(got.double(), expected, atol=2e-5, rtol=2e-5, what="decoded relational heads")


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
    got = kernel.cpu_relational_decode(query, key, values, q_rel, k_rel, relation_proj, 0.25, 0.5)
    copies = [t.contiguous().double() for t in (query, key, values, q_rel, k_rel.reshape(b, kv_len, -1))]
    expected = decode_reference(copies, relation_proj.double(), 0.25, 0.5, h // h_kv)
    assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


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
        op(torch.randn(1, 2, 2, 8), k, v, torch.randn(1, 2, 3, 4), kr, w, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="relation_proj must be a contiguous float32"):
        op(q, k, v, qr, kr, w[:, :, :2], 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"relation queries \[b, q, R, d_r\] and keys"):
        op(q, k, v, qr, kr[:, :4], w, 1.0, 1.0)


def greedy(model, prompt, **kwargs):
    out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("overrides", [dict(), dict(num_relational_key_value_heads=1, num_relations=3, relation_dim=5)],
                         ids=["default", "gqa"])
def test_generation_with_decode_op_equals_without(overrides, loaded, monkeypatch):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(**overrides)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 9))
    calls = CallCounter(monkeypatch, "cpu_relational_decode")
    tokens, scores = greedy(model, prompt)
    assert calls.calls == model.config.num_hidden_layers * 11  # every step after the prefill, every layer
    monkeypatch.setattr(RelationalAttention, "use_cpu_kernel", False)
    tokens_ref, scores_ref = greedy(model, prompt)
    assert calls.calls == model.config.num_hidden_layers * 11
    assert torch.equal(tokens, tokens_ref)
    assert_close(scores, scores_ref, atol=1e-5)


def test_decode_op_dispatch(loaded, monkeypatch):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config())
    calls = CallCounter(monkeypatch, "cpu_relational_decode")
    prompt = torch.randint(0, model.config.vocab_size, (2, 6))
    layers = model.config.num_hidden_layers

    def one_step(**kwargs):
        out = model(prompt, use_cache=True, **kwargs)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            kwargs["attention_mask"] = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return model(prompt[:, :1], past_key_values=out.past_key_values, **kwargs).logits

    model.eval()
    with torch.no_grad():
        one_step()
        assert calls.calls == layers
        one_step(attention_mask=torch.ones_like(prompt).index_fill_(1, torch.tensor([0]), 0))  # padding: python
        assert calls.calls == layers
        model.double()
        one_step()  # fp64: python
        model.float()
        assert calls.calls == layers
    one_step()  # gradients enabled (the op has no backward): python
    assert calls.calls == layers
