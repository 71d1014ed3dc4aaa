"""Checks of the Triton relational attention kernel (`dat_hf/kernels/triton_relational.py`), run by
`test_triton_kernel.py` in a child pytest with `TRITON_INTERPRET=1` (CPU tensors through Triton's interpreter). On a
CUDA machine, run them directly with compiled kernels: `python -m pytest tests/triton_kernel_checks.py`.

- the shared case matrix of `test_relational_backends.py` for the `triton` backend: float32 messages and the
  gradients of the queries, keys, symbol values, relation queries, relation keys and W_r within 2e-5 of the float64
  reference; the cases it cannot run (relation activations, position-relative symbols, weights, additive masks) are
  declined;
- the op against the reference split into its two aggregations, for head chunks with padded heads (12 heads over 4 kv
  heads), head and relation dims that are not powers of two, causal prefill after a cache, a strided (model-layout)
  query, a mask that isolates receivers (zeros and zero gradients, no NaN);
- the op's sliding window of p previous tokens (one- and two-sided, with and without padding, p = 0 and 1, within,
  equal to and beyond a tile) against the reference with Transformers' window mask (`transformers_window`), isolated
  receivers zero;
- the loops of the three kernels walk exactly the tiles that hold a visible pair (causal, sliding windows, after a
  cache), no fewer and no more;
- float16 and bfloat16 values and gradients against the float64 reference on the same rounded inputs;
- decoding steps (one receiver, no gradients) through the backend, with padding;
- models: a tiny `DATForCausalLM` with `relational_attn_implementation="triton"` gives the `eager` backend's logits
  and gradients (GQA, padded sliding window) and its greedy generation; a long sliding window (decoder and encoder)
  runs in one kernel call per layer without a dense mask; under bfloat16 autocast the kernel runs in bfloat16;
  `torch.compile` traces the ops (fake kernels, autograd formula) and gives eager's gradients;
- a backward kernel that fails to build: the first training forward, which runs the real forward kernel and then the
  backward kernels, gives way to the next backend with one warning (`test_backend_fallback.py` covers the rest).
"""

import pytest
import test_relational_backends as matrix
import torch
import triton
import triton.language as tl
from conftest import tiny_config
from relational_cases import (Heads, assert_close, call_backend, causal_and, count_backend_calls, make_inputs,
                              random_bool_mask, reference_parts, right_padding)
from torch._dynamo.backends.registry import lookup_backend
from triton_interpreter import patch_runtime_loop_bounds

from transformers.masking_utils import sliding_window_bidirectional_mask_function, sliding_window_causal_mask_function

import dat_hf.masking_dat as masking_dat
from dat_hf import DATEncoderConfig, DATForCausalLM, DATForTokenClassification
from dat_hf.kernels import triton_relational as kernel
from dat_hf.kernels.triton_relational import _receiver_range, _sender_range
from dat_hf.masking_dat import AttentionMask, receiver_positions, transformers_window

DEVICE = "cpu" if kernel.INTERPRETED else "cuda"
SCALING, RELATION_SCALING = 0.37, 0.61


if kernel.INTERPRETED:
    patch_runtime_loop_bounds()


@pytest.fixture(autouse=True)
def _a_device():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("no CUDA device: run these checks with TRITON_INTERPRET=1 (see test_triton_kernel.py)")


# ---- the shared case matrix ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(matrix.CASES))
def test_matrix_case(case):
    """The shared matrix's check (values and gradients within 2e-5 in float32, or a declined call where the matrix
    expects one)."""
    if not kernel.INTERPRETED:
        pytest.skip("the shared matrix builds CPU tensors; on CUDA the op and model checks below cover the kernel")
    matrix.test_backend_matches_reference("triton", case)


