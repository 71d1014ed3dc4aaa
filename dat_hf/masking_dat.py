# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Attention masks of the relational biases (`relational_biases.py`), built once per forward with Transformers'
`masking_utils`: a dense mask (None or bool `[b, 1, q, kv]`), a FlexAttention `BlockMask` when needed, `row_valid`
(receivers with any sender), and the receiver blocks the plan attends block by block (`find_receiver_blocks`: those
of a sparse graph's dense mask; a long sliding window's from index arithmetic, `long_window_mask`, without a dense
`[q, kv]` mask).
"""

import bisect
import functools
import warnings

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import CppCompileError
from torch.nn.attention.flex_attention import create_block_mask
from transformers.masking_utils import (create_bidirectional_mask, create_bidirectional_sliding_window_mask,
                                        create_causal_mask, create_sliding_window_causal_mask,
                                        sliding_window_bidirectional_mask_function, sliding_window_causal_mask_function)

from .relational_biases import CROSS_ATTENTION_BIAS, is_ordered, mask_function_of, relational_bias
from .transformers_compat import attention_implementation, cache_kwargs


def receiver_offset(q_len: int, kv_len: int, offset=None):
    """The first receiver's index among the keys: `offset` if given (int or tensor), else `kv - q`."""
    return kv_len - q_len if offset is None else offset


def receiver_positions(q_len: int, kv_len: int, device, offset=None, start: int = 0, end: int | None = None):
    """Positions among the keys of receivers [start, end): `receiver_offset(...) + i` -> long `[end - start]`."""
    end = q_len if end is None else end
    return torch.arange(start, end, device=device) + receiver_offset(q_len, kv_len, offset)


def causal_order(q_len: int, kv_len: int, device, offset=None, start: int = 0, end: int | None = None):
    """Implicit causal order made explicit (rule 2): receivers [start, end) see senders j <= their position -> bool
    `[1, 1, end - start, kv]` (True = attend), or None when each sees every sender (e.g. a decoding step)."""
    first = receiver_offset(q_len, kv_len, offset)
    if isinstance(first, int) and first + start >= kv_len - 1:
        return None
    positions = receiver_positions(q_len, kv_len, device, offset, start, end)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= positions)[None, None]


