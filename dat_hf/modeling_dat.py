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

import inspect
import os
from dataclasses import dataclass
from functools import wraps

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_dat import DATConfig
from .cache_dat import NO_CACHE, continuous_batching_limits, open_cache, prepare_cache
from .dual_attention import DATRotaryEmbedding, DualAttention, RelationalAttention
from .kernel_hooks import check_inputs, replaceable
from .attention_plan import gradients_flow, plan_attention
from .masking_dat import build_masks, prebuildable, prebuilt_masks, uses_flex_attention
from .tensor_parallel_dat import applicable_rules, use_local_heads
from .symbol_retrieval import PositionalSymbols, PositionRelativeSymbols, SymbolicAttention, SymbolRetrievers
from .transformers_compat import (TP, CACHE_NAMES, cache_kwargs, output_cache, require, slice_logits_to_keep,
                                  takes_cache)


# What DAT outputs add to Transformers' outputs, in the format `auto_docstring` reads
DAT_OUTPUT_ARGS = r"""
attentions (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
    Attention weights of every head, sensory heads first: one tensor of shape `(batch_size, num_sensory_heads +
    num_relational_heads, query_length, key_length)` per layer.
relations (`tuple(torch.FloatTensor)`, *optional*, returned when `output_attentions=True`):
    The relations `r(x_i, x_j)` of the relational heads: one tensor of shape `(batch_size, num_relations,
    query_length, key_length)` per layer.
"""


@auto_docstring(custom_args=DAT_OUTPUT_ARGS)
@dataclass
class DATModelOutputWithPast(BaseModelOutputWithPast):
    relations: tuple[torch.FloatTensor, ...] | None = None


@auto_docstring(custom_args=DAT_OUTPUT_ARGS)
@dataclass
class DATCausalLMOutputWithPast(CausalLMOutputWithPast):
    relations: tuple[torch.FloatTensor, ...] | None = None


class DATRMSNorm(LlamaRMSNorm):
    """`x / rms(x) * w`, computed in float32 (Llama's RMSNorm). `[..., d]` -> `[..., d]`."""


def make_norm(config) -> nn.Module:
    # CODEPATH: rmsnorm: the released LMs (awni00/DAT-sa8-ra8-ns1024-sh8-nkvh4-343M, configs/dat-343m.json) and their
    # Transformer baselines (configs/transformer-*.json); layernorm: the reference package's default, taken by the
    # paper's ViDAT (ImageNet, CIFAR) and math seq2seq models (no released weights).
    if config.norm_type == "rmsnorm":
        return DATRMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


@replaceable("activation_down_projection")
def activation_down_projection(act_fn, gate, up, down_proj):
    """`down(act(gate) * up)`, or `down(act(gate))` when `up` is None. gate, up `[..., f]` -> `[..., d]`."""
    hidden = act_fn(gate)
    return down_proj(hidden if up is None else hidden * up)


class DATMLP(nn.Module):
    """Feed-forward: `down(act(gate(x)) * up(x))` for swiglu, else `down(act(up(x)))`."""

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

    def forward(self, x):
        up = self.up_proj(x)
        gate, up = (self.gate_proj(x), up) if self.gated else (up, None)
        return activation_down_projection(self.act_fn, gate, up, self.down_proj)


class DATDecoderLayer(GradientCheckpointingLayer):
    """One DAT block: dual attention and MLP with residuals, pre- or post-norm. `[b, n, d]` -> `[b, n, d]`."""

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.pre_norm = config.pre_norm
        self.input_layernorm = make_norm(config)
        self.dual_attn = DualAttention(config, layer_idx, is_causal)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = DATMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, symbols, position_embeddings=None, sensory_plan=None, relational_plan=None,
                cache=None, **kwargs):
        step = fused_layer_step(self, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan,
                                cache, **kwargs)
        if step is not None:  # a registered kernel took the whole step
            return step
        dropout = self.dropout if self.training else _identity  # (in eval a module call that returns its input)

        def attend(x):
            out, _, _ = self.dual_attn(x, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                                       **kwargs)
            return dropout(out)

        if self.pre_norm:
            hidden_states = hidden_states + attend(self.input_layernorm(hidden_states))
            hidden_states = hidden_states + dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        else:
            hidden_states = dropout(self.input_layernorm(hidden_states + attend(hidden_states)))
            hidden_states = self.post_attention_layernorm(hidden_states + dropout(self.mlp(hidden_states)))
        return hidden_states


