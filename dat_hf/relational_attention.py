# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational attention: the reference implementation, and the registry of named backends that compute the same.

For receiver i and relational head h (Altabaa & Lafferty, 2024):

    A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)                            messages   [b, q, h, d_h]
    a^h   = softmax(scaling (x W_q^h)(x W_k^h)^T + mask)                           weights    [b, h, q, kv]
    r(x_i, x_j)_l = act(relation_scaling <x_i W_{q,l}^rel, x_j W_{k,l}^rel>)       relations  [b, R, q, kv]

Every backend has the signature of `eager_relational_attention`: it takes what `RelationalAttention` projected
(queries and keys with RoPE applied) and `module` (for `relation_proj` = W_r `[h, d_h, R]`, `relation_act`,
`num_key_value_groups`, `max_relative_position`, `training`), and returns (messages, weights or None, relations or
None). Backends are chosen by `select_relational_attention`: `config.relational_attn_implementation` when set (an
unsupported call then raises), else the fastest registered backend that supports the call (compiled kernels that
`dat_hf.kernels` registers for their device, then `config._attn_implementation`'s own, then `eager`).
A backend whose kernel fails to compile or launch raises `RelationalBackendUnavailable`; `attend_with_fallback` then
marks it unavailable on that device type for the rest of the process, warns once naming the error and runs the next
backend, unless the backend was requested by `relational_attn_implementation` (the error is raised).
"""

import logging
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .masking_dat import AttentionMask
from .relational_attention_fused import flex_relational_attention, relational_output, sdpa_relational_attention

logger = logging.getLogger(__name__)

# receivers per block of the reference are chosen so that one block's scores and relations stay below this many
# elements (memory linear in the sequence length)
BLOCK_ELEMENTS = 1 << 22


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[b, h_kv, n, d]` -> `[b, h_kv * n_rep, n, d]` (GQA: each key/value head serves `n_rep` query heads)."""
    if n_rep == 1:
        return hidden_states
    b, h, n, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


# ---- the reference ---------------------------------------------------------------------------------------------
def eager_relational_attention(module, query, key, symbol_values, relation_queries, relation_keys,
                               attention_mask: AttentionMask, scaling: float, relation_scaling: float,
                               dropout: float = 0.0, output_attentions: bool = False,
                               relative_position_index: torch.Tensor | None = None, query_offset=None, **kwargs):
    """Relational attention with explicit weights and relations, one block of receivers at a time.

    query `[b, h, q, d_h]`, key `[b, h_kv, kv, d_h]`, symbol values `[b|1, h_kv, kv, d_h]` (or the position-relative
    table `[P, h_kv, d_h]`: pair (i, j) uses row `clip(j - (query_offset + i), -K, K) + K`, where `query_offset` is
    the cache index of the first receiver (default `kv - q`), or `relative_position_index[i, j]`),
    relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]` -> messages `[b, q, h, d_h]`, and with
    `output_attentions` the weights `[b, h, q, kv]` and relations `[b, R, q, kv]`. In training the blocks are
    recomputed in backward (activation checkpointing), so memory stays linear in the sequence length.
    """
    b, h, q_len, _ = query.shape
    kv_len, num_relations = key.shape[2], relation_queries.shape[2]
    key = repeat_kv(key, module.num_key_value_groups)
    symbol_values = per_head_symbols(module, symbol_values, b)
    block = q_len if output_attentions else max(1, min(q_len, BLOCK_ELEMENTS // (b * (h + num_relations) * kv_len)))
    checkpointed = module.training and torch.is_grad_enabled() and block < q_len
    outputs = []
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        args = (module, query[:, :, start:end], key, symbol_values, relation_queries[:, start:end], relation_keys,
                attention_mask.dense(q_len, kv_len, query.device, start, end),
                symbol_rows(module, relative_position_index, query_offset, start, end, q_len, kv_len, query.device),
                scaling, relation_scaling, dropout)
        if checkpointed:
            outputs.append(torch.utils.checkpoint.checkpoint(_attend_block, *args, use_reentrant=False))
        else:
            outputs.append(_attend_block(*args))
    messages, weights, relations = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1 if i == 0 else 2)
                                    for i, parts in enumerate(zip(*outputs)))
    return (messages, weights, relations) if output_attentions else (messages, None, None)


def _attend_block(module, query, key, symbol_values, q_rel, k_rel, mask, symbol_index, scaling, relation_scaling,
                  dropout):
    """One block of m receivers (key and symbol values per query head): -> messages `[b, m, h, d_h]`, weights
    `[b, h, m, kv]`, relations `[b, R, m, kv]`."""
    weights, relations = relational_weights(module, query, key, q_rel, k_rel, mask, scaling, relation_scaling,
                                            dropout)
    return relational_messages(module, weights, relations, symbol_values, symbol_index), weights, relations


def relational_weights(module, query, key, relation_queries, relation_keys, mask, scaling: float,
                       relation_scaling: float, dropout: float = 0.0):
    """Explicit attention weights and relations: query `[b, h, m, d_h]`, key `[b, h, kv, d_h]` (one per query head),
    relation queries `[b, m, R, d_r]` and keys `[b, kv, R, d_r]`, mask None, bool (True = attend) or additive
    `[b|1, 1, m, kv]` -> weights `[b, h, m, kv]` (after dropout), relations `[b, R, m, kv]`."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = nn.functional.dropout(weights.to(query.dtype), p=dropout, training=module.training)
    # r_l(x_i, x_j) = act(relation_scaling <q_rel,l(x_i), k_rel,l(x_j)>)
    relations = torch.einsum("bqrd,bkrd->brqk", relation_queries, relation_keys) * relation_scaling
    if module.relation_act is not None:
        relations = module.relation_act(relations)
    return weights, relations


def relational_messages(module, weights, relations, symbol_values, symbol_index=None):
    """A_i^h = sum_j a_ij s_j W_s^h + (sum_j a_ij r(x_i, x_j)) W_r^h from explicit weights `[b, h, m, kv]` and
    relations `[b, R, m, kv]`; symbol values per query head `[b, h, kv, d_h]`, or the position-relative table
    `[P, h, d_h]` read at `symbol_index` `[m, kv]` -> messages `[b, m, h, d_h]`."""
    attended_relations = torch.einsum("bhqk,brqk->bqhr", weights, relations)
    if symbol_index is None:
        attended_symbols = torch.matmul(weights, symbol_values).transpose(1, 2)  # [b, m, h, d_h]
    else:  # bin the weights by table row, then mix the table: no [m, kv, d_h] tensor
        binned = weights.new_zeros(*weights.shape[:3], symbol_values.shape[0])
        binned.scatter_add_(-1, symbol_index.expand_as(weights), weights)
        attended_symbols = torch.einsum("bhqp,phd->bqhd", binned, symbol_values)
    return relational_output(attended_symbols, attended_relations, module.relation_proj, weights.dtype)


def per_head_symbols(module, symbol_values, batch_size: int):
    """Symbol values for every query head: `[b|1, h_kv, kv, d_h]` -> `[b, h, kv, d_h]`, or the position-relative
    table `[P, h_kv, d_h]` -> `[P, h, d_h]`."""
    if symbol_values.dim() == 3:
        return symbol_values.repeat_interleave(module.num_key_value_groups, dim=1)
    return repeat_kv(symbol_values, module.num_key_value_groups).expand(batch_size, -1, -1, -1)


def symbol_rows(module, relative_position_index, query_offset, start: int, end: int, q_len: int, kv_len: int,
                device, ring: int | None = None):
    """Rows of the position-relative symbol table for receivers [start, end) (long `[m, kv]`), or None. `ring`: keys
    in a ring of that many slots, where a sender's offset is known modulo the ring (exact for a sliding window's
    senders, at most `ring - 1` back)."""
    if not module.relative_symbols:
        return None
    if relative_position_index is not None:  # precomputed bins (e.g. 2-D offsets on an image grid)
        return relative_position_index[start:end].to(device)
    clip = module.max_relative_position
    offset = kv_len - q_len if query_offset is None else query_offset
    receivers = torch.arange(start, end, device=device)[:, None] + offset
    offsets = torch.arange(kv_len, device=device)[None, :] - receivers
    if ring is not None:
        offsets = -((-offsets) % ring)
    return offsets.clamp(-clip, clip) + clip


# ---- the registry ----------------------------------------------------------------------------------------------
class RelationalCall(NamedTuple):
    """What a backend may need to know to say whether it can run a call."""

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
    def of(cls, module, query, mask: AttentionMask, output_attentions: bool) -> "RelationalCall":
        device = query.device.type
        autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
        dtype = torch.get_autocast_dtype(device) if autocast else query.dtype
        requires_grad = torch.is_grad_enabled() and (query.requires_grad or module.relation_proj.requires_grad)
        return cls(device, dtype, query.shape[2], requires_grad, output_attentions, module.relation_activation,
                   module.relative_symbols, module.attention_dropout if module.training else 0.0, mask, autocast,
                   torch.compiler.is_compiling())


class RelationalBackend(NamedTuple):
    """A registered backend: its function, `supports(call) -> None` when it can run the call (else the reason why
    not), the devices on which automatic selection tries it before the configured implementation, and whether it
    takes a sliding window over the whole sequence in one call (`AttentionMask.window`: its own index arithmetic,
    no receiver blocks, no dense mask)."""

    function: Callable
    supports: Callable[[RelationalCall], str | None]
    preferred_on: tuple[str, ...] = ()
    takes_sliding_window: bool = False


def fused_values_limits(call: RelationalCall) -> str | None:
    """What the fused-values backends (sdpa, flex) need: identity relations and symbols per sender."""
    if call.output_attentions:
        return "it does not return attention weights (use 'eager')"
    if call.relation_activation != "identity":
        return f"relation_activation={call.relation_activation!r} needs explicit relations (only 'identity' fuses)"
    if call.relative_symbols:
        return "position-relative symbols need per-pair symbol rows (explicit weights)"
    return None


def _supports_flex(call: RelationalCall) -> str | None:
    if (reason := fused_values_limits(call)) is not None:
        return reason
    if call.dropout > 0:
        return "flex_attention has no attention dropout"
    if call.device == "cpu" and call.requires_grad:
        return "flex_attention has no backward on CPU in PyTorch"
    if call.device == "cpu" and call.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return "flex_attention on CPU runs float32, float16 or bfloat16"
    if call.mask.block_mask is None and (call.mask.masked or call.mask.is_causal):
        return "the masks were built without a BlockMask (set attn_implementation='flex_attention')"
    return None


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
                 preferred_on: tuple[str, ...] = (), takes_sliding_window: bool = False) -> None:
        self[name] = RelationalBackend(function, supports, tuple(preferred_on), takes_sliding_window)

    def backend(self, name: str) -> RelationalBackend:
        if name not in self:
            raise ValueError(f"Unknown relational attention backend {name!r}; registered: {sorted(self)} (compiled "
                             "backends are registered by `import dat_hf`).")
        return self[name]


RELATIONAL_ATTENTION_FUNCTIONS = RelationalAttentionInterface()
RELATIONAL_ATTENTION_FUNCTIONS.register("eager", eager_relational_attention, lambda call: None)
RELATIONAL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_relational_attention, fused_values_limits)
RELATIONAL_ATTENTION_FUNCTIONS.register("flex_attention", flex_relational_attention, _supports_flex)


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


def select_relational_attention(module, query, mask: AttentionMask, output_attentions: bool = False) -> str:
    """The name of the backend that runs this call of `module` (a `RelationalAttention`), recorded as
    `module.relational_attention_backend` (outside `torch.compile`) and logged at debug level."""
    call = RelationalCall.of(module, query, mask, output_attentions)
    requested = getattr(module.config, "relational_attn_implementation", None)
    if requested is not None:
        reason = RELATIONAL_ATTENTION_FUNCTIONS.backend(requested).supports(call)
        if reason is not None:
            raise ValueError(f"`relational_attn_implementation={requested!r}` cannot run this call: {reason}.")
        name = requested
    elif output_attentions:
        name = "eager"  # the only backend that returns weights and relations
    else:
        name = next(name for name in _candidates(module.config._attn_implementation, call)
                    if name in RELATIONAL_ATTENTION_FUNCTIONS
                    and RELATIONAL_ATTENTION_FUNCTIONS[name].supports(call) is None)
    if not call.compiling:
        if getattr(module, "relational_attention_backend", None) != name:
            logger.debug("dat_hf: layer %s relational heads -> %s", module.layer_idx, name)
        module.relational_attention_backend = name
    return name


def attend_with_fallback(module, query, mask: AttentionMask, output_attentions: bool, attend: Callable[[str], tuple]):
    """`attend(backend)` with the backend that `select_relational_attention` picks. If an automatically selected
    backend raises `RelationalBackendUnavailable` (its kernel failed to compile or launch), it leaves automatic
    selection on that device type for the rest of the process, with one `RuntimeWarning` naming the error and the
    backend that runs instead, and the next backend runs; a backend requested by `relational_attn_implementation`
    raises the error."""
    while True:
        backend = select_relational_attention(module, query, mask, output_attentions)
        if torch.compiler.is_compiling():  # (traced ops never launch a kernel)
            return attend(backend)
        try:
            return attend(backend)
        except RelationalBackendUnavailable as error:
            device = query.device.type
            if getattr(module.config, "relational_attn_implementation", None) is not None or backend == "eager" or (
                    backend, device) in RELATIONAL_ATTENTION_FUNCTIONS.unavailable:
                raise
            RELATIONAL_ATTENTION_FUNCTIONS.unavailable[(backend, device)] = str(error)
            fallback = select_relational_attention(module, query, mask, output_attentions)
            warnings.warn(f"dat_hf: the {backend!r} relational attention backend is not used on {device} from now on "
                          f"in this process; {fallback!r} runs instead. {error}", RuntimeWarning, stacklevel=2)


__all__ = ["RELATIONAL_ATTENTION_FUNCTIONS", "RelationalAttentionInterface", "RelationalBackend",
           "RelationalBackendUnavailable", "RelationalCall", "attend_with_fallback", "eager_relational_attention",
           "per_head_symbols", "relational_messages", "relational_weights", "repeat_kv", "select_relational_attention",
           "symbol_rows"]