class AttentionMask:
    """One relational bias as the attention functions take it, plus which receivers have any sender.

    The mask rule, which every backend follows (also for `attention_plan.KernelMask` and `mask_in_format`'s other
    formats; `tests/test_mask_rule.py` holds each backend to it):
    1. A given mask tensor is the whole graph (causal order, padding and bias): `is_causal` is then ignored.
    2. `is_causal` applies only to a None mask: receiver i sits at offset + i among the kv keys (offset = kv - q
       unless given, `receiver_offset`) and sees senders j <= offset + i. A None mask without it masks nothing.
    3. In the "window" format a sliding window over the whole sequence (`KernelMask.window`, a long window's
       `SlidingWindow`) stands for the mask: the graph is the window (one-sided: causal) and its padding, the
       `KernelMask`'s tensor.
    4. A receiver with no sender gets zeros: its row is opened (no NaN), marked in `row_valid`, and its output zeroed.
    A prefill into an empty static cache (q receivers, more slots) is trimmed to q = kv by the plan
    (`PlannedAttention.trims`), so rule 2 holds.

    mask: None, bool `[b|1, 1, q, kv]` (True = attend) or additive float (a user's 4-D mask).
    row_valid: None (every receiver has a sender) or bool `[b, 1, q, 1]`.
    is_causal: whether a None mask means causal order (rule 2).
    block_mask: the same graph as a FlexAttention `BlockMask` (only for `flex_attention`).
    receiver_blocks: None or `((q0, q1, kv0, kv1), ...)`: receiver blocks and the senders any of them may see
        (`find_receiver_blocks`).
    """

    def __init__(self, mask, row_valid, is_causal: bool, block_mask=None, receiver_blocks=None):
        self.mask, self.row_valid, self.is_causal = mask, row_valid, is_causal
        self.block_mask, self.receiver_blocks = block_mask, receiver_blocks

    def to(self, device, non_blocking: bool = False) -> "AttentionMask":
        """This mask on `device` (itself if already there), for accelerate's `device_map` hooks."""
        device = torch.device(device)
        held = (self.mask, self.row_valid, None if self.block_mask is None else self.block_mask.kv_num_blocks)
        if all(t is None or t.device == device for t in held):
            return self
        mask, row_valid = (None if t is None else t.to(device, non_blocking=non_blocking)
                           for t in (self.mask, self.row_valid))
        block_mask = None if self.block_mask is None else self.block_mask.to(device)  # (it takes no non_blocking)
        return AttentionMask(mask, row_valid, self.is_causal, block_mask, self.receiver_blocks)

    def rows_as_batch(self) -> "AttentionMask":
        """`[1, 1, q, kv]` -> `[q, 1, 1, kv]` (views): q rows of one receiver each (`per_request`)."""
        row_valid = None if self.row_valid is None else self.row_valid.transpose(0, 2)
        return AttentionMask(self.mask.transpose(0, 2), row_valid, False)

    @property
    def implicit(self) -> bool:
        """Whether nothing but `is_causal` describes the graph (no tensor, BlockMask or receiver blocks)."""
        return (self.mask is None and self.block_mask is None and self.row_valid is None
                and self.receiver_blocks is None)

    @property
    def masked(self) -> bool:
        """Whether a mask is given beyond the implicit causal order (False: `mask` is None)."""
        return self.mask is not None

    @property
    def bool_or_none(self) -> bool:
        """Whether `mask` is None or bool `[b|1, 1, q, kv]` (without building a window's dense mask)."""
        return self.mask is None or (self.mask.dtype == torch.bool and self.mask.dim() == 4
                                     and self.mask.shape[1] == 1)

    def block(self, q0: int, q1: int, kv0: int, kv1: int) -> "AttentionMask":
        """The mask of receivers [q0, q1) over senders [kv0, kv1) (explicit, so no implicit causal order)."""
        row_valid = None if self.row_valid is None else self.row_valid[..., q0:q1, :]
        return AttentionMask(self.mask[..., q0:q1, kv0:kv1], row_valid, False)

    def dense(self, q_len: int, kv_len: int, device, start: int = 0, end: int | None = None, offset=None):
        """Receivers [start, end) as an explicit mask, bool or additive `[b|1, 1, m, kv]`, or None when nothing is
        masked (rules 1 and 2; `offset` as `receiver_offset`)."""
        if self.mask is not None:
            return self.mask if self.mask.shape[-2] == 1 else self.mask[..., start:q_len if end is None else end, :]
        if not self.is_causal:
            return None
        return causal_order(q_len, kv_len, device, offset, start, end)


# receivers per block; blocks are used when they skip at least this share of plain (causal or full) attention
RECEIVER_BLOCK = 256
MIN_SKIPPED_SHARE = 0.25


def find_receiver_blocks(allowed: torch.Tensor, is_causal: bool, min_blocks: int = 1) -> tuple | None:
    """Receiver blocks of a bool mask `[b|1, 1, q, kv]` for the plan to attend block by block: ((q0, q1, kv0, kv1),
    ...) per `RECEIVER_BLOCK` receivers, with the senders any receiver of each block may see, or None when that would
    not skip `MIN_SKIPPED_SHARE` of plain attention or there are fewer than `min_blocks` blocks of receivers."""
    q_len, kv_len = allowed.shape[-2:]
    if torch.compiler.is_compiling() or not q_len or not kv_len:
        return None
    if min_blocks > 1 and q_len < min_blocks * RECEIVER_BLOCK:
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


class SlidingWindow:
    """A window of p = `previous` tokens (`|i - j| <= p` when two-sided) over `length` tokens, no cache, optional
    padding `[b, length]`: its blocks, receiver blocks and isolated receivers in O(n * window), no `n x n` mask."""

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
        """bool `[b|1, 1, q1 - q0, kv1 - kv0]`; rows False in `row_valid` `[b, 1, q1 - q0, 1]` are opened."""
        q = torch.arange(q0, q1, device=self.device)[:, None]
        kv = torch.arange(kv0, kv1, device=self.device)[None, :]
        allowed = self.function(None, None, q, kv)[None, None]
        if self.padding is not None:
            allowed = allowed & self.padding[:, None, None, kv0:kv1]
        return allowed if row_valid is None else allowed | ~row_valid

    def receiver_blocks(self) -> tuple | None:
        """As `blocks_of_mask` of the dense mask, from index arithmetic."""
        blocks = []
        present = None if self.padding is None else self.padding.any(0).nonzero().flatten().tolist()
        for q0 in range(0, self.length, RECEIVER_BLOCK):
            q1 = min(self.length, q0 + RECEIVER_BLOCK)
            lo, hi = self.senders(q0, q1)
            if present is not None:  # narrowed to the range's first and last token present in some row
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


