# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Sensory attention functions (eager, FlexAttention, SDPA) under the mask rule (`masking_dat.AttentionMask`).

    out = softmax(scaling q k^T + mask) v                                   query [b, h, q, d] -> out [b, q, h, d_v]
"""

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward as transformers_sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import repeat_kv  # `[b, h_kv, n, d]` -> `[b, h_kv * n_rep, n, d]` (GQA)

from .kernel_hooks import BACKENDS, Backend, replaceable
from .masking_dat import causal_order


def implicit_causal(query, key, attention_mask, is_causal):
    """The mask rule made explicit: a given mask as is; a None mask with `is_causal` -> bool `[1, 1, q, kv]` causal
    order (receiver i at kv - q + i), or None when every receiver sees every sender."""
    if attention_mask is not None or not is_causal:
        return attention_mask
    return causal_order(query.shape[2], key.shape[2], query.device)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=False,
                            **kwargs):
    """Reference attention: query `[b, h, q, d]`, key `[b, h_kv, kv, d]`, value `[b, h_kv, kv, d_v]`, mask None, bool
    or additive `[b|1, 1, q, kv]` -> output `[b, q, h, d_v]`, weights `[b, h, q, kv]`."""
    attention_mask = implicit_causal(query, key, attention_mask, is_causal)
    weights = eager_attention_weights(module, query, key, attention_mask, scaling, dropout)
    value = repeat_kv(value, module.num_key_value_groups)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def eager_attention_weights(module, query, key, attention_mask, scaling, dropout=0.0):
    """`softmax(scaling q k^T + mask)`, dropout in training: `[b, h, q, d]`, `[b, h_kv, kv, d]` -> `[b, h, q, kv]`."""
    key = repeat_kv(key, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.promote_types(weights.dtype, torch.float32))
    return nn.functional.dropout(weights.to(query.dtype), p=dropout, training=module.training)


def flex_inputs(*tensors):
    """Contiguous copies inside a compiled CPU graph (inductor's C++ template misreads offset views, PyTorch 2.13)."""
    if not torch.compiler.is_compiling():
        return tensors
    return tuple(t.clone(memory_format=torch.contiguous_format) if t.device.type == "cpu" else t for t in tensors)


# inductor's C++ FlexAttention template is wrong for q/k widths under 32 (PyTorch 2.13-2.14.1); zero columns fix it
CPU_FLEX_MIN_QK_DIM = 32


def cpu_flex_query_key(query, key):
    """On CPU, query and key zero-padded to `CPU_FLEX_MIN_QK_DIM` columns (scores unchanged)."""
    pad = CPU_FLEX_MIN_QK_DIM - query.shape[-1]
    if query.device.type != "cpu" or pad <= 0:
        return query, key
    return nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))


_compiled_flex = {}


def _compiled_flex_attention(device_type: str):
    """FlexAttention compiled once per device type (static shapes on CPU); the plain function inside a compile."""
    if torch.compiler.is_compiling():
        return flex_attention
    if device_type not in _compiled_flex:
        _compiled_flex[device_type] = torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)
    return _compiled_flex[device_type]


def flex_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=False,
                           **kwargs):
    """FlexAttention: query `[b, h, q, d]`, key `[b, h_kv, kv, d]`, value `[b, h_kv, kv, d_v]`, mask a `BlockMask`,
    additive float `[b|1, 1, q, kv]` or None -> output `[b, q, h, d_v]`, None. Raises ValueError for dropout or a
    bool mask."""
    if dropout > 0:
        raise ValueError("FlexAttention has no attention dropout: use the model in eval mode, set "
                         "`attention_dropout=0`, or choose another `attn_implementation`.")
    causal = implicit_causal(query, key, attention_mask, is_causal)
    if attention_mask is None and causal is not None:  # as an additive bias
        attention_mask = torch.zeros(causal.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~causal, float("-inf"))
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

    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling  # before any padding
    query, key, value = flex_inputs(*cpu_flex_query_key(query, key), value)
    out = _compiled_flex_attention(query.device.type)(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                                       scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@replaceable("sdpa_attention")
def sdpa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=False,
                           **kwargs):
    """Transformers' SDPA call under the mask rule (made explicit for 1 < q != kv, where SDPA is upper-left)."""
    if 1 < query.shape[2] != key.shape[2]:
        attention_mask = implicit_causal(query, key, attention_mask, is_causal)
    is_causal = bool(is_causal) and attention_mask is None
    return transformers_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=is_causal, **kwargs)


def sensory_attention_backend(implementation: str) -> Backend:
    """The sensory heads' entry for `attn_implementation`: the one registry's `sensory` entry (DAT's FlexAttention
    and SDPA calls in place of Transformers'), else Transformers' own function (`ALL_ATTENTION_FUNCTIONS`, a tensor
    mask), else eager."""
    entry = SENSORY_ATTENTION_FUNCTIONS.get(implementation)
    if entry is not None:
        return entry
    function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    return SENSORY_ATTENTION_FUNCTIONS["eager"] if function is eager_attention_forward else Backend(function)


# the sensory heads' backends: the one registry's `sensory` table (`kernel_hooks.BACKENDS`)
SENSORY_ATTENTION_FUNCTIONS = BACKENDS.of("sensory")
SENSORY_ATTENTION_FUNCTIONS.register("eager", eager_attention_forward, mask_format="dense")
SENSORY_ATTENTION_FUNCTIONS.register("flex_attention", flex_attention_forward, mask_format="block_mask")
SENSORY_ATTENTION_FUNCTIONS.register("sdpa", sdpa_attention_forward)


__all__ = ["SENSORY_ATTENTION_FUNCTIONS", "sensory_attention_backend", "cpu_flex_query_key", "eager_attention_forward",
           "eager_attention_weights",
           "flex_attention_forward", "flex_inputs", "implicit_causal", "repeat_kv", "sdpa_attention_forward"]
