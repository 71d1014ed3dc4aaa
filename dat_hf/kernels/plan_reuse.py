"""Plan reuse for decoding steps, installed by `import dat_hf` (the model files never import this module: remote code
alone plans every forward, with the same results).

A decoding step's masks are implicit (causal order, no padding tensor): the last such step's `AttentionPlan` serves
the next while nothing `AttentionPlan.build` reads changed (`reuse_key`), never while tracing.
"""

import torch

from ..attention_plan import AttentionPlan, sensory_function
from ..kernel_hooks import register_kernel
from ..relational_attention import RELATIONAL_ATTENTION_FUNCTIONS


def reuse_key(masks: dict, config, query_like: torch.Tensor, output_attentions: bool, requires_grad: bool,
              training: bool, sensory_biases, relational_biases, per_request: bool = False) -> tuple | None:
    """What `AttentionPlan.build` reads, as a key under which a plan can serve the next forward (a decoding step): None
    unless every mask is implicit (no tensor, BlockMask or receiver blocks: causal order or nothing), outside tracing.
    The backends' registry (entries and unavailable ones) and the resolved sensory function are part of it."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return None
    flags = []
    for bias, mask in masks.items():
        if not mask.implicit:
            return None
        flags.append((bias, mask.is_causal))
    device = query_like.device.type
    autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
    return (tuple(flags), tuple(sensory_biases), tuple(relational_biases), query_like.dtype, query_like.device,
            query_like.shape[1], output_attentions, requires_grad, training, per_request, autocast,
            autocast and torch.get_autocast_dtype(device), *sensory_function(config, output_attentions),
            getattr(config, "relational_attn_implementation", None), config.relation_activation,
            config.symbol_retrieval, config.attention_dropout if training else 0.0,
            tuple(RELATIONAL_ATTENTION_FUNCTIONS.items()), tuple(RELATIONAL_ATTENTION_FUNCTIONS.unavailable))


def reused_or_built(model, *inputs, per_request: bool = False) -> AttentionPlan:
    """The kernel of `attention_plan.plan_attention`: `model`'s last plan if its `reuse_key` is this forward's (the
    explicit masks it formed per shape dropped), else a new plan, kept for the next step when it has a key."""
    key = reuse_key(*inputs, per_request)
    if key is None:
        return AttentionPlan.build(*inputs, per_request=per_request)
    last = model.__dict__.get("_last_attention_plan")
    if last is not None and last[0] == key:
        for entry in (*last[1].sensory.values(), *last[1].relational.values()):
            entry._dense = {}
        return last[1]
    plan = AttentionPlan.build(*inputs, per_request=per_request)
    model.__dict__["_last_attention_plan"] = (key, plan)
    return plan


def register() -> None:
    """Install plan reuse into `attention_plan.plan_attention`."""
    register_kernel("plan_attention", reused_or_built, lambda *args, **kwargs: True)


__all__ = ["register", "reuse_key", "reused_or_built"]