def test_matrix_runs_what_the_cpu_kernel_runs():
    """Under the interpreter the matrix runs the triton backend on every case of the fused scope (as the CPU kernel)."""
    supported = [case for case, spec in matrix.CASES.items() if not matrix.expected_unsupported("triton", spec)]
    assert supported == [case for case, spec in matrix.CASES.items() if not matrix.expected_unsupported("cpu", spec)]
    assert len(supported) >= 15


# ---- the op ---------------------------------------------------------------------------------------------------------
def window_function(window, two_sided):
    """Transformers' sliding window mask function of dat_hf's window of `window` previous tokens."""
    make = sliding_window_bidirectional_mask_function if two_sided else sliding_window_causal_mask_function
    return make(transformers_window(window, two_sided))


def op_reference_mask(b, q_len, kv_len, causal, mask=None, window=None, two_sided=False):
    """The op's masking as an explicit mask for the reference: `mask` (bool `[b|1, 1, q|1, kv]`, or none) on top of
    the op's causal order and Transformers' sliding window mask function, in which receiver i sits at position
    kv - q + i (`receiver_positions`). Receivers without senders attend everywhere (`row_valid` `[b, 1, q, 1]` says
    which)."""
    full = torch.ones(b, 1, q_len, kv_len, dtype=torch.bool) if mask is None else mask.expand(b, 1, q_len, kv_len)
    allowed = causal_and(full, q_len, kv_len) if causal else full
    if window is not None:
        allowed = allowed & window_function(window, two_sided)(
            None, None, receiver_positions(q_len, kv_len, "cpu")[:, None], torch.arange(kv_len)[None, :])
    row_valid = allowed.any(-1, keepdim=True)
    return AttentionMask(allowed | ~row_valid, row_valid, False)


def run_op(spec, dtype=torch.float32, causal=True, mask=None, transpose_query=False, seed=0, window=None,
           two_sided=False):
    """(outputs, float64 reference outputs, gradients of the five inputs, float64 reference gradients); the reference
    runs on the inputs rounded to `dtype`. mask: None or bool `[b|1, 1, q|1, kv]`, on top of `causal` and `window`;
    the reference's receivers without senders are zeroed."""
    rounded = [t.detach().to(dtype) for t in make_inputs(seed=seed, **spec)]
    inputs64 = [t.double().requires_grad_() for t in rounded]
    b, q_len, kv_len = rounded[0].shape[0], rounded[0].shape[2], rounded[1].shape[2]
    reference_mask = op_reference_mask(b, q_len, kv_len, causal, mask, window, two_sided)
    row_valid = reference_mask.row_valid.transpose(1, 2)  # [b, q, 1, 1]
    expected = [e * row_valid for e in reference_parts(*inputs64, reference_mask, SCALING, RELATION_SCALING)]
    inputs = [t.to(DEVICE).requires_grad_() for t in rounded]
    query = inputs[0]
    if transpose_query:  # the model's layout: [b, q, h, d] storage viewed as [b, h, q, d]
        query = query.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        inputs[0] = query
    got = kernel.relational_attention_op(query, inputs[1], inputs[2].expand(b, -1, -1, -1), inputs[3], inputs[4],
                                         causal, SCALING, RELATION_SCALING, None if mask is None else mask.to(DEVICE),
                                         window=window, two_sided=two_sided)
    gen = torch.Generator().manual_seed(11)
    grads_out = [torch.randn(e.shape, generator=gen, dtype=torch.float64) for e in expected]
    grads = torch.autograd.grad(got, inputs, [g.to(dtype).to(DEVICE) for g in grads_out])
    grads64 = torch.autograd.grad(expected, inputs64, grads_out)
    return got, expected, grads, grads64


NAMES = ["query", "key", "symbol values", "relation queries", "relation keys"]


def assert_matches(got, expected, grads, grads64, atol, rtol=0.0, dtype=torch.float32):
    for g, e, name in zip(got, expected, ["attended symbols", "attended relations"]):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        assert_close(g.cpu(), e, atol=atol, rtol=rtol, what=name)
    for g, e, name in zip(grads, grads64, NAMES):
        assert g.dtype == dtype and g.shape == e.shape, name
        assert_close(g.cpu(), e, atol=atol, rtol=rtol, what=f"gradient of {name}")


