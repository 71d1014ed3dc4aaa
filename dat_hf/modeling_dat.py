# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Dual Attention Transformer language model: DATModel, DATForCausalLM, DATForSequenceClassification.

A DAT layer (pre-norm shown; post-norm is supported):

    s   = SymbolRetriever(x)                       (symbolic attention, positional or position-relative symbols)
    x  += DualAttention(norm1(x), s)               (sensory heads | relational heads, concatenated)
    x  += MLP(norm2(x))
"""

import os
from dataclasses import dataclass
from functools import wraps

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN, SiLUActivation
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .atomic_save import finish_interrupted_save, save_atomically
from .configuration_dat import DATConfig, DATEncoderConfig
from .dual_attention import (
    DATRotaryEmbedding,
    DualAttention,
    RelationalAttention,
    SensoryAttention,
    use_in_place_cache_layers,
)
from .input_validation import (
    validate_classification_labels,
    validate_graph_inputs,
    validate_lm_labels,
    validate_positions,
    validate_text_inputs,
    validate_token_classification,
)
from .masking_dat import build_masks
from .relational_kernel_cpu import cpu_kernel_ready, cpu_swiglu, cpu_swiglu_backward, load_cpu_kernel
from .symbol_retrieval import PositionalSymbols, PositionRelativeSymbols, SymbolicAttention, SymbolRetrievers


@dataclass
class DATModelOutputWithPast(BaseModelOutputWithPast):
    """`attentions` are the sensory heads' weights; `relational_attentions` the relational heads' weights
    `[b, h_r, q, kv]` and `relations` the relation tensors `[b, R, q, kv]`, one per layer."""

    relational_attentions: tuple[torch.FloatTensor, ...] | None = None
    relations: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DATCausalLMOutputWithPast(CausalLMOutputWithPast):
    relational_attentions: tuple[torch.FloatTensor, ...] | None = None
    relations: tuple[torch.FloatTensor, ...] | None = None


class DATRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        # x / rms(x) * w, computed in float32
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(config) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return DATRMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


def _fused_swiglu(act_fn, gate, up) -> bool:
    """Whether `silu(gate) * up` can take the compiled one-pass op: SwiGLU, float32 on CPU, eager, and no graph wanted
    through it (the op has no autograd formula; `ActivationDownProjection` calls its backward itself)."""
    return (
        up is not None and isinstance(act_fn, SiLUActivation) and gate.dtype == torch.float32
        and up.dtype == torch.float32 and gate.device.type == "cpu" and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
        and (cpu_kernel_ready() or load_cpu_kernel())
    )


class ActivationDownProjection(torch.autograd.Function):
    """`down(act(gate) * up)` (or `down(act(gate))` when `up` is None) that keeps only `gate` and `up` for backward
    and recomputes the `[b, n, f]` activation there: two fewer f-wide tensors per layer than autograd keeps, at the
    cost of one elementwise pass. For SwiGLU in float32 on CPU the activation and both its gradients are one pass each
    (compiled ops). gate, up `[..., f]`, weight `[d, f]`, bias `[d]` or None -> `[..., d]`."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act_fn):
        ctx.act_fn = act_fn
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return nn.functional.linear(ActivationDownProjection._hidden(act_fn, gate, up), weight, bias)

    @staticmethod
    def _hidden(act_fn, gate, up):
        """`act(gate) * up`, or `act(gate)` when `up` is None (also the plain path of `DATMLP`)."""
        if _fused_swiglu(act_fn, gate, up):
            return cpu_swiglu(gate, up)
        hidden = act_fn(gate)
        return hidden if up is None else hidden * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        fused = _fused_swiglu(ctx.act_fn, gate, up)  # (backward runs without grad mode)
        if fused:
            hidden = cpu_swiglu(gate, up)
        else:
            with torch.enable_grad():  # recompute the activation, with a graph back to gate and up
                gate = gate.detach().requires_grad_()
                up = None if up is None else up.detach().requires_grad_()
                hidden = ActivationDownProjection._hidden(ctx.act_fn, gate, up)
        # under autocast the forward ran in the autocast dtype, which grad_out carries
        grad_hidden = grad_out @ weight.to(grad_out.dtype)  # [..., f]
        flat_grad = grad_out.flatten(0, -2)
        grad_weight = (flat_grad.t() @ hidden.detach().flatten(0, -2).to(grad_out.dtype)).to(weight.dtype)
        grad_bias = flat_grad.sum(0).to(weight.dtype) if ctx.has_bias else None
        if fused:
            grad_gate, grad_up = cpu_swiglu_backward(grad_hidden, gate, up)
        elif up is None:
            return torch.autograd.grad(hidden, gate, grad_hidden)[0], None, grad_weight, grad_bias, None
        else:
            grad_gate, grad_up = torch.autograd.grad(hidden, (gate, up), grad_hidden)
        return grad_gate, grad_up, grad_weight, grad_bias, None


