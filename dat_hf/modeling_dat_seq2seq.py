# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Encoder-decoder Dual Attention Transformer: DATSeq2SeqModel and DATForSeq2SeqLM.

    encoder layer:  x += DualAttention(norm(x), s(x))            bidirectional (any relational bias, `full` default)
                    x += MLP(norm(x))
    decoder layer:  y += DualAttention(norm(y), s(y))            causal, cached in the self-attention cache
                    y += CrossAttention(norm(y), x_enc)          `sensory`: multi-head attention to the source;
                                                                 `dual`: + relational heads across the bipartition,
                                                                   sum_j a_ij (r(y_i, x_j) W_r + s(x_j) W_s)
                    y += MLP(norm(y))

Cross-attention keys/values (and, for `dual`, relation keys and source symbol values) are computed once per
generation and kept in the cross-attention half of an `EncoderDecoderCache` (`is_updated[layer]`).
The encoder and decoder stacks share the config's dual-attention fields; each stack's layers are built from a copy
of the config with its own fields (depth, attention graph, positions, cross-attention head counts: `stack_config`).
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from .attention_plan import AttentionPlan, gradients_flow
from .configuration_dat_seq2seq import DATSeq2SeqConfig
from .cache_dat import PackedCache, forward_cache
from .dual_attention import (DualAttention, FusedProjections, RelationalAttention, SensoryAttention,
                             dual_attention_outputs, project_fused)
from .kernel_hooks import check_inputs
from .masking_dat import build_cross_attention_mask, build_masks
from .relational_biases import CROSS_ATTENTION_BIAS
from .modeling_dat import (
    DAT_OUTPUT_ARGS,
    DATMLP,
    DATDecoderLayer,
    DATGenerationMixin,
    DATModel,
    DATPreTrainedModel,
    embed_positions,
    init_text_stack,
    make_norm,
    prepare_decoder_inputs,
    run_dat_layers,
    run_text_stack,
    stack_forward,
)
from .transformers_compat import CACHE_NAMES, cache_kwargs, output_cache, slice_logits_to_keep, takes_cache


def stack_config(config: DATSeq2SeqConfig, **fields) -> DATSeq2SeqConfig:
    """A copy of `config` (shallow: nothing is shared that is written) with one stack's own `fields` (depth, attention
    graph, positions, or the cross-attention's head counts): the layers of that stack are built from it (its
    properties, e.g. `head_dim`, follow the fields). The attention implementations of a forward come from the model's
    config (`AttentionPlan`), never from a copy."""
    stack = copy.copy(config)
    for name, value in fields.items():
        setattr(stack, name, value)
    return stack


def encoder_stack_config(config: DATSeq2SeqConfig) -> DATSeq2SeqConfig:
    return stack_config(
        config,
        num_hidden_layers=config.encoder_layers,
        relational_bias=config.encoder_relational_bias,
        relational_heads_bias=None,
        position_embedding_type=config.encoder_position_type,
        max_position_embeddings=config.encoder_max_positions,
    )


def cross_attention_config(config: DATSeq2SeqConfig) -> DATSeq2SeqConfig:
    return stack_config(
        config,
        num_sensory_heads=config.cross_sensory_heads,
        num_relational_heads=config.cross_relational_heads,
        num_sensory_key_value_heads=config.num_cross_attention_key_value_heads,
        num_relational_key_value_heads=None,
        share_attention_params=False,
        attention_bias=config.cross_attention_bias,
        attention_out_bias=config.cross_attention_out_bias,
    )


def decoder_symbol_config(config: DATSeq2SeqConfig) -> DATSeq2SeqConfig:
    """The decoder's retrievers also give `dual` cross-attention its source symbols: positional symbols then need
    room for source positions."""
    # CODEPATH: no released checkpoint has `dual` cross-attention (dat_hf's relational cross heads); the paper's math
    # models cross-attend with 8 sensory heads.
    if config.cross_relational_heads > 0 and config.max_symbol_positions is None:
        return stack_config(config, max_symbol_positions=max(config.max_position_embeddings, config.encoder_max_positions))
    return config