def _identity(x):
    return x


@replaceable("layer_step")
def fused_layer_step(layer, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                     **kwargs):
    """A decoding step of `layer` (a `DATDecoderLayer`) as one kernel: its output, or None (the reference: no kernel
    takes this step, the layer computes it part by part)."""
    return None


def init_positions(module, config):
    """Give `module` what `embed_positions` uses: learned position embeddings or a RoPE module (or nothing)."""
    # CODEPATH: learned: the paper's math seq2seq models (their sinusoidal tables, stored as learned embeddings by
    # conversion) and the reference LM's default `pos_enc_type='pos_emb'`; no released checkpoint.
    if config.position_embedding_type == "learned":
        module.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
    # CODEPATH: rope: the released LMs (awni00/DAT-sa8-ra8-ns1024-sh8-nkvh4-343M, awni00/T-sa24-757M). Neither
    # (`none`): no released checkpoint; dat_hf's permutation-equivariant encoders (node classification).
    elif config.position_embedding_type == "rope":
        module.rotary_emb = DATRotaryEmbedding(config)


def embed_positions(module, inputs_embeds, position_ids, position_embedding_type):
    """Positions, then embedding dropout (`module.dropout`): learned positions are added to the embeddings, RoPE gives
    `(cos, sin)` for the attention. inputs_embeds `[b, n, d]` -> (hidden_states `[b, n, d]`, position_embeddings or
    None)."""
    hidden_states, position_embeddings = inputs_embeds, None
    if position_embedding_type == "learned":
        hidden_states = inputs_embeds + module.embed_positions(position_ids)
    elif position_embedding_type == "rope":
        position_embeddings = module.rotary_emb(inputs_embeds, position_ids)
    return (module.dropout(hidden_states) if module.training else hidden_states), position_embeddings


def init_dat_stack(model, config, layers: list, uses_symbols: bool, symbol_config=None, final_norm: bool = True):
    """Give `model` the stack `run_dat_layers` runs: symbol retrievers when `uses_symbols` (built from `symbol_config`,
    default `config`), the `layers`, and the final norm (an identity without `final_norm`)."""
    model.symbol_retrievers = SymbolRetrievers(symbol_config or config) if uses_symbols else None
    model.layers = nn.ModuleList(layers)
    model.norm = make_norm(config) if final_norm else nn.Identity()
    model.gradient_checkpointing = False


def init_text_stack(model, config, vocab_size: int, layers: list, **stack):
    """A token stack: embeddings `[vocab_size, d]`, positions (`init_positions`), embedding dropout, then the stack
    (`init_dat_stack(model, config, layers, **stack)`)."""
    model.embed_tokens = nn.Embedding(vocab_size, config.hidden_size, config.pad_token_id)
    init_positions(model, config)
    model.dropout = nn.Dropout(config.embedding_dropout)
    init_dat_stack(model, config, layers, **stack)


def plan_layers(model, inputs_embeds, attention_mask, cache=NO_CACHE, position_ids=None, graph_adjacency=None,
                causal=True, output_attentions=False):
    """Every layer's (sensory, relational) biases and this forward's attention plan: each distinct bias's mask built
    once by the forward's cache (`ForwardCache.masks`: continuous batching's over its packed requests, or given as a
    dict `{bias: mask}` from `create_masks_for_generate`), its function chosen once per head type (`AttentionPlan`)."""
    config = model.config
    layer_biases = config.layer_biases()
    biases = [bias for pair in layer_biases for bias in pair]
    masks = cache.masks(biases, config, inputs_embeds, attention_mask, position_ids, graph_adjacency, causal)
    inputs = (masks, config, inputs_embeds, output_attentions, gradients_flow(model, inputs_embeds), model.training,
              [sensory for sensory, _ in layer_biases], [relational for _, relational in layer_biases])
    return layer_biases, plan_attention(model, *inputs, per_request=cache.rows_are_requests)


def starts_cache(model, use_cache, cache) -> bool:
    """Whether a decoder forward starts its own cache: asked for, none given, and not a training forward (train mode,
    gradients on), whose cache nothing would read."""
    return bool(use_cache) and cache is None and not (model.training and torch.is_grad_enabled())


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
    check_inputs("positions", model.config, model.symbol_retrievers, position_ids, name)
    return position_ids, (position_ids if positions_given else None)