class DATMLP(nn.Module):
    """Feed-forward: `down(act(gate(x)) * up(x))` for swiglu, else `down(act(up(x)))`. In training the activation is
    recomputed in backward (`ActivationDownProjection`) unless `down_proj` is wrapped (PEFT, quantization, hooks)."""

    def __init__(self, config):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.hidden_act == "swiglu"
        self.up_proj = nn.Linear(d, f, bias=bias)
        if self.gated:
            self.gate_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.down_proj.residual_init = True
        self.act_fn = ACT2FN["silu" if self.gated else config.hidden_act]
        # relu's backward needs only its output, which down_proj keeps anyway: nothing to gain by recomputing it
        self.recompute_activation = config.hidden_act != "relu"

    def forward(self, x):
        up = self.up_proj(x)
        gate, up = (self.gate_proj(x), up) if self.gated else (up, None)
        if self._recomputes_activation(gate):
            return ActivationDownProjection.apply(gate, up, self.down_proj.weight, self.down_proj.bias, self.act_fn)
        return self.down_proj(ActivationDownProjection._hidden(self.act_fn, gate, up))

    def _recomputes_activation(self, gate) -> bool:
        down = self.down_proj
        return (
            self.recompute_activation
            and gate.requires_grad
            and type(down) is nn.Linear
            and not (down._forward_hooks or down._forward_pre_hooks)
            and not torch.compiler.is_compiling()  # the compiler chooses what to recompute itself
        )


class DATDecoderLayer(GradientCheckpointingLayer):
    """One DAT block: dual attention and MLP with residuals, pre- or post-norm. `[b, n, d]` -> `[b, n, d]`."""

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.pre_norm = config.pre_norm
        self.input_layernorm = make_norm(config)
        self.dual_attn = DualAttention(config, layer_idx, is_causal)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = DATMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, symbols, position_embeddings=None, sensory_mask=None, relational_mask=None,
                past_key_values=None, **kwargs):
        def attend(x):
            return self.dropout(self.dual_attn(x, symbols, position_embeddings, sensory_mask, relational_mask,
                                               past_key_values, **kwargs))

        if self.pre_norm:
            hidden_states = hidden_states + attend(self.input_layernorm(hidden_states))
            hidden_states = hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        else:
            hidden_states = self.dropout(self.input_layernorm(hidden_states + attend(hidden_states)))
            hidden_states = self.post_attention_layernorm(hidden_states + self.dropout(self.mlp(hidden_states)))
        return hidden_states


def init_positions(module, config):
    """Give `module` what `add_positions` uses: learned position embeddings or a RoPE module (or nothing)."""
    if config.position_embedding_type == "learned":
        module.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
    elif config.position_embedding_type == "rope":
        module.rotary_emb = DATRotaryEmbedding(config)


def add_positions(module, hidden_states, position_ids, position_embedding_type):
    """Learned positions are added to the embeddings; RoPE gives `(cos, sin)` for the attention.
    -> (hidden_states `[b, n, d]`, position_embeddings or None)."""
    if position_embedding_type == "learned":
        return hidden_states + module.embed_positions(position_ids), None
    if position_embedding_type == "rope":
        return hidden_states, module.rotary_emb(hidden_states, position_ids)
    return hidden_states, None


def build_layer_masks(config, inputs_embeds, attention_mask, past_key_values=None, position_ids=None,
                      graph_adjacency=None, causal=True):
    """Every layer's (sensory, relational) biases and their masks, each distinct bias built once per forward."""
    layer_biases = config.layer_biases()
    validate_graph_inputs(config, graph_adjacency, inputs_embeds.shape[0], inputs_embeds.shape[1], past_key_values)
    masks = build_masks([bias for pair in layer_biases for bias in pair], config, inputs_embeds, attention_mask,
                        past_key_values, position_ids, graph_adjacency, causal=causal)
    return layer_biases, masks


def starts_cache(model, use_cache, past_key_values) -> bool:
    """Whether a decoder forward starts its own cache: asked for, none given, and not a training forward (train mode,
    gradients on), whose cache nothing would read."""
    return bool(use_cache) and past_key_values is None and not (model.training and torch.is_grad_enabled())


