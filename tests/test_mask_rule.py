"""The one mask rule (`dat_hf.masking_dat.AttentionMask`) held against every backend, each against a slow softmax
written here (one receiver, one head at a time over the senders the graph allows):

- a given mask that is not causal (every pair, or a band that reaches above the diagonal) with `is_causal=True`:
  the output follows the mask alone, for the relational backends (`eager`, `sdpa`, `flex_attention`, the compiled
  `cpu` kernel, `triton` under Triton's interpreter in a child process) and the sensory functions (eager, SDPA,
  FlexAttention), each given the mask in the format it declares, as the attention plan converts it;
- no mask with `is_causal` and fewer receivers than senders: receiver i sees senders j <= kv - q + i;
- `AttentionMask.dense` with and without an offset (the kernels' `receiver_offset` by default), and the attention
  plan's trimming of an implicit causal mask over a static cache's empty slots, which keeps receiver i at slot i.
Each case also checks that its graph changes the output (a backend that intersected the mask with causal order, or
put the receivers at the first slots, would fail).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from relational_cases import RELATION_SCALING, SCALING, Heads, assert_close, call_backend, make_inputs

import dat_hf.kernels.cpu as cpu_kernel
from dat_hf.attention_plan import KernelMask, PlannedRelational, PlannedSensory, mask_in_format
from dat_hf.kernels import cpu_build
from dat_hf.masking_dat import AttentionMask, with_row_validity, receiver_offset
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalCall, RelationalSpec
from dat_hf.sensory_attention import eager_attention_forward, flex_attention_forward, sdpa_attention_forward

TESTS = Path(__file__).parent
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
B, H, H_KV, Q_LEN, KV_LEN, D, R, D_R = 2, 4, 2, 6, 10, 8, 2, 4
RELATIONAL_BACKENDS = ["eager", "sdpa", "flex_attention", "cpu", "triton"]
SENSORY_FUNCTIONS = {"eager": (eager_attention_forward, "dense"), "sdpa": (sdpa_attention_forward, "tensor"),
                     "flex_attention": (flex_attention_forward, "block_mask")}

if INTERPRETED:
    from triton_interpreter import patch_runtime_loop_bounds

    patch_runtime_loop_bounds()


# ---- graphs and the slow softmax ---------------------------------------------------------------------------------
def lower_right(q_len, kv_len, offset=None):
    """bool `[q, kv]`: receiver i sees senders j <= offset + i (default offset kv - q), written out."""
    offset = kv_len - q_len if offset is None else offset
    return torch.tensor([[j <= offset + i for j in range(kv_len)] for i in range(q_len)])


def given_graph(kind, b=B, q_len=Q_LEN, kv_len=KV_LEN):
    """bool `[b, 1, q, kv]` that is not causal: every pair, or a band of senders p - 1 .. p + 2 around each receiver's
    position p = kv - q + i (row 1 of the batch shifted by one), which reaches above the diagonal."""
    if kind == "every-pair":
        return torch.ones(b, 1, q_len, kv_len, dtype=torch.bool)
    graph = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    for n in range(b):
        for i in range(q_len):
            p = kv_len - q_len + i - n
            graph[n, 0, i, max(0, p - 1):min(kv_len, p + 3)] = True
    assert (graph & ~lower_right(q_len, kv_len)).any()  # senders after the receiver: not causal
    return graph


def slow_sensory(query, key, value, allowed):
    """softmax(SCALING q k^T) v over the allowed senders, one (row, receiver, head) at a time: allowed `[b, q, kv]`
    -> `[b, q, h, d_v]` (float64)."""
    query, key, value = (t.detach().double() for t in (query, key, value))
    b, h, q_len, _ = query.shape
    groups = h // key.shape[1]
    out = torch.zeros(b, q_len, h, value.shape[-1], dtype=torch.float64)
    for n in range(b):
        for i in range(q_len):
            senders = allowed[min(n, allowed.shape[0] - 1), i].nonzero().flatten()
            for head in range(h):
                weights = torch.softmax(key[n, head // groups, senders] @ query[n, head, i] * SCALING, dim=0)
                out[n, i, head] = weights @ value[n, head // groups, senders]
    return out


def slow_relational(relation_proj, query, key, symbols, q_rel, k_rel, allowed):
    """A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j), identity relations, over the allowed senders, one (row,
    receiver, head) at a time: allowed `[b, q, kv]` -> `[b, q, h, d_h]` (float64)."""
    query, key, symbols, q_rel, k_rel, relation_proj = (t.detach().double() for t in (
        query, key, symbols, q_rel, k_rel, relation_proj))
    b, h, q_len, d = query.shape
    groups = h // key.shape[1]
    out = torch.zeros(b, q_len, h, d, dtype=torch.float64)
    for n in range(b):
        for i in range(q_len):
            senders = allowed[min(n, allowed.shape[0] - 1), i].nonzero().flatten()
            relations = torch.einsum("rd,jrd->jr", q_rel[n, i], k_rel[n, senders]) * RELATION_SCALING  # [j, R]
            for head in range(h):
                kv = head // groups
                weights = torch.softmax(key[n, kv, senders] @ query[n, head, i] * SCALING, dim=0)
                messages = relations @ relation_proj[head].T + symbols[min(n, symbols.shape[0] - 1), kv, senders]
                out[n, i, head] = weights @ messages
    return out


def assert_differs(a, b, what):
    """The case can tell the rule from its alternative: the two graphs give outputs that differ."""
    assert (a - b).abs().max().item() > 1e-3, f"{what}: the graphs give the same output (the case cannot fail)"


# ---- the backends --------------------------------------------------------------------------------------------------
def relational_backend(name):
    """The backend's float dtype here; skips with the reason where it cannot run in this process."""
    if name == "cpu":
        if not cpu_kernel.load_cpu_kernel():
            reason = cpu_build._STATE["error"] or "no C++ compiler, or DAT_HF_CPU_KERNEL=0"
            pytest.skip(f"the compiled CPU kernel is not available here ({reason})")
        return torch.float32
    if name == "triton":
        if "triton" not in RELATIONAL_ATTENTION_FUNCTIONS:
            pytest.skip("triton is not installed (no `triton` backend registered)")
        if not INTERPRETED:
            pytest.skip("runs on CPU tensors under TRITON_INTERPRET=1, in the child process of "
                        "test_triton_backend_under_the_interpreter")
        return torch.float32
    return torch.float32 if name == "flex_attention" else torch.float64


