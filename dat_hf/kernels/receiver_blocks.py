"""Receiver blocks and long sliding windows: the attention plan's fast path for sparse graphs, installed by
`import dat_hf` (the model files never import this module: remote code alone attends over whole masks, with the same
results).

- `blocks_of_mask`, the kernel of `masking_dat.find_receiver_blocks`: a bool mask's receivers in blocks of
  `RECEIVER_BLOCK`, each with the range of senders any of them may see, when that skips at least
  `MIN_SKIPPED_SHARE` of plain (causal or full) attention.
- `window_without_dense_mask`, the kernel of `masking_dat.long_window_mask`: a long sliding window without cache
  content as a `WindowMask` (its blocks, receiver blocks and isolated receivers in O(n * window), no `n x n` mask).
- `ReceiverBlocks`: what the plan's entries installed by `plan_entries.py` add to attend block by block over such
  masks (one call per block of receivers, over the senders any of them may see).
"""

import bisect

import torch
from transformers.masking_utils import sliding_window_bidirectional_mask_function, sliding_window_causal_mask_function

from ..attention_plan import KernelMask, mask_in_format
from ..kernel_hooks import register_kernel
from ..masking_dat import AttentionMask, transformers_window


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


# receivers per block; blocks are used when they skip at least this share of plain (causal or full) attention
RECEIVER_BLOCK = 256
MIN_SKIPPED_SHARE = 0.25


def blocks_of_mask(allowed: torch.Tensor, is_causal: bool, min_blocks: int = 1) -> tuple | None:
    """bool `[b|1, 1, q, kv]` -> ((q0, q1, kv0, kv1), ...) per `RECEIVER_BLOCK` receivers, or None when that
    would not skip `MIN_SKIPPED_SHARE` of the work or there are fewer than `min_blocks` blocks of receivers."""
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


def block(mask: AttentionMask, q0: int, q1: int, kv0: int, kv1: int) -> AttentionMask:
    """The mask of receivers [q0, q1) over senders [kv0, kv1) (explicit, so no implicit causal order)."""
    if isinstance(mask, WindowMask):
        return mask.block(q0, q1, kv0, kv1)
    row_valid = None if mask.row_valid is None else mask.row_valid[..., q0:q1, :]
    return AttentionMask(mask.mask[..., q0:q1, kv0:kv1], row_valid, False)


def window_without_dense_mask(previous: int, two_sided: bool, inputs_embeds, attention_mask,
                              position_ids) -> "WindowMask | None":
    """A long window over a forward's own tokens (no cached ones) as a `SlidingWindow`, or None where Transformers'
    builder must decide (packed sequences, a 4-D mask, `torch.compile`)."""
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


class ReceiverBlocks:
    """A plan entry (`attention_plan.PlannedAttention`) run block by block where its mask has receiver blocks:
    `blocks`, `(q0, q1, kv0, kv1, mask)` per block (the mask in the entry's format), or None."""

    def _kernel_mask(self, source: AttentionMask):
        self.blocks = None
        if self._blockable(source) and source.receiver_blocks is not None:
            fmt = "tensor" if self.mask_format == "window" else self.mask_format
            self.blocks = tuple((q0, q1, kv0, kv1, mask_in_format(block(source, q0, q1, kv0, kv1), fmt, q1 - q0,
                                                                  kv1 - kv0))
                                for q0, q1, kv0, kv1 in source.receiver_blocks)
            return None
        if self.mask_format == "window" and isinstance(source, WindowMask):  # the whole window to the kernel
            padding = source.window.padding
            return KernelMask(None if padding is None else padding[:, None, None, :], source.is_causal, source.window)
        return super()._kernel_mask(source)

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


def register() -> None:
    """Install the finder of receiver blocks and long windows into the mask builder's hooks (the plan's entries that
    attend over them: `plan_entries.py`)."""
    register_kernel("receiver_blocks", blocks_of_mask, lambda *args, **kwargs: True)
    register_kernel("long_window_mask", window_without_dense_mask, lambda *args, **kwargs: True)


__all__ = ["MIN_SKIPPED_SHARE", "RECEIVER_BLOCK", "ReceiverBlocks", "SlidingWindow", "WindowMask", "block",
           "blocks_of_mask", "cut", "register", "window_without_dense_mask"]
