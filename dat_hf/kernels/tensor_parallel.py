"""A layer's input projections under tensor parallelism as one local matrix product: where the model files' reference
(`dual_attention.project_fused`) runs each column-sharded projection through its style's forward (`colwise`, and
`dat_gather`, which gathers its output), each with an all-reduce of the input's gradient in backward, this runs them
as one product of this rank's rows, gathers the parts of gathered projections whole, and all-reduces the input's
gradient once. Registered for the replaceable `project_fused` where torch has distributed tensors."""

import torch
import torch.distributed as dist
from torch import nn

from ..dual_attention import head_linears
from ..kernel_hooks import register_kernel
from ..tensor_parallel_dat import gather_last_dim, local_tensor

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # no distributed tensors: no tensor parallelism
    DTensor = None


class SumGradients(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (the input of column-sharded projections)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def column_sharded(linear) -> bool:
    """A plain `nn.Linear` (no hooks) whose output features are sharded over a 1-D mesh (`colwise`, `dat_gather`).
    (Checked for every layer's input of every model: `_parameters`, as `nn.Module.__getattr__` is slow.)"""
    if type(linear) is not nn.Linear:
        return False
    weight = linear._parameters["weight"]
    return (isinstance(weight, DTensor) and weight.placements == (Shard(0),)
            and not (linear._forward_hooks or linear._forward_pre_hooks))


def accepts_sharded(fused, sensory, relational, x) -> bool:
    """Every projection of `fused` column-sharded (never outside a distributed run: checked at every layer call)."""
    return dist.is_initialized() and all(map(column_sharded, head_linears(sensory, relational, fused.projections)))


def local_widths(fused, sensory, relational, linears, weights) -> list[int]:
    """Each part's width in the local product: its projections' rows on this rank (`weights`, local). `fused.widths`
    counts them as the reference's outputs come: a colwise projection by its rows here, one its owner gathers
    (`gathered_projections`, `dat_gather`) whole."""
    owners = {"sensory": sensory, "relational": relational}
    projections = iter(zip(fused.projections, linears, weights))
    widths = []
    for width in fused.widths:
        local = output = 0
        while output < width:
            (owner, name), linear, weight = next(projections)
            gathered = name in getattr(owners[owner], "gathered_projections", ())
            local += weight.shape[0]
            output += linear.out_features if gathered else weight.shape[0]
        widths.append(local)
    return widths


def sharded_projections(fused, sensory, relational, x: torch.Tensor) -> list:
    """`project_fused` over column-sharded projections: x `[b, n, d]` -> the parts of `fused`, `[b, n, width]` each,
    from one product of this rank's rows, the parts narrower here than their width gathered whole; one all-reduce of
    x's gradient for all of them."""
    linears = head_linears(sensory, relational, fused.projections)
    mesh = linears[0].weight.device_mesh
    if torch.is_grad_enabled() and x.requires_grad:
        x = SumGradients.apply(x, mesh.get_group())
    weights = [linear.weight.to_local() for linear in linears]
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([local_tensor(linear.bias) if linear.bias is not None else weight.new_zeros(weight.shape[0])
                          for linear, weight in zip(linears, weights)])
    widths = local_widths(fused, sensory, relational, linears, weights)
    parts = nn.functional.linear(x, torch.cat(weights), bias).split(widths, dim=-1)
    return [part if local == width else gather_last_dim(part, mesh, width)
            for part, local, width in zip(parts, widths, fused.widths)]


def register():
    if DTensor is not None:
        register_kernel("project_fused", sharded_projections, accepts_sharded)


__all__ = ["SumGradients", "accepts_sharded", "column_sharded", "local_widths", "register", "sharded_projections"]
