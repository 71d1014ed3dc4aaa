"""No silent fallback, no crash: a relational attention backend whose kernel fails to compile or launch.

The `triton` backend turns Triton's compile and launch errors into `RelationalBackendUnavailable` (naming the error);
automatic selection then takes it out of use on that device type with one `RuntimeWarning` and runs the next backend,
while `relational_attn_implementation="triton"` raises. Here, in process on CPU, the registry tries the `triton`
backend first on CPU (as automatic selection does on CUDA) and the kernel launches are replaced by ones that fail as
Triton does; `triton_kernel_checks.py` repeats the training case with the real kernels under Triton's interpreter.
"""

import warnings

import pytest
import torch
from conftest import tiny_config

from dat_hf import DATForCausalLM
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalBackendUnavailable


@pytest.fixture
def kernel(monkeypatch):
    """The Triton backend module, with its backend tried first on CPU for every call (the `cpu` backend out of
    automatic selection) and no backend marked unavailable; the registry is restored afterwards."""
    pytest.importorskip("triton")
    from dat_hf.kernels import triton_relational

    registry = RELATIONAL_ATTENTION_FUNCTIONS
    monkeypatch.setitem(registry, "triton", registry["triton"]._replace(supports=lambda call: None,
                                                                        preferred_on=("cpu",)))
    monkeypatch.setitem(registry, "cpu", registry["cpu"]._replace(preferred_on=()))
    monkeypatch.setattr(registry, "unavailable", {})
    return triton_relational


class FailingLaunch:
    """Stands in for an autotuned Triton kernel whose launch raises `error` (counted)."""

    def __init__(self, error):
        self.error, self.launches = error, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            raise self.error
        return launch


def out_of_shared_memory():
    from triton.runtime.errors import OutOfResources

    return OutOfResources(262144, 232448, "shared memory")


def model_and_inputs(seed=0):
    torch.manual_seed(seed)
    model = DATForCausalLM(tiny_config(num_relational_key_value_heads=1))
    return model, torch.randint(0, model.config.vocab_size, (2, 11))


def logits_with(model, x, backend):
    model.config.relational_attn_implementation = backend
    try:
        with torch.no_grad():
            return model(x).logits
    finally:
        model.config.relational_attn_implementation = None


def relational_backends(model):
    return {layer.dual_attn.relational.relational_attention_backend for layer in model.model.layers}


def test_a_kernel_that_fails_to_launch_gives_way_to_the_next_backend_with_one_warning(kernel, monkeypatch):
    model, x = model_and_inputs()
    model.eval()
    expected = logits_with(model, x, "sdpa")
    failing = FailingLaunch(out_of_shared_memory())
    monkeypatch.setattr(kernel, "_forward_kernel", failing)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():  # (inference: the op's own launch fails)
        warnings.simplefilter("always")
        first = model(x).logits
        second = model(x).logits  # the backend is out of use: no second try, no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "'triton'" in messages[0] and "'sdpa' runs instead" in messages[0], messages[0]
    assert "OutOfResources: out of resource: shared memory, Required: 262144" in messages[0], messages[0]
    assert failing.launches == 1
    assert relational_backends(model) == {"sdpa"}
    assert RELATIONAL_ATTENTION_FUNCTIONS.unavailable.keys() == {("triton", "cpu")}
    torch.testing.assert_close(first, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=1e-5)


def test_a_backward_kernel_that_fails_gives_way_in_the_forward(kernel, monkeypatch):
    """Training: the backward kernels run once per kernel variant before the first training call, so their failure
    (a PTXAS error here) shows in the forward, which then runs the next backend, and `loss.backward()` works."""
    from triton.runtime.errors import PTXASError

    model, x = model_and_inputs(1)
    model.train()
    model.config.relational_attn_implementation = "sdpa"
    model(x).logits.logsumexp(-1).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.config.relational_attn_implementation = None

    def forward_op(query, key, values, q_rel, k_rel, *options):  # the forward kernel works
        b, h, q_len, d = query.shape
        return (query.new_zeros(b, q_len, h, d), query.new_zeros(b, q_len, h, q_rel.shape[2]),
                query.new_zeros(b, h, q_len))

    def backward_op(*args):
        raise PTXASError("ptxas fatal: Unresolved extern function")

    monkeypatch.setattr(kernel, "_forward_op", forward_op)
    monkeypatch.setattr(kernel, "_backward_op", backward_op)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).logits.logsumexp(-1).mean().backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "PTXASError: PTXAS error: ptxas fatal" in messages[0], messages
    assert relational_backends(model) == {"sdpa"}
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_requested_triton_backend_raises_the_error(kernel, monkeypatch):
    model, x = model_and_inputs()
    model.eval().config.relational_attn_implementation = "triton"
    monkeypatch.setattr(kernel, "_forward_kernel", FailingLaunch(RuntimeError("Triton Error [CUDA]: invalid argument")))
    with pytest.raises(RelationalBackendUnavailable,
                       match=r"failed to compile or launch on cpu \(torch.float32\): RuntimeError: Triton Error "
                             r"\[CUDA\]: invalid argument"):
        model(x)
    assert RELATIONAL_ATTENTION_FUNCTIONS.unavailable == {}


def test_other_errors_are_raised_not_swallowed(kernel, monkeypatch):
    """Only compile and launch failures make the backend give way: an error of another kind (a bug, an input error,
    CUDA memory) is raised from an automatically selected backend too."""
    model, x = model_and_inputs()
    model.eval()
    monkeypatch.setattr(kernel, "_forward_kernel", FailingLaunch(RuntimeError("shape '[2, 11]' is invalid")))
    with pytest.raises(RuntimeError, match="is invalid"):
        model(x)
    assert RELATIONAL_ATTENTION_FUNCTIONS.unavailable == {}
    from triton.compiler.errors import CompilationError

    failure = kernel.kernel_failure
    assert failure(out_of_shared_memory()) and failure(CompilationError("src", None, "tile shape"))
    assert failure(RuntimeError("PassManager::run failed"))
    assert not failure(ValueError("relational attention (triton): the mask must be bool"))
    assert not failure(torch.OutOfMemoryError("CUDA out of memory (Triton Error)"))
    assert not failure(RuntimeError("expected scalar type Float but found Half"))
