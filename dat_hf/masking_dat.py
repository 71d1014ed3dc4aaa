# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational inductive biases as attention masks (one small mask library for every DAT model).

Each bias is an attention graph (receiver i may attend to sender j), as in "On the relational inductive biases of
attention": `full` (complete graph), `causal` (total order), `sliding_window` (the p previous tokens and itself),
`sliding_window_bidirectional` (|i - j| <= p), `sparse` (a fixed graph from the config: local blocks plus global
tokens, or explicit edges) and `graph` (an adjacency given with each input). Encoder-decoder cross-attention is the
bipartite graph `bipartite` (every target token to every unpadded source token). What each bias is (ordered or not,
a window, its mask function) comes from its entry in the registry, `relational_biases.py`; the masks are built here.

Masks are built once per forward with Transformers' `masking_utils`, in one dense form (None when nothing is
masked or plain causal order applies, else bool `[b, 1, q, kv]`; every backend and the eager functions take it),
plus a `BlockMask` for FlexAttention when the model uses it (masked blocks are then skipped), together with
`row_valid`, which marks receivers that have at least one sender. Rows without senders are unmasked in the dense
form (no NaN) and their output is zeroed. Where a mask lets blocks of receivers skip senders, the attention runs
block by block (`receiver_blocks`); a long sliding window then never forms its dense mask at all (`SlidingWindow`:
the blocks' masks come from Transformers' index functions, O(n * window)).
"""

import bisect

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.masking_utils import (create_bidirectional_mask, create_bidirectional_sliding_window_mask,
                                        create_causal_mask, create_sliding_window_causal_mask,
                                        sliding_window_bidirectional_mask_function,
                                        sliding_window_causal_mask_function)

from .cache_dat import ring_layer
from .relational_biases import CROSS_ATTENTION_BIAS, is_ordered, relational_bias
from .transformers_compat import cache_kwargs


class _Cut(torch.autograd.Function):
    """Ranges of one tensor along a dim, as views; backward writes each range's gradient into one zero tensor (plain
    slicing would make a full-size zero-padded gradient per range, O(n^2 / block) for n / block ranges)."""

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


def receiver_offset(q_len: int, kv_len: int, offset=None):
    """The one definition of the first receiver's index among the keys: `offset` when given (an int or a tensor),
    else `kv - q` (the `q_len` new tokens are the last of the `kv_len` keys)."""
    return kv_len - q_len if offset is None else offset


def receiver_positions(q_len: int, kv_len: int, device, offset=None, start: int = 0, end: int | None = None):
    """Where receivers sit among the keys: receivers [start, end) of `q_len` new tokens over `kv_len` keys are at
    `receiver_offset(q_len, kv_len, offset) + i` -> long `[end - start]`."""
    end = q_len if end is None else end
    return torch.arange(start, end, device=device) + receiver_offset(q_len, kv_len, offset)


def causal_order(q_len: int, kv_len: int, device, offset=None, start: int = 0, end: int | None = None):
    """The implicit causal order made explicit (`AttentionMask`'s rule): receivers [start, end) of `q_len` over
    `kv_len` keys, receiver i at `receiver_offset(q_len, kv_len, offset) + i`, see senders j <= their position -> bool
    `[1, 1, end - start, kv]` (True = attend), or None when each of them sees every sender (e.g. one receiver, a
    decoding step, at the default offset)."""
    first = receiver_offset(q_len, kv_len, offset)
    if isinstance(first, int) and first + start >= kv_len - 1:
        return None
    positions = receiver_positions(q_len, kv_len, device, offset, start, end)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= positions)[None, None]


class AttentionMask:
    """One relational bias as the attention functions take it, plus which receivers have any sender.

    The mask rule: what every backend receives (this object, or `attention_plan.KernelMask` / `mask_in_format`'s
    other formats, which carry the same fields), and what every backend computes from it; `tests/test_mask_rule.py`
    holds each backend to it.
    1. A mask tensor, when given, is the whole graph: it already holds the causal order, the padding and the bias,
       so `is_causal` is ignored (a backend never intersects a given mask with causal order).
    2. `is_causal` applies only when the mask is None: receiver i of the q new tokens sits at position offset + i
       among the kv keys, offset = kv - q unless given (`receiver_offset`), and sees senders j <= offset + i (one
       receiver, a decoding step, sees every sender). A None mask without `is_causal` masks nothing.
    3. In the "window" format a `SlidingWindow` over the whole sequence stands for the mask: the graph is the window
       (one-sided: causal) and its padding, the `KernelMask`'s tensor.
    4. A receiver with no sender gets zeros: the producers open its row (no NaN in any kernel) and mark it in
       `row_valid`, and the attention plan zeroes its output (the compiled kernels also give zeros for an empty row).
    Transformers leaves a prefill into an empty static cache implicit too, its receivers at the first q of more
    slots (the later ones empty): the attention plan trims those senders (`PlannedAttention.trims`), so that the
    backends receive q = kv and rule 2 holds.

    mask: None (see `is_causal`), bool `[b|1, 1, q, kv]` (True = attend) or, from a user's 4-D mask, additive float.
        A sliding window over a long sequence keeps its index arithmetic (`window`) instead: its blocks come from it
        and the dense mask is built only when asked for.
    row_valid: None (every receiver has a sender) or bool `[b, 1, q, 1]`.
    is_causal: whether a None mask means causal order (rule 2; ignored when a mask is given).
    block_mask: the same graph as a FlexAttention `BlockMask` (only when the model uses `flex_attention`).
    receiver_blocks: None, or `((q0, q1, kv0, kv1), ...)`: blocks of receivers and the senders any of them may
        see, when attending block by block skips a good share of the work (a sliding window, a block-sparse graph).
    window: None or a `SlidingWindow` (then `mask` is built from it on first use, and each block's mask once per
        forward for all layers).
    """

    __slots__ = ("_mask", "row_valid", "is_causal", "block_mask", "receiver_blocks", "window", "_window_blocks")

    def __init__(self, mask, row_valid, is_causal: bool, block_mask=None, receiver_blocks=None, window=None):
        self._mask, self.row_valid, self.is_causal = mask, row_valid, is_causal
        self.block_mask, self.receiver_blocks, self.window = block_mask, receiver_blocks, window
        self._window_blocks = {}

    def to(self, device, non_blocking: bool = False) -> "AttentionMask":
        """This mask on `device` (itself if it is there): accelerate's hooks move each layer's inputs with `.to`, for a
        model spread over devices by `device_map`."""
        device = torch.device(device)
        held = (self._mask, self.row_valid, None if self.window is None else self.window.padding,
                None if self.block_mask is None else self.block_mask.kv_num_blocks)
        if all(t is None or t.device == device for t in held):
            return self

        mask, row_valid = (None if t is None else t.to(device, non_blocking=non_blocking)
                           for t in (self._mask, self.row_valid))
        window = None if self.window is None else self.window.to(device, non_blocking)
        block_mask = None if self.block_mask is None else self.block_mask.to(device)  # (it takes no non_blocking)
        return AttentionMask(mask, row_valid, self.is_causal, block_mask, self.receiver_blocks, window)

    def rows_as_batch(self) -> "AttentionMask":
        """A mask `[1, 1, q, kv]` of one row's q receivers -> that of q rows of one receiver each, `[q, 1, 1, kv]`
        (views), for receivers that attend one by one over the same keys (`PlannedRelational`'s `per_request`)."""
        row_valid = None if self.row_valid is None else self.row_valid.transpose(0, 2)
        return AttentionMask(self.mask.transpose(0, 2), row_valid, False)

    def _from_window(self, q0: int, q1: int, kv0: int, kv1: int) -> torch.Tensor:
        """The sliding window's bool mask of receivers [q0, q1) over senders [kv0, kv1), isolated receivers open."""
        row_valid = None if self.row_valid is None else self.row_valid[..., q0:q1, :]
        return self.window.allowed(q0, q1, kv0, kv1, row_valid)

    @property
    def mask(self) -> torch.Tensor | None:
        if self._mask is None and self.window is not None:
            self._mask = self._from_window(0, self.window.length, 0, self.window.length)
        return self._mask

    @property
    def masked(self) -> bool:
        """Whether a mask is given beyond the implicit causal order (False: `mask` is None)."""
        return self._mask is not None or self.window is not None

    @property
    def bool_or_none(self) -> bool:
        """Whether `mask` is None or bool `[b|1, 1, q, kv]` (what the compiled kernels take), known without building
        a sliding window's dense mask."""
        if self._mask is None:
            return True
        return self._mask.dtype == torch.bool and self._mask.dim() == 4 and self._mask.shape[1] == 1

    def block(self, q0: int, q1: int, kv0: int, kv1: int) -> "AttentionMask":
        """The mask of receivers [q0, q1) over senders [kv0, kv1) (explicit, so no implicit causal order)."""
        row_valid = None if self.row_valid is None else self.row_valid[..., q0:q1, :]
        if self._mask is None and self.window is not None:  # (every layer's heads attend over the same blocks)
            key = (q0, q1, kv0, kv1)
            if key not in self._window_blocks:
                self._window_blocks[key] = self._from_window(*key)
            return AttentionMask(self._window_blocks[key], row_valid, False)
        return AttentionMask(self.mask[..., q0:q1, kv0:kv1], row_valid, False)

    def dense(self, q_len: int, kv_len: int, device, start: int = 0, end: int | None = None, offset=None):
        """The mask of receivers [start, end) (default: all) as an explicit tensor for code that forms its own scores:
        bool (True = attend) or additive float `[b|1, 1, m, kv]`; None when nothing is masked. A given mask is
        returned as it is (rule 1); the implicit causal order puts receiver i at `offset` + i (default kv - q,
        `receiver_offset`: rule 2, `causal_order`)."""
        end = q_len if end is None else end
        if self._mask is None and self.window is not None:
            return self._from_window(start, end, 0, kv_len)
        if self.mask is not None:
            return self.mask if self.mask.shape[-2] == 1 else self.mask[..., start:end, :]
        if not self.is_causal:
            return None
        return causal_order(q_len, kv_len, device, offset, start, end)


# receivers per block when a mask lets each block see only some of the senders; blocks are used when they skip at
# least this share of the pairs that plain (causal or full) attention would compute
RECEIVER_BLOCK = 256
MIN_SKIPPED_SHARE = 0.25


def _receiver_blocks(allowed: torch.Tensor, is_causal: bool) -> tuple | None:
    """bool `[b|1, 1, q, kv]` -> ((q0, q1, kv0, kv1), ...), each block of `RECEIVER_BLOCK` receivers (all of them in
    one block when fewer than two blocks' worth, e.g. a decoding step over a cache) with the range of senders that any
    of them may see, or None when that would not skip `MIN_SKIPPED_SHARE` of the work."""
    q_len, kv_len = allowed.shape[-2:]
    if torch.compiler.is_compiling() or not q_len or not kv_len:
        return None
    size = RECEIVER_BLOCK if q_len >= 2 * RECEIVER_BLOCK else q_len
    rows = allowed.any(0)[0]  # [q, kv]: the union over the batch
    columns = torch.nn.functional.pad(rows, (0, 0, 0, -q_len % size)).view(-1, size, kv_len).any(1)  # [blocks, kv]
    first = columns.int().argmax(-1)
    last = kv_len - columns.flip(-1).int().argmax(-1)
    blocks = [(q0, min(q_len, q0 + size), lo, hi)
              for q0, lo, hi in zip(range(0, q_len, size), first.tolist(), last.tolist())]
    return _if_skipping_enough(blocks, q_len, kv_len, is_causal)


def _if_skipping_enough(blocks, q_len: int, kv_len: int, is_causal: bool) -> tuple | None:
    """`blocks` as a tuple if they skip at least `MIN_SKIPPED_SHARE` of plain (causal or full) attention, else None."""
    pairs = sum((q1 - q0) * (hi - lo) for q0, q1, lo, hi in blocks)
    plain = q_len * kv_len - (q_len * (q_len - 1) // 2 if is_causal else 0)
    return tuple(blocks) if pairs <= (1 - MIN_SKIPPED_SHARE) * plain else None


def transformers_window(previous: int, two_sided: bool) -> int:
    """dat_hf's one window convention, `previous` = p (a receiver sees its p previous tokens and itself, or also its
    p next ones when two-sided; `sliding_window_size`; the kernels take it as is), in Transformers' convention (its
    mask functions, mask builders and cache layers): the senders up to and including the receiver, p + 1, or p each
    side."""
    return previous if two_sided else previous + 1


class SlidingWindow:
    """A sliding window of `previous` = p tokens (a receiver sees senders p back, or `|i - j| <= p` when two-sided)
    over the `length` tokens of one forward without a cache (receivers and senders alike),
    with an optional 2-D padding mask `[b, length]`: any block of its mask, its receiver blocks and its isolated
    receivers come from index arithmetic in O(n * window), never from the dense `n x n` mask."""

    def __init__(self, previous: int, two_sided: bool, padding: torch.Tensor | None, length: int, device):
        self.previous, self.two_sided, self.padding = previous, two_sided, padding
        self.length, self.device = length, device
        make = sliding_window_bidirectional_mask_function if two_sided else sliding_window_causal_mask_function
        self.function = make(transformers_window(previous, two_sided))

    def to(self, device, non_blocking: bool = False) -> "SlidingWindow":
        """The same window with its padding mask on `device`."""
        padding = None if self.padding is None else self.padding.to(device, non_blocking=non_blocking)
        return SlidingWindow(self.previous, self.two_sided, padding, self.length, device)

    def senders(self, q0: int, q1: int) -> tuple[int, int]:
        """The range [kv0, kv1) of senders that receivers [q0, q1) may see (before padding)."""
        if self.two_sided:
            return max(0, q0 - self.previous), min(self.length, q1 + self.previous)
        return max(0, q0 - self.previous), min(self.length, q1)

    def allowed(self, q0: int, q1: int, kv0: int, kv1: int, row_valid=None) -> torch.Tensor:
        """bool `[b|1, 1, q1 - q0, kv1 - kv0]` (True = attend); receivers where `row_valid` `[b, 1, q1 - q0, 1]` is
        False attend everywhere (their output is zeroed)."""
        q = torch.arange(q0, q1, device=self.device)[:, None]
        kv = torch.arange(kv0, kv1, device=self.device)[None, :]
        allowed = self.function(None, None, q, kv)[None, None]
        if self.padding is not None:
            allowed = allowed & self.padding[:, None, None, kv0:kv1]
        return allowed if row_valid is None else allowed | ~row_valid

    def receiver_blocks(self) -> tuple | None:
        """As `_receiver_blocks` of the dense mask: blocks of `RECEIVER_BLOCK` receivers with the senders any of them
        may see (padding narrows them), or None when that would not skip `MIN_SKIPPED_SHARE` of the work."""
        blocks = []
        present = None if self.padding is None else self.padding.any(0).nonzero().flatten().tolist()
        for q0 in range(0, self.length, RECEIVER_BLOCK):
            q1 = min(self.length, q0 + RECEIVER_BLOCK)
            lo, hi = self.senders(q0, q1)
            if present is not None:  # the first and last sender of the range that is a token in some row
                first, last = bisect.bisect_left(present, lo), bisect.bisect_left(present, hi) - 1
                if first <= last:
                    lo, hi = present[first], present[last] + 1
            blocks.append((q0, q1, lo, hi))
        return _if_skipping_enough(blocks, self.length, self.length, not self.two_sided)

    def row_valid(self) -> torch.Tensor | None:
        """bool `[b, 1, q, 1]`: receivers with at least one unpadded sender in their window; None if all have one."""
        if self.padding is None:
            return None
        seen = torch.nn.functional.pad(self.padding.long().cumsum(-1), (1, 0))  # [b, kv + 1]: tokens before index
        i = torch.arange(self.length, device=self.device)
        if self.two_sided:
            lo, hi = (i - self.previous).clamp(min=0), (i + self.previous + 1).clamp(max=self.length)
        else:
            lo, hi = (i - self.previous).clamp(min=0), i + 1
        valid = (seen[:, hi] - seen[:, lo] > 0)[:, None, :, None]
        return None if bool(valid.all()) else valid


def _sliding_window_without_dense_mask(previous: int, two_sided: bool, inputs_embeds, attention_mask, cache,
                                       position_ids) -> AttentionMask | None:
    """A long sliding window of one forward without cache content, as a `SlidingWindow` (no `n x n` mask), when its
    receiver blocks skip enough work; None where Transformers' mask builder must decide (a cache with tokens,
    packed sequences told by `position_ids`, a 4-D mask, `torch.compile`)."""
    q_len = inputs_embeds.shape[1]
    if q_len < 2 * RECEIVER_BLOCK or torch.compiler.is_compiling():
        return None
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != q_len):
        return None
    if cache is not None and (getattr(cache, "is_compileable", False)
                                        or cache.get_seq_length() > 0):
        return None
    if position_ids is not None and attention_mask is None and cache is None and not two_sided:
        return None  # (Transformers reads packed sequences from the positions)
    window_mask = SlidingWindow(previous, two_sided, attention_mask, q_len, inputs_embeds.device)
    blocks = window_mask.receiver_blocks()
    if blocks is None:
        return None
    return AttentionMask(None, window_mask.row_valid(), not two_sided, receiver_blocks=blocks, window=window_mask)


def _with_row_validity(mask: torch.Tensor | None, is_causal: bool, block_mask=None,
                       receiver_blocks: bool = True) -> AttentionMask:
    if mask is None or not isinstance(mask, torch.Tensor):
        return AttentionMask(None, None, is_causal, block_mask)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    # a tensor for the BlockMask (a user's 4-D mask, which Transformers hands on for FlexAttention too; a mask built
    # ahead or rotated to a ring's slots): FlexAttention heads get the BlockMask of `mask`, read as attend / not attend
    if isinstance(block_mask, torch.Tensor):
        block_mask = _block_mask_of(allowed)
    row_valid = allowed.any(dim=-1, keepdim=True)
    blocks = _receiver_blocks(allowed, is_causal) if receiver_blocks and mask.dtype == torch.bool else None
    if not torch.compiler.is_compiling() and bool(row_valid.all()):
        return AttentionMask(mask, None, is_causal, block_mask, blocks)
    # let isolated receivers attend everywhere (finite kernels), their output is zeroed by the caller
    if mask.dtype == torch.bool:
        mask = mask | ~row_valid
    else:
        mask = mask.masked_fill(~row_valid, 0.0)
    return AttentionMask(mask, row_valid, is_causal, block_mask, blocks)


class MaskBuilderConfig:
    """What Transformers' mask builders (`masking_utils`) read of a config, and nothing else: the implementation
    whose mask format is wanted, the causal flag and the window of sliding-window masks (Transformers' convention,
    `transformers_window`)."""

    def __init__(self, attn_implementation: str, sliding_window: int | None = None):
        self._attn_implementation, self.sliding_window, self.is_causal = attn_implementation, sliding_window, True


def _block_mask_of(allowed: torch.Tensor):
    """The FlexAttention `BlockMask` of a bool mask `[b|1, 1, q, kv]`."""
    batch = allowed.shape[0]

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return allowed[batch_idx if batch > 1 else 0, 0, q_idx, kv_idx]

    return create_block_mask(mask_mod, batch, None, *allowed.shape[-2:], device=allowed.device)


def uses_flex_attention(config) -> bool:
    """Whether some heads run FlexAttention (then masks also come as `BlockMask`s)."""
    return "flex_attention" in (config._attn_implementation, getattr(config, "relational_attn_implementation", None))


def _both_formats(create, config, sliding_window=None, **kwargs):
    """(dense mask, BlockMask or None) from a `masking_utils` mask function."""
    dense = create(config=MaskBuilderConfig("sdpa", sliding_window), **kwargs)
    block = None
    if uses_flex_attention(config):
        block = create(config=MaskBuilderConfig("flex_attention", sliding_window), **kwargs)
    return dense, block


def build_attention_mask(
    bias: str,
    config,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache=None,
    position_ids: torch.Tensor | None = None,
    graph_adjacency: torch.Tensor | None = None,
    causal: bool = True,
    receiver_blocks: bool = True,
) -> AttentionMask:
    """Build the mask of one relational bias (its registry entry, `relational_biases.py`, says how). `causal`
    intersects every bias with the causal order (decoders); `receiver_blocks=False` skips finding the blocks of
    receivers (a mask built ahead, whose blocks are not kept)."""
    entry = relational_bias(bias)
    if entry.cross:
        raise ValueError(f"{bias!r} is a cross-attention graph: `build_cross_attention_mask` builds it.")
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.bool()
    ordered = is_ordered(bias, causal)
    if entry.window:
        # Transformers' own window masks (index arithmetic), in their convention; the causal order keeps one side
        two_sided = not ordered
        create = create_bidirectional_sliding_window_mask if two_sided else create_sliding_window_causal_mask
        previous = config.sliding_window_size
        window = transformers_window(previous, two_sided)
        inputs = dict(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **cache_kwargs(cache),
                      **({} if two_sided else {"position_ids": position_ids}))
        blockwise = _sliding_window_without_dense_mask(previous, two_sided, inputs_embeds, attention_mask,
                                                       cache, position_ids) if receiver_blocks else None
        if blockwise is not None:
            if uses_flex_attention(config):  # FlexAttention heads skip the masked blocks with a BlockMask
                blockwise.block_mask = create(config=MaskBuilderConfig("flex_attention", window), **inputs)
            return blockwise
        dense, block = _both_formats(create, config, window, **inputs)
        ring = ring_layer(cache)  # (a one-token step over a ring cache: its keys in slot order)
        if ring is not None and dense is not None and (in_slots := ring.to_slots(dense)) is not dense:
            dense, block = in_slots, None if block is None else in_slots
        return _with_row_validity(dense, is_causal=ordered, block_mask=block, receiver_blocks=receiver_blocks)
    and_fn = None if entry.mask_function is None else entry.mask_function(
        config, inputs_embeds.device, attention_mask=attention_mask, graph_adjacency=graph_adjacency)
    if ordered:
        masks = _both_formats(create_causal_mask, config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                              **cache_kwargs(cache), position_ids=position_ids, and_mask_function=and_fn)
    else:
        masks = _both_formats(create_bidirectional_mask, config, inputs_embeds=inputs_embeds,
                              attention_mask=attention_mask, **cache_kwargs(cache),
                              and_mask_function=and_fn)
    return _with_row_validity(*masks[:1], is_causal=ordered, block_mask=masks[1], receiver_blocks=receiver_blocks)


def build_cross_attention_mask(config, inputs_embeds, encoder_hidden_states, encoder_attention_mask) -> AttentionMask:
    """The bipartite graph of encoder-decoder attention (`CROSS_ATTENTION_BIAS`): every target token to every
    unpadded source token."""
    if encoder_attention_mask is not None and encoder_attention_mask.dtype != torch.bool:
        encoder_attention_mask = encoder_attention_mask.bool()
    dense, block = _both_formats(create_bidirectional_mask, config, inputs_embeds=inputs_embeds,
                                 attention_mask=encoder_attention_mask, encoder_hidden_states=encoder_hidden_states)
    return _with_row_validity(dense, is_causal=relational_bias(CROSS_ATTENTION_BIAS).ordered, block_mask=block)


def prebuilt_masks(masks: dict, biases, causal=True, flex=False) -> dict[str, AttentionMask]:
    """`{bias: dense mask or None}` built ahead (by `create_masks_for_generate` for a compiled decoding step) ->
    `{bias: AttentionMask}`; with `flex` (FlexAttention heads) each mask also becomes a `BlockMask`, here (inside
    the compiled step: Transformers hands the dict's values over as tensors)."""
    missing = set(biases) - set(masks)
    if missing:
        raise ValueError(f"`attention_mask` as a dict must hold a mask for every relational bias; missing {missing}.")
    return {bias: _with_row_validity(masks[bias], is_causal=is_ordered(bias, causal),
                                     block_mask=masks[bias] if flex else None) for bias in dict.fromkeys(biases)}


def paged_masks(attention_mask, biases) -> dict[str, AttentionMask]:
    """Continuous batching's masks -> `{bias: AttentionMask}`. The manager builds one additive mask `[1, 1, M, N]`
    per cache layer type (a dict `{layer type: mask}` when the model has both): each request's new tokens over the
    tokens the paged cache reads back for it, in causal order (and its sliding window); 0 where it attends. Each bias
    takes the mask of its layer type (`RelationalBias.layer_type`)."""
    if attention_mask is None:
        raise ValueError("Continuous batching gave no attention mask: DAT's heads run with 'sdpa' or 'eager' "
                         "(`attn_implementation`), for which Transformers' manager builds one.")
    masks = {}
    for bias in dict.fromkeys(biases):
        mask = attention_mask[relational_bias(bias).layer_type] if isinstance(attention_mask, dict) else attention_mask
        # as bool (what the compiled kernels take); receiver blocks skip the senders of other requests (with fewer
        # receivers than two blocks, one block would span every request's senders: not looked for, e.g. in a
        # decoding step)
        masks[bias] = _with_row_validity(mask if mask.dtype == torch.bool else mask == 0, is_causal=False,
                                         receiver_blocks=mask.shape[-2] >= 2 * RECEIVER_BLOCK)
    return masks


def prebuildable(mask: AttentionMask) -> torch.Tensor | None:
    """What `create_masks_for_generate` hands over for one bias: the dense mask, or, where the causal order is
    implicit (None) but FlexAttention heads need it, the explicit causal mask over the slots of the `BlockMask`."""
    if mask.mask is None and mask.block_mask is not None:
        q_len, kv_len = mask.block_mask.seq_lengths
        # Transformers leaves causal order implicit for one receiver (it sees every slot) and for a prefill into the
        # first slots of a static cache (the later ones empty: receiver i at slot i, offset 0), or q = kv
        return mask.dense(q_len, kv_len, mask.block_mask.kv_num_blocks.device, offset=None if q_len == 1 else 0)
    return mask.mask


def build_masks(biases, config, inputs_embeds, attention_mask, cache=None, position_ids=None,
                graph_adjacency=None, causal=True, receiver_blocks=True) -> dict[str, AttentionMask]:
    """Build every distinct bias used by a model once per forward: {bias name: AttentionMask}."""
    return {
        bias: build_attention_mask(bias, config, inputs_embeds, attention_mask, cache, position_ids,
                                   graph_adjacency, causal, receiver_blocks)
        for bias in dict.fromkeys(biases)
    }


__all__ = ["AttentionMask", "SlidingWindow", "build_attention_mask", "build_cross_attention_mask",
           "build_masks", "causal_order", "paged_masks", "prebuildable", "prebuilt_masks"]