def prepare_decoder_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache, kwargs,
                           prefix=""):
    """The start of a decoder forward (`DATModel`'s and the seq2seq decoder's): its cache (`cache_dat.open_cache`:
    continuous batching's paged cache, a cache started when asked for, a given one with DAT's layers), the inputs
    checked, the tokens embedded, the positions resolved. `kwargs` loses the output flags that the layers do not take.

    -> (inputs_embeds `[b, n, d]`, cache, position_ids `[b|1, n]`, the positions for the mask builder: see
    `resolve_position_ids`)."""
    config = model.config
    cache = open_cache(cache, config, position_ids, starts_cache(model, use_cache, cache), kwargs)
    check_inputs("text_inputs", input_ids, inputs_embeds, cache.padding(attention_mask), position_ids,
                 cache.past_seen, vocab_size=config.vocab_size, hidden_size=config.hidden_size, prefix=prefix)
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)
    batch_size, seq_len, _ = inputs_embeds.shape
    kwargs.pop("output_relations", None)
    kwargs.pop("output_hidden_states", None)
    position_ids, mask_positions = resolve_position_ids(model, position_ids, attention_mask, batch_size, seq_len,
                                                        cache.past_seen, inputs_embeds.device, prefix + "position_ids")
    return inputs_embeds, cache, position_ids, mask_positions


def run_dat_layers(layers, symbol_retrievers, hidden_states, position_ids, layer_biases, plan, source=None,
                   **layer_kwargs):
    """The DAT stack shared by every model family. hidden_states `[b, n, d]` -> `[b, n, d]`.

    Layer i gets its symbols `s = SymbolRetriever_i(x)` `[b|1, n, d]` (computed once when the retrievers are shared
    and feature-independent; none without `symbol_retrievers`) and the plan entries of its (sensory, relational)
    biases. With `source` (the seq2seq decoder's `CrossAttentionSource`) it also gets the encoder's states `[b, m, d]`
    and the source tokens' symbols, for its cross-attention. The first `len(layer_biases)` layers run (a config's
    `num_hidden_layers`, which Transformers lowers for the drafts of self-speculative decoding)."""
    symbols = None
    if symbol_retrievers is not None and symbol_retrievers.shared and symbol_retrievers.feature_independent:
        symbols = symbol_retrievers(0, hidden_states, position_ids)
    for i, (layer, (sensory_bias, relational_bias)) in enumerate(zip(layers, layer_biases)):
        layer_symbols = symbols
        if symbol_retrievers is not None and layer_symbols is None:
            layer_symbols = symbol_retrievers(i, hidden_states, position_ids)
        cross_inputs = () if source is None else (source.hidden_states, source.symbols(i))
        hidden_states = layer(hidden_states, layer_symbols, *cross_inputs, sensory_plan=plan.sensory[sensory_bias],
                              relational_plan=plan.relational[relational_bias], **layer_kwargs)
    return hidden_states


def run_text_stack(model, inputs_embeds, attention_mask, cache, position_ids, mask_positions, symbol_retrievers,
                   kwargs: dict, graph_adjacency=None, source=None, **layer_kwargs):
    """The body of a decoder forward after `prepare_decoder_inputs`: positions embedded, the attention plan
    (`plan_layers`), the layers (`run_dat_layers`, with `source` for cross-attention), the final norm.
    inputs_embeds `[b, n, d]` -> hidden_states `[b, n, d]`."""
    hidden_states, position_embeddings = embed_positions(model, inputs_embeds, position_ids,
                                                         model.config.position_embedding_type)
    layer_biases, plan = plan_layers(model, inputs_embeds, attention_mask, cache, mask_positions, graph_adjacency,
                                     model.is_causal, kwargs.get("output_attentions", False))
    hidden_states = run_dat_layers(model.layers, symbol_retrievers, hidden_states, position_ids, layer_biases, plan,
                                   source, position_embeddings=position_embeddings, cache=cache, **layer_kwargs,
                                   **kwargs)
    return model.norm(hidden_states)


