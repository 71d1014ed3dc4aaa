# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Relational attention as ordinary attention over fused values (the `sdpa` and `flex_attention` backends).

With the identity relation activation the relations can be aggregated before they are formed:

    sum_j a_ij r_l(x_i, x_j) = relation_scaling <q_l(x_i), sum_j a_ij k_l(x_j)>

so the relational heads are one attention call whose values are `[symbol values | relation keys]`
(`d_h + R d_r` wide), through Transformers' attention functions: no `[q, kv]` tensor is kept and the cache stores
per token the attention key, the symbol value and the relation key. The cost per pair is `h (d_h + R d_r)`
multiply-adds for the values, against `R d_r + h R` when relations are formed once for all heads (the compiled
kernels). Signature and outputs as `relational_attention.eager_relational_attention`.
"""

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def _fused_values_attention(interface: str, module, query, key, symbol_values, relation_queries, relation_keys,
                            mask, scaling, relation_scaling, dropout):
    b, h, q_len, d = query.shape
    h_kv, kv_len = key.shape[1], key.shape[2]
    num_relations, relation_dim = relation_queries.shape[2:]
    relation_keys = relation_keys.reshape(b, 1, kv_len, num_relations * relation_dim).expand(b, h_kv, -1, -1)
    value = torch.cat([symbol_values.expand(b, -1, -1, -1), relation_keys], dim=-1)  # [b, h_kv, kv, d_h + R d_r]
    if interface == "sdpa":
        # fused SDPA kernels need equal query and value widths (else a math fallback keeps the [q, kv] weights):
        # zero-padding queries and keys leaves every score unchanged
        pad = value.shape[-1] - d
        query, key = nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))
        attention_mask = mask.mask
    else:
        attention_mask = mask.block_mask
    out, _ = ALL_ATTENTION_FUNCTIONS[interface](
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, is_causal=mask.is_causal)
    attended_symbols, attended_keys = out.split([d, num_relations * relation_dim], dim=-1)  # out [b, q, h, d_v]
    attended_keys = attended_keys.reshape(b, q_len, h, num_relations, relation_dim)
    attended_relations = (attended_keys * relation_queries[:, :, None]).sum(-1) * relation_scaling  # [b, q, h, R]
    # A_i^h = sum_j a_ij s_j W_s^h + (sum_j a_ij r(x_i, x_j)) W_r^h
    return attended_symbols + torch.einsum("bqhr,hdr->bqhd", attended_relations, module.relation_proj.to(out.dtype))


def sdpa_relational_attention(module, query, key, symbol_values, relation_queries, relation_keys, attention_mask,
                              scaling, relation_scaling, dropout=0.0, **kwargs):
    """Fused values through `torch.nn.functional.scaled_dot_product_attention` (bool mask or causal flag)."""
    messages = _fused_values_attention("sdpa", module, query, key, symbol_values, relation_queries, relation_keys,
                                       attention_mask, scaling, relation_scaling, dropout)
    return messages, None, None


def flex_relational_attention(module, query, key, symbol_values, relation_queries, relation_keys, attention_mask,
                              scaling, relation_scaling, dropout=0.0, **kwargs):
    """Fused values through FlexAttention with the relational bias as a `BlockMask`: masked blocks are skipped, so a
    sliding window or a sparse graph costs its edges, not `q x kv` (values keep their own width: no padding)."""
    messages = _fused_values_attention("flex_attention", module, query, key, symbol_values, relation_queries,
                                       relation_keys, attention_mask, scaling, relation_scaling, dropout)
    return messages, None, None


__all__ = ["flex_relational_attention", "sdpa_relational_attention"]
