# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational inductive biases as attention masks (one small mask library for every DAT model).

Each bias is an attention graph (receiver i may attend to sender j), as in "On the relational inductive biases of
attention": `full` (complete graph), `causal` (total order), `sliding_window` (the p previous tokens and itself),
`sliding_window_bidirectional` (|i - j| <= p), `sparse` (a fixed graph from the config: local blocks plus global
tokens, or explicit edges) and `graph` (an adjacency given with each input). Encoder-decoder cross-attention is the
bipartite graph `bipartite` (every target token to every unpadded source token).

Masks are built once per forward with Transformers' `masking_utils`, always in one dense form (None when nothing is
masked or plain causal order applies, else bool `[b, 1, q, kv]`; every backend and the eager functions take it),
plus a `BlockMask` for FlexAttention when the model uses it (masked blocks are then skipped), together with
`row_valid`, which marks receivers that have at least one sender. Rows without senders are unmasked in the dense
form (no NaN) and their output is zeroed.
"""

from typing import NamedTuple

import torch
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask


class AttentionMask(NamedTuple):
    """One relational bias as the attention functions take it, plus which receivers have any sender.

    mask: None (no masking, or plain causal order when `is_causal`: receiver i at position kv - q + i sees senders
        up to there), bool `[b|1, 1, q, kv]` (True = attend) or, from a user's 4-D mask, additive float.
    row_valid: None (every receiver has a sender) or bool `[b, 1, q, 1]`.
    is_causal: whether a None mask means causal.
    block_mask: the same graph as a FlexAttention `BlockMask` (only when the model uses `flex_attention`).
    """

    mask: torch.Tensor | None
    row_valid: torch.Tensor | None
    is_causal: bool
    block_mask: object = None

    def dense(self, q_len: int, kv_len: int, device, start: int = 0, end: int | None = None):
        """The mask of receivers [start, end) (default: all) as an explicit tensor for code that forms its own scores:
        bool (True = attend) or additive float `[b|1, 1, m, kv]`; None when nothing is masked."""
        end = q_len if end is None else end
        if self.mask is not None:
            return self.mask if self.mask.shape[-2] == 1 else self.mask[..., start:end, :]
        if not self.is_causal:
            return None
        # receiver i sits at position kv_len - q_len + i (after a cache) and sees senders up to there
        positions = torch.arange(start, end, device=device)[:, None] + (kv_len - q_len)
        return (torch.arange(kv_len, device=device)[None, :] <= positions)[None, None]


def _window_function(window: int, two_sided: bool):
    def window_fn(batch_idx, head_idx, q_idx, kv_idx):
        distance = q_idx - kv_idx
        if two_sided:
            return (distance <= window) & (distance >= -window)
        return distance <= window

    return window_fn


def _token_positions(attention_mask):
    """Each token's index among the real tokens of its row (`[b, kv]`), so that padding does not move a fixed graph;
    None without a 2-D padding mask (cache indices are then the positions)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _sparse_function(config, device, positions=None):
    """The fixed `sparse` graph over token positions (real tokens only: padding never shifts it)."""
    block, n_global = config.sparse_block_size, config.sparse_global_tokens
    edges = None
    # CODEPATH: no released checkpoint; dat_hf's `sparse` relational bias given as an explicit edge list (else local
    # blocks and global tokens only).
    if config.sparse_edges:
        size = max(max(e) for e in config.sparse_edges) + 1
        edges = torch.zeros(size, size, dtype=torch.bool, device=device)
        index = torch.tensor(config.sparse_edges, device=device)
        edges[index[:, 0], index[:, 1]] = True

    def sparse_fn(batch_idx, head_idx, q_idx, kv_idx):
        if positions is not None:
            q_idx, kv_idx = positions[batch_idx, q_idx], positions[batch_idx, kv_idx]
        allowed = q_idx == kv_idx
        if block is not None:
            allowed = allowed | (torch.div(q_idx, block, rounding_mode="floor") == torch.div(kv_idx, block, rounding_mode="floor"))
        if n_global > 0:
            allowed = allowed | (q_idx < n_global) | (kv_idx < n_global)
        if edges is not None:
            n = edges.shape[0]
            inside = (q_idx < n) & (kv_idx < n)
            allowed = allowed | (inside & edges[q_idx.clamp(max=n - 1), kv_idx.clamp(max=n - 1)])
        return allowed

    return sparse_fn


def _graph_function(adjacency: torch.Tensor):
    def graph_fn(batch_idx, head_idx, q_idx, kv_idx):
        return adjacency[batch_idx, q_idx, kv_idx]

    return graph_fn