def relational_inputs(dtype, q_len=Q_LEN, kv_len=KV_LEN):
    module = Heads(h=H, h_kv=H_KV, d=D, R=R, dtype=dtype)
    inputs = make_inputs(b=B, h=H, h_kv=H_KV, q_len=q_len, kv_len=kv_len, d=D, R=R, d_r=D_R, dtype=dtype)
    return module, inputs


def run_relational(name, module, inputs, mask: AttentionMask):
    """The backend with the mask in its declared format (`call_backend`: the attention plan's conversion)."""
    with torch.no_grad():
        return call_backend(name, module, *inputs, mask)[0]


def run_sensory(name, module, query, key, value, mask: AttentionMask):
    """The sensory function with the mask in its declared format and the causal flag, as `PlannedSensory` calls it
    (untrimmed: the function itself is held to the rule)."""
    function, mask_format = SENSORY_FUNCTIONS[name]
    given, is_causal = mask_in_format(mask, mask_format, query.shape[2], key.shape[2], query.device), mask.is_causal
    if isinstance(given, KernelMask):
        given, is_causal = given.mask, given.is_causal
    with torch.no_grad():
        return function(module, query, key, value, given, scaling=SCALING, dropout=0.0, is_causal=is_causal)[0]


def sensory_inputs(name, q_len=Q_LEN, kv_len=KV_LEN):
    dtype = torch.float32 if name == "flex_attention" else torch.float64
    g = torch.Generator().manual_seed(7)
    query = torch.randn(B, H, q_len, D, generator=g, dtype=dtype)
    key, value = (torch.randn(B, H_KV, kv_len, D, generator=g, dtype=dtype) for _ in range(2))
    return Heads(h=H, h_kv=H_KV, d=D, R=R, dtype=dtype), query, key, value, (2e-5 if dtype == torch.float32 else 1e-10)


def with_graph(graph, flex):
    """The graph as the producers hand it, with `is_causal=True` (a decoder's bias): `with_row_validity`, which also
    builds its `BlockMask` for FlexAttention heads."""
    return with_row_validity(graph, is_causal=True, block_mask=graph if flex else None, min_blocks=None)