def attentions_imply_relations(func):
    """`output_attentions` (the config's unless given) travels down in the kwargs to the attention modules, which
    then return every head's weights (with the eager functions); `output_attentions=True` also returns the relations
    (unless the model sets `relations_with_attentions = False`: then only with `output_relations=True`, which also
    returns the weights)."""

    @wraps(func)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("output_attentions", getattr(self.config, "output_attentions", False))
        if kwargs["output_attentions"] and self.relations_with_attentions:
            kwargs.setdefault("output_relations", True)
        if kwargs.get("output_relations"):  # relations come from the explicit path, with the weights
            kwargs["output_attentions"] = True
        return func(self, *args, **kwargs)

    return wrapper


def stack_forward(forward):
    """The decorators of a DAT stack's forward (above `auto_docstring`; innermost last): `output_attentions` implies
    the relations (`attentions_imply_relations`), the config's defaults fill the unset output flags
    (`merge_with_config_defaults`), and the layers' hidden states, attention weights and relations are recorded
    (`capture_outputs`, from the model's `_can_record_outputs`)."""
    return attentions_imply_relations(merge_with_config_defaults(capture_outputs(forward)))


def recorded_outputs(outputs) -> dict:
    """What a head passes on from its DAT stack's output (recorded on request): the hidden states, every head's
    attention weights and the relations."""
    return dict(hidden_states=outputs.hidden_states, attentions=outputs.attentions, relations=outputs.relations)


def load_plainly(cls, from_pretrained, pretrained_model_name_or_path, *args, **kwargs):
    """Transformers' `from_pretrained`, refusing a local folder that holds an interrupted save of dat_hf's (its files
    may be half old, half new: dat_hf completes or undoes the save when it loads the folder)."""
    if isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
        journal = os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder") or "", ".dat_hf_commit.json")
        if os.path.isfile(journal):
            raise OSError(f"{journal}: this folder holds an interrupted save. Load it once where dat_hf is installed "
                          "(`import dat_hf`), which completes or undoes that save.")
    return from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


# Hook points of saving and loading, Transformers' plain behaviour here (and so in a saved folder's remote code);
# `import dat_hf` (the installed package, never copied) installs crash-safe saving and the bound checks of untrusted
# checkpoints into them (`dat_hf/safe_folders.py`).
SAVE_LOAD_HOOKS = {
    # (model, PreTrainedModel.save_pretrained bound to it, its arguments): saves the model
    "save": lambda model, save, *args, **kwargs: save(*args, **kwargs),
    # (class, PreTrainedModel.from_pretrained bound to it, its arguments): the loaded model
    "load": load_plainly,
    # (class, the arguments of its __init__), before __init__ builds the model: may refuse the config
    "build": lambda cls, args: None,
}


