# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational attention: the reference implementation, and the registry of named backends that compute the same.

For receiver i and relational head h (Altabaa & Lafferty, 2024):

    A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)                            messages   [b, q, h, d_h]
    a^h   = softmax(scaling (x W_q^h)(x W_k^h)^T + mask)                           weights    [b, h, q, kv]
    r(x_i, x_j)_l = act(relation_scaling <x_i W_{q,l}^rel, x_j W_{k,l}^rel>)       relations  [b, R, q, kv]

Every backend has the signature of `eager_relational_attention`: tensors (queries and keys with RoPE applied, W_r), the
mask in the one format the backend declares (`RelationalBackend.mask_format`, see `attention_plan.mask_in_format`),
read under the one mask rule (`masking_dat.AttentionMask`: a given mask is the whole graph; `is_causal` applies to a
None mask only, receiver i at kv - q + i), and a frozen `RelationalSpec` (GQA groups, scalings, relation activation); it returns (messages, weights or None,
relations or None). Which backend runs which call is decided once per forward by the attention plan
(`attention_plan.py`, with `select_relational_attention` here): `config.relational_attn_implementation` when set (an
unsupported call then raises), else the fastest registered backend that supports the call (compiled kernels that
`dat_hf.kernels` registers for their device, then `config._attn_implementation`'s own, then `eager`).
A backend whose kernel fails to compile or launch raises `RelationalBackendUnavailable`; the plan then marks it
unavailable on that device type for the rest of the process, warns once naming the error and runs the next backend,
unless the backend was requested by `relational_attn_implementation` (the error is raised).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .masking_dat import AttentionMask, receiver_positions
from .sensory_attention import repeat_kv

# receivers per block of the reference are chosen so that one block's scores and relations stay below this many
# elements (memory linear in the sequence length)
BLOCK_ELEMENTS = 1 << 22


def relational_output(attended_symbols, attended_relations, relation_proj, dtype=None):
    """The one place of `A W_r`: A_i^h = sum_j a_ij s_j W_s^h + (sum_j a_ij r(x_i, x_j)) W_r^h, from the attended
    symbols `[b, q, h, d_h]` and attended relations `[b, q, h, R]`, with W_r `[h, d_h, R]` (in `dtype`, as given)
    -> messages `[b, q, h, d_h]`."""
    weight = relation_proj if dtype is None else relation_proj.to(dtype)
    return attended_symbols + torch.einsum("bqhr,hdr->bqhd", attended_relations, weight)


class RelationalSpec(NamedTuple):
    """What a relational backend needs of its heads besides tensors (frozen; one per `RelationalAttention`). It is
    also what the fused backends hand Transformers' attention functions as their `module`."""

    num_key_value_groups: int  # query heads per key/value head (GQA; named as Transformers' attention functions read it)
    scaling: float  # of the attention scores, d_h^-1/2
    relation_scaling: float  # of the relations, d_r^-1/2
    relation_act: Callable | None  # None: identity (the released LMs)


class RelativeSymbols(NamedTuple):
    """Where receivers read the position-relative symbol table `[2K + 1, h, d_h]`: pair (i, j) uses row
    `clip(j - p_i, -K, K) + K`, p_i the receiver's index among the keys (`receiver_positions`), or
    `index[i, j]` when given (precomputed rows, e.g. 2-D offsets on an image grid)."""

    clip: int  # K (`max_relative_position`)
    offset: torch.Tensor | int | None = None  # the first receiver's index among the keys (default kv - q)
    ring: int | None = None  # keys in a ring of that many slots: offsets known modulo the ring
    index: torch.Tensor | None = None  # long [q, kv]

    def rows(self, start: int, end: int, q_len: int, kv_len: int, device) -> torch.Tensor:
        """Rows of the table for receivers [start, end) over the first `kv_len` keys: long `[end - start, kv]`."""
        if self.index is not None:
            return self.index[start:end, :kv_len].to(device)
        offsets = torch.arange(kv_len, device=device)[None, :] - receiver_positions(q_len, kv_len, device,
                                                                                    self.offset, start, end)[:, None]
        if self.ring is not None:  # (exact for a sliding window's senders, at most `ring - 1` back)
            offsets = -((-offsets) % self.ring)
        return offsets.clamp(-self.clip, self.clip) + self.clip


# ---- the reference ---------------------------------------------------------------------------------------------
def eager_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                               attention_mask: AttentionMask, spec: RelationalSpec, dropout: float = 0.0,
                               output_attentions: bool = False, symbols_at: RelativeSymbols | None = None):
    """Relational attention with explicit weights and relations, one block of receivers at a time.

    query `[b, h, q, d_h]`, key `[b, h_kv, kv, d_h]`, symbol values `[b|1, h_kv, kv, d_h]` (or, with `symbols_at`,
    the position-relative table `[P, h_kv, d_h]`), relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`,
    W_r `[h, d_h, R]`, the mask as an `AttentionMask` (its dense rows are formed block by block, `AttentionMask.dense`:
    the mask rule) -> messages
    `[b, q, h, d_h]`, and with `output_attentions` the weights `[b, h, q, kv]` and relations `[b, R, q, kv]`. In
    training the blocks are recomputed in backward (activation checkpointing), so memory stays linear in the
    sequence length.
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
    """One block of m receivers (key and symbol values per query head): -> messages `[b, m, h, d_h]`, weights
    `[b, h, m, kv]`, relations `[b, R, m, kv]`."""
    weights, relations = relational_weights(query, key, q_rel, k_rel, mask, spec, dropout)
    return relational_messages(weights, relations, symbol_values, relation_proj, symbol_index), weights, relations


def relational_weights(query, key, relation_queries, relation_keys, mask, spec: RelationalSpec, dropout: float = 0.0):
    """Explicit attention weights and relations: query `[b, h, m, d_h]`, key `[b, h, kv, d_h]` (one per query head),
    relation queries `[b, m, R, d_r]` and keys `[b, kv, R, d_r]`, mask None, bool (True = attend) or additive
    `[b|1, 1, m, kv]` -> weights `[b, h, m, kv]` (after dropout), relations `[b, R, m, kv]`."""
    scores = torch.matmul(query, key.transpose(2, 3)) * spec.scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = nn.functional.dropout(weights.to(query.dtype), p=dropout, training=dropout > 0)
    # r_l(x_i, x_j) = act(relation_scaling <q_rel,l(x_i), k_rel,l(x_j)>)
    relations = torch.einsum("bqrd,bkrd->brqk", relation_queries, relation_keys) * spec.relation_scaling
    if spec.relation_act is not None:
        relations = spec.relation_act(relations)
    return weights, relations


def relational_messages(weights, relations, symbol_values, relation_proj, symbol_index=None):
    """A_i^h = sum_j a_ij s_j W_s^h + (sum_j a_ij r(x_i, x_j)) W_r^h from explicit weights `[b, h, m, kv]` and
    relations `[b, R, m, kv]`; symbol values per query head `[b, h, kv, d_h]`, or the position-relative table
    `[P, h, d_h]` read at `symbol_index` `[m, kv]`; W_r `[h, d_h, R]` -> messages `[b, m, h, d_h]`."""
    attended_relations = torch.einsum("bhqk,brqk->bqhr", weights, relations)
    if symbol_index is None:
        attended_symbols = torch.matmul(weights, symbol_values).transpose(1, 2)  # [b, m, h, d_h]
    else:  # bin the weights by table row, then mix the table: no [m, kv, d_h] tensor
        binned = weights.new_zeros(*weights.shape[:3], symbol_values.shape[0])
        binned.scatter_add_(-1, symbol_index.expand_as(weights), weights)
        attended_symbols = torch.einsum("bhqp,phd->bqhd", binned, symbol_values)
    return relational_output(attended_symbols, attended_relations, relation_proj, weights.dtype)


def per_head_symbols(symbol_values, groups: int, batch_size: int):
    """Symbol values for every query head: `[b|1, h_kv, kv, d_h]` -> `[b, h, kv, d_h]`, or the position-relative
    table `[P, h_kv, d_h]` -> `[P, h, d_h]`."""
    if symbol_values.dim() == 3:
        return symbol_values.repeat_interleave(groups, dim=1)
    return repeat_kv(symbol_values, groups).expand(batch_size, -1, -1, -1)


# ---- the registry ----------------------------------------------------------------------------------------------
class RelationalCall(NamedTuple):
    """What a backend may need to know to say whether it can run a call (one per relational bias and forward)."""

    device: str  # "cpu", "cuda", ...
    dtype: torch.dtype  # of the queries (the autocast dtype under autocast)
    query_length: int
    requires_grad: bool  # gradients will flow through the attention
    output_attentions: bool
    relation_activation: str  # "identity" or an activation name
    relative_symbols: bool  # position-relative symbol table instead of per-sender symbol values
    dropout: float  # attention dropout of this call (0 in eval)
    mask: AttentionMask
    autocast: bool
    compiling: bool  # inside `torch.compile` tracing

    @classmethod
    def of_forward(cls, query_like: torch.Tensor, query_length: int, requires_grad: bool, output_attentions: bool,
                   relation_activation: str, relative_symbols: bool, dropout: float,
                   mask: AttentionMask) -> "RelationalCall":
        """The call of every layer of one forward over `mask` (`query_like`: a tensor of the forward's device and
        dtype)."""
        device = query_like.device.type
        autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
        dtype = torch.get_autocast_dtype(device) if autocast else query_like.dtype
        return cls(device, dtype, query_length, requires_grad, output_attentions, relation_activation,
                   relative_symbols, dropout, mask, autocast, torch.compiler.is_compiling())


class RelationalBackend(NamedTuple):
    """A registered backend: its function, `supports(call) -> None` when it can run the call (else the reason why
    not), the devices on which automatic selection tries it before the configured implementation, and the one mask
    format it takes (`attention_plan.MASK_FORMATS`: "reference" the `AttentionMask`, "tensor" a `KernelMask`,
    "window" a `KernelMask` that may carry a sliding window over the whole sequence instead of a tensor,
    "block_mask" a FlexAttention `BlockMask`)."""

    function: Callable
    supports: Callable[[RelationalCall], str | None]
    preferred_on: tuple[str, ...] = ()
    mask_format: str = "tensor"


class RelationalBackendUnavailable(RuntimeError):
    """A backend's kernel failed to compile or launch on a device (raised by the backend, naming the error): automatic
    selection falls back to the next backend; a backend requested by `relational_attn_implementation` raises it."""


class RelationalAttentionInterface(dict):
    """Named relational attention backends (`eager`, `sdpa`, `flex_attention`, and compiled ones registered by
    `dat_hf.kernels`), like Transformers' `ALL_ATTENTION_FUNCTIONS`. `unavailable` maps (backend, device type) to the
    error that took the backend out of automatic selection on that device type (clear it to try again)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unavailable: dict[tuple[str, str], str] = {}

    def register(self, name: str, function: Callable, supports: Callable[[RelationalCall], str | None],
                 preferred_on: tuple[str, ...] = (), mask_format: str = "tensor") -> None:
        self[name] = RelationalBackend(function, supports, tuple(preferred_on), mask_format)

    def backend(self, name: str) -> RelationalBackend:
        if name not in self:
            raise ValueError(f"Unknown relational attention backend {name!r}; registered: {sorted(self)} (compiled "
                             "backends are registered by `import dat_hf`).")
        return self[name]