def resolve_position_ids(model, position_ids, attention_mask, batch_size, seq_len, past_seen, device,
                         name="position_ids"):
    """The positions of a decoder forward (the caller's, or counted from the cache and padding), checked against the
    position tables -> (position_ids `[b|1, n]`, the positions for the mask builder: the caller's only, since it looks
    for packed sequences (positions restarting) in them)."""
    positions_given = position_ids is not None
    if position_ids is None:
        position_ids = DATModel._default_position_ids(attention_mask, batch_size, seq_len, past_seen, device)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    validate_positions(model.config, model.symbol_retrievers, position_ids, name)
    return position_ids, (position_ids if positions_given else None)


def run_dat_layers(layers, symbol_retrievers, hidden_states, position_ids, layer_biases, masks, **layer_kwargs):
    """The DAT stack shared by every model family: each layer gets its symbols (computed once when shared and
    feature-independent) and the masks of its biases. `[b, n, d]` -> `[b, n, d]`."""
    symbols = None
    if symbol_retrievers is not None and symbol_retrievers.shared and symbol_retrievers.feature_independent:
        symbols = symbol_retrievers(0, hidden_states, position_ids)
    for i, layer in enumerate(layers):
        layer_symbols = symbols
        if symbol_retrievers is not None and layer_symbols is None:
            layer_symbols = symbol_retrievers(i, hidden_states, position_ids)
        sensory_bias, relational_bias = layer_biases[i]
        hidden_states = layer(hidden_states, layer_symbols, sensory_mask=masks[sensory_bias],
                              relational_mask=masks[relational_bias], **layer_kwargs)
    return hidden_states


def attentions_imply_relations(func):
    """`output_attentions=True` also returns the relational heads' weights and the relations."""

    @wraps(func)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            kwargs.setdefault("output_relational_attentions", True)
            kwargs.setdefault("output_relations", True)
        return func(self, *args, **kwargs)

    return wrapper


