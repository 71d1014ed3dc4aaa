# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Tensor parallelism of DAT layers (`from_pretrained(..., tp_plan="auto")`), as Transformers shards Llama's.

The plan (`configuration_dat.dual_attention_tp_plan`), per layer, over `tp` ranks:

    sensory heads      q, k, v colwise (whole heads per rank)          o rowwise (all-reduce)
    relational heads   q_attn, k_attn, W_s colwise; W_r `[h, d_h, R]`  o rowwise (all-reduce)
                       sharded by head (`dat_heads`)
    relations          q_rel, k_rel colwise, outputs gathered (`dat_gather`): every head reads every relation
                       r(x_i, x_j), so each rank computes all R relations for its own heads
    MLP                gate, up colwise                                down rowwise
    symbols            replicated (every rank needs every sender's symbol)

Transformers' `colwise` / `rowwise` styles run the projections; this file adds the two styles DAT needs beyond them
and `local_tensor`, the rank's own part of a sharded parameter that a model file reads itself (W_r). Each attention
module then learns the heads it holds from its sharded weights (`SensoryAttention.use_local_heads`).
"""

import torch
from torch import nn

try:  # (Transformers releases before `transformers.distributed`, or a torch built without distributed: no TP)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, ColwiseParallel, TensorParallelLayer
except ImportError:
    DTensor = ALL_PARALLEL_STYLES = None

# the styles DAT's plan names beside Transformers' own
GATHER_STYLE = "dat_gather"
HEADS_STYLE = "dat_heads"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds (a sharded parameter under tensor parallelism), else `tensor` itself."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


if ALL_PARALLEL_STYLES is not None:

    class GatheredColwiseParallel(ColwiseParallel):
        """Column-wise, output gathered on every rank, and in backward each rank's gradient of that output taken as
        a partial sum (reduce-scatter). Transformers' `colwise_gather_output` takes it as replicated, which holds for
        an LM head (every rank computes the same loss from the same logits) but not for the relation queries and
        keys: every rank's heads read all of them, each rank's gradient is its heads' share."""

        def __init__(self):
            super().__init__(input_layouts=Replicate(), output_layouts=Replicate())

        def transform_output_post_forward(self, module, output, mesh):
            if not isinstance(output, DTensor):  # (this rank's slice; the last rank's is shorter for uneven widths)
                shape = (*output.shape[:-1], module.out_features)
                output = DTensor.from_local(output, mesh, [Shard(output.dim() - 1)], run_check=False, shape=shape,
                                            stride=torch.empty(shape, device="meta").stride())
            if output.placements != (Replicate(),):
                output = output.redistribute(placements=[Replicate()])
            return output.to_local(grad_placements=[Partial()])

    class HeadShardedParameter(TensorParallelLayer):
        """A parameter `[heads, ...]` sharded by its first dimension: each rank holds its own heads' rows (W_r
        `[h, d_h, R]`). The model reads the rank's part with `local_tensor`."""

        def shard_param(self, module, param, mesh):
            meta = module._parameters.get(param)
            if meta is None:
                return
            module._parameters[param] = nn.Parameter(distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                                                     requires_grad=meta.requires_grad)

    ALL_PARALLEL_STYLES.register(GATHER_STYLE, GatheredColwiseParallel())
    ALL_PARALLEL_STYLES.register(HEADS_STYLE, HeadShardedParameter())


def local_columns(linear: nn.Linear) -> int:
    """Input features `linear` reads on this rank: its weight's local columns when sharded by column (a `rowwise`
    projection), else `in_features`."""
    return local_tensor(linear.weight).shape[-1]


def localize_heads(module, name: str, tp_size: int, head_parameters: list[str]) -> None:
    """Set `module.num_heads` and `module.num_kv_heads` (an attention module's) to the heads this rank holds, from its
    weights: `head_parameters` (the projections that output heads, and W_r) sharded by row and `o_proj` by column
    (all of them, or none: replicated heads). Raise, naming the module, for a plan that shards some of them only, or
    head counts that tp_size does not divide (each rank must hold whole heads; GQA keeps its groups)."""
    tensors = {part: getattr(module, part) for part in head_parameters if getattr(module, part, None) is not None}
    sharded = {part: (local_tensor(t.weight).shape[0] != t.out_features) if isinstance(t, nn.Linear)
               else local_tensor(t).shape[0] != t.shape[0] for part, t in tensors.items()}
    sharded["o_proj"] = local_columns(module.o_proj) != module.o_proj.in_features
    if not any(sharded.values()):
        return
    if not all(sharded.values()):
        raise ValueError(f"The tensor-parallel plan shards {sorted(p for p, s in sharded.items() if s)} of {name} but "
                         f"not {sorted(p for p, s in sharded.items() if not s)}: a layer's heads are sharded whole "
                         "(their projections colwise, W_r by head, `o_proj` rowwise) or not at all.")
    if module.num_heads % tp_size or module.num_kv_heads % tp_size:
        raise ValueError(f"Tensor parallelism over tp_size={tp_size} ranks cannot shard the {module.num_heads} heads "
                         f"and {module.num_kv_heads} key/value heads of {name}: each rank holds whole heads, so both "
                         "counts must be divisible by tp_size (choose a tp_size that divides every head count, or a "
                         "`tp_plan` that leaves these heads replicated).")
    module.num_heads //= tp_size
    module.num_kv_heads //= tp_size


__all__ = ["GATHER_STYLE", "HEADS_STYLE", "local_columns", "local_tensor", "localize_heads"]