def check_graph_adjacency(adjacency, batch_size: int, seq_len: int):
    if adjacency is None:
        raise ValueError("`relational_bias='graph'` needs `graph_adjacency`, a bool tensor [batch, n, n].")
    if adjacency.dtype != torch.bool:
        raise ValueError(f"`graph_adjacency` must be a bool tensor, got dtype {adjacency.dtype}.")
    if tuple(adjacency.shape) != (batch_size, seq_len, seq_len):
        raise ValueError(
            f"`graph_adjacency` must have shape [batch, n, n] = {[batch_size, seq_len, seq_len]}, "
            f"got {list(adjacency.shape)}."
        )


def _with_row_validity(mask: torch.Tensor | None, is_causal: bool, block_mask=None) -> AttentionMask:
    if mask is None or not isinstance(mask, torch.Tensor):
        return AttentionMask(None, None, is_causal, block_mask)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    row_valid = allowed.any(dim=-1, keepdim=True)
    if not torch.compiler.is_compiling() and bool(row_valid.all()):
        return AttentionMask(mask, None, is_causal, block_mask)
    # let isolated receivers attend everywhere (finite kernels), their output is zeroed by the caller
    if mask.dtype == torch.bool:
        mask = mask | ~row_valid
    else:
        mask = mask.masked_fill(~row_valid, 0.0)
    return AttentionMask(mask, row_valid, is_causal, block_mask)


class _MaskFormat:
    """A config as `masking_utils` reads it, with the attention implementation whose mask format is wanted."""

    def __init__(self, config, attn_implementation: str):
        self._config = config
        self._attn_implementation = attn_implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


def uses_flex_attention(config) -> bool:
    """Whether some heads run FlexAttention (then masks also come as `BlockMask`s)."""
    return "flex_attention" in (config._attn_implementation, getattr(config, "relational_attn_implementation", None))


def _both_formats(create, config, **kwargs):
    """(dense mask, BlockMask or None) from a `masking_utils` mask function."""
    dense = create(config=_MaskFormat(config, "sdpa"), **kwargs)
    block = create(config=_MaskFormat(config, "flex_attention"), **kwargs) if uses_flex_attention(config) else None
    return dense, block


def build_attention_mask(
    bias: str,
    config,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values=None,
    position_ids: torch.Tensor | None = None,
    graph_adjacency: torch.Tensor | None = None,
    causal: bool = True,
) -> AttentionMask:
    """Build the mask of one relational bias. `causal` intersects every bias with the causal order (decoders)."""
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.bool()
    and_fn = None
    if bias in ("sliding_window", "sliding_window_bidirectional"):
        and_fn = _window_function(config.sliding_window_size, two_sided=bias == "sliding_window_bidirectional")
    elif bias == "sparse":
        and_fn = _sparse_function(config, inputs_embeds.device, _token_positions(attention_mask))
    elif bias == "graph":
        and_fn = _graph_function(graph_adjacency)
    elif bias not in ("full", "causal"):
        raise ValueError(f"Unknown relational bias {bias!r}.")
    # `causal` and `sliding_window` are ordered graphs in any model (also bidirectional encoders)
    ordered = bias in ("causal", "sliding_window") or (causal and bias != "full")
    if ordered:
        masks = _both_formats(create_causal_mask, config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                              past_key_values=past_key_values, position_ids=position_ids, and_mask_function=and_fn)
    else:
        masks = _both_formats(create_bidirectional_mask, config, inputs_embeds=inputs_embeds,
                              attention_mask=attention_mask, past_key_values=past_key_values,
                              and_mask_function=and_fn)
    return _with_row_validity(*masks[:1], is_causal=ordered, block_mask=masks[1])


def build_cross_attention_mask(config, inputs_embeds, encoder_hidden_states, encoder_attention_mask) -> AttentionMask:
    """The bipartite graph of encoder-decoder attention: every target token to every unpadded source token."""
    if encoder_attention_mask is not None and encoder_attention_mask.dtype != torch.bool:
        encoder_attention_mask = encoder_attention_mask.bool()
    dense, block = _both_formats(create_bidirectional_mask, config, inputs_embeds=inputs_embeds,
                                 attention_mask=encoder_attention_mask, encoder_hidden_states=encoder_hidden_states)
    return _with_row_validity(dense, is_causal=False, block_mask=block)


def build_masks(biases, config, inputs_embeds, attention_mask, past_key_values=None, position_ids=None,
                graph_adjacency=None, causal=True) -> dict[str, AttentionMask]:
    """Build every distinct bias used by a model once per forward: {bias name: AttentionMask}."""
    return {
        bias: build_attention_mask(bias, config, inputs_embeds, attention_mask, past_key_values, position_ids,
                                   graph_adjacency, causal)
        for bias in dict.fromkeys(biases)
    }


__all__ = ["AttentionMask", "build_attention_mask", "build_cross_attention_mask", "build_masks",
           "check_graph_adjacency"]
