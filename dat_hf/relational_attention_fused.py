# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational attention as ordinary attention over fused values (the `sdpa` and `flex_attention` backends).

With the identity relation activation the relations can be aggregated before they are formed:

    sum_j a_ij r_l(x_i, x_j) = relation_scaling <q_l(x_i), sum_j a_ij k_l(x_j)>

so the relational heads are one attention call over values `[symbol values | relation keys]` (`d_h + R d_r` wide):
no `[q, kv]` tensor is kept. Signature as `eager_relational_attention`, under the mask rule.
"""

import torch
from torch import nn

from .relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalCall, relational_output
from .sensory_attention import flex_attention_forward, sdpa_attention_forward


# the widest value chunk of one FlexAttention call off CPU (or the query width's next power of two, if wider)
FLEX_VALUE_CHUNK = 128
# devices whose FlexAttention kernel takes any value width in one call
WHOLE_VALUE_DEVICES = frozenset({"cpu"})


def flex_value_chunks(value_width: int, query_width: int, device_type: str) -> list[int]:
    """Value chunk widths, one FlexAttention call each: the whole width on CPU, else chunks of at most
    `max(FLEX_VALUE_CHUNK, next power of two of the query width)`."""
    if device_type in WHOLE_VALUE_DEVICES:
        return [value_width]
    widest = max(FLEX_VALUE_CHUNK, 1 << (query_width - 1).bit_length())
    return [min(widest, value_width - start) for start in range(0, value_width, widest)]


def fused_values_limits(call: RelationalCall) -> str | None:
    """Why the fused-values backends cannot run `call`, or None."""
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


def _fused_values_attention(interface: str, query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                            mask, spec, dropout):
    b, h, q_len, d = query.shape
    h_kv, kv_len = key.shape[1], key.shape[2]
    num_relations, relation_dim = relation_queries.shape[2:]
    relation_keys = relation_keys.reshape(b, 1, kv_len, num_relations * relation_dim).expand(b, h_kv, -1, -1)
    value = torch.cat([symbol_values.expand(b, -1, -1, -1), relation_keys], dim=-1)  # [b, h_kv, kv, d_h + R d_r]
    if interface == "sdpa":  # mask: a `KernelMask`
        # fused SDPA kernels need equal query and value widths: zero-pad queries and keys (scores unchanged)
        pad = value.shape[-1] - d
        query, key = nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))
        attend, attention_mask, is_causal = sdpa_attention_forward, mask.mask, mask.is_causal
        widths = [value.shape[-1]]
    else:  # mask: a `BlockMask`, a tensor, None, or a `KernelMask` without a tensor (`mask_in_format`)
        attend = flex_attention_forward
        attention_mask, is_causal = (mask.mask, mask.is_causal) if isinstance(mask, tuple) else (mask, False)
        widths = flex_value_chunks(value.shape[-1], d, query.device.type)
    chunks = value.split(widths, dim=-1)
    outs = [attend(spec, query, key, chunk, attention_mask, scaling=spec.scaling, dropout=dropout,
                   is_causal=is_causal)[0] for chunk in chunks]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    attended_symbols, attended_keys = out.split([d, num_relations * relation_dim], dim=-1)  # out [b, q, h, d_v]
    attended_keys = attended_keys.reshape(b, q_len, h, num_relations, relation_dim)
    attended_relations = (attended_keys * relation_queries[:, :, None]).sum(-1) * spec.relation_scaling  # [b, q, h, R]
    return relational_output(attended_symbols, attended_relations, relation_proj, out.dtype)


def sdpa_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj, attention_mask,
                              spec, dropout=0.0, **kwargs):
    """Fused values through SDPA (mask: a `KernelMask`)."""
    messages = _fused_values_attention("sdpa", query, key, symbol_values, relation_queries, relation_keys,
                                       relation_proj, attention_mask, spec, dropout)
    return messages, None, None


def flex_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                              attention_mask, spec, dropout=0.0, **kwargs):
    """Fused values through FlexAttention (mask: a `BlockMask`, whose masked blocks are skipped)."""
    messages = _fused_values_attention("flex_attention", query, key, symbol_values, relation_queries, relation_keys,
                                       relation_proj, attention_mask, spec, dropout)
    return messages, None, None


RELATIONAL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_relational_attention, fused_values_limits)
RELATIONAL_ATTENTION_FUNCTIONS.register("flex_attention", flex_relational_attention, _supports_flex,
                                        mask_format="block_mask")

__all__ = ["flex_relational_attention", "flex_value_chunks", "fused_values_limits", "sdpa_relational_attention"]