# ---- (a) a given mask alone decides --------------------------------------------------------------------------------
@pytest.mark.parametrize("graph_kind", ["every-pair", "band-above-diagonal"])
@pytest.mark.parametrize("backend", RELATIONAL_BACKENDS)
def test_relational_given_mask_alone_decides(backend, graph_kind):
    dtype = relational_backend(backend)
    module, inputs = relational_inputs(dtype)
    graph = given_graph(graph_kind)
    mask = with_graph(graph, backend == "flex_attention")
    assert mask.is_causal and mask.mask is not None
    got = run_relational(backend, module, inputs, mask)
    expected = slow_relational(module.relation_proj, *inputs, graph[:, 0])
    assert_differs(expected, slow_relational(module.relation_proj, *inputs, graph[:, 0] & lower_right(Q_LEN, KV_LEN)),
                   f"{graph_kind} against {graph_kind} and causal order")
    assert_close(got, expected, atol=2e-5 if dtype == torch.float32 else 1e-10,
                 what=f"{backend}: {graph_kind} mask with is_causal=True")


@pytest.mark.parametrize("graph_kind", ["every-pair", "band-above-diagonal"])
@pytest.mark.parametrize("function", list(SENSORY_FUNCTIONS))
def test_sensory_given_mask_alone_decides(function, graph_kind):
    module, query, key, value, atol = sensory_inputs(function)
    graph = given_graph(graph_kind)
    mask = with_graph(graph, function == "flex_attention")
    got = run_sensory(function, module, query, key, value, mask)
    expected = slow_sensory(query, key, value, graph[:, 0])
    assert_differs(expected, slow_sensory(query, key, value, graph[:, 0] & lower_right(Q_LEN, KV_LEN)),
                   f"{graph_kind} against {graph_kind} and causal order")
    assert_close(got, expected, atol=atol, what=f"sensory {function}: {graph_kind} mask with is_causal=True")


# ---- (b) no mask, causal: receiver i at kv - q + i -----------------------------------------------------------------
@pytest.mark.parametrize("backend", RELATIONAL_BACKENDS)
def test_relational_implicit_causal_after_a_cache(backend):
    dtype = relational_backend(backend)
    module, inputs = relational_inputs(dtype)
    got = run_relational(backend, module, inputs, AttentionMask(None, None, True))
    expected = slow_relational(module.relation_proj, *inputs, lower_right(Q_LEN, KV_LEN)[None])
    assert_differs(expected, slow_relational(module.relation_proj, *inputs, lower_right(Q_LEN, KV_LEN, 0)[None]),
                   "receivers after the cache against receivers at the first slots")
    assert_close(got, expected, atol=2e-5 if dtype == torch.float32 else 1e-10,
                 what=f"{backend}: no mask, is_causal=True, q {Q_LEN} < kv {KV_LEN}")


@pytest.mark.parametrize("function", list(SENSORY_FUNCTIONS))
def test_sensory_implicit_causal_after_a_cache(function):
    module, query, key, value, atol = sensory_inputs(function)
    expected = slow_sensory(query, key, value, lower_right(Q_LEN, KV_LEN)[None])
    assert_differs(expected, slow_sensory(query, key, value, lower_right(Q_LEN, KV_LEN, 0)[None]),
                   "receivers after the cache against receivers at the first slots")
    got = run_sensory(function, module, query, key, value, AttentionMask(None, None, True))
    assert_close(got, expected, atol=atol, what=f"sensory {function} through its format: no mask, is_causal=True")
    raw, _ = SENSORY_FUNCTIONS[function]
    with torch.no_grad():  # the function itself, given no mask and the flag
        got = raw(module, query, key, value, None, scaling=SCALING, dropout=0.0, is_causal=True)[0]
        unmasked = raw(module, query, key, value, None, scaling=SCALING, dropout=0.0, is_causal=False)[0]
    assert_close(got, expected, atol=atol, what=f"sensory {function}: None mask, is_causal=True")
    assert_close(unmasked, slow_sensory(query, key, value, torch.ones(1, Q_LEN, KV_LEN, dtype=torch.bool)),
                 atol=atol, what=f"sensory {function}: None mask, is_causal=False masks nothing")