OP_CASES = {  # (spec, causal, mask builder)
    "head-chunks-padded-heads-gqa": (dict(h=12, h_kv=4, q_len=9, kv_len=9, d=17, R=5, d_r=20), True, None),
    "causal-after-cache-crosses-blocks": (dict(b=1, q_len=20, kv_len=45, d=8, R=2, d_r=4), True, None),
    "full-crosses-blocks-mask-per-row": (dict(b=2, h_kv=2, q_len=18, kv_len=35, d=8, R=3, d_r=4), False,
                                         lambda: random_bool_mask(2, 18, 35, seed=4)),
    "padding-shared-over-receivers": (dict(b=3, q_len=7, kv_len=19), False, lambda: right_padding(3, 19, [19, 8, 2])),
    "causal-and-mask-shared-over-batch": (dict(b=2, q_len=12, kv_len=12), True,
                                          lambda: random_bool_mask(1, 12, 12, seed=5)),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_op_matches_reference(case):
    spec, causal, make_mask = OP_CASES[case]
    assert_matches(*run_op(spec, causal=causal, mask=make_mask() if make_mask else None), atol=2e-5, rtol=2e-5)


SPLIT_CASES = {  # (spec, causal, mask builder, window): the senders in splits of 64 (`SPLIT_SENDERS` lowered)
    "decoding-gqa": (dict(b=2, h=4, h_kv=2, q_len=1, kv_len=200), True, None, None),
    "decoding-padded-a-row-without-senders": (dict(b=3, q_len=1, kv_len=150), False,
                                              lambda: right_padding(3, 150, [150, 40, 0]), None),
    "decoding-window-leaves-splits-empty": (dict(b=1, q_len=1, kv_len=200), True, None, 39),
    "receivers-after-a-cache": (dict(b=1, q_len=20, kv_len=200, d=8, R=2, d_r=4), True, None, None),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_sender_splits_match_reference(case, monkeypatch):
    """Too few blocks of receivers to fill the GPU (a decoding step): the senders go to several programs, whose
    outputs are joined by their log-sum-exps (`_combine_splits`), also where a split holds no sender of a receiver
    or a receiver has none at all; values and gradients (the backward reads the joined log-sum-exp) as the reference."""
    spec, causal, make_mask, window = SPLIT_CASES[case]
    monkeypatch.setattr(kernel, "SPLIT_SENDERS", 64)
    splits, size = kernel._sender_splits(spec["q_len"], spec["kv_len"], spec["b"], torch.device(DEVICE))
    assert splits > 1 and size == 64 * (size // 64), (splits, size)
    got = run_op(spec, causal=causal, mask=make_mask() if make_mask else None, window=window)
    assert_matches(*got, atol=2e-5, rtol=2e-5)


def left_padding(b, kv_len, lengths):
    """bool `[b, 1, 1, kv]`: row i's first kv - lengths[i] senders are padding."""
    return right_padding(b, kv_len, lengths).flip(-1)


# (spec, window p, two_sided, causal, padding): tiles of 16 receivers x 32 senders under the interpreter
WINDOW_CASES = {
    "one-sided-window-0": (dict(q_len=40, kv_len=40), 0, False, True, None),
    "one-sided-window-1": (dict(q_len=40, kv_len=40), 1, False, True, None),
    "one-sided-in-a-tile-left-padding-isolates": (dict(b=3, q_len=70, kv_len=70), 8, False, True,
                                                  lambda: left_padding(3, 70, [70, 57, 30])),
    "one-sided-a-tile-wide-not-causal": (dict(q_len=64, kv_len=64, d=8, R=2, d_r=4), 31, False, False, None),
    "one-sided-after-cache": (dict(b=1, q_len=20, kv_len=45, d=8, R=2, d_r=4), 6, False, True, None),
    "two-sided-window-0": (dict(q_len=40, kv_len=40), 0, True, False, None),
    "two-sided-window-1": (dict(q_len=40, kv_len=40), 1, True, False, None),
    "two-sided-in-a-tile-right-padding-isolates": (dict(b=3, q_len=60, kv_len=60), 5, True, False,
                                                   lambda: right_padding(3, 60, [60, 47, 20])),
    "two-sided-beyond-a-tile": (dict(q_len=50, kv_len=50, d=8, R=2, d_r=4), 40, True, False, None),
    "two-sided-and-causal-after-cache": (dict(b=1, q_len=20, kv_len=45, d=8, R=2, d_r=4), 7, True, True, None),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_op_sliding_window_matches_reference(case):
    """The op's window of p previous tokens (index arithmetic; GQA, 4 heads over 2 kv heads) equals Transformers'
    window mask function of that window given to the reference as a dense mask; receivers whose window holds only
    padding get zeros and zero gradients."""
    spec, window, two_sided, causal, make_padding = WINDOW_CASES[case]
    padding = make_padding() if make_padding else None
    got, expected, grads, grads64 = run_op(dict(dict(h=4, h_kv=2), **spec), causal=causal, mask=padding,
                                           window=window, two_sided=two_sided)
    assert_matches(got, expected, grads, grads64, atol=2e-5, rtol=2e-5)
    b, q_len, kv_len = got[0].shape[0], got[0].shape[1], spec["kv_len"]
    isolated = ~op_reference_mask(b, q_len, kv_len, causal, padding, window, two_sided).row_valid[:, 0, :, 0]
    assert isolated.any() == (padding is not None)
    assert (got[0][isolated] == 0).all() and (got[1][isolated] == 0).all()
    assert (grads[0].transpose(1, 2)[isolated] == 0).all() and (grads[3][isolated] == 0).all()


@triton.jit
def _loop_bounds(SENDERS, RECEIVERS, q_len, kv_len, offset, window_lo, window_hi, CAUSAL: tl.constexpr,
                 WINDOWED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program t writes [start, end) of the sender loop of receiver tile t (forward, dQ) and of the receiver loop of
    sender tile t (dKV)."""
    tile = tl.program_id(0)
    pair = tl.arange(0, 2)
    start, end = _sender_range(tile * BLOCK_M, q_len, kv_len, offset, window_lo, window_hi, CAUSAL, WINDOWED,
                               BLOCK_M, BLOCK_N)
    tl.store(SENDERS + 2 * tile + pair, tl.where(pair == 0, start, end))
    start, end = _receiver_range(tile * BLOCK_N, q_len, offset, window_lo, window_hi, CAUSAL, WINDOWED, BLOCK_M,
                                 BLOCK_N)
    tl.store(RECEIVERS + 2 * tile + pair, tl.where(pair == 0, start, end))


def test_loops_walk_exactly_the_tiles_with_visible_pairs():
    """The kernels' loop bounds under causal order and a sliding window of p previous tokens (one- and two-sided,
    p = 0 up to beyond the sequence, after a cache, one receiver) are tight and complete: a receiver tile's sender
    loop walks exactly the sender tiles holding a pair that Transformers' mask functions let it see, and a sender
    tile's receiver loop exactly the receiver tiles that see it (none for senders that no receiver sees). (A bound
    that walks extra tiles gives right values and only costs time, so the value checks above cannot catch it.)"""
    def tiles(start, end, size):
        assert start % size == 0, (start, size)  # loops start on a tile boundary
        return set(range(start // size, triton.cdiv(end, size))) if end > start else set()

    checked = 0
    for q_len, kv_len in ((40, 40), (70, 70), (20, 45), (1, 45), (33, 100)):
        offset = masking_dat.receiver_offset(q_len, kv_len)  # as the op passes it
        position = receiver_positions(q_len, kv_len, "cpu")[:, None]
        for window, two_sided, causal in [(None, False, True), (None, False, False)] + [
                (w, s, c) for w in (0, 1, 7, 16, 31, 32, 200) for s in (False, True) for c in (True, False)]:
            visible = torch.ones(q_len, kv_len, dtype=torch.bool)
            if causal:
                visible &= torch.arange(kv_len)[None, :] <= position
            lo = hi = 0
            if window is not None:
                visible &= window_function(window, two_sided)(None, None, position, torch.arange(kv_len)[None, :])
                lo, hi = (window, window) if two_sided else (window, 0)  # as the op passes them
            for block_m, block_n in ((16, 32), (64, 32), (32, 64)):
                m_tiles, n_tiles = triton.cdiv(q_len, block_m), triton.cdiv(kv_len, block_n)
                senders = torch.zeros(max(m_tiles, n_tiles), 2, dtype=torch.int32, device=DEVICE)
                receivers = torch.zeros_like(senders)
                _loop_bounds[(max(m_tiles, n_tiles),)](senders, receivers, q_len, kv_len, offset, lo, hi,
                                                       CAUSAL=causal, WINDOWED=window is not None, BLOCK_M=block_m,
                                                       BLOCK_N=block_n)
                case = (q_len, kv_len, window, two_sided, causal, block_m, block_n)
                pairs = visible.nonzero()
                for t, (start, end) in enumerate(senders[:m_tiles].tolist()):
                    rows = pairs[(pairs[:, 0] // block_m) == t]
                    assert tiles(start, end, block_n) == set((rows[:, 1] // block_n).tolist()), (case, "senders", t)
                for t, (start, end) in enumerate(receivers[:n_tiles].tolist()):
                    cols = pairs[(pairs[:, 1] // block_n) == t]
                    assert tiles(start, end, block_m) == set((cols[:, 0] // block_m).tolist()), (case, "receivers", t)
                checked += 1
    assert checked == 5 * 30 * 3


def test_strided_query():
    got, expected, grads, grads64 = run_op(dict(h_kv=2), transpose_query=True)
    assert_matches(got, expected, grads, grads64, atol=2e-5, rtol=2e-5)


def test_receivers_without_senders_get_zeros_and_zero_gradients():
    b, q_len = 2, 9
    inputs = [t.detach().float().to(DEVICE).requires_grad_() for t in make_inputs(b=b, q_len=q_len, kv_len=q_len)]
    mask = torch.ones(b, 1, q_len, q_len, dtype=torch.bool)
    mask[1, :, 4] = False  # receiver 4 of row 1 has no sender
    mask[0, :, :, 2:] = False  # and row 0's receivers see senders 0 and 1 only (receiver 0: sender 0)
    symbols, relations = kernel.relational_attention_op(*inputs, True, SCALING, RELATION_SCALING, mask.to(DEVICE))
    assert torch.isfinite(symbols).all() and torch.isfinite(relations).all()
    assert (symbols[1, 4] == 0).all() and (relations[1, 4] == 0).all()
    grads = torch.autograd.grad(symbols.sum() + relations.sum(), inputs)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][1, :, 4] == 0).all() and (grads[3][1, 4] == 0).all()  # its query and relation query
    assert (grads[1][0, :, 2:] == 0).all() and (grads[4][0, 2:] == 0).all()  # senders nobody sees
    expected = reference_parts(*[t.detach().double().cpu() for t in inputs],
                               AttentionMask(causal_and(mask, q_len, q_len), None, False), SCALING, RELATION_SCALING)
    assert_close(symbols[0].cpu(), expected[0][0], atol=2e-5)  # a fully visible row is unaffected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """Values and gradients from half-precision inputs with float32 accumulation, against the float64 reference on the
    same rounded inputs: within 0.2% (float16) / 2% (bfloat16) of the largest entry, and closer than the reference
    itself computed in that dtype."""
    spec = dict(h=4, h_kv=2, q_len=20, kv_len=36, d=16, R=3, d_r=16)
    got, expected, grads, grads64 = run_op(spec, dtype=dtype)
    assert_matches(got, expected, grads, grads64, atol=0.0, rtol={torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype],
                   dtype=dtype)
    in_dtype = reference_parts(*[t.detach().to(dtype) for t in make_inputs(**spec)],
                               op_reference_mask(2, spec["q_len"], spec["kv_len"], True), SCALING, RELATION_SCALING)
    for g, r, e in zip(got, in_dtype, expected):
        assert (g.cpu().double() - e).abs().max() < (r.double() - e).abs().max()


def test_bad_inputs_name_the_problem():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    qr, kr = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    op = kernel.relational_attention_op
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        op(*(t.double() for t in (q, k, v, qr, kr)), True, 1.0, 1.0)
    with pytest.raises(ValueError, match="symbol values must be a 4-d"):
        op(q, k, v.half(), qr, kr, True, 1.0, 1.0)
    with pytest.raises(ValueError, match="relation queries"):
        op(q, k, v, qr[:, :4], kr, True, 1.0, 1.0)
    with pytest.raises(ValueError, match="h divisible by h_kv"):
        op(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), qr, kr, True, 1.0, 1.0)
    with pytest.raises(ValueError, match="causal attention needs kv_len >= q_len"):
        op(q, k[:, :, :3], v[:, :, :3], qr, kr[:, :3], True, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"the mask must be bool \[b\|1, 1, q\|1, kv\] = \[2\|1, 1, 5\|1, 5\]"):
        op(q, k, v, qr, kr, True, 1.0, 1.0, torch.ones(2, 1, 5, 4, dtype=torch.bool))
    for window in (-1, 2.0, True):
        with pytest.raises(ValueError, match="the window must be None or an int >= 0"):
            op(q, k, v, qr, kr, True, 1.0, 1.0, window=window)


# ---- the backend: decoding and models ----------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
def test_decoding_step(padded):
    """One receiver per row after a 33-token cache (three sender blocks), no gradients, W_r applied."""
    b, kv_len = 3, 33
    inputs = make_inputs(b=b, h=4, h_kv=2, q_len=1, kv_len=kv_len)
    module = Heads(h=4, h_kv=2)
    mask = AttentionMask(right_padding(b, kv_len, [33, 20, 5]) if padded else None, None, True)
    with torch.no_grad():
        expected, _, _ = call_backend("eager", module, *inputs, mask, SCALING, RELATION_SCALING)
        module32 = Heads(h=4, h_kv=2, relation_proj=module.relation_proj.detach().float().to(DEVICE))
        mask32 = AttentionMask(None if mask.mask is None else mask.mask.to(DEVICE), None, True)
        got, _, _ = call_backend(kernel.triton_relational_attention, module32, *(t.float().to(DEVICE) for t in inputs),
                                 mask32, SCALING, RELATION_SCALING)
    assert got.shape == (b, 1, 4, 6)
    assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5, what="decoding step")


@pytest.mark.parametrize("name", ["gqa", "sliding-window-padded"])
def test_causal_lm_logits_and_gradients_equal_eager(name):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(**matrix.LM_CONFIGS[name])).to(DEVICE)
    x = torch.randint(0, model.config.vocab_size, (3, 21), device=DEVICE)
    inputs = {"input_ids": x}
    if name.endswith("padded"):  # rows padded on the left by 0, 5 and 11 tokens
        inputs["attention_mask"] = (torch.arange(21, device=DEVICE)[None]
                                    >= torch.tensor([0, 5, 11], device=DEVICE)[:, None]).long()
    matrix.assert_backends_agree(model, inputs, backends=("triton",))  # also: every layer ran the triton backend


def window_model(family):
    """A tiny decoder (left padding) or token classifier (right padding) whose relational and sensory heads see a
    sliding window, and inputs long enough that it runs as `SlidingWindow` index arithmetic over receiver blocks of 8
    (with `masking_dat.RECEIVER_BLOCK` = 8)."""
    n, kept = 40, torch.tensor([40, 33, 26], device=DEVICE)
    if family == "decoder":
        model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=4))
        attention_mask = torch.arange(n, device=DEVICE)[None] >= n - kept[:, None]
    else:
        model = DATForTokenClassification(DATEncoderConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
            num_relational_key_value_heads=1, intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
            max_position_embeddings=64, num_labels=3, relational_bias="sliding_window_bidirectional",
            sliding_window_size=3))
        attention_mask = torch.arange(n, device=DEVICE)[None] < kept[:, None]
    x = torch.randint(0, model.config.vocab_size, (3, n), device=DEVICE)
    return model.to(DEVICE), {"input_ids": x, "attention_mask": attention_mask.long()}


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_long_sliding_window_is_one_call_per_layer(monkeypatch, family):
    """A sliding window kept as index arithmetic goes to the kernel whole: one op call per layer with the window and
    the padding as a `[b, 1, 1, kv]` mask, the `eager` backend's logits and gradients, and no dense mask built (the
    sensory heads run block by block from the window's block masks)."""
    monkeypatch.setattr(masking_dat, "RECEIVER_BLOCK", 8)

    def refuse(self):
        raise AssertionError("the dense mask of a sliding window was built")

    monkeypatch.setattr(masking_dat.WindowMask, "mask", property(refuse, masking_dat.WindowMask.mask.fset))
    op, windows = kernel.relational_attention_op, []

    def spy(*args, **kwargs):
        mask = args[8] if len(args) > 8 else kwargs.get("mask")
        windows.append((kwargs.get("window"), kwargs.get("two_sided"), None if mask is None else tuple(mask.shape)))
        return op(*args, **kwargs)

    monkeypatch.setattr(kernel, "relational_attention_op", spy)
    torch.manual_seed(4)
    model, inputs = window_model(family)
    mask = masking_dat.build_masks([model.config.relational_bias], model.config, torch.zeros(3, 40, 32),
                                   inputs["attention_mask"].bool().cpu(), causal=family == "decoder")
    assert next(iter(mask.values())).window is not None  # (the window's index arithmetic applies)
    matrix.assert_backends_agree(model, inputs, backends=("triton",))
    expected = (4, False) if family == "decoder" else (3, True)  # the window: sliding_window_size
    assert windows == [(*expected, (3, 1, 1, 40))] * model.config.num_hidden_layers


@pytest.mark.parametrize("prompt_length", [7, 70])
def test_greedy_generation_equals_eager(prompt_length, monkeypatch):
    """Greedy tokens and scores of the triton backend = eager; after 70 tokens the decoding steps split their senders
    (`SPLIT_SENDERS` lowered to 64)."""
    monkeypatch.setattr(kernel, "SPLIT_SENDERS", 64)
    torch.manual_seed(1)
    model = DATForCausalLM(tiny_config(num_relational_key_value_heads=1, max_position_embeddings=96)).to(DEVICE).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, prompt_length), device=DEVICE)
    assert (kernel._sender_splits(1, prompt_length + 1, 2, prompt.device)[0] > 1) == (prompt_length > 64)
    generated = {}
    for backend in ("eager", "triton"):
        model.config.relational_attn_implementation = backend
        with count_backend_calls(backend) as calls:
            generated[backend] = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                                output_scores=True, return_dict_in_generate=True)
        assert calls[0] == 6 * model.config.num_hidden_layers, backend  # prefill + 5 decoding steps
    assert torch.equal(generated["triton"].sequences, generated["eager"].sequences)
    assert_close(torch.stack(generated["triton"].scores).cpu(), torch.stack(generated["eager"].scores).cpu(),
                 atol=1e-4, rtol=0, what="scores")


