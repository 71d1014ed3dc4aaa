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
kernels). Signature and outputs as `relational_attention.eager_relational_attention`, each with its mask format,
under the one mask rule (`masking_dat.AttentionMask`: a given mask alone decides, `is_causal` applies to a None mask
only, receiver i at kv - q + i).

FlexAttention's GPU kernels (Triton templates) hold a `[BLOCK_M, V]` accumulator and stage `[BLOCK_N, V]` value tiles
in shared memory, `V` rounded up to a power of two, with tiles chosen for the query width alone: the values of the
343M config (64 + 8 x 64 = 576 wide, 1024 rounded) would need 832 KiB of shared memory with H100's tiles for
`d_h = 64` (it has 227 KiB). Off CPU the values therefore go in chunks (`flex_value_chunks`), one call each.
"""

import torch
from torch import nn
from .relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalCall, relational_output
from .sensory_attention import flex_attention_forward, sdpa_attention_forward


# the widest value chunk of one FlexAttention call off CPU (or the query width rounded up to a power of two, if wider);
# with queries 64 wide, inductor's forward tiles then take 160 KiB of shared memory on H100, 88 KiB on A100
FLEX_VALUE_CHUNK = 128
# devices whose FlexAttention kernel takes any value width in one call (the CPU kernel loops over it)
WHOLE_VALUE_DEVICES = frozenset({"cpu"})


def flex_value_chunks(value_width: int, query_width: int, device_type: str) -> list[int]:
    """The widths of the value chunks FlexAttention gets, one call each: the whole width on CPU; elsewhere chunks no
    wider than `max(FLEX_VALUE_CHUNK, query width rounded up to a power of two)`. Each call recomputes the scores
    (`d_h` multiply-adds and one exponential per pair and chunk)."""
    if device_type in WHOLE_VALUE_DEVICES:
        return [value_width]
    widest = max(FLEX_VALUE_CHUNK, 1 << (query_width - 1).bit_length())
    return [min(widest, value_width - start) for start in range(0, value_width, widest)]


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


RELATIONAL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_relational_attention, fused_values_limits)
RELATIONAL_ATTENTION_FUNCTIONS.register("flex_attention", flex_relational_attention, _supports_flex,
                                        mask_format="block_mask")

__all__ = ["flex_relational_attention", "flex_value_chunks", "fused_values_limits", "sdpa_relational_attention"]
