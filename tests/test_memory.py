"""Training memory: activations kept for backward grow linearly with the sequence length, and the symbol retrieval
that backward recomputes gives the same gradients as keeping it."""

import pytest
import torch

import dat_hf.relational_attention as relational_attention
from dat_hf import DATForCausalLM
from dat_hf.modeling_dat import DATMLP
from dat_hf.symbol_retrieval import SymbolicAttention

from conftest import tiny_config


def kept_bytes(fn):
    """Bytes of distinct storages autograd keeps for backward while `fn()` runs."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def saved_bytes(model, seq_len, batch=2):
    """What one training forward of `model` keeps for backward."""
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    return kept_bytes(lambda: model(x, labels=x))


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "eager"])
def test_saved_activations_grow_linearly(backend, monkeypatch):
    """Doubling the sequence doubles what is kept for backward (no n x n term on any relational backend; the
    reference's blocks are made small so that it checkpoints several per sequence, as it does at long lengths)."""
    monkeypatch.setattr(relational_attention, "BLOCK_ELEMENTS", 1 << 16)
    torch.manual_seed(0)
    config = tiny_config(max_position_embeddings=1024, vocab_size=16, relational_attn_implementation=backend)
    model = DATForCausalLM(config).train()
    small, large = saved_bytes(model, 256), saved_bytes(model, 512)
    # an n x n float tensor per head would make this ratio ~4 at these sizes
    assert 1.8 < large / small < 2.2, (small, large)


def test_symbol_retrieval_recomputed_in_backward_matches_kept():
    torch.manual_seed(0)
    config = tiny_config()
    retriever = SymbolicAttention(config).train()
    for p in retriever.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 7, config.hidden_size, requires_grad=True)
    grad = torch.randn(2, 7, config.hidden_size)

    recomputed = retriever(x)  # training + grad enabled: checkpointed
    got = torch.autograd.grad(recomputed, [x, *retriever.parameters()], grad)
    kept = retriever._retrieve(x, retriever.symbol_library)
    expected = torch.autograd.grad(kept, [x, *retriever.parameters()], grad)
    torch.testing.assert_close(recomputed, kept)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)

    # what is kept for backward: the checkpointed retrieval keeps less than the plain one
    assert kept_bytes(lambda: retriever(x)) < kept_bytes(lambda: retriever._retrieve(x, retriever.symbol_library))


# f-wide activations no longer kept: act(gate) and act(gate) * up for swiglu; act(up) for gelu; none for relu, whose
# backward needs only its output, which the down projection keeps anyway
@pytest.mark.parametrize("hidden_act, mlp_bias, fewer", [("swiglu", False, 2), ("swiglu", True, 2), ("gelu", True, 1),
                                                         ("relu", False, 0)])
def test_mlp_recomputes_activation_in_backward(hidden_act, mlp_bias, fewer):
    """The registered `activation_down_projection` kernel (`dat_hf.kernels.mlp`) keeps only the gate/up outputs and
    gives the reference's outputs and gradients."""
    torch.manual_seed(0)
    mlp = DATMLP(tiny_config(hidden_act=hidden_act, mlp_bias=mlp_bias, intermediate_size=96)).train()
    x = torch.randn(2, 5, mlp.up_proj.in_features, requires_grad=True)
    grad = torch.randn(2, 5, mlp.down_proj.out_features)
    params = [x, *mlp.parameters()]

    out = mlp(x)
    got = torch.autograd.grad(out, params, grad)
    hook = mlp.down_proj.register_forward_hook(lambda *args: None)  # a wrapped down_proj takes the plain path
    plain = mlp(x)
    expected = torch.autograd.grad(plain, params, grad)
    # (float32 on CPU: the SwiGLU of the recomputing path is the compiled one-pass op, rounded differently)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)

    plain_kept = kept_bytes(lambda: mlp(x))
    hook.remove()
    kept = kept_bytes(lambda: mlp(x))
    f_tensor = 2 * 5 * 96 * 4  # one float32 [2, 5, f] activation
    assert plain_kept - kept == fewer * f_tensor, (plain_kept, kept)
