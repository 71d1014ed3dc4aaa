# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational attention: the reference implementation, and the registry of named backends that compute the same.

For receiver i and relational head h (Altabaa & Lafferty, 2024):

    A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)                            messages   [b, q, h, d_h]
    a^h   = softmax(scaling (x W_q^h)(x W_k^h)^T + mask)                           weights    [b, h, q, kv]
    r(x_i, x_j)_l = act(relation_scaling <x_i W_{q,l}^rel, x_j W_{k,l}^rel>)       relations  [b, R, q, kv]

Every backend (an entry of the one registry's `relational` table, `kernel_hooks.BACKENDS`) has the signature of
`eager_relational_attention`, takes its mask in its declared format under the mask rule (`masking_dat.AttentionMask`),
and returns (messages, weights or None, relations or None).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .kernel_hooks import BACKENDS
from .masking_dat import AttentionMask, receiver_positions
from .sensory_attention import repeat_kv

# the reference's receiver blocks keep scores and relations below this many elements
BLOCK_ELEMENTS = 1 << 22


def relational_output(attended_symbols, attended_relations, relation_proj, dtype=None):
    """Attended symbols `[b, q, h, d_h]` + attended relations `[b, q, h, R]` @ W_r `[h, d_h, R]` (in `dtype`)
    -> messages `[b, q, h, d_h]`."""
    weight = relation_proj if dtype is None else relation_proj.to(dtype)
    return attended_symbols + torch.einsum("bqhr,hdr->bqhd", attended_relations, weight)


class RelationalSpec(NamedTuple):
    """A relational backend's non-tensor inputs (also the `module` the fused backends hand attention functions)."""

    num_key_value_groups: int  # query heads per key/value head (GQA)
    scaling: float  # of the attention scores, d_h^-1/2
    relation_scaling: float  # of the relations, d_r^-1/2
    relation_act: Callable | None  # None: identity (the released LMs)


class RelativeSymbols(NamedTuple):
    """Rows of the relative symbol table `[2K + 1, h, d_h]`: `clip(j - p_i, -K, K) + K` (p_i the receiver's index
    among the keys), or `index[i, j]` when given."""

    clip: int  # K (`max_relative_position`)
    offset: torch.Tensor | int | None = None  # the first receiver's index among the keys (default kv - q)
    ring: int | None = None  # keys in a ring of that many slots: offsets known modulo the ring
    index: torch.Tensor | None = None  # long [q, kv]

    def rows(self, start: int, end: int, q_len: int, kv_len: int, device) -> torch.Tensor:
        """Receivers [start, end) over the first `kv_len` keys -> long `[end - start, kv]`."""
        if self.index is not None:
            return self.index[start:end, :kv_len].to(device)
        offsets = torch.arange(kv_len, device=device)[None, :] - receiver_positions(q_len, kv_len, device,
                                                                                    self.offset, start, end)[:, None]
        if self.ring is not None:  # exact for senders at most `ring - 1` back
            offsets = -((-offsets) % self.ring)
        return offsets.clamp(-self.clip, self.clip) + self.clip


# ---- the reference ---------------------------------------------------------------------------------------------
def eager_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                               attention_mask: AttentionMask, spec: RelationalSpec, dropout: float = 0.0,
                               output_attentions: bool = False, symbols_at: RelativeSymbols | None = None):
    """Relational attention with explicit weights, one checkpointed block of receivers at a time.

    query `[b, h, q, d_h]`, key `[b, h_kv, kv, d_h]`, symbol values `[b|1, h_kv, kv, d_h]` (or the table
    `[P, h_kv, d_h]` with `symbols_at`), relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`, W_r
    `[h, d_h, R]`, an `AttentionMask` -> messages `[b, q, h, d_h]`, weights `[b, h, q, kv]` and relations
    `[b, R, q, kv]` (both None without `output_attentions`).
    """
    b, h, q_len, _ = query.shape
    kv_len, num_relations = key.shape[2], relation_queries.shape[2]
    key = repeat_kv(key, spec.num_key_value_groups)
    symbol_values = per_head_symbols(symbol_values, spec.num_key_value_groups, b)
    block = q_len if output_attentions else max(1, min(q_len, BLOCK_ELEMENTS // (b * (h + num_relations) * kv_len)))
    checkpointed = torch.is_grad_enabled() and query.requires_grad and block < q_len
    outputs = []
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        args = (query[:, :, start:end], key, symbol_values, relation_queries[:, start:end], relation_keys,
                relation_proj, attention_mask.dense(q_len, kv_len, query.device, start, end),
                None if symbols_at is None else symbols_at.rows(start, end, q_len, kv_len, query.device), spec,
                dropout)
        if checkpointed:
            outputs.append(torch.utils.checkpoint.checkpoint(_attend_block, *args, use_reentrant=False))
        else:
            outputs.append(_attend_block(*args))
    messages, weights, relations = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1 if i == 0 else 2)
                                    for i, parts in enumerate(zip(*outputs)))
    return (messages, weights, relations) if output_attentions else (messages, None, None)


def _attend_block(query, key, symbol_values, q_rel, k_rel, relation_proj, mask, symbol_index, spec, dropout):
    """One block of m receivers -> messages `[b, m, h, d_h]`, weights `[b, h, m, kv]`, relations `[b, R, m, kv]`."""
    weights, relations = relational_weights(query, key, q_rel, k_rel, mask, spec, dropout)
    return relational_messages(weights, relations, symbol_values, relation_proj, symbol_index), weights, relations


