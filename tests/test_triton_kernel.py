"""The Triton relational attention backend (`dat_hf/kernels/triton_relational.py`) on a machine without a GPU.

Triton picks its interpreter when a kernel is decorated, i.e. when `dat_hf` is imported (`dat_hf.kernels` registers
the backend), so `TRITON_INTERPRET=1` must be set before that; this pytest process imported `dat_hf` in
`conftest.py` already. The kernel checks (`triton_kernel_checks.py`: the shared case matrix, the op's values and
gradients, half precision, decoding, models) therefore run in a child pytest started with the variable, which keeps
the rest of the suite on ordinary (compiled) Triton. Here, in process:

- Triton is installed where the dev extras install it (Linux x86-64), else these tests skip and say why;
- the registration: backend `"triton"`, tried first on CUDA; outside the interpreter it declines CPU tensors, and it
  declines what it cannot run (float64, dropout, weights, relation activations, relative symbols, additive masks);
- `import dat_hf` works and registers no `"triton"` backend when `triton` cannot be imported;
- the kernels compile for sm_90 (H100, H200) ahead of time, as their first launch on such a GPU compiles them.

CI's floor leg runs this module with Triton 3.6.0, the lent GPU image's (constraints/floor.txt), the other legs with
the newest Triton.
"""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dat_hf.masking_dat import AttentionMask
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalCall

TESTS = Path(__file__).parent


@pytest.fixture
def triton_kernel():
    try:
        import triton  # noqa: F401
    except ImportError:
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            pytest.fail("triton is not installed: `pip install -e '.[dev]'` installs it on Linux x86-64")
        pytest.skip(f"triton has no wheels for {platform.system()} {platform.machine()}")
    from dat_hf.kernels import triton_relational

    return triton_relational


@pytest.mark.integration
def test_kernel_checks_under_the_interpreter(triton_kernel):
    env = dict(os.environ, TRITON_INTERPRET="1", DAT_HF_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(TESTS / "triton_kernel_checks.py")], cwd=TESTS.parent, env=env, capture_output=True,
                         text=True, timeout=1200)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"=*\s*\d+ passed(, \d+ warnings?)? in .*", summary), summary  # none failed or skipped


def call(device="cpu", dtype=torch.float32, mask=None, **overrides):
    fields = dict(device=device, dtype=dtype, query_length=7, requires_grad=True, output_attentions=False,
                  relation_activation="identity", relative_symbols=False, dropout=0.0,
                  mask=AttentionMask(mask, None, True), autocast=False, compiling=False)
    return RelationalCall(**{**fields, **overrides})


def test_registration_and_what_it_declines(triton_kernel):
    backend = RELATIONAL_ATTENTION_FUNCTIONS["triton"]
    assert backend.function is triton_kernel.triton_relational_attention and backend.preferred_on == ("cuda",)
    supports = backend.supports
    if triton_kernel.INTERPRETED:  # the whole suite runs under TRITON_INTERPRET=1
        assert supports(call("cpu")) is None
    else:
        assert "runs on CUDA" in supports(call("cpu"))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert supports(call("cuda", dtype)) is None
    assert supports(call("cuda", query_length=1, requires_grad=False)) is None  # decoding
    assert supports(call("cuda", mask=torch.ones(2, 1, 7, 7, dtype=torch.bool))) is None
    declined = {
        "float64": call("cuda", torch.float64),
        "dropout": call("cuda", dropout=0.1),
        "weights": call("cuda", output_attentions=True),
        "relu relations": call("cuda", relation_activation="relu"),
        "relative symbols": call("cuda", relative_symbols=True),
        "additive mask": call("cuda", mask=torch.zeros(2, 1, 7, 7)),
    }
    for what, declined_call in declined.items():
        assert supports(declined_call) is not None, what


