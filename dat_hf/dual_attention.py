# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Dual attention: sensory (self-attention) heads beside relational heads.

    DualAttention(x, s) = [SensoryAttention(x) | RelationalAttention(x, s)] W_o
    A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)
    r(x_i, x_j)_l = <x_i W_{q,l}^rel, x_j W_{k,l}^rel> / sqrt(d_r)
"""

from typing import NamedTuple

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import rotate_half

from .attention_plan import PlannedRelational, PlannedSensory
from .cache_dat import PackedCache, packed_update, receiver_slots
from .kernel_hooks import replaceable
from .relational_attention import (RelationalSpec, RelativeSymbols, per_head_symbols, relational_messages,
                                   relational_weights)
from .sensory_attention import eager_attention_weights, repeat_kv
from .tensor_parallel_dat import local_tensor


@replaceable("rotary")
def apply_rotary(x, cos, sin):
    """RoPE: x `[b, n, heads, d]`, cos, sin `[b|1, n, d]` -> `x cos + rotate_half(x) sin`."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos) + (rotate_half(x) * sin)


class DATRotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention (the reference's interleaved pairs are permuted at conversion)."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))

    @torch.no_grad()
    def forward(self, x, position_ids):
        """position_ids `[b|1, n]` -> cos, sin `[b|1, n, d_h]`."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@replaceable("fused_linear")
def fused_linear(linears, x):
    """`cat([linear(x) for linear in linears], -1)`: x `[..., d]` -> `[..., sum of out_features]`; `import dat_hf`
    installs one matrix product over the concatenated weights for long inputs (`dat_hf/kernels/projections.py`)."""
    rows = x.reshape(-1, x.shape[-1])  # 2-d: one BLAS call per projection (decoding is op-bound)
    return torch.cat([linear(rows) for linear in linears], dim=-1).view(*x.shape[:-1], -1)


class FusedProjections(NamedTuple):
    """Projections of one input as one matrix product split into parts (`project_fused`).

    projections: (head type, attribute) pairs in fused-output order, looked up per call (PEFT replaces modules).
    widths: each part's output features; under tensor parallelism as its projections' styles output them (`colwise`:
    this rank's heads; `dat_gather`: every relation, gathered whole).
    """

    projections: tuple
    widths: tuple

    @classmethod
    def plan(cls, parts: list) -> "FusedProjections":
        """`parts`: ((head type, attribute) pairs, width) per part."""
        return cls(tuple(projection for names, _ in parts for projection in names), tuple(width for _, width in parts))


def head_linears(sensory, relational, projections) -> list:
    """The modules named by (head type, attribute) pairs (read from `_modules`: `nn.Module.__getattr__` is slow)."""
    owners = {"relational": None if relational is None else relational._modules,
              "sensory": None if sensory is None else sensory._modules}
    return [owners[owner][name] for owner, name in projections]


@replaceable("project_fused")
def project_fused(fused: FusedProjections, sensory, relational, x) -> list:
    """x `[b, n, d]` -> the parts of `fused`, `[b, n, width]` each."""
    return list(fused_linear(head_linears(sensory, relational, fused.projections), x).split(fused.widths, dim=-1))


def attend_with_weights(sensory, relational, sensory_inputs, relational_inputs):
    """`output_attentions`: outputs from the explicit weights that are returned -> (output `[b, q, (h_s + h_r)
    d_h]`, weights `[b, h_s + h_r, q, kv]` (sensory first, zero rows without senders), relations `[b, R, q, kv]`)."""
    parts, relations = [], None
    if sensory is not None:
        parts.append(sensory.attention_weights(*sensory_inputs))
    if relational is not None:
        weights_r, relations = relational.attention_weights(*relational_inputs[:6])
        parts.append(weights_r)
    weights = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    outputs, heads = [], 0
    if sensory is not None:
        heads = sensory.num_heads
        outputs.append(sensory.output_from_weights(weights[:, :heads], sensory_inputs[2]))
    if relational is not None:
        outputs.append(relational.output_from_weights(weights[:, heads:], relations, relational_inputs[2],
                                                      relational_inputs[6]))
    return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0], weights, relations


class SensoryAttention(nn.Module):
    """Multi-head self-attention (GQA) through `attention`, this forward's plan entry: q `[b, h, q, d_h]`, k, v
    `[b, h_kv, kv, d_h]` (RoPE applied) -> output `[b, q, h * d_h]`, None."""

    # what tensor parallelism shards by head (`tensor_parallel_dat.use_local_heads`)
    head_parameters = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_sensory_heads
        self.num_kv_heads = config.sensory_kv_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        d, hd = config.hidden_size, self.head_dim
        # CODEPATH: own projections: every released checkpoint; shared (`share_attention_params`, q and k from the
        # relational heads): none, the reference's `share_attn_params` option.
        if not config.share_attention_params:
            self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
            self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, self.num_heads * hd, bias=config.attention_out_bias)
        self.o_proj.residual_init = True

    def forward(self, query, key, value, attention: PlannedSensory, **kwargs):
        out = attention(self, query, key, value, self.attention_dropout if self.training else 0.0, **kwargs)
        return self.o_proj(out.reshape(*out.shape[:2], -1)), None

    def attention_weights(self, query, key, value, attention: PlannedSensory):
        """Explicit weights `[b, h, q, kv]`, zero rows for receivers without senders."""
        weights = eager_attention_weights(self, query, key,
                                          attention.weights_mask(query.shape[2], key.shape[2], query.device),
                                          self.scaling, self.attention_dropout if self.training else 0.0)
        return weights if attention.row_valid is None else weights * attention.row_valid.to(weights.dtype)

    def output_from_weights(self, weights, value):
        """weights `[b, h, q, kv]`, value `[b, h_kv, kv, d_h]` -> output `[b, q, h * d_h]`."""
        out = torch.matmul(weights, repeat_kv(value, self.num_key_value_groups)).transpose(1, 2)
        return self.o_proj(out.reshape(*out.shape[:2], -1))


class RelationalAttention(nn.Module):
    """Relational heads: `A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)`.

    query `[b, h, q, d_h]`, key `[b, h_kv, kv, d_h]`, symbol values `[b|1, h_kv, kv, d_h]` (or the table
    `[2K + 1, h_kv, d_h]`), relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]` -> `[b, q, h * d_h]`,
    through `attention`, this forward's plan entry (its backend is recorded as `relational_attention_backend`).
    """

    # what tensor parallelism shards by head, and what every head reads whole (`tensor_parallel_dat.use_local_heads`)
    head_parameters = ("q_attn_proj", "k_attn_proj", "symbol_proj", "relation_proj")
    gathered_projections = ("q_rel_proj", "k_rel_proj")

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_relational_heads
        self.num_kv_heads = config.relational_kv_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.num_relations = config.relations
        self.relation_dim = config.relation_head_dim
        self.scaling = self.head_dim**-0.5
        self.relation_scaling = self.relation_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.relative_symbols = config.symbol_retrieval == "position_relative"
        self.max_relative_position = config.max_relative_position
        self.symmetric_relations = config.symmetric_relations
        self.relation_activation = config.relation_activation
        # CODEPATH: identity: the released LMs (configs/dat-343m.json); other `rel_activation`s: no released checkpoint.
        self.relation_act = ACT2FN[config.relation_activation] if config.relation_activation != "identity" else None
        self.relational_attention_backend = None
        d, hd, rd = config.hidden_size, self.head_dim, self.num_relations * self.relation_dim
        self.q_attn_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_attn_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.q_rel_proj = nn.Linear(d, rd, bias=False)
        # CODEPATH: asymmetric relations: the released LMs (awni00/DAT-sa8-ra8-ns1024-sh8-nkvh4-343M) and the paper's
        # math models; symmetric (`r(x, y) = r(y, x)`): the paper's ViDAT and relational-games models (no weights).
        if not config.symmetric_relations:
            self.k_rel_proj = nn.Linear(d, rd, bias=False)
        self.symbol_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)  # W_s
        self.relation_proj = nn.Parameter(torch.empty(self.num_heads, hd, self.num_relations))  # W_r [h, d_h, R]
        self.o_proj = nn.Linear(self.num_heads * hd, self.num_heads * hd, bias=config.attention_out_bias)
        self.o_proj.residual_init = True
        self.spec = RelationalSpec(self.num_key_value_groups, self.scaling, self.relation_scaling, self.relation_act)

    def local_relation_proj(self):
        """W_r `[h, d_h, R]` of this rank's heads (tensor parallelism shards it by head)."""
        return local_tensor(self.relation_proj)

    def project_symbols(self, symbols):
        """The position-relative symbol table `[2K + 1, d]` -> symbol values `[2K + 1, h_kv, d_h]`."""
        return self.symbol_proj(symbols).view(symbols.shape[0], -1, self.head_dim)

    def symbols_at(self, offset=None, ring: int | None = None, index=None):
        """A `RelativeSymbols` (None for symbols per sender): `offset` of the first receiver among the keys (default
        kv - q); `ring` slots; `index` long `[q, kv]`, precomputed rows."""
        if not self.relative_symbols:
            return None
        return RelativeSymbols(self.max_relative_position, offset, ring, index)

    def forward(self, query, key, symbol_values, relation_queries, relation_keys, attention: PlannedRelational,
                symbols_at: RelativeSymbols | None = None, **kwargs):
        messages = attention(self, query, key, symbol_values, relation_queries, relation_keys, symbols_at)
        return self.o_proj(messages.reshape(*messages.shape[:2], -1)), None, None

    def attention_weights(self, query, key, symbol_values, relation_queries, relation_keys,
                          attention: PlannedRelational):
        """Explicit weights `[b, h, q, kv]` (zero rows without senders) and relations `[b, R, q, kv]`."""
        if not torch.compiler.is_compiling():
            self.relational_attention_backend = attention.name
        weights, relations = relational_weights(
            query, repeat_kv(key, self.num_key_value_groups), relation_queries, relation_keys,
            attention.weights_mask(query.shape[2], key.shape[2], query.device), self.spec,
            self.attention_dropout if self.training else 0.0)
        return (weights if attention.row_valid is None else weights * attention.row_valid.to(weights.dtype)), relations

    def output_from_weights(self, weights, relations, symbol_values, symbols_at: RelativeSymbols | None = None):
        """Messages from explicit weights `[b, h, q, kv]` and relations, projected: -> `[b, q, h * d_h]`."""
        b, _, q_len, kv_len = weights.shape
        symbol_index = None if symbols_at is None else symbols_at.rows(0, q_len, q_len, kv_len, weights.device)
        messages = relational_messages(weights, relations,
                                       per_head_symbols(symbol_values, self.num_key_value_groups, b),
                                       self.local_relation_proj(), symbol_index)
        return self.o_proj(messages.reshape(b, q_len, -1))


@replaceable("dual_attention_step")
def fused_decoding_step(module, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                        **kwargs):
    """A decoding step of `module` (a `DualAttention`) as one kernel: its forward's outputs, or None (the reference:
    no kernel takes this step, the forward computes it part by part)."""
    return None


class DualAttention(nn.Module):
    """Sensory and relational heads side by side, outputs concatenated; one fused input projection, one cache layer.

    hidden_states `[b, n, d]`, symbols `[b|1, n, d]` (or the relative table) -> output `[b, n, d]`, weights
    `[b, h_s + h_r, n, kv]` and relations `[b, R, n, kv]` (both only with `output_attentions`).
    """

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # CODEPATH: sensory heads: every released checkpoint; none (`n_heads_sa=0`): no released checkpoint.
        self.sensory = SensoryAttention(config, layer_idx, is_causal) if config.num_sensory_heads > 0 else None
        # CODEPATH: relational heads: awni00/DAT-sa8-ra8-ns1024-sh8-nkvh4-343M; none: awni00/T-sa24-757M.
        self.relational = RelationalAttention(config, layer_idx, is_causal) if config.num_relational_heads > 0 else None
        self.share_qk = config.share_attention_params and self.sensory is not None and self.relational is not None
        self.head_dim = config.head_dim
        self.plan_projections()

    def plan_projections(self):
        """The fused input projection and cache layout, from the head counts (rerun by `use_local_heads`)."""
        rel, sen = self.relational, self.sensory
        self.packed = PackedCache(sen, rel, self.head_dim, self.share_qk)
        own_qk = [m for m in (rel, sen) if m is not None and not (m is sen and self.share_qk)]
        self._query_heads = tuple(m.num_heads for m in own_qk)
        self._key_heads_total = sum(self.packed.key_heads)
        # fused output: [keys | queries] (relational first), sensory values, relation queries, relation keys
        names = {"relational": ("k_attn_proj", "q_attn_proj"), "sensory": ("k_proj", "q_proj")}
        owners = ["relational" if m is rel else "sensory" for m in own_qk]
        keys_queries = [(o, names[o][0]) for o in owners] + [(o, names[o][1]) for o in owners]
        parts = [(keys_queries, (self._key_heads_total + sum(self._query_heads)) * self.head_dim)]
        if sen is not None:
            parts.append(([("sensory", "v_proj")], sen.num_kv_heads * self.head_dim))
        if rel is not None:
            relation_projections = ["q_rel_proj"] + ([] if rel.symmetric_relations else ["k_rel_proj"])
            parts += [([("relational", name)], rel.num_relations * rel.relation_dim) for name in relation_projections]
        self.input_projections = FusedProjections.plan(parts)

    def forward(self, hidden_states, symbols, position_embeddings=None, sensory_plan=None, relational_plan=None,
                cache=None, relative_position_index=None, **kwargs):
        step = fused_decoding_step(self, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan,
                                   cache, **kwargs)
        if step is not None:  # a registered kernel took the whole step
            return step
        b, n, _ = hidden_states.shape
        relational, sensory = self.relational, self.sensory  # module attribute lookups are slow
        parts = project_fused(self.input_projections, sensory, relational, hidden_states)
        # [keys | queries] `[b, n, heads, d_h]`: RoPE once, then `[b, heads, n, d_h]` views
        keys_queries = parts.pop(0).view(b, n, -1, self.head_dim)
        if position_embeddings is not None:
            keys_queries = apply_rotary(keys_queries, *position_embeddings)
        keys_queries = keys_queries.transpose(1, 2)
        key_cache = keys_queries[:, : self._key_heads_total]
        values = []  # flat `[b, n, width]`: sensory values, symbol values, relation keys
        if sensory is not None:
            values.append(parts.pop(0))
        symbols_at = None
        if relational is not None:
            relation_queries = parts[0].view(b, n, relational.num_relations, relational.relation_dim)
            if relational.relative_symbols:
                symbol_values = relational.project_symbols(symbols)  # the per-offset table, not cached
                slots = receiver_slots(cache, self.layer_idx, n, relational.max_relative_position)
                symbols_at = relational.symbols_at(**{"index": relative_position_index, **slots})
            else:
                symbol_values = relational.symbol_proj(symbols)
                values.append(symbol_values if symbol_values.shape[0] == b else symbol_values.expand(b, n, -1))
            values.append(parts[-1])  # relation keys (the relation queries for symmetric relations)
        keys, values = packed_update(cache, self.packed, key_cache, values, self.layer_idx)
        queries = keys_queries[:, self._key_heads_total:].split(self._query_heads, dim=1)
        q_r, k_r = queries[0], keys[0]
        q_s, k_s = (q_r, k_r) if self.share_qk else (queries[-1], keys[-1])
        if relational is not None and not relational.relative_symbols:
            symbol_values = values[-2]
        sensory_inputs = (q_s, k_s, values[0], sensory_plan) if sensory is not None else None
        relational_inputs = (q_r, k_r, symbol_values, relation_queries, values[-1], relational_plan,
                             symbols_at) if relational is not None else None
        return dual_attention_outputs(sensory, relational, sensory_inputs, relational_inputs, **kwargs)


def dual_attention_outputs(sensory, relational, sensory_inputs, relational_inputs, **kwargs):
    """-> (output `[b, q, (h_s + h_r) d_h]` (sensory first), weights or None, relations or None)."""
    if kwargs.get("output_attentions", False):
        return attend_with_weights(sensory, relational, sensory_inputs, relational_inputs)
    outputs = []
    if sensory is not None:
        outputs.append(sensory(*sensory_inputs, **kwargs)[0])
    if relational is not None:
        outputs.append(relational(*relational_inputs)[0])
    return (torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]), None, None


__all__ = ["DualAttention", "FusedProjections", "SensoryAttention", "RelationalAttention",
           "DATRotaryEmbedding", "apply_rotary", "project_fused", "dual_attention_outputs", "fused_linear"]
