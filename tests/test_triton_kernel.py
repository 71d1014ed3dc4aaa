"""The Triton relational attention backend (`dat_hf/kernels/triton_relational.py`) on a machine without a GPU.

Triton picks its interpreter when a kernel is decorated, i.e. when `dat_hf` is imported (`dat_hf.kernels` registers
the backend), so `TRITON_INTERPRET=1` must be set before that; this pytest process imported `dat_hf` in
`conftest.py` already. The kernel checks (`triton_kernel_checks.py`: the shared case matrix, the op's values and
gradients, half precision, decoding, models) therefore run in a child pytest started with the variable, which keeps
the rest of the suite on ordinary (compiled) Triton. Here, in process:

- Triton is installed where the dev extras install it (Linux x86-64), else these tests skip and say why;
- the registration: backend `"triton"`, tried first on CUDA; outside the interpreter it declines CPU tensors, and it
  declines what it cannot run (float64, dropout, weights, relation activations, relative symbols, additive masks);
- `import dat_hf` works and registers no `"triton"` backend when `triton` cannot be imported.
"""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

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


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"  # `import triton` raises ImportError
            "import dat_hf\n"
            "from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS\n"
            "print(sorted(RELATIONAL_ATTENTION_FUNCTIONS))")
    env = dict(os.environ, DAT_HF_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['cpu', 'eager', 'flex_attention', 'sdpa']"