@pytest.mark.integration
def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"  # `import triton` raises ImportError
            "import dat_hf\n"
            "from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS\n"
            "print(sorted(RELATIONAL_ATTENTION_FUNCTIONS))")
    env = dict(os.environ, DAT_HF_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['cpu', 'eager', 'flex_attention', 'sdpa']"


# ---- compiled for the GPU, on this machine -----------------------------------------------------------------------
HOPPER, HOPPER_SHARED_MEMORY = 90, 232448  # sm_90 (H100, H200): the most shared memory one block may use


class _Launches:
    """Stands in for an autotuned kernel: records each launch's arguments (by name) instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({**dict(zip(self.kernel.fn.arg_names, args)), **kwargs})
        return launch


@pytest.mark.integration
def test_autotuning_can_be_fixed_to_one_config(triton_kernel):
    """`DAT_HF_TRITON_AUTOTUNE=0` leaves each kernel one config (the smallest), so checks over many shapes compile
    each shape once instead of once per config; by default every config is tried."""
    script = ("from dat_hf.kernels import triton_relational as k; "
              "print([len(getattr(k, n).configs) for n in ('_forward_kernel', '_backward_dkv_kernel', "
              "'_backward_dq_kernel')], k._forward_kernel.configs[0].kwargs)")
    counts = {}
    for value in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"DAT_HF_TRITON_AUTOTUNE": value}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        counts[value] = out.stdout.strip().splitlines()[-1]
    assert counts["0"] == "[1, 1, 1] {'BLOCK_M': 16, 'BLOCK_N': 16}", counts
    assert counts["1"].startswith("[7, 6, 7]"), counts


def _compile_for_hopper(kernel, arguments, config):
    """`kernel` (autotuned) compiled ahead of time for sm_90 with one launch's arguments and one of its autotuning
    configs, as its first launch on an H100/H200 would compile it -> Triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types = kernel.fn, {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.bool: "i1"}
    values = {**arguments, **config.kwargs}
    signature, constexprs = {}, {}
    for index, name in enumerate(fn.arg_names):
        value = values[name]
        if index in fn.constexprs:
            signature[name], constexprs[(index,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + types[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", HOPPER, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


@pytest.mark.integration  # (Triton's ptxas for every kernel: 40 s cold; CI's floor leg runs it with the image's Triton)
def test_kernels_compile_for_hopper_at_the_343m_shapes(triton_kernel, monkeypatch):
    """The forward and both backward kernels compile for sm_90 (PTX and SASS, with Triton's own ptxas) with the
    arguments a bfloat16 training step of DAT-343M's relational heads launches them with (8 heads over 4 kv heads,
    d_h 64, R 8, d_r 64), causal and as a padded sliding window, and every kernel has an autotuning config that fits
    in an H100/H200 block's shared memory (the smallest and the largest config are compiled; shared memory grows with
    the tile sizes); float32 (IEEE dots) and float16 compile too, and so do a decoding step's forward over a long cache
    (its senders in splits) and the kernel that joins the splits. Run on this CPU machine: a kernel that only the
    interpreter has run (it never compiles) fails here, not on the first GPU."""
    if triton_kernel.INTERPRETED:
        pytest.skip("this process runs Triton's interpreter (TRITON_INTERPRET=1)")
    kernels = {name: _Launches(getattr(triton_kernel, name))
               for name in ("_forward_kernel", "_backward_dkv_kernel", "_backward_dq_kernel")}
    for name, launches in kernels.items():
        monkeypatch.setattr(triton_kernel, name, launches)

    def launch_all(dtype, **options):  # one forward and one backward launch of each kernel
        b, h, h_kv, n, d, R, d_r = 2, 8, 4, 64, 64, 8, 64
        q, k, v = torch.randn(b, h, n, d, dtype=dtype), *torch.randn(2, b, h_kv, n, d, dtype=dtype)
        q_rel, k_rel = torch.randn(2, b, n, R, d_r, dtype=dtype)
        symbols, relations, lse = triton_kernel._forward_op(q, k, v, q_rel, k_rel, **options, scaling=0.125,
                                                            relation_scaling=0.125)
        triton_kernel._backward_op(symbols, relations, q, k, v, q_rel, k_rel, symbols, relations, lse, **options,
                                   scaling=0.125, relation_scaling=0.125)

    causal = dict(mask=None, causal=True, window=None, two_sided=False)
    padding = torch.ones(2, 1, 1, 64, dtype=torch.bool).index_fill_(3, torch.arange(5), False)
    window = dict(mask=padding, causal=False, window=15, two_sided=False)
    launch_all(torch.bfloat16, **causal)
    launch_all(torch.bfloat16, **window)
    launch_all(torch.float32, **causal)
    launch_all(torch.float16, **window)
    for name, launches in kernels.items():
        bf16_causal, bf16_window, fp32, fp16 = launches.launches
        assert bf16_window["WINDOWED"] and bf16_window["HAS_MASK"] and fp32["PRECISION"] == "ieee"
        smallest, largest = launches.kernel.configs[0], launches.kernel.configs[-1]
        shared = {}
        for config in (smallest, largest):  # the bfloat16 causal step
            compiled = _compile_for_hopper(launches.kernel, bf16_causal, config)
            assert compiled.asm["cubin"], (name, config)
            shared[str(config)] = compiled.metadata.shared
        assert shared[str(smallest)] <= HOPPER_SHARED_MEMORY, f"{name}: no config fits in shared memory: {shared}"
        for arguments in (bf16_window, fp32, fp16):  # the other variants, with the smallest config
            compiled = _compile_for_hopper(launches.kernel, arguments, smallest)
            assert compiled.asm["cubin"], (name, arguments["PRECISION"])
        print(f"{name}: shared memory {shared} bytes")

    # a decoding step over a 4096-token cache: the senders in splits, then the kernel that joins them
    import triton

    combine = _Launches(SimpleNamespace(fn=triton_kernel._combine_kernel, configs=[triton.Config({}, num_warps=4)]))
    monkeypatch.setattr(triton_kernel, "_combine_kernel", combine)
    q, k, v = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16), *torch.randn(2, 1, 4, 4096, 64, dtype=torch.bfloat16)
    q_rel, k_rel = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16), torch.randn(1, 4096, 8, 64, dtype=torch.bfloat16)
    triton_kernel._forward_op(q, k, v, q_rel, k_rel, mask=None, causal=True, window=None, two_sided=False,
                              scaling=0.125, relation_scaling=0.125)
    step, joined = kernels["_forward_kernel"].launches[-1], combine.launches[-1]
    assert joined["splits"] > 1 and step["split_size"] * joined["splits"] >= 4096
    assert _compile_for_hopper(kernels["_forward_kernel"].kernel, step, kernels["_forward_kernel"].kernel.configs[0]
                               ).asm["cubin"]
    assert _compile_for_hopper(combine.kernel, joined, combine.kernel.configs[0]).asm["cubin"]
