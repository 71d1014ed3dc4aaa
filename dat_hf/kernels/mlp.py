"""The MLP's activation and down projection, `down(act(gate) * up)`, for training: the `[b, n, f]` activation is
recomputed in backward instead of kept (two fewer f-wide tensors per layer than autograd keeps, for one element-wise
pass), and for SwiGLU in float32 on CPU the activation and both its gradients are one pass each (compiled ops).
Registered for the model files' replaceable `activation_down_projection`."""

import torch
from torch import nn

from ..kernel_hooks import register_kernel
from .cpu import swiglu_backward_op, swiglu_op, takes_swiglu_op
from .projections import is_plain_linear


def _hidden(act_fn, gate, up):
    """`act(gate) * up`, or `act(gate)` when `up` is None."""
    if takes_swiglu_op(act_fn, gate, up):
        return swiglu_op(gate, up)
    hidden = act_fn(gate)
    return hidden if up is None else hidden * up


class ActivationDownProjection(torch.autograd.Function):
    """`down(act(gate) * up)` that keeps only `gate` and `up` for backward and recomputes the activation there.
    gate, up `[..., f]` (up may be None), weight `[d, f]`, bias `[d]` or None -> `[..., d]`."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act_fn):
        ctx.act_fn = act_fn
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return nn.functional.linear(_hidden(act_fn, gate, up), weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        fused = takes_swiglu_op(ctx.act_fn, gate, up)
        if fused:
            hidden = swiglu_op(gate, up)
        else:
            with torch.enable_grad():  # recompute the activation, with a graph back to gate and up
                gate = gate.detach().requires_grad_()
                up = None if up is None else up.detach().requires_grad_()
                hidden = _hidden(ctx.act_fn, gate, up)
        # under autocast the forward ran in the autocast dtype, which grad_out carries
        grad_hidden = grad_out @ weight.to(grad_out.dtype)  # [..., f]
        flat_grad = grad_out.flatten(0, -2)
        grad_weight = (flat_grad.t() @ hidden.detach().flatten(0, -2).to(grad_out.dtype)).to(weight.dtype)
        grad_bias = flat_grad.sum(0).to(weight.dtype) if ctx.has_bias else None
        if fused:
            grad_gate, grad_up = swiglu_backward_op(grad_hidden, gate, up)
        elif up is None:
            return torch.autograd.grad(hidden, gate, grad_hidden)[0], None, grad_weight, grad_bias, None
        else:
            grad_gate, grad_up = torch.autograd.grad(hidden, (gate, up), grad_hidden)
        return grad_gate, grad_up, grad_weight, grad_bias, None


def recomputed_activation_down_projection(act_fn, gate, up, down_proj):
    return ActivationDownProjection.apply(gate, up, down_proj.weight, down_proj.bias, act_fn)


def accepts_recomputation(act_fn, gate, up, down_proj) -> bool:
    """Training (a graph through `gate`) with a plain `nn.Linear` down projection (not wrapped by PEFT, quantization
    or hooks), outside `torch.compile` (the compiler chooses what to recompute); ReLU's backward needs only its output,
    which the down projection keeps anyway."""
    return (torch.is_grad_enabled() and gate.requires_grad and is_plain_linear(down_proj)
            and not isinstance(act_fn, nn.ReLU) and not torch.compiler.is_compiling())


def fused_swiglu_down_projection(act_fn, gate, up, down_proj):
    return down_proj(swiglu_op(gate, up))


def accepts_fused_swiglu(act_fn, gate, up, down_proj) -> bool:
    """Inference (no graph through the activation) with SwiGLU on float32 CPU tensors."""
    return (up is not None and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
            and takes_swiglu_op(act_fn, gate, up))


def register():
    register_kernel("activation_down_projection", recomputed_activation_down_projection, accepts_recomputation)
    register_kernel("activation_down_projection", fused_swiglu_down_projection, accepts_fused_swiglu)


__all__ = ["ActivationDownProjection", "register"]
