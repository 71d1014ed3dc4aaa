# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The attention plan of one forward: per relational bias and head type, the function and its mask format.

    plan = AttentionPlan.build(masks, config, inputs_embeds, output_attentions, requires_grad)
    out = plan.sensory[bias](module, query, key, value)                                           # [b, q, h, d_h]
    messages = plan.relational[bias](module, query, key, symbol_values, relation_queries, relation_keys)
"""

import copy
import warnings
import weakref
from typing import NamedTuple

import torch

from .masking_dat import AttentionMask, WindowMask
from .relational_attention import (RELATIONAL_ATTENTION_FUNCTIONS, RelationalBackendUnavailable, RelationalCall,
                                   select_relational_attention)
# (the import registers the `sdpa` and `flex_attention` relational backends)
from .relational_attention_fused import fused_values_limits
from .sensory_attention import SENSORY_ATTENTION_FUNCTIONS, sensory_attention_backend
from .transformers_compat import attention_implementation


class KernelMask(NamedTuple):
    """The mask as kernels take it, under the mask rule (`masking_dat.AttentionMask`): `mask` None or
    `[b|1, 1, q, kv]`; `is_causal` for a None mask; `window`: a sliding window over the whole sequence ("window"
    format: a long window's `masking_dat.SlidingWindow`; `mask` is then its padding `[b, 1, 1, kv]` or None)."""

    mask: torch.Tensor | None
    is_causal: bool
    window: object = None


# "reference": the `AttentionMask`; "dense": a tensor or None; "tensor": a `KernelMask`; "window": a `KernelMask` that
# may carry a `SlidingWindow`; "block_mask": a `BlockMask` (else the tensor, else a tensorless `KernelMask`)
MASK_FORMATS = ("reference", "dense", "tensor", "window", "block_mask")


def mask_in_format(mask: AttentionMask, mask_format: str, q_len: int | None = None, kv_len: int | None = None,
                   device=None):
    """`mask` in one of `MASK_FORMATS` ("dense" needs the lengths and device). Raises ValueError otherwise."""
    if mask_format == "reference":
        return mask
    if mask_format == "dense":
        return mask.dense(q_len, kv_len, device)
    if mask_format == "block_mask":
        if mask.block_mask is not None:
            return mask.block_mask
        return KernelMask(None, True) if mask.mask is None and mask.is_causal else mask.mask
    if mask_format in ("tensor", "window"):
        return KernelMask(mask.mask, mask.is_causal)
    raise ValueError(f"Unknown mask format {mask_format!r}; one of {MASK_FORMATS}.")


class _Cut(torch.autograd.Function):
    """Ranges of `x` along `dim` as views; backward accumulates them into one zero tensor (not one per range)."""

    @staticmethod
    def forward(ctx, x, dim, ranges):
        ctx.shape, ctx.dim, ctx.ranges = x.shape, dim, ranges
        return tuple(x.narrow(dim, lo, hi - lo) for lo, hi in ranges)

    @staticmethod
    def backward(ctx, *grads):
        grad = None
        for (lo, hi), g in zip(ctx.ranges, grads):
            if g is not None:
                grad = g.new_zeros(ctx.shape) if grad is None else grad
                grad.narrow(ctx.dim, lo, hi - lo).add_(g)
        return grad, None, None


def cut(x: torch.Tensor, dim: int, ranges) -> tuple:
    """`x` cut to each `(lo, hi)` of `ranges` along `dim` (views; one backward node for all of them)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Cut.apply(x, dim, list(ranges))
    return tuple(x.narrow(dim, lo, hi - lo) for lo, hi in ranges)


class PlannedAttention:
    """One head type over one bias in this forward: `name`, `mask` (in its format), `row_valid` (None or bool
    `[b, 1, q, 1]`), and `blocks` where it attends block by block over its mask's receiver blocks: `(q0, q1, kv0, kv1,
    mask)` per block (the mask in the entry's format), or None."""

    def __init__(self, source: AttentionMask, name: str, function, mask_format: str, output_attentions: bool = False):
        self.name, self.function, self.mask_format = name, function, mask_format
        self.output_attentions = output_attentions
        self._place(source)

    def _place(self, source: AttentionMask):
        self.source, self.row_valid, self.is_causal = source, source.row_valid, source.is_causal
        self._dense = {}
        # implicit causal mask over more senders than receivers (a static cache's empty slots): keep q senders
        self.trims = not source.masked and source.is_causal and not (self.mask_format == "block_mask"
                                                                      and source.block_mask is not None)
        self.mask = self._kernel_mask(source)

    def _kernel_mask(self, source: AttentionMask):
        """The mask the function takes (None for "dense": `weights_mask` forms it per shape; None with `blocks`)."""
        self.blocks = None
        if self._blockable(source) and source.receiver_blocks is not None:
            fmt = "tensor" if self.mask_format == "window" else self.mask_format
            self.blocks = tuple((q0, q1, kv0, kv1, mask_in_format(source.block(q0, q1, kv0, kv1), fmt, q1 - q0,
                                                                  kv1 - kv0))
                                for q0, q1, kv0, kv1 in source.receiver_blocks)
            return None
        if self.mask_format == "window" and isinstance(source, WindowMask):  # the whole window to the kernel
            padding = source.window.padding
            return KernelMask(None if padding is None else padding[:, None, None, :], source.is_causal, source.window)
        return None if self.mask_format == "dense" else mask_in_format(source, self.mask_format)

    def _blockable(self, source: AttentionMask) -> bool:
        """No receiver blocks for weights, a BlockMask (it skips blocks itself) nor a whole sliding window."""
        return not self.output_attentions and (self.mask_format in ("dense", "tensor", "reference") or (
            self.mask_format == "window" and not isinstance(source, WindowMask)))

    def _by_blocks(self, attend, receivers, senders):
        """`attend(mask, receiver_parts, sender_parts)` per block (`(tensor, dim)` pairs cut), concatenated on dim 1."""
        blocks = self.blocks
        receiver_parts = [cut(t, dim, [(q0, q1) for q0, q1, *_ in blocks]) for t, dim in receivers]
        sender_parts = [cut(t, dim, [(kv0, kv1) for _, _, kv0, kv1, _ in blocks]) for t, dim in senders]
        return torch.cat([attend(blocks[i][4], [parts[i] for parts in receiver_parts],
                                 [parts[i] for parts in sender_parts]) for i in range(len(blocks))], dim=1)

    def to(self, device, non_blocking: bool = False) -> "PlannedAttention":
        """This entry with its masks on `device` (itself if already there), for accelerate's hooks."""
        source = self.source.to(device, non_blocking)
        if source is self.source:
            return self
        moved = copy.copy(self)
        moved._place(source)
        return moved

    def reuse(self) -> None:
        """Drop the explicit masks formed per shape (this entry serves another forward)."""
        self._dense = {}

    def weights_mask(self, q_len: int, kv_len: int, device):
        """The explicit mask `[b|1, 1, q, kv]` or None, formed once per shape and forward."""
        key = (q_len, kv_len)
        if key not in self._dense:
            self._dense[key] = mask_in_format(self.source, "dense", q_len, kv_len, device)
        return self._dense[key]

    def _senders(self, q_len: int, kv_len: int) -> int:
        return q_len if self.trims and 1 < q_len < kv_len else kv_len

    def _zero_isolated(self, out):
        """out `[b, q, h, d]` with receivers without senders zeroed."""
        return out if self.row_valid is None else out * self.row_valid.transpose(1, 2).to(out.dtype)


class PlannedSensory(PlannedAttention):
    """Sensory heads: a function of the `sensory` table (`kernel_hooks.BACKENDS`), or Transformers' own."""

    def __call__(self, module, query, key, value, dropout: float = 0.0, **kwargs):
        """query `[b, h, q, d_h]`, key, value `[b, h_kv, kv, d_h]` -> `[b, q, h, d_h]`."""
        if self.blocks is not None:
            return self._zero_isolated(self._by_blocks(lambda mask, receivers, senders: self._run(
                module, *receivers, *senders, mask, dropout, **kwargs), [(query, 2)], [(key, 2), (value, 2)]))
        q_len, kv_len = query.shape[2], key.shape[2]
        senders = self._senders(q_len, kv_len)
        if senders < kv_len:
            key, value = key[:, :, :senders], value[:, :, :senders]
        mask = self.weights_mask(q_len, senders, query.device) if self.mask_format == "dense" else self.mask
        return self._zero_isolated(self._run(module, query, key, value, mask, dropout, **kwargs))

    def _run(self, module, query, key, value, mask, dropout, **kwargs):
        is_causal = self.is_causal
        if isinstance(mask, KernelMask):
            mask, is_causal = mask.mask, mask.is_causal
        return self.function(module, query, key, value, mask, scaling=module.scaling, dropout=dropout,
                             is_causal=is_causal, **kwargs)[0]


class PlannedRelational(PlannedAttention):
    """Relational heads: a registered backend; where a compiled backend's kernel fails to compile or launch
    (`RelationalBackendUnavailable`), the next one takes over (`_fall_back`). Block by block over receiver blocks
    except for position-relative symbols, whose rows follow each receiver's position."""

    def __init__(self, source: AttentionMask, call: RelationalCall, requested: str | None,
                 attn_implementation: str | None, per_request: bool = False):
        self.call, self.requested, self.attn_implementation = call, requested, attn_implementation
        # continuous batching's decoding steps: q rows of one receiver each (`source` already in that form)
        self.per_request = per_request
        name = select_relational_attention(call, requested, attn_implementation)
        backend = RELATIONAL_ATTENTION_FUNCTIONS[name]
        super().__init__(source, name, backend.function, backend.mask_format, call.output_attentions)

    def __call__(self, module, query, key, symbol_values, relation_queries, relation_keys, symbols_at=None):
        """Inputs as `eager_relational_attention` -> messages `[b, q, h, d_h]`; records the backend on `module`."""
        args = (query, key, symbol_values, relation_queries, relation_keys, module.local_relation_proj(),
                module.spec, module.attention_dropout if module.training else 0.0, symbols_at)
        while True:
            try:
                messages = self._attend(*args)
                break
            except RelationalBackendUnavailable as error:
                if torch.compiler.is_compiling():
                    raise
                self._fall_back(error)
        if not torch.compiler.is_compiling() and getattr(module, "relational_attention_backend", None) != self.name:
            module.relational_attention_backend = self.name  # (`__setattr__` is slow)
        return messages

    def _blockable(self, source: AttentionMask) -> bool:
        return not self.call.relative_symbols and super()._blockable(source)

    def _fall_back(self, error: RelationalBackendUnavailable):
        """Drop the failed backend on this device type for the process (one `RuntimeWarning`) and take the next;
        re-raise for a requested backend."""
        device, failed = self.call.device, self.name
        if (self.requested is not None or failed == "eager"
                or (failed, device) in RELATIONAL_ATTENTION_FUNCTIONS.unavailable):
            raise error
        RELATIONAL_ATTENTION_FUNCTIONS.unavailable[(failed, device)] = str(error)
        self.__init__(self.source, self.call, self.requested, self.attn_implementation, self.per_request)
        warnings.warn(f"dat_hf: the {failed!r} relational attention backend is not used on {device} from now on in "
                      f"this process; {self.name!r} runs instead. {error}", RuntimeWarning, stacklevel=4)

    def _attend(self, query, key, symbol_values, relation_queries, relation_keys, relation_proj, spec, dropout,
                symbols_at):
        if self.blocks is not None and not self.per_request:
            def attend_block(mask, receivers, senders):
                (query_part, relation_query_part), (key_part, symbol_part, relation_key_part) = receivers, senders
                return self.function(query_part, key_part, symbol_part, relation_query_part, relation_key_part,
                                     relation_proj, mask, spec, dropout)[0]

            return self._zero_isolated(self._by_blocks(attend_block, [(query, 2), (relation_queries, 1)],
                                                       [(key, 2), (symbol_values, 2), (relation_keys, 1)]))
        if self.per_request:  # [1, h, q, d_h] -> [q, h, 1, d_h] over the row's keys (expanded views)
            rows = query.shape[2]
            query, relation_queries = query.transpose(0, 2), relation_queries.transpose(0, 1)
            key, symbol_values, relation_keys = (t.expand(rows, *t.shape[1:])
                                                 for t in (key, symbol_values, relation_keys))
            messages, _, _ = self.function(query, key, symbol_values, relation_queries, relation_keys,
                                           relation_proj, self.mask, spec, dropout)
            return self._zero_isolated(messages).transpose(0, 1)
        senders = self._senders(query.shape[2], key.shape[2])
        if senders < key.shape[2]:
            key, relation_keys = key[:, :, :senders], relation_keys[:, :senders]
            if symbols_at is None:
                symbol_values = symbol_values[:, :, :senders]
        messages, _, _ = self.function(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                                       self.mask, spec, dropout, symbols_at=symbols_at)
        return self._zero_isolated(messages)


def sensory_function(config, output_attentions: bool) -> tuple:
    """(implementation name, the sensory heads' `Backend`: function and mask format): eager for weights, else the
    config's (`sensory_attention_backend`)."""
    implementation = attention_implementation(config)  # (continuous batching's `paged|eager` as `eager`)
    if output_attentions:
        return implementation, SENSORY_ATTENTION_FUNCTIONS["eager"]
    return implementation, sensory_attention_backend(implementation)


class PlanReads(NamedTuple):
    """Everything `AttentionPlan` is built from besides the masks: the forward's biases, device, dtype and query
    length, its flags, the config fields the plan reads, the sensory function resolved, and the registry's entries
    (`registry_state`). A plan is a function of these and the masks, so a plan over implicit masks (causal order or
    nothing: no tensor) serves every later forward whose reads are equal (`plan_attention`)."""

    sensory_biases: tuple
    relational_biases: tuple
    device: torch.device
    dtype: torch.dtype
    query_length: int
    output_attentions: bool
    requires_grad: bool
    dropout: float
    implementation: str
    sensory_backend: object  # (the resolved `Backend`)
    requested: str | None  # `relational_attn_implementation`
    relation_activation: str
    relative_symbols: bool
    per_request: bool  # one receiver per row (continuous batching's decoding steps)
    autocast: tuple  # (enabled, dtype)
    compiling: bool  # (or exporting)
    registry: tuple

    @classmethod
    def of(cls, masks: dict, config, query_like: torch.Tensor, output_attentions: bool = False,
           requires_grad: bool = False, training: bool = False, sensory_biases=None, relational_biases=None,
           relative_symbols: bool | None = None, per_request: bool = False) -> "PlanReads":
        """What a plan over `masks` reads (arguments as `AttentionPlan.build`'s)."""
        implementation, backend = sensory_function(config, output_attentions)
        device = query_like.device.type
        autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
        if relative_symbols is None:
            relative_symbols = config.symbol_retrieval == "position_relative"
        compiling = torch.compiler.is_compiling() or torch.compiler.is_exporting()  # (no plan is reused: no registry)
        return cls(tuple(dict.fromkeys(masks if sensory_biases is None else sensory_biases)),
                   tuple(dict.fromkeys(masks if relational_biases is None else relational_biases)),
                   query_like.device, query_like.dtype, query_like.shape[1], output_attentions, requires_grad,
                   config.attention_dropout if training else 0.0, implementation, backend,
                   getattr(config, "relational_attn_implementation", None), config.relation_activation,
                   relative_symbols, per_request, (autocast, autocast and torch.get_autocast_dtype(device)),
                   compiling, () if compiling else registry_state())

    def call(self, mask: AttentionMask) -> RelationalCall:
        """The relational heads' call over `mask` (per bias)."""
        enabled, autocast_dtype = self.autocast
        return RelationalCall(self.device.type, autocast_dtype if enabled else self.dtype,
                              1 if self.per_request else self.query_length, self.requires_grad,
                              self.output_attentions, self.relation_activation, self.relative_symbols, self.dropout,
                              mask, enabled, torch.compiler.is_compiling())


def registry_state() -> tuple:
    """The registry entries a plan reads: the relational backends (and those taken out of automatic selection) and
    the sensory functions."""
    return (tuple(RELATIONAL_ATTENTION_FUNCTIONS.items()), tuple(RELATIONAL_ATTENTION_FUNCTIONS.unavailable.items()),
            tuple(SENSORY_ATTENTION_FUNCTIONS.items()))


class AttentionPlan(NamedTuple):
    """`{bias: PlannedSensory}` and `{bias: PlannedRelational}` for one forward, and what they were built from."""

    sensory: dict
    relational: dict
    reads: PlanReads | None = None

    @classmethod
    def build(cls, masks: dict, config, query_like: torch.Tensor, output_attentions: bool = False,
              requires_grad: bool = False, training: bool = False, sensory_biases=None, relational_biases=None,
              relative_symbols: bool | None = None, per_request: bool = False) -> "AttentionPlan":
        """The plan over `masks` (`{bias: AttentionMask}`) for each head type's biases (default: all). `query_like`:
        the forward's device and dtype, q in dim 1; `per_request`: one receiver per row (continuous batching)."""
        return cls.of_reads(masks, PlanReads.of(masks, config, query_like, output_attentions, requires_grad, training,
                                                sensory_biases, relational_biases, relative_symbols, per_request))

    @classmethod
    def of_reads(cls, masks: dict, reads: PlanReads) -> "AttentionPlan":
        """The plan over `masks` from `reads` alone (nothing else is read)."""
        backend = reads.sensory_backend
        name = "eager" if backend is SENSORY_ATTENTION_FUNCTIONS["eager"] else reads.implementation
        sensory = {bias: PlannedSensory(masks[bias], name, backend.function, backend.mask_format,
                                         reads.output_attentions) for bias in reads.sensory_biases}
        relational = {}
        for bias in reads.relational_biases:
            mask = masks[bias].rows_as_batch() if reads.per_request else masks[bias]
            relational[bias] = PlannedRelational(mask, reads.call(mask), reads.requested, reads.implementation,
                                                 reads.per_request)
        return cls(sensory, relational, reads)

    def serves(self, masks: dict, reads: PlanReads) -> bool:
        """Whether this plan is the one `masks` and `reads` would build: equal reads, and masks that are all
        implicit (causal order or nothing) with this plan's order; never while tracing."""
        if reads.compiling or reads != self.reads:
            return False
        entries = {**self.sensory, **self.relational}
        return all(mask.implicit and bias in entries and entries[bias].source.implicit
                   and entries[bias].is_causal == mask.is_causal for bias, mask in masks.items())

    def reused(self) -> "AttentionPlan":
        """This plan for one more forward (each entry's explicit masks, formed per shape, dropped)."""
        for entry in (*self.sensory.values(), *self.relational.values()):
            entry.reuse()
        return self


# each model's last plan, which serves the next forward while it `serves` it (decoding steps)
_LAST_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, AttentionPlan]" = weakref.WeakKeyDictionary()


def plan_attention(model, masks: dict, *inputs, per_request: bool = False) -> AttentionPlan:
    """`model`'s plan for this forward (`AttentionPlan.build(masks, *inputs, per_request=per_request)`): the last
    forward's plan where it serves this one (a decoding step over implicit masks), else a new one."""
    reads = PlanReads.of(masks, *inputs, per_request=per_request)
    if reads.compiling:
        return AttentionPlan.of_reads(masks, reads)
    last = _LAST_PLANS.get(model)
    if last is not None and last.serves(masks, reads):
        return last.reused()
    plan = AttentionPlan.of_reads(masks, reads)
    if all(mask.implicit for mask in masks.values()):  # (only such a plan can serve a later forward: keep no tensors)
        _LAST_PLANS[model] = plan
    return plan


def gradients_flow(model, inputs_embeds: torch.Tensor) -> bool:
    """Whether gradients will flow through a forward of `model` (grad mode, and inputs or parameters need them)."""
    if not torch.is_grad_enabled():
        return False
    return inputs_embeds.requires_grad or any(p.requires_grad for p in model.parameters())


__all__ = ["MASK_FORMATS", "AttentionPlan", "KernelMask", "PlanReads", "PlannedRelational",
           "PlannedSensory", "gradients_flow", "mask_in_format", "plan_attention", "registry_state"]
