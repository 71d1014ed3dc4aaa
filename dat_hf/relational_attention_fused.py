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
kernels). Signature and outputs as `relational_attention.eager_relational_attention`, each with its mask format.

FlexAttention's GPU kernels (Triton templates) hold a `[BLOCK_M, V]` accumulator and stage `[BLOCK_N, V]` value tiles
in shared memory, `V` rounded up to a power of two, with tiles chosen for the query width alone: the values of the
343M config (64 + 8 x 64 = 576 wide, 1024 rounded) would need 832 KiB of shared memory with H100's tiles for
`d_h = 64` (it has 227 KiB). Off CPU the values therefore go in chunks (`flex_value_chunks`), one call each.
"""

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


# the widest value chunk of one FlexAttention call off CPU (or the query width rounded up to a power of two, if wider);
# with queries 64 wide, inductor's forward tiles then take 160 KiB of shared memory on H100, 88 KiB on A100
FLEX_VALUE_CHUNK = 128
# devices whose FlexAttention kernel takes any value width in one call (the CPU kernel loops over it)
WHOLE_VALUE_DEVICES = frozenset({"cpu"})


def relational_output(attended_symbols, attended_relations, relation_proj, dtype=None):
    """The one place of `A W_r`: A_i^h = sum_j a_ij s_j W_s^h + (sum_j a_ij r(x_i, x_j)) W_r^h, from the attended
    symbols `[b, q, h, d_h]` and attended relations `[b, q, h, R]`, with W_r `[h, d_h, R]` (in `dtype`, as given)
    -> messages `[b, q, h, d_h]`."""
    weight = relation_proj if dtype is None else relation_proj.to(dtype)
    return attended_symbols + torch.einsum("bqhr,hdr->bqhd", attended_relations, weight)


def flex_value_chunks(value_width: int, query_width: int, device_type: str) -> list[int]:
    """The widths of the value chunks FlexAttention gets, one call each: the whole width on CPU; elsewhere chunks no
    wider than `max(FLEX_VALUE_CHUNK, query width rounded up to a power of two)`. Each call recomputes the scores
    (`d_h` multiply-adds and one exponential per pair and chunk)."""
    if device_type in WHOLE_VALUE_DEVICES:
        return [value_width]
    widest = max(FLEX_VALUE_CHUNK, 1 << (query_width - 1).bit_length())
    return [min(widest, value_width - start) for start in range(0, value_width, widest)]


def flex_inputs(*tensors):
    """The tensors as FlexAttention gets them: copies inside a compiled CPU graph, where inductor's C++ FlexAttention
    template reads a view that starts past its buffer's beginning (a head slice of the cache) from the buffer's start,
    i.e. other heads (PyTorch 2.13; Dynamo cannot tell views by their offset)."""
    if not torch.compiler.is_compiling():
        return tensors
    return tuple(t.clone(memory_format=torch.contiguous_format) if t.device.type == "cpu" else t for t in tensors)


# inductor's C++ FlexAttention template (PyTorch 2.13 and 2.14.1, AVX2) computes wrong or non-finite outputs for
# query/key head dimensions under 32 when the length is not a multiple of 16 (e.g. d_h = 16 at 24 or 40 tokens, with
# or without a mask; what the call returns then depends on what ran before). Zero columns leave every score as it is.
CPU_FLEX_MIN_QK_DIM = 32


def cpu_flex_query_key(query, key):
    """query `[b, h, q, d]` and key `[b, h_kv, kv, d]` with zero columns up to `CPU_FLEX_MIN_QK_DIM` when `d` is
    narrower on CPU (the scores, and so the output, are unchanged: the caller passes the scale of `d`)."""
    pad = CPU_FLEX_MIN_QK_DIM - query.shape[-1]
    if query.device.type != "cpu" or pad <= 0:
        return query, key
    return nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))


_compiled_flex = {}


def _compiled_flex_attention(device_type: str):
    """FlexAttention compiled once per process and device type; with static shapes on CPU, where PyTorch 2.13's
    inductor miscompiles the C++ template for dynamic ones (a second shape made Dynamo compile a dynamic kernel that
    failed to build, `'cur_kvSplitSize1' was not declared`, so a call's fate depended on what had run before).
    Inside a compiled graph the plain function is traced into it."""
    if torch.compiler.is_compiling():
        return flex_attention
    if device_type not in _compiled_flex:
        _compiled_flex[device_type] = torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)
    return _compiled_flex[device_type]


def flex_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """FlexAttention for both head types. query `[b, h, q, d]`, key `[b, h_kv, kv, d]`, value `[b, h_kv, kv, d_v]`,
    attention_mask a `BlockMask`, an additive float tensor `[b|1, 1, q, kv]` or None -> output `[b, q, h, d_v]`,
    None (no weights). Receivers without any sender get zeros (FlexAttention's convention; the callers zero them)."""
    if dropout > 0:
        raise ValueError("FlexAttention has no attention dropout: use the model in eval mode, set "
                         "`attention_dropout=0`, or choose another `attn_implementation`.")
    block_mask, score_mod = None, None
    if isinstance(attention_mask, BlockMask):
        block_mask = attention_mask
    elif attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            raise ValueError("FlexAttention heads need their mask as a BlockMask or an additive float tensor, got a "
                             "bool tensor: build the masks with the model's config "
                             "(`attn_implementation='flex_attention'`).")
        additive = attention_mask[..., : key.shape[-2]]

        def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            return score + additive[batch_idx if additive.shape[0] > 1 else 0, 0, q_idx, kv_idx]

    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling  # of the head dimension, before any padding
    query, key, value = flex_inputs(*cpu_flex_query_key(query, key), value)
    out = _compiled_flex_attention(query.device.type)(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                                       scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _fused_values_attention(interface: str, query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                            mask, spec, dropout):
    b, h, q_len, d = query.shape
    h_kv, kv_len = key.shape[1], key.shape[2]
    num_relations, relation_dim = relation_queries.shape[2:]
    relation_keys = relation_keys.reshape(b, 1, kv_len, num_relations * relation_dim).expand(b, h_kv, -1, -1)
    value = torch.cat([symbol_values.expand(b, -1, -1, -1), relation_keys], dim=-1)  # [b, h_kv, kv, d_h + R d_r]
    if interface == "sdpa":  # mask: a `KernelMask`
        # fused SDPA kernels need equal query and value widths (else a math fallback keeps the [q, kv] weights):
        # zero-padding queries and keys leaves every score unchanged
        pad = value.shape[-1] - d
        query, key = nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))
        attend, attention_mask, is_causal = ALL_ATTENTION_FUNCTIONS["sdpa"], mask.mask, mask.is_causal
        widths = [value.shape[-1]]
    else:  # mask: a `BlockMask` (or None)
        attend, attention_mask, is_causal = flex_attention_forward, mask, False
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
    """Fused values through `torch.nn.functional.scaled_dot_product_attention` (a `KernelMask`: bool mask or causal
    flag)."""
    messages = _fused_values_attention("sdpa", query, key, symbol_values, relation_queries, relation_keys,
                                       relation_proj, attention_mask, spec, dropout)
    return messages, None, None


def flex_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                              attention_mask, spec, dropout=0.0, **kwargs):
    """Fused values through FlexAttention with the relational bias as a `BlockMask`: masked blocks are skipped, so a
    sliding window or a sparse graph costs its edges, not `q x kv` (values keep their own width: no padding)."""
    messages = _fused_values_attention("flex_attention", query, key, symbol_values, relation_queries, relation_keys,
                                       relation_proj, attention_mask, spec, dropout)
    return messages, None, None


__all__ = ["cpu_flex_query_key", "flex_attention_forward", "flex_inputs", "flex_relational_attention", "flex_value_chunks", "relational_output",
           "sdpa_relational_attention"]