# ---- (c) `dense` and the plan's trimming ---------------------------------------------------------------------------
def test_dense_puts_receivers_at_the_offset():
    causal = AttentionMask(None, None, True)
    t = torch.tensor
    after_cache = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)[None, None]
    first_slots = t([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)[None, None]
    assert torch.equal(causal.dense(3, 5, "cpu"), after_cache)  # default: receiver_offset, kv - q
    assert receiver_offset(3, 5) == 2
    assert torch.equal(causal.dense(3, 5, "cpu", offset=0), first_slots)
    assert torch.equal(causal.dense(3, 5, "cpu", offset=torch.tensor(0)), first_slots)
    assert torch.equal(causal.dense(3, 5, "cpu", start=1, end=3), after_cache[..., 1:3, :])
    assert torch.equal(causal.dense(3, 5, "cpu", start=1, end=2, offset=0), first_slots[..., 1:2, :])
    assert causal.dense(4, 4, "cpu").equal(lower_right(4, 4)[None, None])
    assert causal.dense(1, 5, "cpu") is None  # one receiver (a decoding step) sees every sender
    assert torch.equal(causal.dense(1, 5, "cpu", offset=2), t([[1, 1, 1, 0, 0]], dtype=torch.bool)[None, None])
    assert AttentionMask(None, None, False).dense(3, 5, "cpu", offset=0) is None  # not causal: nothing masked
    band = given_graph("band-above-diagonal", b=1, q_len=3, kv_len=5)
    given = AttentionMask(band, None, True)
    for offset in (None, 0):  # a given mask is the graph: no offset, no causal order
        assert torch.equal(given.dense(3, 5, "cpu", offset=offset), band)
        assert torch.equal(given.dense(3, 5, "cpu", start=1, end=3, offset=offset), band[..., 1:3, :])
    assert torch.equal(mask_in_format(causal, "dense", 3, 5, "cpu"), after_cache)


def trimming_module(dtype=torch.float64):
    module = Heads(h=H, h_kv=H_KV, d=D, R=R, dtype=dtype)
    module.scaling = SCALING
    module.spec = RelationalSpec(module.num_key_value_groups, SCALING, RELATION_SCALING, None)
    module.training = False
    return module


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_plan_trims_an_empty_static_cache(backend):
    """A prefill of q tokens into an empty static cache of kv slots: Transformers leaves the causal mask implicit
    with the receivers at the first q slots; the plan keeps only those senders, so that the backends, under the rule
    (receiver i at kv - q + i of what they get), give receiver i slot i. The empty slots hold junk."""
    q_len, kv_len = 4, 9
    mask = AttentionMask(None, None, True)
    module = trimming_module()
    function, mask_format = (eager_attention_forward, "dense") if backend == "eager" else (sdpa_attention_forward,
                                                                                          "tensor")
    _, query, key, value, _ = sensory_inputs("eager", q_len, kv_len)
    key[:, :, q_len:], value[:, :, q_len:] = 1e3, 1e3
    with torch.no_grad():
        got = PlannedSensory(mask, backend, function, mask_format)(module, query, key, value)
    first_slots = lower_right(q_len, kv_len, 0)[None]
    assert_close(got, slow_sensory(query, key, value, first_slots), atol=1e-10, what=f"sensory {backend}, trimmed")

    _, inputs = relational_inputs(torch.float64, q_len, kv_len)
    query, key, symbols, q_rel, k_rel = (t.detach().clone() for t in inputs)
    for t in (key, symbols):
        t[:, :, q_len:] = 1e3
    k_rel[:, q_len:] = 1e3
    call = RelationalCall.of_forward(query, q_len, False, False, "identity", False, 0.0, mask)
    with torch.no_grad():
        planned = PlannedRelational(mask, call, backend, backend)
        got = planned(module, query, key, symbols, q_rel, k_rel)
    assert planned.name == backend
    assert_close(got, slow_relational(module.relation_proj, query, key, symbols, q_rel, k_rel, first_slots),
                 atol=1e-10, what=f"relational {backend}, trimmed")


# ---- triton under its interpreter ----------------------------------------------------------------------------------
@pytest.mark.integration
def test_triton_backend_under_the_interpreter():
    """The `triton` cases above, in a child pytest with TRITON_INTERPRET=1 (set before `dat_hf` is imported: Triton
    picks its interpreter when a kernel is decorated): all of them pass, none skipped."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", DAT_HF_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                          "-k", "triton and not under_the_interpreter"], cwd=TESTS.parent, env=env,
                         capture_output=True, text=True, timeout=1200)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    passed = re.fullmatch(r"=*\s*(\d+) passed(?:, \d+ deselected)?(?:, \d+ warnings?)? in .*", summary)
    assert passed, summary  # none failed or skipped
    assert int(passed.group(1)) == 3, summary  # two given masks and the implicit causal order
