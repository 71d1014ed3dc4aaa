"""Continuous batching's paged cache read without a copy, installed by `import dat_hf` (the model files never import
this module: remote code alone joins the two halves it reads back, `cache_dat.paged_views`, with the same results).

A layer's packed token (`PackedCache`: keys | sensory values | symbol values | relation keys) is stored zero-padded as
the key and value halves of Transformers' `PagedAttentionCache` (`PagedCache.update_packed`); every part is read back
as a strided view of the pages, except the one part that straddles the halves (joined, one small copy).
"""

from functools import lru_cache

import torch

from ..kernel_hooks import register_kernel


def _token_rows(read: torch.Tensor):
    """A half read back, `[1, heads, N, d]` -> (tensor with each token's `heads * d` elements contiguous, token
    stride, token 0's storage offset)."""
    if read.stride(3) != 1 or read.stride(1) != read.shape[3]:
        read = read.transpose(1, 2).contiguous().transpose(1, 2)
    return read, read.stride(2), read.storage_offset()


@lru_cache(maxsize=None)
def paged_layout(widths: tuple[int, ...], head_dim: int) -> tuple[int, int, tuple]:
    """A packed token of parts `widths` in the cache's two halves -> (heads, zero padding, per part (half, start,
    end), or (None, start in the first half, end in the second) for the part across them)."""
    width = sum(widths)
    heads = -(-width // (2 * head_dim))
    half, pieces, start = heads * head_dim, [], 0
    for part in widths:
        end = start + part
        if end <= half:
            pieces.append((0, start, end))
        elif start >= half:
            pieces.append((1, start - half, end - half))
        else:
            pieces.append((None, start, end - half))
        start = end
    return heads, 2 * half - width, tuple(pieces)


def paged_views_without_copy(packed, halves, widths: tuple) -> tuple:
    """The kernel of `cache_dat.paged_views`: the halves `[1, heads, N, d_h]` -> keys per head type
    `[1, h_kv, N, d_h]` and values as `packed.views` gives them, strided views of the pages (except the part across
    the halves)."""
    d = packed.head_dim
    heads, _, pieces = paged_layout(widths, d)
    half = heads * d
    read = [_token_rows(part) for part in halves]
    n = read[0][0].shape[2]
    # per part: (element offset, heads; 0: relation keys), keys one per head type
    part_views = [[(sum(packed.key_heads[:i]) * d, h) for i, h in enumerate(packed.key_heads)]]
    part_views += [[(0, h)] for h in packed.value_heads]
    views = []
    for (h, start, end), width, offsets in zip(pieces, widths, part_views):
        if h is None:  # across the halves: both pieces, `[N, width]`
            (first, row0, at0), (second, row1, at1) = read
            base = torch.cat((first.as_strided((n, half - start), (row0, 1), at0 + start),
                              second.as_strided((n, end), (row1, 1), at1)), dim=-1)
            row, at = width, base.storage_offset()
        else:
            base, row, at = read[h]
            at += start
        for offset, heads in offsets:  # `[1, heads, N, d]`, or relation keys `[1, N, R, d_r]`
            size, stride = (((heads, n, d), (d, row, 1)) if heads else
                            ((n, *packed.relation_shape), (row, packed.relation_shape[1], 1)))
            views.append(base.as_strided((1, *size), (n * row, *stride), at + offset))
    return views[:len(packed.key_heads)], views[len(packed.key_heads):]


def register() -> None:
    """Install the paged cache's views without a copy into `cache_dat.paged_views`."""
    register_kernel("paged_views", paged_views_without_copy, lambda *args, **kwargs: True)


__all__ = ["paged_layout", "paged_views_without_copy", "register"]