class WindowMask(AttentionMask):
    """A `SlidingWindow` over the whole sequence as an `AttentionMask`: its dense `mask` is built only when asked for
    (the "window" mask format hands kernels the window itself), its blocks from index arithmetic."""

    def __init__(self, window: SlidingWindow, row_valid, is_causal: bool, block_mask=None, receiver_blocks=None):
        self.window, self._mask, self._blocks = window, None, {}
        super().__init__(None, row_valid, is_causal, block_mask, receiver_blocks)

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = self._allowed(0, self.window.length, 0, self.window.length)
        return self._mask

    @mask.setter
    def mask(self, mask):
        self._mask = mask

    implicit = False
    masked = True
    bool_or_none = True

    def _allowed(self, q0: int, q1: int, kv0: int, kv1: int) -> torch.Tensor:
        """The window's bool mask of receivers [q0, q1) over senders [kv0, kv1), isolated receivers open."""
        return self.window.allowed(q0, q1, kv0, kv1, None if self.row_valid is None else self.row_valid[..., q0:q1, :])

    def to(self, device, non_blocking: bool = False) -> "WindowMask":
        held = (self.row_valid, self.window.padding, None if self.block_mask is None else self.block_mask.kv_num_blocks)
        if all(t is None or t.device == torch.device(device) for t in held):
            return self
        row_valid = None if self.row_valid is None else self.row_valid.to(device, non_blocking=non_blocking)
        block_mask = None if self.block_mask is None else self.block_mask.to(device)
        return WindowMask(self.window.to(device, non_blocking), row_valid, self.is_causal, block_mask,
                          self.receiver_blocks)

    def dense(self, q_len: int, kv_len: int, device, start: int = 0, end: int | None = None, offset=None):
        return self._allowed(start, q_len if end is None else end, 0, kv_len)

    def block(self, q0: int, q1: int, kv0: int, kv1: int) -> AttentionMask:
        """As `block`, built once per forward (every layer's heads attend over the same blocks)."""
        key = (q0, q1, kv0, kv1)
        if key not in self._blocks:
            self._blocks[key] = self._allowed(*key)
        return AttentionMask(self._blocks[key], None if self.row_valid is None else self.row_valid[..., q0:q1, :],
                             False)


def long_window_mask(previous: int, two_sided: bool, inputs_embeds, attention_mask,
                     position_ids) -> "WindowMask | None":
    """A long sliding window of `previous` tokens (each side when `two_sided`) over a forward's own tokens (none
    cached) as a `WindowMask`, which builds no dense `[q, kv]` mask, or None where Transformers' builders make the
    dense mask (short inputs, packed sequences, a 4-D mask, `torch.compile`, too few blocks to skip)."""
    q_len = inputs_embeds.shape[1]
    if q_len < 2 * RECEIVER_BLOCK or torch.compiler.is_compiling():
        return None
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != q_len):
        return None
    if position_ids is not None and attention_mask is None and not two_sided:
        return None  # (Transformers reads packed sequences from the positions)
    window_mask = SlidingWindow(previous, two_sided, attention_mask, q_len, inputs_embeds.device)
    blocks = window_mask.receiver_blocks()
    if blocks is None:
        return None
    return WindowMask(window_mask, window_mask.row_valid(), not two_sided, receiver_blocks=blocks)


def transformers_window(previous: int, two_sided: bool) -> int:
    """dat_hf's window p (p previous tokens and itself, or p each side) -> Transformers' (p + 1, or p two-sided)."""
    return previous if two_sided else previous + 1


