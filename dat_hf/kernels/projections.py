"""A layer's input projections as one matrix product, installed by `import dat_hf` (the model files never import this
module: remote code alone runs them one by one, `dual_attention.fused_linear`, with the same results).
"""

import torch
from torch import nn

from ..kernel_hooks import register_kernel


# below this many rows the projections run one by one (concatenating weights costs more than it saves)
FUSED_PROJECTION_MIN_ROWS = 64


def is_plain_linear(module) -> bool:
    """An `nn.Linear` with no hooks and no instance `forward` (TP styles, Accelerate hooks)."""
    return (type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)
            and "forward" not in module.__dict__)


def takes_concatenation(linears, x) -> bool:
    """Inputs of at least `FUSED_PROJECTION_MIN_ROWS` rows (or exported) through plain linears (not PEFT-wrapped,
    hooked or quantized modules): the shorter ones run one by one (the reference, or the CPU kernel's one op)."""
    return ((torch.compiler.is_exporting() or x.shape[:-1].numel() >= FUSED_PROJECTION_MIN_ROWS)
            and all(map(is_plain_linear, linears)))


def concatenated_linear(linears, x):
    """The kernel of `dual_attention.fused_linear`: `cat([linear(x) for linear in linears], -1)` as one GEMM over the
    concatenated weights. x `[..., d]` -> `[..., sum of out_features]`."""
    weight = torch.cat([linear.weight for linear in linears])
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
                          for linear in linears])
    return nn.functional.linear(x, weight, bias)


def register() -> None:
    """Install the concatenated projection into `dual_attention.fused_linear` (for long inputs; the CPU kernel's one
    op takes decoding-sized ones)."""
    register_kernel("fused_linear", concatenated_linear, takes_concatenation)


__all__ = ["FUSED_PROJECTION_MIN_ROWS", "concatenated_linear", "is_plain_linear", "register", "takes_concatenation"]