class DATPreTrainedModel(PreTrainedModel):
    config: DATConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DATDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    _supports_attention_backend = False
    _can_record_outputs = {
        "hidden_states": DATDecoderLayer,
        "attentions": OutputRecorder(SensoryAttention, index=1),
        "relational_attentions": OutputRecorder(RelationalAttention, index=1),
        "relations": OutputRecorder(RelationalAttention, index=2),
    }

    # every Auto class of the family, written to `auto_map` on save so remote code loads any of them
    auto_classes = {
        "AutoConfig": "configuration_dat.DATConfig",
        "AutoModel": "modeling_dat.DATModel",
        "AutoModelForCausalLM": "modeling_dat.DATForCausalLM",
        "AutoModelForSequenceClassification": "modeling_dat.DATForSequenceClassification",
    }

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, crash-safe (`atomic_save`: after a failure or a kill at any point the
        folder loads as the old model or the new one), with an `auto_map` covering every Auto class of the family
        and the modeling files copied beside. Files other than the model's in the folder are kept."""
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **self.auto_classes}
        save = super().save_pretrained
        is_main_process = args[0] if args else kwargs.get("is_main_process", True)
        if (kwargs.get("push_to_hub") or kwargs.get("distributed_checkpoint")
                or getattr(self, "_hf_peft_config_loaded", False) or not self.should_save_on_this_rank(is_main_process)):
            return save(save_directory, *args, **kwargs)  # uploads, adapters, other ranks: not one whole model here
        save_atomically(save_directory, lambda staging: save(staging, *args, **kwargs))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, after completing or undoing an interrupted save in a local folder."""
        if isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
            finish_interrupted_save(os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder") or ""))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    # trf-ignore: TRF018 (every parameter of the family is initialised here; nothing is left to the base class)
    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            # projections into the residual stream are scaled down with depth (GPT-2)
            scale = (2 * self.config.num_hidden_layers) ** -0.5 if getattr(module, "residual_init", False) else 1.0
            init.normal_(module.weight, mean=0.0, std=std * scale)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, DATRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, RelationalAttention):
            init.normal_(module.relation_proj, mean=0.0, std=std)
        elif isinstance(module, SymbolicAttention):
            init.normal_(module.template_features, mean=0.0, std=1.0)
            if hasattr(module, "symbol_library"):
                init.normal_(module.symbol_library, mean=0.0, std=1.0)
        elif isinstance(module, PositionalSymbols):
            if hasattr(module, "symbol_library"):
                init.normal_(module.symbol_library, mean=0.0, std=std)
        elif isinstance(module, PositionRelativeSymbols):
            init.normal_(module.rel_pos_embeddings, mean=0.0, std=std)
        elif isinstance(module, DATRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())


class DATModel(DATPreTrainedModel):
    """The DAT decoder stack. input_ids `[b, n]` -> last_hidden_state `[b, n, d]`.

    Inputs are checked first (`input_validation`, the same rules for every family): a bad input raises a ValueError
    naming the argument; an empty batch or sequence is refused (no empty outputs)."""

    is_causal = True

    def __init__(self, config: DATConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        init_positions(self, config)
        self.dropout = nn.Dropout(config.embedding_dropout)
        self.symbol_retrievers = SymbolRetrievers(config) if config.num_relational_heads > 0 else None
        self.layers = nn.ModuleList(
            [DATDecoderLayer(config, i, is_causal=self.is_causal) for i in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @attentions_imply_relations
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        graph_adjacency: torch.BoolTensor | None = None,
        **kwargs,
    ) -> DATModelOutputWithPast:
        r"""
        graph_adjacency (`torch.BoolTensor` of shape `[batch, n, n]`, *optional*):
            Per-instance attention graph for layers whose relational bias is `graph` (True = i may attend to j).
        """
        if past_key_values is not None and not isinstance(past_key_values, DynamicCache):
            # each layer's cache packs keys and values of different widths (see DualAttention), which fixed-shape
            # caches cannot hold
            raise ValueError(
                f"DAT models need a `DynamicCache`, got {type(past_key_values).__name__} (e.g. "
                "`cache_implementation='static'` is not supported)."
            )
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        validate_text_inputs(input_ids, inputs_embeds, attention_mask, position_ids, past_seen,
                             vocab_size=self.config.vocab_size, hidden_size=self.config.hidden_size)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len, _ = inputs_embeds.shape
        output_attentions = kwargs.pop("output_attentions", self.config.output_attentions)
        kwargs.pop("output_relational_attentions", None)
        kwargs.pop("output_relations", None)
        kwargs.pop("output_hidden_states", None)

        if starts_cache(self, use_cache, past_key_values):
            past_key_values = use_in_place_cache_layers(DynamicCache(config=self.config))
        position_ids, mask_positions = resolve_position_ids(self, position_ids, attention_mask, batch_size, seq_len,
                                                            past_seen, inputs_embeds.device)

        hidden_states, position_embeddings = add_positions(self, inputs_embeds, position_ids,
                                                           self.config.position_embedding_type)
        hidden_states = self.dropout(hidden_states)

        layer_biases, masks = build_layer_masks(self.config, inputs_embeds, attention_mask, past_key_values,
                                                mask_positions, graph_adjacency, causal=self.is_causal)
        hidden_states = run_dat_layers(
            self.layers, self.symbol_retrievers, hidden_states, position_ids, layer_biases, masks,
            position_embeddings=position_embeddings, past_key_values=past_key_values,
            output_attentions=output_attentions, **kwargs,
        )
        hidden_states = self.norm(hidden_states)
        return DATModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)

    @staticmethod
    def _default_position_ids(attention_mask, batch_size, seq_len, past_seen, device):
        if attention_mask is not None and attention_mask.dim() == 2:
            # left padding: positions count real tokens only
            positions = attention_mask.long().cumsum(-1) - 1
            return positions.clamp(min=0)[:, -seq_len:]
        return (torch.arange(seq_len, device=device) + past_seen)[None].expand(batch_size, -1)


class DATGenerationMixin(GenerationMixin):
    """`GenerationMixin` whose own `DynamicCache` (the decoder self-attention cache) gets in-place layers sized for
    the whole generation: one token is copied per step instead of the whole cache. A user's cache is left alone."""

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)
        cache = model_kwargs.get("past_key_values")
        if cache is not None and not getattr(cache, "_is_user_defined", False):
            use_in_place_cache_layers(getattr(cache, "self_attention_cache", cache), max_cache_length)