def with_row_validity(mask: torch.Tensor | None, is_causal: bool, block_mask=None,
                      min_blocks: int | None = 1) -> AttentionMask:
    """A built mask (None, bool or additive `[b|1, 1, q, kv]`) as an `AttentionMask`: isolated receivers' rows
    opened and marked (rule 4), a tensor given as the BlockMask converted, and the receiver blocks of a bool mask
    looked for when it may have at least `min_blocks` of them (None: not looked for)."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return AttentionMask(None, None, is_causal, block_mask)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    # a tensor as the BlockMask (a user's 4-D mask, a prebuilt or ring-rotated mask): convert it
    if isinstance(block_mask, torch.Tensor):
        block_mask = _block_mask_of(allowed)
    row_valid = allowed.any(dim=-1, keepdim=True)
    looked_for = min_blocks is not None and mask.dtype == torch.bool
    blocks = find_receiver_blocks(allowed, is_causal, min_blocks) if looked_for else None
    if not torch.compiler.is_compiling() and bool(row_valid.all()):
        return AttentionMask(mask, None, is_causal, block_mask, blocks)
    # open isolated receivers' rows (rule 4)
    if mask.dtype == torch.bool:
        mask = mask | ~row_valid
    else:
        mask = mask.masked_fill(~row_valid, 0.0)
    return AttentionMask(mask, row_valid, is_causal, block_mask, blocks)


class MaskBuilderConfig:
    """The config fields `masking_utils`' builders read: implementation, causal flag and window."""

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
    return "flex_attention" in (attention_implementation(config), getattr(config, "relational_attn_implementation", None))


def _both_formats(create, config, sliding_window=None, **kwargs):
    """(dense mask, BlockMask or None) from a `masking_utils` mask function. Where Inductor cannot build the C++ of
    Transformers' compiled `create_block_mask` (`CppCompileError`; PyTorch 2.13-2.14.1 over one key and several rows:
    a mask function's reads of a `[b, 1]` tensor, the sparse graph's positions or the padding, vectorized along the
    batch), the BlockMask is the dense mask, which `with_row_validity` converts without compiling (one warning)."""
    dense = create(config=MaskBuilderConfig("sdpa", sliding_window), **kwargs)
    block = None
    if uses_flex_attention(config):
        shape = tuple(dense.shape) if isinstance(dense, torch.Tensor) else None
        if shape in _UNCOMPILABLE_BLOCK_MASKS:  # (not compiled again: a failed build takes seconds)
            return dense, dense
        try:
            block = create(config=MaskBuilderConfig("flex_attention", sliding_window), **kwargs)
        except BackendCompilerFailed as error:  # (Inductor raises `InductorError`, the compile error inside)
            if not (isinstance(getattr(error, "inner_exception", None), CppCompileError) and shape is not None):
                raise
            _warn_block_mask_uncompiled()
            _UNCOMPILABLE_BLOCK_MASKS.add(shape)
            block = dense
    return dense, block


# the dense masks' shapes whose BlockMask Inductor failed to compile in this process (`_both_formats`)
_UNCOMPILABLE_BLOCK_MASKS: set[tuple] = set()


@functools.cache
def _warn_block_mask_uncompiled():
    warnings.warn("dat_hf: Inductor could not compile FlexAttention's BlockMask of a mask (CppCompileError: the C++ "
                  "it generated does not build); such BlockMasks are made from the dense mask, uncompiled (warned "
                  "once).", RuntimeWarning, stacklevel=3)


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
    """The mask of one relational bias. `causal`: intersect with causal order (decoders); `receiver_blocks=False`:
    no receiver blocks (a mask built ahead)."""
    entry = relational_bias(bias)
    if entry.cross:
        raise ValueError(f"{bias!r} is a cross-attention graph: `build_cross_attention_mask` builds it.")
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.bool()
    ordered = is_ordered(bias, causal)
    if not entry.window:  # a graph of pairs: its mask function with the causal or bidirectional builder
        and_fn = mask_function_of(entry, config, inputs_embeds.device, attention_mask=attention_mask,
                                  graph_adjacency=graph_adjacency)
        if ordered:
            masks = _both_formats(create_causal_mask, config, inputs_embeds=inputs_embeds,
                                  attention_mask=attention_mask, **cache_kwargs(cache), position_ids=position_ids,
                                  and_mask_function=and_fn)
        else:
            masks = _both_formats(create_bidirectional_mask, config, inputs_embeds=inputs_embeds,
                                  attention_mask=attention_mask, **cache_kwargs(cache),
                                  and_mask_function=and_fn)
        return with_row_validity(*masks[:1], is_causal=ordered, block_mask=masks[1],
                                 min_blocks=1 if receiver_blocks else None)
    # a window: Transformers' sliding-window builders (a long one over the forward's own tokens: no dense mask)
    two_sided = not ordered
    create = create_bidirectional_sliding_window_mask if two_sided else create_sliding_window_causal_mask
    previous = config.sliding_window_size
    window = transformers_window(previous, two_sided)
    inputs = dict(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **cache_kwargs(cache),
                  **({} if two_sided else {"position_ids": position_ids}))
    cached = cache is not None and (getattr(cache, "is_compileable", False) or cache.get_seq_length() > 0)
    blockwise = (long_window_mask(previous, two_sided, inputs_embeds, attention_mask, position_ids)
                 if receiver_blocks and not cached else None)
    if blockwise is not None:
        if uses_flex_attention(config):
            blockwise.block_mask = create(config=MaskBuilderConfig("flex_attention", window), **inputs)
        return blockwise
    dense, block = _both_formats(create, config, window, **inputs)
    # a one-token step over a ring cache (its sliding layers' `to_slots`, `cache_dat.RingSlidingWindowLayer`): keys
    # in slot order
    layer = next((layer for layer in getattr(cache, "layers", ()) if getattr(layer, "is_sliding", False)), None)
    to_slots = getattr(layer, "to_slots", None)
    if to_slots is not None and dense is not None and (in_slots := to_slots(dense)) is not dense:
        dense, block = in_slots, None if block is None else in_slots
    return with_row_validity(dense, is_causal=ordered, block_mask=block,
                             min_blocks=1 if receiver_blocks else None)