def test_autocast_runs_the_kernel_in_bfloat16():
    torch.manual_seed(2)
    model = DATForCausalLM(tiny_config()).to(DEVICE).train()
    x = torch.randint(0, model.config.vocab_size, (2, 19), device=DEVICE)
    with torch.no_grad():
        expected = model(x).logits  # float32, automatic selection
    model.config.relational_attn_implementation = "triton"
    with torch.autocast(DEVICE, dtype=torch.bfloat16), count_backend_calls("triton") as calls:
        logits = model(x).logits
        assert_close(logits.float(), expected, atol=5e-2, what="bfloat16 autocast logits")
        logits.float().logsumexp(-1).mean().backward()
    assert calls[0] == model.config.num_hidden_layers
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_torch_compile_traces_the_ops():
    """The ops are opaque to the compiler (fake kernels, an autograd formula traced by AOTAutograd): compiled logits
    and gradients equal eager ones."""
    torch.manual_seed(3)
    model = DATForCausalLM(tiny_config(relational_attn_implementation="triton")).to(DEVICE).train()
    x = torch.randint(0, model.config.vocab_size, (2, 13), device=DEVICE)
    expected, expected_grads = matrix.logits_and_grads(model, {"input_ids": x})
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    logits, grads = matrix.logits_and_grads(compiled, {"input_ids": x})
    assert any("triton_relational_forward" in graph for graph in graphs)
    assert_close(logits, expected, atol=1e-5)
    for g, e in zip(grads, expected_grads):
        assert_close(g, e, atol=1e-5, rtol=1e-4)