def source_position_ids(attention_mask, batch_size, length, device):
    """Positions of source tokens (padding-aware, as in the encoder)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.arange(length, device=device)[None].expand(batch_size, -1)


class CrossAttentionSource:
    """The source side of the decoder layers' cross-attention in one forward (`run_dat_layers`): the encoder's states
    `[b, m, d]` and, for relational cross heads (`dual`), the source tokens' symbols `s_i(x_enc)` `[b|1, m, d]`, made
    by the decoder's retrievers for layer i unless its cross-attention cache layer holds their values already (they
    are computed once per generation)."""

    def __init__(self, hidden_states, attention_mask, symbol_retrievers, cache, relational: bool):
        self.hidden_states = hidden_states
        self.symbol_retrievers = symbol_retrievers if relational else None
        self.cache = cache
        self.positions = None
        if relational:
            batch_size, length = hidden_states.shape[:2]
            self.positions = source_position_ids(attention_mask, batch_size, length, hidden_states.device)

    def symbols(self, layer_idx: int):
        if self.symbol_retrievers is None or self.cache.holds_source(layer_idx):
            return None
        return self.symbol_retrievers(layer_idx, self.hidden_states, self.positions)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int | None):
    """`[start, y_0, ..., y_{n-2}]` from labels `[b, n]` (-100 replaced by the pad token)."""
    if decoder_start_token_id is None:
        raise ValueError("`config.decoder_start_token_id` must be set to build `decoder_input_ids` from `labels`.")
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    if (shifted == -100).any():
        if pad_token_id is None:
            raise ValueError("`config.pad_token_id` must be set to replace -100 in `labels` when shifting them.")
        shifted.masked_fill_(shifted == -100, pad_token_id)
    return shifted


# Cross-attention weights of DAT decoders (every cross head), in the format `auto_docstring` reads
CROSS_ATTENTION_ARGS = r"""
cross_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
    Cross-attention weights of every cross head (sensory heads, then the relational heads of `dual`
    cross-attention): one tensor of shape `(batch_size, num_cross_heads, target_length, source_length)` per decoder
    layer.
"""
# The encoder's and the decoder's relations (and every head's weights) in the seq2seq outputs
SEQ2SEQ_OUTPUT_ARGS = CROSS_ATTENTION_ARGS + r"""
encoder_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
    Attention weights of every encoder head, sensory heads first: one tensor of shape `(batch_size,
    num_sensory_heads + num_relational_heads, source_length, source_length)` per encoder layer.
decoder_attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
    Self-attention weights of every decoder head, sensory heads first: one tensor of shape `(batch_size,
    num_sensory_heads + num_relational_heads, target_length, key_length)` per decoder layer.