def build_cross_attention_mask(config, inputs_embeds, encoder_hidden_states, encoder_attention_mask) -> AttentionMask:
    """The bipartite cross-attention graph: every target token to every unpadded source token."""
    if encoder_attention_mask is not None and encoder_attention_mask.dtype != torch.bool:
        encoder_attention_mask = encoder_attention_mask.bool()
    dense, block = _both_formats(create_bidirectional_mask, config, inputs_embeds=inputs_embeds,
                                 attention_mask=encoder_attention_mask, encoder_hidden_states=encoder_hidden_states)
    return with_row_validity(dense, is_causal=relational_bias(CROSS_ATTENTION_BIAS).ordered, block_mask=block)


def prebuilt_masks(masks: dict, biases, causal=True, flex=False) -> dict[str, AttentionMask]:
    """`{bias: dense mask or None}` from `create_masks_for_generate` -> `{bias: AttentionMask}` (with `flex`, each
    also as a `BlockMask`). Raises ValueError if a bias is missing."""
    missing = set(biases) - set(masks)
    if missing:
        raise ValueError(f"`attention_mask` as a dict must hold a mask for every relational bias; missing {missing}.")
    return {bias: with_row_validity(masks[bias], is_causal=is_ordered(bias, causal),
                                     block_mask=masks[bias] if flex else None) for bias in dict.fromkeys(biases)}


def prebuildable(mask: AttentionMask) -> torch.Tensor | None:
    """What `create_masks_for_generate` hands over for one bias: the dense mask, or the explicit causal mask over
    the `BlockMask`'s slots where the order is implicit."""
    if mask.mask is None and mask.block_mask is not None:
        q_len, kv_len = mask.block_mask.seq_lengths
        # implicit: one receiver (sees every slot), or a prefill into a static cache's first slots (offset 0)
        return mask.dense(q_len, kv_len, mask.block_mask.kv_num_blocks.device, offset=None if q_len == 1 else 0)
    return mask.mask


def build_masks(biases, config, inputs_embeds, attention_mask, cache=None, position_ids=None,
                graph_adjacency=None, causal=True, receiver_blocks=True) -> dict[str, AttentionMask]:
    """`{bias: AttentionMask}` for every distinct bias, once per forward."""
    return {
        bias: build_attention_mask(bias, config, inputs_embeds, attention_mask, cache, position_ids,
                                   graph_adjacency, causal, receiver_blocks)
        for bias in dict.fromkeys(biases)
    }


__all__ = ["AttentionMask", "build_attention_mask", "build_cross_attention_mask",
           "build_masks", "causal_order", "prebuildable", "prebuilt_masks", "find_receiver_blocks",
           "long_window_mask", "with_row_validity", "MIN_SKIPPED_SHARE", "RECEIVER_BLOCK", "SlidingWindow",
           "WindowMask"]