class _CountedLaunches:
    """Stands in for an autotuned kernel: counts its launches, then runs `kernel` or, without one, raises `error`."""

    def __init__(self, kernel=None, error=None):
        self.kernel, self.error, self.launches = kernel, error, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            if self.kernel is None:
                raise self.error
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_a_failing_backward_kernel_gives_way_in_the_forward(monkeypatch):
    """Automatic selection tries the triton backend first (as on CUDA); the dkv kernel fails as one needing more
    shared memory than the device has: the first training forward runs the real forward kernel and then the backward
    kernels, so it is the forward that gives way to `sdpa` (one warning naming the error) and `backward()` works with
    `sdpa`'s gradients."""
    import warnings

    from triton.runtime.errors import OutOfResources

    from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS as registry

    monkeypatch.setitem(registry, "triton", registry["triton"]._replace(preferred_on=(DEVICE,)))
    monkeypatch.setitem(registry, "cpu", registry["cpu"]._replace(preferred_on=()))
    monkeypatch.setattr(registry, "unavailable", {})
    monkeypatch.setattr(kernel, "_CHECKED_BACKWARD", set())
    torch.manual_seed(5)
    model = DATForCausalLM(tiny_config(num_relational_key_value_heads=1)).to(DEVICE).train()
    x = torch.randint(0, model.config.vocab_size, (2, 13), device=DEVICE)
    model.config.relational_attn_implementation = "sdpa"
    expected, expected_grads = matrix.logits_and_grads(model, {"input_ids": x})
    model.config.relational_attn_implementation = None
    forward = _CountedLaunches(kernel._forward_kernel)
    dkv = _CountedLaunches(error=OutOfResources(262144, 232448, "shared memory"))
    monkeypatch.setattr(kernel, "_forward_kernel", forward)
    monkeypatch.setattr(kernel, "_backward_dkv_kernel", dkv)
    with count_backend_calls("triton") as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, grads = matrix.logits_and_grads(model, {"input_ids": x})
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "OutOfResources: out of resource: shared memory" in messages[0], messages
    # layer 0 tried the backend once (its forward kernel ran, then dkv failed); layer 1 did not try it
    assert (calls[0], forward.launches, dkv.launches) == (1, 1, 1)
    assert {layer.dual_attn.relational.relational_attention_backend for layer in model.model.layers} == {"sdpa"}
    assert_close(logits, expected, atol=1e-5)
    for g, e in zip(grads, expected_grads):
        assert_close(g, e, atol=1e-5, rtol=1e-4)