def relational_weights(query, key, relation_queries, relation_keys, mask, spec: RelationalSpec, dropout: float = 0.0):
    """query `[b, h, m, d_h]`, key `[b, h, kv, d_h]`, relation queries `[b, m, R, d_r]`, keys `[b, kv, R, d_r]`,
    mask None, bool or additive `[b|1, 1, m, kv]` -> weights `[b, h, m, kv]`, relations `[b, R, m, kv]`."""
    scores = torch.matmul(query, key.transpose(2, 3)) * spec.scaling
    if mask is not None:
        scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
                  else scores + mask)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = nn.functional.dropout(weights.to(query.dtype), p=dropout, training=dropout > 0)
    # r_l(x_i, x_j) = act(relation_scaling <q_rel,l(x_i), k_rel,l(x_j)>)
    relations = torch.einsum("bqrd,bkrd->brqk", relation_queries, relation_keys) * spec.relation_scaling
    if spec.relation_act is not None:
        relations = spec.relation_act(relations)
    return weights, relations


def relational_messages(weights, relations, symbol_values, relation_proj, symbol_index=None):
    """Weights `[b, h, m, kv]`, relations `[b, R, m, kv]`, symbol values `[b, h, kv, d_h]` (or the table
    `[P, h, d_h]` read at `symbol_index` `[m, kv]`), W_r `[h, d_h, R]` -> messages `[b, m, h, d_h]`."""
    attended_relations = torch.einsum("bhqk,brqk->bqhr", weights, relations)
    if symbol_index is None:
        attended_symbols = torch.matmul(weights, symbol_values).transpose(1, 2)  # [b, m, h, d_h]
    else:  # bin the weights by table row: no [m, kv, d_h] tensor
        binned = weights.new_zeros(*weights.shape[:3], symbol_values.shape[0])
        binned.scatter_add_(-1, symbol_index.expand_as(weights), weights)
        attended_symbols = torch.einsum("bhqp,phd->bqhd", binned, symbol_values)
    return relational_output(attended_symbols, attended_relations, relation_proj, weights.dtype)


def per_head_symbols(symbol_values, groups: int, batch_size: int):
    """`[b|1, h_kv, kv, d_h]` -> `[b, h, kv, d_h]`, or the table `[P, h_kv, d_h]` -> `[P, h, d_h]`."""
    if symbol_values.dim() == 3:
        return symbol_values.repeat_interleave(groups, dim=1)
    return repeat_kv(symbol_values, groups).expand(batch_size, -1, -1, -1)


# ---- the registry ----------------------------------------------------------------------------------------------
class RelationalCall(NamedTuple):
    """What a backend needs to know to say whether it can run a call (one per bias and forward)."""

    device: str  # "cpu", "cuda", ...
    dtype: torch.dtype  # of the queries (the autocast dtype under autocast)
    query_length: int
    requires_grad: bool  # gradients will flow through the attention
    output_attentions: bool
    relation_activation: str
    relative_symbols: bool
    dropout: float
    mask: AttentionMask
    autocast: bool
    compiling: bool  # inside `torch.compile` tracing

    @classmethod
    def of_forward(cls, query_like: torch.Tensor, query_length: int, requires_grad: bool, output_attentions: bool,
                   relation_activation: str, relative_symbols: bool, dropout: float,
                   mask: AttentionMask) -> "RelationalCall":
        """The call of every layer of one forward over `mask`."""
        device = query_like.device.type
        autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
        dtype = torch.get_autocast_dtype(device) if autocast else query_like.dtype
        return cls(device, dtype, query_length, requires_grad, output_attentions, relation_activation,
                   relative_symbols, dropout, mask, autocast, torch.compiler.is_compiling())


class RelationalBackendUnavailable(RuntimeError):
    """A backend's kernel failed to compile or launch: the plan falls back to the next one unless requested."""


# the relational heads' backends: the one registry's `relational` table (`kernel_hooks.BACKENDS`)
RELATIONAL_ATTENTION_FUNCTIONS = BACKENDS.of("relational")
RELATIONAL_ATTENTION_FUNCTIONS.register("eager", eager_relational_attention, lambda call: None,
                                        mask_format="reference")


def _candidates(attn_implementation: str | None, call: RelationalCall) -> list[str]:
    """Backends in automatic selection's order (decoding steps skip the fused values; no compiled ones in export)."""
    if attn_implementation == "eager":
        return ["eager"]
    compiled = [name for name, backend in RELATIONAL_ATTENTION_FUNCTIONS.items() if call.device in backend.preferred_on
                and not torch.compiler.is_exporting()]
    if call.query_length == 1:
        names = compiled + ["eager"]
    else:
        names = (["flex_attention"] if attn_implementation == "flex_attention" else []) + compiled + ["sdpa", "eager"]
    return [name for name in names if (name, call.device) not in RELATIONAL_ATTENTION_FUNCTIONS.unavailable]


def select_relational_attention(call: RelationalCall, requested: str | None, attn_implementation: str | None) -> str:
    """The backend for `call`: `requested` (ValueError if it cannot run it), `eager` for weights, else the first
    supporting candidate."""
    if requested is not None:
        reason = RELATIONAL_ATTENTION_FUNCTIONS.backend(requested).supports(call)
        if reason is not None:
            raise ValueError(f"`relational_attn_implementation={requested!r}` cannot run this call: {reason}.")
        return requested
    if call.output_attentions:
        return "eager"
    return next(name for name in _candidates(attn_implementation, call) if name in RELATIONAL_ATTENTION_FUNCTIONS
                and RELATIONAL_ATTENTION_FUNCTIONS[name].supports(call) is None)


__all__ = ["RELATIONAL_ATTENTION_FUNCTIONS", "RelationalBackendUnavailable", "RelationalCall", "RelationalSpec",
           "RelativeSymbols", "eager_relational_attention", "per_head_symbols", "relational_messages",
           "relational_output", "relational_weights", "repeat_kv", "select_relational_attention"]