@auto_docstring
class DATPreTrainedModel(PreTrainedModel):
    config: DATConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DATDecoderLayer"]
    _skip_keys_device_placement = CACHE_NAMES
    _supports_sdpa = True
    _supports_flex_attn = True
    # FlashAttention's kernels take no arbitrary masks (relational biases) and no value widths beyond the key width
    _supports_flash_attn = False
    _can_compile_fullgraph = True
    _supports_attention_backend = False
    # `output_attentions=True` also returns the relations (see `attentions_imply_relations`)
    relations_with_attentions = True
    _can_record_outputs = {
        "hidden_states": DATDecoderLayer,
        "attentions": OutputRecorder(DualAttention, index=1),
        "relations": OutputRecorder(DualAttention, index=2),
    }

    # every Auto class of the family, written to `auto_map` on save so remote code loads any of them
    auto_classes = {
        "AutoConfig": "configuration_dat.DATConfig",
        "AutoModel": "modeling_dat.DATModel",
        "AutoModelForCausalLM": "modeling_dat.DATForCausalLM",
        "AutoModelForSequenceClassification": "modeling_dat.DATForSequenceClassification",
    }

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with an `auto_map` covering every Auto class of the family and the
        modeling files copied beside; with dat_hf installed, crash-safe (`SAVE_LOAD_HOOKS`: after a failure or a kill
        at any point the folder loads as the old model or the new one) and, for a model sharded with FSDP2, called
        on every rank. Files other than the model's are kept."""
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **self.auto_classes}
        return SAVE_LOAD_HOOKS["save"](self, super().save_pretrained, save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`; with dat_hf installed, for a local folder, after completing or undoing
        an interrupted save, with the config checked against the checkpoint's tensor index before the model is built,
        and loading again if a save commits during the load (`SAVE_LOAD_HOOKS`)."""
        return SAVE_LOAD_HOOKS["load"](cls, super().from_pretrained, pretrained_model_name_or_path, *args, **kwargs)

    def init_parallel_plans(self) -> None:
        """Transformers' plans, the tensor-parallel rules naming modules this model lacks dropped (`applicable_rules`:
        the config's plan, `base_model_tp_plan`, names every projection a DAT layer may have)."""
        super().init_parallel_plans()
        self._tp_plan = applicable_rules(self, self._tp_plan)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Transformers' parallelism (`tp_plan="auto"`, `DistributedConfig`) before the weights load; under tensor
        parallelism every attention module is then left with the heads its rank holds (`use_local_heads`). A release
        whose tensor parallelism moved stops here, naming what moved (`transformers_compat.require`)."""
        tensor_parallel = mesh_manager is not None and (getattr(distributed_config, "tp_size", None) or 1) > 1
        if tensor_parallel:
            require(TP)
        model = super().maybe_distribute_model(model, distributed_config, mesh_manager)
        if tensor_parallel:
            use_local_heads(model, distributed_config.tp_size)
        return model

    def __new__(cls, *args, **kwargs):
        SAVE_LOAD_HOOKS["build"](cls, args)  # (with dat_hf: the config is checked against the checkpoint being loaded)
        return super().__new__(cls)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # Transformers' own: linears, embeddings (std `initializer_range`), norms
        std = self.config.initializer_range
        if getattr(module, "residual_init", False):
            # projections into the residual stream are scaled down with depth (GPT-2)
            init.normal_(module.weight, mean=0.0, std=std * (2 * self.config.num_hidden_layers) ** -0.5)
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


@auto_docstring(custom_intro="The DAT decoder stack. input_ids `[b, n]` -> last_hidden_state `[b, n, d]`.")
class DATModel(DATPreTrainedModel):

    is_causal = True

    def __init__(self, config: DATConfig):
        super().__init__(config)
        # CODEPATH: relational heads, hence symbols: awni00/DAT-sa8-ra8-ns1024-sh8-nkvh4-343M; none: the Transformer
        # baseline awni00/T-sa24-757M.
        layers = [DATDecoderLayer(config, i, is_causal=self.is_causal) for i in range(config.num_hidden_layers)]
        init_text_stack(self, config, config.vocab_size, layers, uses_symbols=config.num_relational_heads > 0)
        self.post_init()

    @stack_forward
    @auto_docstring
    @takes_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        graph_adjacency: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATModelOutputWithPast:
        r"""
        graph_adjacency (`torch.BoolTensor` of shape `(batch_size, sequence_length, sequence_length)`, *optional*):
            Per-instance attention graph of the layers whose relational bias is `graph` (True: token i may attend to j).

        Returns:
            [`DATModelOutputWithPast`] (a tuple with `return_dict=False`): `last_hidden_state` `(batch_size,
            sequence_length, hidden_size)`, the cache, and on request the hidden states, the attention weights of every
            head and the relations.
        """
        inputs_embeds, cache, position_ids, mask_positions = prepare_decoder_inputs(
            self, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache, kwargs)
        hidden_states = run_text_stack(self, inputs_embeds, attention_mask, cache, position_ids, mask_positions,
                                       self.symbol_retrievers, kwargs, graph_adjacency)
        return DATModelOutputWithPast(last_hidden_state=hidden_states, **cache_kwargs(cache.cache))

    @staticmethod
    def _default_position_ids(attention_mask, batch_size, seq_len, past_seen, device):
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            # left padding: positions count real tokens only
            positions = attention_mask.long().cumsum(-1) - 1
            return positions.clamp(min=0)[:, -seq_len:]
        return (torch.arange(seq_len, device=device) + past_seen)[None].expand(batch_size, -1)


class DATGenerationMixin(GenerationMixin):
    """`GenerationMixin` with DAT's cache layers in the caches `generate` makes (in-place `DynamicCache` layers sized
    for the whole generation, `StaticCache` layers whose keys and values have their own head counts), and, for
    compileable caches, masks of every relational bias built before the compiled forward (`create_masks_for_generate`).
    A user's cache gets DAT's layers in the model's forward."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # `generate` reads the forward's signature at every step for a model class outside Transformers (its check
        # for remote code's `cache_position`): computed once here, where the forward is defined
        if "forward" in cls.__dict__:
            cls.forward.__signature__ = inspect.signature(cls.forward)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)
        cache = output_cache(model_kwargs)
        if cache is not None and not getattr(cache, "_is_user_defined", False):
            prepare_cache(cache, max_cache_length)

    def _get_static_cache_init_shape(self):
        """None: a `StaticCache` is not initialized ahead (Transformers does so for chunked prefills, with one shape
        for keys and values); DAT's layers initialize at their first update, keys and values with their own heads."""
        return None

    def init_continuous_batching(self, *args, **kwargs):
        """Transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve
        --continuous-batching`): every layer's packed cache (`PackedCache`) lives in the manager's paged cache
        (`PagedCache`), and both head types attend over its packed batches with the mask it builds per layer type.
        Configurations it cannot serve are refused here, by name (`continuous_batching_limits`)."""
        limits = self.continuous_batching_limits()
        if limits:
            raise ValueError("Continuous batching cannot serve this DAT model: " + "; ".join(limits) + ". Batch the "
                             "prompts with padding and call `generate` instead.")
        return super().init_continuous_batching(*args, **kwargs)

    def continuous_batching_limits(self) -> list[str]:
        """Why continuous batching cannot serve this model, one line per reason (`cache_dat.continuous_batching_limits`,
        the one list); empty when it can."""
        return continuous_batching_limits(self.config, getattr(self, "_tp_size", None) or 1)

    @takes_cache
    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache=None, position_ids=None,
                                  **kwargs):
        """`{bias: mask}` for every relational bias of the decoder (dense bool `[b, 1, q, max_len]` or None), from the
        2-D padding mask: what the forward would build, made outside the compiled graph (see `prebuildable`)."""
        decoder_config = config.get_text_config(decoder=True)
        biases = {bias for pair in decoder_config.layer_biases() for bias in pair}
        masks = build_masks(biases, decoder_config, inputs_embeds, attention_mask, cache, position_ids,
                            receiver_blocks=False)  # (the forward finds the blocks of what it is handed)
        return {bias: prebuildable(mask) for bias, mask in masks.items()}


@auto_docstring(
    custom_intro="DAT language model head. input_ids `[b, n]` -> logits `[b, n, vocab]` (loss with `labels`)."
)
class DATForCausalLM(DATPreTrainedModel, DATGenerationMixin):

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DATConfig):
        super().__init__(config)
        self.model = DATModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    @takes_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        graph_adjacency: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATCausalLMOutputWithPast:
        r"""
        graph_adjacency (`torch.BoolTensor` of shape `(batch_size, sequence_length, sequence_length)`, *optional*):
            Per-instance attention graph of the layers whose relational bias is `graph` (True: token i may attend to j).
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets of the next-token loss: usually `input_ids` (the loss shifts them, so that position t predicts
            token t + 1); -100 is ignored.

        Returns:
            [`DATCausalLMOutputWithPast`] (a tuple with `return_dict=False`): `logits` `(batch_size, sequence_length,
            vocab_size)` (the last `logits_to_keep` positions), `loss` with `labels`, the cache, and on request the
            hidden states, the attention weights of every head and the relations.
        """
        check_inputs("lm_labels", labels, input_ids, inputs_embeds, self.config.vocab_size)
        outputs: DATModelOutputWithPast = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, graph_adjacency=graph_adjacency, **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return DATCausalLMOutputWithPast(
            loss=loss, logits=logits, **cache_kwargs(output_cache(outputs)), **recorded_outputs(outputs)
        )


@auto_docstring(
    custom_intro="Classifies a sequence from its last token that is not `pad_token_id` (Transformers' "
    "`GenericForSequenceClassification`). input_ids `[b, n]` -> logits `[b, num_labels]`."
)
class DATForSequenceClassification(GenericForSequenceClassification, DATPreTrainedModel):

    def __init__(self, config: DATConfig):
        DATPreTrainedModel.__init__(self, config)  # (the generic head would build its base model by `AutoModel`)
        self.num_labels = config.num_labels
        self.model = DATModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    @auto_docstring
    @takes_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Class indices in `[0, num_labels)`, or regression targets (`num_labels == 1`) or multi-hot targets, as
            `config.problem_type` says.
        """
        check_inputs("classification_labels", self.config, labels, input_ids, inputs_embeds)
        return super().forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache,
                               **kwargs)


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
]
