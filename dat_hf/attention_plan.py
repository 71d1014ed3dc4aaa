# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The attention plan of one forward: for each relational bias and head type, the function that runs it and the
mask in the one format that function takes, chosen once per forward (as Transformers' `create_causal_mask` follows
`config._attn_implementation`) and handed to every layer, which makes one call:

    plan = AttentionPlan.build(masks, config, inputs_embeds, output_attentions, requires_grad)
    out = plan.sensory[bias](module, query, key, value)                                           # [b, q, h, d_h]
    messages = plan.relational[bias](module, query, key, symbol_values, relation_queries, relation_keys)

An entry also trims the empty slots of a static cache from an implicit causal mask, runs blocks of receivers against
the senders they may see when the mask allows it (a wrapper around the function: `receiver_blocks`), and zeroes the
messages of receivers without any sender. A relational backend whose kernel fails to compile or launch
(`RelationalBackendUnavailable`) is replaced in its entry by the next one (see `relational_attention.py`).
"""

import copy
import warnings
from typing import NamedTuple

import torch

from .masking_dat import AttentionMask, SlidingWindow, cut
from .relational_attention import (RELATIONAL_ATTENTION_FUNCTIONS, RelationalBackendUnavailable, RelationalCall,
                                   select_relational_attention)
# (importing the fused-values backends registers `sdpa` and `flex_attention` beside the reference's `eager`)
from .relational_attention_fused import fused_values_limits
from .sensory_attention import DAT_ATTENTION_FUNCTIONS, eager_attention_forward, flex_attention_forward
from .tensor_parallel_dat import local_tensor


class KernelMask(NamedTuple):
    """The mask as kernels take it, under the one mask rule (`masking_dat.AttentionMask`): `mask` None or a tensor
    `[b|1, 1, q, kv]` (bool, True = attend, or additive), the whole graph when given; `is_causal`, which applies only
    when `mask` is None (receiver i at kv - q + i sees senders j <= kv - q + i); and for backends of the "window"
    format a `SlidingWindow` over the whole sequence (then `mask` is its padding, bool `[b, 1, 1, kv]`, or None, and
    the graph is the window and the padding)."""

    mask: torch.Tensor | None
    is_causal: bool
    window: SlidingWindow | None = None


# "reference": the `AttentionMask` itself (the eager functions form its dense rows block by block); "dense": an explicit
# tensor or None (nothing masked); "tensor": a `KernelMask`; "window": a `KernelMask` that may carry a sliding window;
# "block_mask": a FlexAttention `BlockMask` (or the tensor mask, as an additive bias, where none was built; or, where
# neither was, a `KernelMask` without a tensor that says whether causal order applies). Each holds the same graph under
# the one mask rule (`masking_dat.AttentionMask`).
MASK_FORMATS = ("reference", "dense", "tensor", "window", "block_mask")


def mask_in_format(mask: AttentionMask, mask_format: str, q_len: int | None = None, kv_len: int | None = None,
                   device=None):
    """`mask` in one of `MASK_FORMATS` ("dense" needs the lengths and device: an implicit causal mask becomes
    explicit, receiver i at kv - q + i)."""
    if mask_format == "reference":
        return mask
    if mask_format == "dense":
        return mask.dense(q_len, kv_len, device)
    if mask_format == "block_mask":
        if mask.block_mask is not None:
            return mask.block_mask
        return KernelMask(None, True) if mask.mask is None and mask.is_causal else mask.mask
    if mask_format == "window" and mask.window is not None:
        padding = mask.window.padding
        return KernelMask(None if padding is None else padding[:, None, None, :], mask.is_causal, mask.window)
    if mask_format in ("tensor", "window"):
        return KernelMask(mask.mask, mask.is_causal)
    raise ValueError(f"Unknown mask format {mask_format!r}; one of {MASK_FORMATS}.")


class PlannedAttention:
    """One head type over one relational bias in this forward: `name` (the function's), `mask` (in its format),
    `blocks` (receiver blocks `(q0, q1, kv0, kv1, mask)` or None), `row_valid` (None, or bool `[b, 1, q, 1]`:
    receivers with any sender; the others send zeros)."""

    def __init__(self, source: AttentionMask, name: str, function, mask_format: str, blocked: bool):
        self.name, self.function, self.mask_format = name, function, mask_format
        # (no receiver blocks for a BlockMask, which skips masked blocks itself, nor for a whole sliding window)
        self.blocked = blocked and (mask_format in ("dense", "tensor", "reference") or (
            mask_format == "window" and source.window is None))
        self._place(source)

    def _place(self, source: AttentionMask):
        """The masks of `source` in this entry's format."""
        self.source, self.row_valid, self.is_causal = source, source.row_valid, source.is_causal
        self._dense = {}
        # an implicit causal mask over more senders than receivers: a prefill into a static cache, whose later slots
        # are empty (a BlockMask is sized for every slot and skips the empty ones itself)
        self.trims = not source.masked and source.is_causal and not (self.mask_format == "block_mask"
                                                                      and source.block_mask is not None)
        self.blocks = None
        if self.blocked and source.receiver_blocks is not None:
            fmt = "tensor" if self.mask_format == "window" else self.mask_format
            self.blocks = tuple((q0, q1, kv0, kv1, mask_in_format(source.block(q0, q1, kv0, kv1), fmt, q1 - q0,
                                                                  kv1 - kv0))
                                for q0, q1, kv0, kv1 in source.receiver_blocks)
        # (blocks take their own masks: a long sliding window's dense mask is never formed)
        self.mask = None
        if self.mask_format != "dense" and self.blocks is None:
            self.mask = mask_in_format(source, self.mask_format)

    def to(self, device, non_blocking: bool = False) -> "PlannedAttention":
        """This entry with its masks on `device` (itself if they are there): accelerate's hooks move each layer's
        inputs with `.to`, for a model spread over devices by `device_map`."""
        source = self.source.to(device, non_blocking)
        if source is self.source:
            return self
        moved = copy.copy(self)
        moved._place(source)
        return moved

    def weights_mask(self, q_len: int, kv_len: int, device):
        """The explicit mask `[b|1, 1, q, kv]` (or None) for the functions that form the weights themselves (formed
        once per shape and forward: every layer's call over the bias shares it)."""
        key = (q_len, kv_len)
        if key not in self._dense:
            self._dense[key] = mask_in_format(self.source, "dense", q_len, kv_len, device)
        return self._dense[key]

    def _senders(self, q_len: int, kv_len: int) -> int:
        return q_len if self.trims and 1 < q_len < kv_len else kv_len

    def _by_blocks(self, attend, receivers, senders):
        """`attend(mask, receiver_parts, sender_parts)` per receiver block: the `(tensor, dim)` pairs of `receivers`
        cut to [q0, q1) and of `senders` to [kv0, kv1); outputs `[b, q1 - q0, ...]` concatenated over receivers."""
        blocks = self.blocks
        receiver_parts = [cut(t, dim, [(q0, q1) for q0, q1, *_ in blocks]) for t, dim in receivers]
        sender_parts = [cut(t, dim, [(kv0, kv1) for _, _, kv0, kv1, _ in blocks]) for t, dim in senders]
        return torch.cat([attend(blocks[i][4], [parts[i] for parts in receiver_parts],
                                 [parts[i] for parts in sender_parts]) for i in range(len(blocks))], dim=1)

    def _zero_isolated(self, out):
        """out `[b, q, h, d]`: receivers without any sender send zeros."""
        return out if self.row_valid is None else out * self.row_valid.transpose(1, 2).to(out.dtype)


class PlannedSensory(PlannedAttention):
    """Sensory heads: a Transformers attention function (`DAT_ATTENTION_FUNCTIONS`), called with the module."""

    def __call__(self, module, query, key, value, dropout: float = 0.0, **kwargs):
        """query `[b, h, q, d_h]`, key, value `[b, h_kv, kv, d_h]` -> `[b, q, h, d_h]`."""
        if self.blocks is not None:
            out = self._by_blocks(lambda mask, receivers, senders: self._run(
                module, *receivers, *senders, mask, dropout, **kwargs), [(query, 2)], [(key, 2), (value, 2)])
            return self._zero_isolated(out)
        q_len, kv_len = query.shape[2], key.shape[2]
        senders = self._senders(q_len, kv_len)
        key, value = key[:, :, :senders], value[:, :, :senders]
        mask = self.weights_mask(q_len, senders, query.device) if self.mask_format == "dense" else self.mask
        return self._zero_isolated(self._run(module, query, key, value, mask, dropout, **kwargs))

    def _run(self, module, query, key, value, mask, dropout, **kwargs):
        is_causal = self.is_causal
        if isinstance(mask, KernelMask):  # (Transformers' functions take the tensor and the causal flag apart)
            mask, is_causal = mask.mask, mask.is_causal
        return self.function(module, query, key, value, mask, scaling=module.scaling, dropout=dropout,
                             is_causal=is_causal, **kwargs)[0]


class PlannedRelational(PlannedAttention):
    """Relational heads: a registered relational backend, and what it takes to replace it if its kernel fails."""

    def __init__(self, source: AttentionMask, call: RelationalCall, requested: str | None,
                 attn_implementation: str | None, per_request: bool = False):
        self.call, self.requested, self.attn_implementation = call, requested, attn_implementation
        # continuous batching's decoding steps: the q receivers of the packed row are each one request's new token;
        # they attend as q rows of one receiver over the same keys (views, `source` in that form), so that a
        # one-receiver backend (the CPU kernel's decoding op) reads each request's senders only
        self.per_request = per_request
        name = select_relational_attention(call, requested, attn_implementation)
        backend = RELATIONAL_ATTENTION_FUNCTIONS[name]
        # receiver blocks: not for weights or per-pair symbol rows (the mask format decides the rest)
        blocked = not (call.output_attentions or call.relative_symbols)
        super().__init__(source, name, backend.function, backend.mask_format, blocked)

    def __call__(self, module, query, key, symbol_values, relation_queries, relation_keys, symbols_at=None):
        """`module` (a `RelationalAttention`: its W_r, `spec` and dropout), inputs as `eager_relational_attention`
        -> messages `[b, q, h, d_h]`. The backend that ran is recorded as `module.relational_attention_backend`."""
        args = (query, key, symbol_values, relation_queries, relation_keys, local_tensor(module.relation_proj),
                module.spec, module.attention_dropout if module.training else 0.0, symbols_at)
        if torch.compiler.is_compiling():  # (traced ops never launch a kernel)
            return self._attend(*args)
        while True:
            try:
                messages = self._attend(*args)
                module.relational_attention_backend = self.name
                return messages
            except RelationalBackendUnavailable as error:
                self._fall_back(error)

    def _attend(self, query, key, symbol_values, relation_queries, relation_keys, relation_proj, spec, dropout,
                symbols_at):
        if self.per_request:  # [1, h, q, d_h] -> [q, h, 1, d_h] over the keys of the row (expanded views)
            rows = query.shape[2]
            query, relation_queries = query.transpose(0, 2), relation_queries.transpose(0, 1)
            key, symbol_values, relation_keys = (t.expand(rows, *t.shape[1:])
                                                 for t in (key, symbol_values, relation_keys))
            messages, _, _ = self.function(query, key, symbol_values, relation_queries, relation_keys,
                                           relation_proj, self.mask, spec, dropout)
            return self._zero_isolated(messages).transpose(0, 1)
        if self.blocks is not None:
            def attend_block(mask, receivers, senders):
                (query_part, relation_query_part), (key_part, symbol_part, relation_key_part) = receivers, senders
                return self.function(query_part, key_part, symbol_part, relation_query_part, relation_key_part,
                                     relation_proj, mask, spec, dropout)[0]

            return self._zero_isolated(self._by_blocks(attend_block, [(query, 2), (relation_queries, 1)],
                                                       [(key, 2), (symbol_values, 2), (relation_keys, 1)]))
        senders = self._senders(query.shape[2], key.shape[2])
        if senders < key.shape[2]:
            key, relation_keys = key[:, :, :senders], relation_keys[:, :senders]
            if symbols_at is None:
                symbol_values = symbol_values[:, :, :senders]
        messages, _, _ = self.function(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                                       self.mask, spec, dropout, symbols_at=symbols_at)
        return self._zero_isolated(messages)

    def _fall_back(self, error: RelationalBackendUnavailable):
        """The backend's kernel failed: out of automatic selection on this device type for the rest of the process
        (one `RuntimeWarning`), this entry takes the next backend; a requested backend raises the error."""
        device, failed = self.call.device, self.name
        if self.requested is not None or failed == "eager" or (failed, device) in RELATIONAL_ATTENTION_FUNCTIONS.unavailable:
            raise error
        RELATIONAL_ATTENTION_FUNCTIONS.unavailable[(failed, device)] = str(error)
        self.__init__(self.source, self.call, self.requested, self.attn_implementation, self.per_request)
        warnings.warn(f"dat_hf: the {failed!r} relational attention backend is not used on {device} from now on in "
                      f"this process; {self.name!r} runs instead. {error}", RuntimeWarning, stacklevel=3)


class AttentionPlan(NamedTuple):
    """`{bias: PlannedSensory}` and `{bias: PlannedRelational}` for every bias a model's layers use, one forward."""

    sensory: dict
    relational: dict

    @classmethod
    def build(cls, masks: dict, config, query_like: torch.Tensor, output_attentions: bool = False,
              requires_grad: bool = False, training: bool = False, sensory_biases=None, relational_biases=None,
              relative_symbols: bool | None = None, per_request: bool = False) -> "AttentionPlan":
        """The plan over `masks` (`{bias: AttentionMask}`), for the biases each head type uses (default: all of
        them), with the implementations `config` asks for. `query_like`: a tensor of the forward's device and dtype,
        with `q` receivers in dim 1; `requires_grad`: gradients will flow through the attention; `per_request`: the
        receivers of one row are each one request's new token (continuous batching's decoding steps), the
        relational heads attend one receiver per row (`PlannedRelational`)."""
        sensory_biases = masks if sensory_biases is None else sensory_biases
        relational_biases = masks if relational_biases is None else relational_biases
        dropout = config.attention_dropout if training else 0.0
        # (continuous batching sets "paged|eager": DAT's heads read the paged cache themselves, `cache_dat.PagedCache`)
        implementation = config._attn_implementation
        implementation = implementation.removeprefix("paged|") if isinstance(implementation, str) else implementation
        function = eager_attention_forward
        if not output_attentions:  # (fused kernels return no weights)
            function = DAT_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        sensory_format = ("dense" if function is eager_attention_forward
                          else "block_mask" if function is flex_attention_forward else "tensor")
        name = "eager" if function is eager_attention_forward else implementation
        sensory = {bias: PlannedSensory(masks[bias], name, function, sensory_format, not output_attentions)
                   for bias in dict.fromkeys(sensory_biases)}
        if relative_symbols is None:
            relative_symbols = config.symbol_retrieval == "position_relative"
        requested = getattr(config, "relational_attn_implementation", None)
        relational = {}
        for bias in dict.fromkeys(relational_biases):
            mask = masks[bias].rows_as_batch() if per_request else masks[bias]
            call = RelationalCall.of_forward(query_like, 1 if per_request else query_like.shape[1], requires_grad,
                                             output_attentions, config.relation_activation, relative_symbols, dropout,
                                             mask)
            relational[bias] = PlannedRelational(mask, call, requested, implementation, per_request)
        return cls(sensory, relational)


def gradients_flow(model, inputs_embeds: torch.Tensor) -> bool:
    """Whether gradients will flow through a forward of `model` (grad mode, and the inputs or some parameter need
    them): the backends without a backward are then not planned."""
    if not torch.is_grad_enabled():
        return False
    return inputs_embeds.requires_grad or any(p.requires_grad for p in model.parameters())


__all__ = ["MASK_FORMATS", "AttentionPlan", "KernelMask", "PlannedRelational", "PlannedSensory", "gradients_flow",
           "mask_in_format"]