encoder_relations (`tuple(torch.FloatTensor)`, *optional*, returned when `output_relations=True`):
    The relations of the encoder's relational heads: one tensor of shape `(batch_size, num_relations, source_length,
    source_length)` per encoder layer.
decoder_relations (`tuple(torch.FloatTensor)`, *optional*, returned when `output_relations=True`):
    The relations of the decoder self-attention's relational heads: one tensor of shape `(batch_size, num_relations,
    target_length, key_length)` per decoder layer.
"""


@auto_docstring(custom_args=SEQ2SEQ_OUTPUT_ARGS)
@dataclass
class DATSeq2SeqModelOutput(Seq2SeqModelOutput):
    encoder_relations: tuple[torch.FloatTensor, ...] | None = None
    decoder_relations: tuple[torch.FloatTensor, ...] | None = None


@auto_docstring(custom_args=SEQ2SEQ_OUTPUT_ARGS)
@dataclass
class DATSeq2SeqLMOutput(Seq2SeqLMOutput):
    encoder_relations: tuple[torch.FloatTensor, ...] | None = None
    decoder_relations: tuple[torch.FloatTensor, ...] | None = None


@auto_docstring(custom_args=DAT_OUTPUT_ARGS)
@dataclass
class DATEncoderOutput(BaseModelOutput):
    relations: tuple[torch.FloatTensor, ...] | None = None


@auto_docstring(custom_args=DAT_OUTPUT_ARGS + CROSS_ATTENTION_ARGS)
@dataclass
class DATDecoderOutput(BaseModelOutputWithPastAndCrossAttentions):
    relations: tuple[torch.FloatTensor, ...] | None = None


class DATCrossAttention(nn.Module):
    """Decoder-to-encoder attention over the bipartite graph (every target token to every unpadded source token).

    `sensory` heads: softmax(q(y_i) k(x_j)) v(x_j). `dual` adds relational heads: softmax(q(y_i) k(x_j)) weights
    `r(y_i, x_j) W_r + s_j W_s`, with `r_l(y_i, x_j) = <y_i W_{q,l}, x_j W_{k,l}> / sqrt(d_r)` and the source symbols
    `s_j`. The query projections see the decoder, the key/value/relation-key/symbol projections the encoder (and its
    symbols). No positions are applied (the reference's cross-attention has none). hidden_states `[b, n, d]` ->
    `[b, n, d]`.

    Cache: as the decoder's own layers (`PackedCache`), written once with the source's keys and values.
    """

    def __init__(self, config: DATSeq2SeqConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        cross_config = cross_attention_config(config)
        self.head_dim = cross_config.head_dim
        self.sensory = SensoryAttention(cross_config, layer_idx, is_causal=False) if cross_config.num_sensory_heads else None
        self.relational = (
            RelationalAttention(cross_config, layer_idx, is_causal=False) if cross_config.num_relational_heads else None
        )
        self.symmetric_relations = config.symmetric_relations
        self.plan_projections()

    def plan_projections(self):
        """The fused projections (`FusedProjections`: target queries; source keys, values and relation keys) and the
        cache layout, from the heads' counts (again after tensor parallelism: `use_local_heads`)."""
        sen, rel, hd = self.sensory, self.relational, self.head_dim
        self.packed = PackedCache(sen, rel, hd)
        queries, source = [], []  # (projections, width) per part
        if sen is not None:
            queries.append(([("sensory", "q_proj")], sen.num_heads * hd))
            source += [([("sensory", name)], sen.num_kv_heads * hd) for name in ("k_proj", "v_proj")]
        if rel is not None:
            relation_width = rel.num_relations * rel.relation_dim
            relation_keys = "q_rel_proj" if self.symmetric_relations else "k_rel_proj"
            queries += [([("relational", "q_attn_proj")], rel.num_heads * hd),
                        ([("relational", "q_rel_proj")], relation_width)]
            source += [([("relational", "k_attn_proj")], rel.num_kv_heads * hd),
                       ([("relational", relation_keys)], relation_width)]
        self.query_projections = FusedProjections.plan(queries)
        self.source_projections = FusedProjections.plan(source)

    def _project_queries(self, hidden_states):
        """Target queries (one matrix product): sensory `[b, h_s, n, d_h]`, relational `[b, h_r, n, d_h]`, relation
        queries `[b, n, R, d_r]` (None for a head type the layer lacks)."""
        b, n, _ = hidden_states.shape
        sen, rel, hd = self.sensory, self.relational, self.head_dim
        parts = project_fused(self.query_projections, sen, rel, hidden_states)
        q_s = parts.pop(0).view(b, n, -1, hd).transpose(1, 2) if sen is not None else None
        q_r = q_rel = None
        if rel is not None:
            q_r = parts[0].view(b, n, -1, hd).transpose(1, 2)
            q_rel = parts[1].view(b, n, rel.num_relations, rel.relation_dim)
        return q_s, q_r, q_rel

    def _project_source(self, encoder_hidden_states, source_symbols):
        """Keys and values of the source (one matrix product, plus the symbol values), in the order of the packed
        cache (`PackedCache`): keys `[b, h_kv, m, d_h]` (relational, sensory) and flat values `[b, m, width]`
        (sensory values, symbol values, relation keys)."""
        b, m, _ = encoder_hidden_states.shape
        sen, rel, hd = self.sensory, self.relational, self.head_dim
        parts = project_fused(self.source_projections, sen, rel, encoder_hidden_states)
        keys, values = [], []
        if sen is not None:
            keys.append(parts.pop(0).view(b, m, -1, hd).transpose(1, 2))
            values.append(parts.pop(0))
        if rel is not None:
            keys.insert(0, parts[0].view(b, m, -1, hd).transpose(1, 2))
            values += [rel.symbol_proj(source_symbols).expand(b, m, -1), parts[1]]
        return keys, values

    def forward(self, hidden_states, encoder_hidden_states, source_symbols, cross_plan, cache=None, **kwargs):
        """`cross_plan`: this forward's plan of the bipartite graph (`AttentionPlan`)."""
        q_s, q_r, q_rel = self._project_queries(hidden_states)
        # the source's keys and values: cached, or projected (and cached, once per generation)
        keys, values = forward_cache(cache).source(
            self.packed, self.layer_idx, lambda: self._project_source(encoder_hidden_states, source_symbols))
        sensory_inputs = relational_inputs = None
        if self.sensory is not None:
            sensory_inputs = (q_s, keys[-1], values[0], cross_plan.sensory[CROSS_ATTENTION_BIAS])
        if self.relational is not None:
            relational_inputs = (q_r, keys[0], values[-2], q_rel, values[-1],
                                 cross_plan.relational[CROSS_ATTENTION_BIAS], None)
        return dual_attention_outputs(self.sensory, self.relational, sensory_inputs, relational_inputs, **kwargs)


class DATSeq2SeqDecoderLayer(GradientCheckpointingLayer):
    """Causal dual attention, cross-attention to the encoder, MLP (pre- or post-norm). `[b, n, d]` -> `[b, n, d]`."""

    def __init__(self, config: DATSeq2SeqConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.pre_norm = config.pre_norm
        self.input_layernorm = make_norm(config)
        self.dual_attn = DualAttention(config, layer_idx, is_causal=True)
        self.cross_attention_layernorm = make_norm(config)
        self.cross_attn = DATCrossAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = DATMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, symbols, encoder_hidden_states, source_symbols=None, position_embeddings=None,
                sensory_plan=None, relational_plan=None, cross_plan=None, cache=None, **kwargs):
        """symbols `[b|1, n, d]` (or None) of the target, encoder_hidden_states `[b, m, d]`, source_symbols `[b|1, m,
        d]` (for `dual` cross-attention while its cache layer is empty, else None); `cache` the forward's
        `ForwardCache` (its own half and the source's)."""

        def self_attend(x):
            out, _, _ = self.dual_attn(x, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                                       **kwargs)
            return self.dropout(out)

        def cross_attend(x):
            out, _, _ = self.cross_attn(x, encoder_hidden_states, source_symbols, cross_plan, cache,
                                        **kwargs)
            return self.dropout(out)

        if self.pre_norm:
            hidden_states = hidden_states + self_attend(self.input_layernorm(hidden_states))
            hidden_states = hidden_states + cross_attend(self.cross_attention_layernorm(hidden_states))
            hidden_states = hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        else:
            hidden_states = self.input_layernorm(hidden_states + self_attend(hidden_states))
            hidden_states = self.cross_attention_layernorm(hidden_states + cross_attend(hidden_states))
            hidden_states = self.post_attention_layernorm(hidden_states + self.dropout(self.mlp(hidden_states)))
        return hidden_states


@auto_docstring
class DATSeq2SeqPreTrainedModel(DATPreTrainedModel):
    config: DATSeq2SeqConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DATDecoderLayer", "DATSeq2SeqDecoderLayer"]
    _can_record_outputs = None
    # Trainer: the loss is a plain mean over label tokens (no `num_items_in_batch`)
    accepts_loss_kwargs = False
    # seq2seq outputs keep Transformers' fields under `output_attentions`: relations only with `output_relations=True`
    relations_with_attentions = False

    auto_classes = {
        "AutoConfig": "configuration_dat_seq2seq.DATSeq2SeqConfig",
        "AutoModel": "modeling_dat_seq2seq.DATSeq2SeqModel",
        "AutoModelForSeq2SeqLM": "modeling_dat_seq2seq.DATForSeq2SeqLM",
    }

    # the encoder and the decoder are models of their own inside the seq2seq model, which holds the parallel plans of
    # both (`DATSeq2SeqConfig.base_model_tp_plan` names `encoder.layers.*` and `decoder.layers.*`)
    is_stack = False

    def _tied_mapping(self) -> dict:
        return {}

    def init_parallel_plans(self) -> None:
        super().init_parallel_plans()
        if self.is_stack:
            self._tp_plan, self._pp_plan = {}, {}

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """`set_attn_implementation` applies: every attention call goes through an `AttentionInterface`
        (`dual_attention.SensoryAttention.forward`). Transformers' own check reads only this file, finds
        `DATCrossAttention` and not the interface, and would refuse."""
        return True

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """Ties follow the config: `share_embeddings` (encoder/decoder token embeddings) and `tie_word_embeddings`
        (LM head) independently."""
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return self._tied_mapping()


def encoder_hidden_states_recorder() -> OutputRecorder:
    """The encoder's hidden-state recorder: its layers are counted by `config.encoder_layers`, which resolves negative
    `output_hidden_states` indices. Set as an attribute, not passed to the constructor: Transformers 5.17's
    `OutputRecorder` has no `num_hidden_layers_key` field (and takes no negative indices), later versions read it."""
    recorder = OutputRecorder(DATDecoderLayer, index=0)
    recorder.num_hidden_layers_key = "encoder_layers"
    return recorder


class DATSeq2SeqEncoder(DATSeq2SeqPreTrainedModel):
    """The bidirectional DAT encoder. input_ids `[b, m]` -> last_hidden_state `[b, m, d]`."""

    is_stack = True

    _can_record_outputs = {
        "hidden_states": encoder_hidden_states_recorder(),
        "attentions": OutputRecorder(DualAttention, index=1),
        "relations": OutputRecorder(DualAttention, index=2),
    }

    def __init__(self, config: DATSeq2SeqConfig):
        super().__init__(config)
        stack = encoder_stack_config(config)
        # CODEPATH: relational heads: the paper's math DAT models (4 sensory + 4 relational encoder heads); none: their
        # Transformer baselines (8 self-attention heads). No final norm: the reference `Seq2SeqDualAttnTransformer`
        # (the paper's math models, converted with `final_norm=False`); a final norm: dat_hf's default for models
        # trained from scratch. No released weights.
        layers = [DATDecoderLayer(stack, i, is_causal=False) for i in range(config.encoder_layers)]
        init_text_stack(self, stack, config.source_vocab_size, layers, uses_symbols=config.num_relational_heads > 0,
                        final_norm=config.final_norm)
        self.post_init()

    @stack_forward
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> DATEncoderOutput:
        r"""
        Returns:
            [`DATEncoderOutput`] (a tuple with `return_dict=False`): `last_hidden_state` `(batch_size, source_length,
            hidden_size)`, and on request the hidden states, the attention weights of every head and the relations.
        """
        stack = encoder_stack_config(self.config)  # (live: e.g. `resize_token_embeddings` changes the vocabulary)
        # CODEPATH: error wording only. A separate source vocabulary: no released checkpoint (the paper's math models
        # share one character vocabulary).
        vocab_field = "encoder_vocab_size" if self.config.encoder_vocab_size else "vocab_size"
        check_inputs("text_inputs", input_ids, inputs_embeds, attention_mask, position_ids,
                     vocab_size=stack.source_vocab_size, hidden_size=stack.hidden_size, vocab_field=vocab_field)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len, _ = inputs_embeds.shape
        check_inputs("source_length", seq_len, stack.max_position_embeddings, "encoder_max_position_embeddings")
        for key in ("output_relations", "output_hidden_states"):
            kwargs.pop(key, None)
        if position_ids is None:
            position_ids = DATModel._default_position_ids(attention_mask, batch_size, seq_len, 0, inputs_embeds.device)
        check_inputs("positions", stack, self.symbol_retrievers, position_ids)
        hidden_states, position_embeddings = embed_positions(self, inputs_embeds, position_ids,
                                                             stack.position_embedding_type)

        biases = [self.config.encoder_layer_bias(i) for i in range(self.config.encoder_layers)]
        masks = build_masks(biases, self.config, inputs_embeds, attention_mask, causal=False)
        plan = AttentionPlan.build(masks, self.config, inputs_embeds, kwargs.get("output_attentions", False),
                                   gradients_flow(self, inputs_embeds), self.training)
        hidden_states = run_dat_layers(
            self.layers, self.symbol_retrievers, hidden_states, position_ids, [(b, b) for b in biases], plan,
            position_embeddings=position_embeddings, **kwargs,
        )
        hidden_states = self.norm(hidden_states)
        return DATEncoderOutput(last_hidden_state=hidden_states)


class DATSeq2SeqDecoder(DATSeq2SeqPreTrainedModel):
    """The causal DAT decoder with cross-attention. decoder input_ids `[b, n]` -> last_hidden_state `[b, n, d]`."""

    is_stack = True
    is_causal = True

    _can_record_outputs = {
        "hidden_states": OutputRecorder(DATSeq2SeqDecoderLayer, index=0),
        "attentions": OutputRecorder(DualAttention, index=1, layer_name="dual_attn"),
        "cross_attentions": OutputRecorder(DATCrossAttention, index=1),
        "relations": OutputRecorder(DualAttention, index=2, layer_name="dual_attn"),
    }

    def __init__(self, config: DATSeq2SeqConfig):
        super().__init__(config)
        # CODEPATH: symbols in the decoder: the paper's math DAT with 4 + 4 decoder heads, and `dual` cross-attention
        # (dat_hf only); none: its variant with a standard decoder (8 sensory heads). No released weights. The final
        # norm as in the encoder: none in the reference's math models, one in dat_hf's default.
        layers = [DATSeq2SeqDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        init_text_stack(self, config, config.vocab_size, layers, uses_symbols=config.decoder_uses_symbols,
                        symbol_config=decoder_symbol_config(config), final_norm=config.final_norm)
        self.post_init()

    @stack_forward
    @auto_docstring
    @takes_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.FloatTensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DATDecoderOutput:
        r"""
        Returns:
            [`DATDecoderOutput`] (a tuple with `return_dict=False`): `last_hidden_state` `(batch_size, target_length,
            hidden_size)`, the cache, and on request the hidden states, the (cross-)attention weights of every head
            and the relations.
        """
        inputs_embeds, cache, position_ids, mask_positions = prepare_decoder_inputs(
            self, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache, kwargs, prefix="decoder_")
        check_inputs("encoder_states", encoder_hidden_states, encoder_attention_mask, inputs_embeds.shape[0],
                     self.config.hidden_size)
        cross_mask = build_cross_attention_mask(self.config, inputs_embeds, encoder_hidden_states, encoder_attention_mask)
        cross_plan = AttentionPlan.build({CROSS_ATTENTION_BIAS: cross_mask}, self.config, inputs_embeds,
                                         kwargs.get("output_attentions", False), gradients_flow(self, inputs_embeds),
                                         self.training)
        source = CrossAttentionSource(encoder_hidden_states, encoder_attention_mask, self.symbol_retrievers, cache,
                                      relational=self.config.cross_relational_heads > 0)
        # CODEPATH: target symbols for the decoder's own relational heads (the paper's math DAT with 4 + 4 decoder
        # heads); without them the retrievers serve only `dual` cross-attention (no released checkpoint).
        target_retrievers = self.symbol_retrievers if self.config.num_relational_heads > 0 else None
        hidden_states = run_text_stack(self, inputs_embeds, attention_mask, cache, position_ids, mask_positions,
                                       target_retrievers, kwargs, source=source, cross_plan=cross_plan)
        return DATDecoderOutput(last_hidden_state=hidden_states, **cache_kwargs(cache.cache))


@auto_docstring(
    custom_intro="Encoder + decoder. (input_ids `[b, m]`, decoder_input_ids `[b, n]`) -> last_hidden_state `[b, n, d]`."
)
class DATSeq2SeqModel(DATSeq2SeqPreTrainedModel):

    _tied_weights_keys = {"decoder.embed_tokens.weight": "encoder.embed_tokens.weight"}

    def __init__(self, config: DATSeq2SeqConfig):
        super().__init__(config)
        self.encoder = DATSeq2SeqEncoder(config)
        self.decoder = DATSeq2SeqDecoder(config)
        self.post_init()

    def _tied_mapping(self):
        # CODEPATH: separate source and target embeddings: the paper's math models (the reference has two embedders;
        # `share_embeddings=False` at conversion); shared: dat_hf's default (one vocabulary). No released weights.
        return dict(self._tied_weights_keys) if self.config.share_embeddings else {}

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value):
        self.encoder.embed_tokens = value
        # CODEPATH: shared embeddings (dat_hf's default) vs the math models' separate ones, as in `_tied_mapping`.
        if self.config.share_embeddings:
            self.decoder.embed_tokens = value

    def get_encoder(self, modality=None):
        return self.encoder

    def get_decoder(self):
        return self.decoder

    @can_return_tuple
    @auto_docstring
    @takes_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        encoder_outputs: tuple | BaseModelOutput | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        decoder_inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATSeq2SeqModelOutput:
        r"""
        decoder_position_ids (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            Positions of the target tokens (default: counted from the cache and the decoder's padding).

        Returns:
            [`DATSeq2SeqModelOutput`] (a tuple with `return_dict=False`): the decoder's `last_hidden_state`
            `(batch_size, target_length, hidden_size)`, the encoder's, the cache, and on request the hidden states,
            the (cross-)attention weights of every head and the relations of both stacks.
        """
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "DATSeq2SeqModel needs `decoder_input_ids` or `decoder_inputs_embeds` (DATForSeq2SeqLM also accepts "
                "`labels`, from which it builds `decoder_input_ids`)."
            )
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = DATEncoderOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        source = input_ids if input_ids is not None else inputs_embeds
        encoder_hidden = encoder_outputs.last_hidden_state
        if source is not None and source.shape[0] != encoder_hidden.shape[0]:
            raise ValueError(
                f"Batch size mismatch: `input_ids` has {source.shape[0]} sequences but `encoder_outputs` {encoder_hidden.shape[0]}."
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, encoder_hidden_states=encoder_hidden,
            encoder_attention_mask=attention_mask, position_ids=decoder_position_ids, cache=cache,
            inputs_embeds=decoder_inputs_embeds, use_cache=use_cache, **kwargs,
        )
        return DATSeq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_kwargs(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_hidden,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            encoder_relations=getattr(encoder_outputs, "relations", None),
            decoder_relations=getattr(decoder_outputs, "relations", None),
        )


@auto_docstring(
    custom_intro=r"""
    DAT encoder-decoder with a language-model head. (input_ids `[b, m]`, decoder_input_ids or labels `[b, n]`) ->
    logits `[b, n, vocab]`; loss = plain token cross-entropy on `labels` (-100 ignored), which are *not* shifted:
    `logits[:, t]` predicts `labels[:, t]` (decoder inputs are the labels shifted right).
    """
)
class DATForSeq2SeqLM(DATSeq2SeqPreTrainedModel, DATGenerationMixin):

    _tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: DATSeq2SeqConfig):
        super().__init__(config)
        self.model = DATSeq2SeqModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def _tied_mapping(self):
        if not self.config.tie_word_embeddings:
            return {}
        # CODEPATH: tied LM heads are dat_hf's (the math models convert untied: the reference's tying is a no-op). With
        # shared embeddings (dat_hf's default), tie to the source of the encoder/decoder tie (one parameter for all).
        source = "model.encoder.embed_tokens.weight" if self.config.share_embeddings else "model.decoder.embed_tokens.weight"
        return {"lm_head.weight": source}

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def get_encoder(self, modality=None):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, **kwargs):
        # (both names in the signature: `generate()` before Transformers 5.24 checks its kwargs against it)
        cache = cache if cache is not None else past_key_values
        # A compileable cache gets the decoder's masks built before the step (`create_masks_for_generate`), which
        # Transformers 5.17 does only when given a decoder padding mask: the decoder's tokens are all real, so give
        # it the all-ones one (a sliding-window static cache cannot have its masks built in a compiled step).
        if getattr(cache, "is_compileable", False) and kwargs.get("decoder_attention_mask") is None:
            kwargs["decoder_attention_mask"] = torch.ones_like(input_ids)
        return super().prepare_inputs_for_generation(input_ids, **cache_kwargs(cache), **kwargs)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor):
        """Decoder inputs for `labels` (used by `DataCollatorForSeq2Seq`): labels shifted right behind
        `decoder_start_token_id`, -100 replaced by `pad_token_id`."""
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @can_return_tuple
    @auto_docstring
    @takes_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        encoder_outputs: tuple | BaseModelOutput | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        decoder_inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATSeq2SeqLMOutput:
        r"""
        decoder_position_ids (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            Positions of the target tokens (default: counted from the cache and the decoder's padding).
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            Target token ids (-100 ignored), *not* shifted: `logits[:, t]` predicts `labels[:, t]`. Without
            `decoder_input_ids`, the decoder inputs are the labels shifted right behind `decoder_start_token_id`.

        Returns:
            [`DATSeq2SeqLMOutput`] (a tuple with `return_dict=False`): `logits` `(batch_size, target_length,
            vocab_size)` (the last `logits_to_keep` positions), `loss` with `labels`, the encoder's
            `last_hidden_state`, the cache, and on request the hidden states, the (cross-)attention weights of every
            head and the relations of both stacks.
        """
        check_inputs("seq2seq_inputs", input_ids, inputs_embeds, decoder_input_ids, decoder_inputs_embeds, labels,
                     self.config.vocab_size)
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs: DATSeq2SeqModelOutput = self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, decoder_position_ids=decoder_position_ids,
            encoder_outputs=encoder_outputs, cache=cache, inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds, use_cache=use_cache, **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            # plain cross-entropy, no shift (self.loss_function would pick the causal-LM loss, which shifts)
            loss = nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.to(logits.device).reshape(-1), ignore_index=-100
            )
        recorded = {name: getattr(outputs, name) for name in DATSeq2SeqModelOutput.__dataclass_fields__
                    if name != "last_hidden_state" and name not in CACHE_NAMES}
        return DATSeq2SeqLMOutput(loss=loss, logits=logits, **cache_kwargs(output_cache(outputs)), **recorded)


__all__ = [
    "DATSeq2SeqPreTrainedModel",
    "DATSeq2SeqEncoder",
    "DATSeq2SeqDecoder",
    "DATSeq2SeqModel",
    "DATForSeq2SeqLM",
    "DATSeq2SeqDecoderLayer",
    "DATCrossAttention",
    "shift_tokens_right",
]
