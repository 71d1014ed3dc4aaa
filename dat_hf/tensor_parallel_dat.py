# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Tensor parallelism of DAT layers (`from_pretrained(..., tp_plan="auto")`), as Transformers shards Llama's.

The plan (`DualAttentionConfig.base_model_tp_plan`, declared as Llama's), per layer, over `tp` ranks:

    sensory heads      q, k, v colwise (whole heads per rank)          o rowwise (all-reduce)
    relational heads   q_attn, k_attn, W_s colwise; W_r `[h, d_h, R]`  o rowwise (all-reduce)
                       sharded by head (`dat_heads`)
    relations          q_rel, k_rel colwise, outputs gathered (`dat_gather`): every head reads every relation
                       r(x_i, x_j), so each rank computes all R relations for its own heads
    MLP                gate, up colwise                                down rowwise
    symbols            replicated (every rank needs every sender's symbol)
"""

import re

import torch
from torch import nn

from .transformers_compat import parallel_styles

# Transformers' style registry and the styles DAT's build on, reached through the seam (`INTERNALS`); None where the
# installed release has no tensor parallelism in that form or torch no distributed tensors (`tp_plan="auto"` then
# stops at its start, naming what moved: `DATPreTrainedModel.maybe_distribute_model`)
STYLES = parallel_styles()
if STYLES is not None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    ALL_PARALLEL_STYLES, ColwiseParallel, TensorParallelLayer = STYLES
else:
    DTensor = ALL_PARALLEL_STYLES = None

GATHER_STYLE = "dat_gather"
HEADS_STYLE = "dat_heads"


def plan_rule(name: str) -> str:
    """A module's name as a plan's rules name it: `model.layers.3.mlp` -> `model.layers.*.mlp`."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", name)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded `tensor`, else `tensor` itself."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def gather_last_dim(local: torch.Tensor, mesh, width: int) -> torch.Tensor:
    """This rank's slice `[..., w]` -> the whole `[..., width]` (all-gather); backward reduce-scatters, each rank's
    gradient being a partial sum."""
    shape = (*local.shape[:-1], width)
    whole = DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False, shape=shape,
                               stride=torch.empty(shape, device="meta").stride())
    return whole.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


if ALL_PARALLEL_STYLES is not None:

    class GatheredColwiseParallel(ColwiseParallel):
        """Column-wise with the output gathered; unlike `colwise_gather_output`, backward treats each rank's
        gradient as a partial sum (reduce-scatter): each rank's heads read every relation."""

        def __init__(self):
            super().__init__(input_layouts=Replicate(), output_layouts=Replicate())

        def transform_output_post_forward(self, module, output, mesh, *args, **kwargs):  # (5.25 adds `config=`)
            if not isinstance(output, DTensor):
                return gather_last_dim(output, mesh, module.out_features)
            if output.placements != (Replicate(),):
                output = output.redistribute(placements=[Replicate()])
            return output.to_local(grad_placements=[Partial()])

    class HeadShardedParameter(TensorParallelLayer):
        """A parameter `[heads, ...]` (W_r) sharded by head; read with `local_tensor`."""

        def shard_param(self, module, param, mesh, *args, **kwargs):  # (5.25 adds `config=`, `mesh_manager=`)
            meta = module._parameters.get(param)
            if meta is None:
                return
            module.register_parameter(param, nn.Parameter(distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                                                          requires_grad=meta.requires_grad))

    ALL_PARALLEL_STYLES.register(GATHER_STYLE, GatheredColwiseParallel())
    ALL_PARALLEL_STYLES.register(HEADS_STYLE, HeadShardedParameter())


def tensor_parallel_slice(tensor: torch.Tensor, dim: int) -> int:
    """The length of `tensor`'s dim `dim` this rank holds under TP (the mesh's `tp` dimension; FSDP's do not count)."""
    size = tensor.shape[dim]
    if DTensor is None or not isinstance(tensor, DTensor):
        return size
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or ()
    tp = names.index("tp") if "tp" in names else (0 if mesh.ndim == 1 else None)
    if tp is None:
        return size
    placement = tensor.placements[tp]
    if not (placement.is_shard() and placement.dim % tensor.dim() == dim % tensor.dim()):
        return size
    chunk = -(-size // mesh.size(tp))
    return max(0, min(chunk, size - mesh.get_local_rank(tp) * chunk))


def local_rows(linear: nn.Linear) -> int:
    """Output features `linear` computes on this rank."""
    return tensor_parallel_slice(linear.weight, 0)


def local_columns(linear: nn.Linear) -> int:
    """Input features `linear` reads on this rank."""
    return tensor_parallel_slice(linear.weight, -1)


def localize_heads(module, name: str, tp_size: int, head_parameters: list[str]) -> None:
    """Set `module.num_heads`/`num_kv_heads` to this rank's, from its sharded `head_parameters` and `o_proj`.
    ValueError if only some are sharded, or tp_size does not divide the head counts."""
    held = {part: getattr(module, part, None) for part in head_parameters}
    weights = {part: t.weight if isinstance(t, nn.Linear) else t for part, t in held.items() if t is not None}
    sharded = {part: tensor_parallel_slice(weight, 0) != weight.shape[0] for part, weight in weights.items()}
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


def use_local_heads(model, tp_size: int) -> None:
    """After TP sharding: each attention module (one with `head_parameters`) keeps its rank's heads. Raises ValueError
    if a relation projection (`gathered_projections`) is sharded other than by `dat_gather` (every head reads every
    relation)."""
    plan = model.tp_plan or {}
    for name, module in model.named_modules():
        if not hasattr(module, "head_parameters"):
            continue
        localize_heads(module, name, tp_size, list(module.head_parameters))
        for part in getattr(module, "gathered_projections", ()):
            linear = getattr(module, part, None)
            style = plan.get(plan_rule(f"{name}.{part}"))
            if linear is not None and local_rows(linear) != linear.out_features and style != GATHER_STYLE:
                raise ValueError(f"The tensor-parallel plan shards {name}.{part} by {style!r}: every relational "
                                 f"head reads every relation, so the relation projections are replicated or "
                                 f"sharded with their outputs gathered ({GATHER_STYLE!r}).")
    for module in model.modules():
        if hasattr(module, "plan_projections"):
            module.plan_projections()


def applicable_rules(model, plan: dict) -> dict:
    """`plan` without the rules that name no module or parameter of `model` (a config's layers may lack some: the
    sensory heads' q and k when shared, `k_rel_proj` for symmetric relations, the gate of an ungated MLP)."""
    names = {plan_rule(name) for name, _ in (*model.named_modules(), *model.named_parameters())}
    return {rule: style for rule, style in plan.items() if rule in names}


__all__ = ["GATHER_STYLE", "HEADS_STYLE", "gather_last_dim", "local_columns", "local_rows", "local_tensor",
           "localize_heads", "plan_rule", "tensor_parallel_slice", "applicable_rules", "use_local_heads"]