class DATForCausalLM(DATPreTrainedModel, DATGenerationMixin):
    """DAT language model head. input_ids `[b, n]` -> logits `[b, n, vocab]` (loss with `labels`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DATConfig):
        super().__init__(config)
        self.model = DATModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        graph_adjacency: torch.BoolTensor | None = None,
        **kwargs,
    ) -> DATCausalLMOutputWithPast:
        validate_lm_labels(labels, input_ids, inputs_embeds, self.config.vocab_size)
        outputs: DATModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            graph_adjacency=graph_adjacency,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return DATCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            relational_attentions=outputs.relational_attentions,
            relations=outputs.relations,
        )


class DATForSequenceClassification(DATPreTrainedModel):
    """Classifies a sequence from its last non-padding token. input_ids `[b, n]` -> logits `[b, num_labels]`."""

    def __init__(self, config: DATConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = DATModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        validate_classification_labels(self.config, labels, input_ids, inputs_embeds)
        outputs = self.model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
            inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size = logits.shape[0]
        if attention_mask is not None and attention_mask.dim() == 2:
            # the rightmost real token (left or right padding)
            positions = torch.arange(attention_mask.shape[-1], device=logits.device)
            last = (positions * attention_mask.to(logits.device).long()).argmax(-1) - (attention_mask.shape[-1] - logits.shape[1])
        elif self.config.pad_token_id is not None and input_ids is not None:
            positions = torch.arange(input_ids.shape[-1], device=logits.device)
            last = (positions * (input_ids != self.config.pad_token_id).long()).argmax(-1)
        else:
            if batch_size != 1 and self.config.pad_token_id is None and attention_mask is None:
                raise ValueError("Batches of several sequences need `attention_mask` or `pad_token_id` to find the "
                                 "last token of each.")
            last = torch.full((batch_size,), logits.shape[1] - 1, device=logits.device)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
        return SequenceClassifierOutputWithPast(
            loss=loss, logits=pooled_logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


# ---- bidirectional stack (every relational bias; `graph` for node classification) ---------------------------------
ENCODER_AUTO_CLASSES = {
    "AutoConfig": "configuration_dat.DATEncoderConfig",
    "AutoModel": "modeling_dat.DATEncoderModel",
    "AutoModelForTokenClassification": "modeling_dat.DATForTokenClassification",
}


class DATEncoderModel(DATModel):
    """The bidirectional DAT stack: no causal order is imposed, so `full`, `sliding_window_bidirectional`, `sparse`
    and `graph` biases see both directions (`causal` and `sliding_window` stay ordered). input_ids `[b, n]` (or
    inputs_embeds `[b, n, d]`) -> last_hidden_state `[b, n, d]`."""

    config: DATEncoderConfig
    is_causal = False
    auto_classes = ENCODER_AUTO_CLASSES


@dataclass
class DATTokenClassifierOutput(TokenClassifierOutput):
    relational_attentions: tuple[torch.FloatTensor, ...] | None = None
    relations: tuple[torch.FloatTensor, ...] | None = None


class DATForTokenClassification(DATPreTrainedModel):
    """Classifies every token (node) from a bidirectional DAT stack: the GAT use case with `relational_bias='graph'`.

    input_ids `[b, n]`, inputs_embeds `[b, n, d]` or node_features `[b, n, num_node_features]` (with
    `config.num_node_features`), plus graph_adjacency `[b, n, n]` for `graph` layers -> logits `[b, n, num_labels]`
    (cross-entropy loss with `labels` `[b, n]`, -100 = ignored).
    """

    config: DATEncoderConfig
    auto_classes = ENCODER_AUTO_CLASSES

    def __init__(self, config: DATEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = DATEncoderModel(config)
        self.node_proj = nn.Linear(config.num_node_features, config.hidden_size) if config.num_node_features else None
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        node_features: torch.FloatTensor | None = None,
        graph_adjacency: torch.BoolTensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> DATTokenClassifierOutput:
        r"""
        node_features (`torch.FloatTensor` of shape `[batch, n, config.num_node_features]`, *optional*):
            Node features, projected to `hidden_size` (instead of `input_ids` / `inputs_embeds`).
        graph_adjacency (`torch.BoolTensor` of shape `[batch, n, n]`, *optional*):
            Per-instance attention graph for layers whose relational bias is `graph` (True = i may attend to j).
        """
        validate_token_classification(self.config, input_ids, inputs_embeds, node_features, labels)
        if node_features is not None:
            inputs_embeds = self.node_proj(node_features)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, graph_adjacency=graph_adjacency, **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, num_items_in_batch=num_items_in_batch)
        return DATTokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            relational_attentions=outputs.relational_attentions, relations=outputs.relations,
        )


__all__ = [
    "DATPreTrainedModel",
    "DATModel",
    "DATForCausalLM",
    "DATForSequenceClassification",
    "DATDecoderLayer",
    "DATMLP",
    "DATRMSNorm",
    "DATModelOutputWithPast",
    "DATCausalLMOutputWithPast",
    "DATEncoderModel",
    "DATForTokenClassification",
    "DATTokenClassifierOutput",
]