RELATIONAL_ATTENTION_FUNCTIONS = RelationalAttentionInterface()
RELATIONAL_ATTENTION_FUNCTIONS.register("eager", eager_relational_attention, lambda call: None,
                                        mask_format="reference")
# (`sdpa` and `flex_attention`: relational_attention_fused.py; compiled kernels: dat_hf.kernels)


def _candidates(attn_implementation: str | None, call: RelationalCall) -> list[str]:
    """Backends in the order automatic selection tries them. Decoding steps (one receiver per row) skip the fused
    values: the explicit step reads each cached relation key once, fused values would copy them for every head.
    While `torch.export` traces, only the PyTorch backends (an exported program holds no compiled op of dat_hf's)."""
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
    """The name of the backend that runs `call`: `requested` (`relational_attn_implementation`; raises if it cannot
    run the call), `eager` for weights, else the first of `_candidates` that supports it."""
    if requested is not None:
        reason = RELATIONAL_ATTENTION_FUNCTIONS.backend(requested).supports(call)
        if reason is not None:
            raise ValueError(f"`relational_attn_implementation={requested!r}` cannot run this call: {reason}.")
        return requested
    if call.output_attentions:
        return "eager"  # the only backend that returns weights and relations
    return next(name for name in _candidates(attn_implementation, call)
                if name in RELATIONAL_ATTENTION_FUNCTIONS and RELATIONAL_ATTENTION_FUNCTIONS[name].supports(call) is None)


__all__ = ["RELATIONAL_ATTENTION_FUNCTIONS", "RelationalAttentionInterface", "RelationalBackend",
           "RelationalBackendUnavailable", "RelationalCall", "RelationalSpec", "RelativeSymbols",
           "eager_relational_attention", "per_head_symbols", "relational_messages", "relational_output",
           "relational_weights", "repeat_kv",
           "select_relational_attention"]
