# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Configuration of the Dual Attention Transformer (DAT) model family.

`DualAttentionConfig` holds the fields shared by every DAT model (dual attention, symbols, relational biases,
feed-forward, norms, positions) and validates them at construction; `DATConfig` is the causal language model's
config (`model_type="dat"`). Vision and seq2seq configs subclass `DualAttentionConfig` too.
"""

import dataclasses
import math
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.utils import auto_docstring

from .relational_biases import check_bias_field, layer_type

POSITION_EMBEDDINGS = ("rope", "learned", "none")
# the fields with a fixed set of values
CHOICES = {
    "symbol_retrieval": ("symbolic_attention", "positional", "position_relative"),
    "position_embedding_type": POSITION_EMBEDDINGS,
    "norm_type": ("layernorm", "rmsnorm"),
    "relation_activation": ("identity", "relu", "gelu", "gelu_pytorch_tanh", "silu", "sigmoid", "tanh"),
    "hidden_act": ("swiglu", "gelu", "gelu_pytorch_tanh", "relu", "silu", "tanh", "sigmoid"),
}


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def _check_positive(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def _check_probability(name, value):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0):
        raise ValueError(f"`{name}` must be a probability in [0, 1), got {value!r}.")


MAX_LAYERS = 10_000  # beyond any real model; a config.json asking for more is refused before anything is built


def _check_layers(name, value):
    _check_positive(name, value)
    if value > MAX_LAYERS:
        raise ValueError(f"`{name}` must be at most {MAX_LAYERS}, got {value!r}.")


# the ranges of the float fields (besides the probabilities): name -> (lowest, highest, lowest included)
FLOAT_RANGES = {
    "symbolic_attention_scale": (0.0, 1e6, False),
    "norm_eps": (0.0, 1.0, False),
    "rope_theta": (0.0, 1e12, False),
    "initializer_range": (0.0, 10.0, True),
}


def _check_floats(config):
    """Every float field (`@strict` has checked the types) holds a finite number: NaN and infinities are refused with
    the field's name (a NaN scale would otherwise give NaN logits silently); then the ranges of `FLOAT_RANGES`."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"`{field.name}` must be a finite number, got {value!r}.")
    for name, (low, high, closed) in FLOAT_RANGES.items():
        value = getattr(config, name)
        if value is not None and not ((low <= value if closed else low < value) and value <= high):
            raise ValueError(f"`{name}` must be in {'[' if closed else '('}{low:g}, {high:g}], got {value!r}.")


@auto_docstring(
    custom_intro=r"""
    The fields shared by every DAT model (dual attention, symbols, relational biases, feed-forward, norms, positions),
    validated at construction. Dimensions follow the paper: each layer has `num_sensory_heads` self-attention heads and
    `num_relational_heads` relational heads of dimension `hidden_size // (num_sensory_heads + num_relational_heads)`;
    relational heads send `sum_j a_ij (r(x_i, x_j) W_r + s_j W_s)`, where `r` has `num_relations` components, each an
    inner product of `relation_dim`-dimensional projections, and `s_j` is the sender's symbol.
    """
)
@strict
class DualAttentionConfig(PreTrainedConfig):
    r"""
    num_sensory_heads (`int`):
        Sensory (self-attention) heads per layer. All heads have dimension `head_dim = hidden_size //
        (num_sensory_heads + num_relational_heads)`; either head count may be 0, not both.
    num_relational_heads (`int`):
        Relational heads per layer. Head h sends `sum_j a_ij (r(x_i, x_j) W_r + s_j W_s)`, with the relation vector
        `r` and the sender's symbol `s_j` (see `symbol_retrieval`).
    num_sensory_key_value_heads (`int`):
        Key/value heads of the sensory heads (grouped-query attention); None = one per head.
    num_relational_key_value_heads (`int`):
        Key heads (and symbol-value heads) of the relational heads (grouped-query attention); None = one per head.
    num_relations (`int`):
        Components of the relation vector `r(x_i, x_j)`; None = `num_relational_heads`.
    relation_dim (`int`):
        Dimension of each relation's query/key projection; None = `num_relational_heads * head_dim //
        num_relations`.
    relation_activation (`str`):
        Activation applied to the relations (`identity` lets the fused backends run).
    symmetric_relations (`bool`):
        Share the relation query and key projections, so that `r(x, y) = r(y, x)`.
    share_attention_params (`bool`):
        Sensory and relational heads share their attention query/key projections (needs equal head counts).
    symbol_retrieval (`str`):
        Where each sender's symbol comes from: `symbolic_attention` (attention over a learned symbol library),
        `positional` (a learned embedding of the position) or `position_relative` (an embedding of the clipped
        offset `j - i`).
    num_symbols (`int`):
        Size of the symbol library of symbolic attention.
    symbolic_attention_heads (`int`):
        Heads of symbolic attention.
    symbolic_attention_scale (`float`):
        Softmax scale of symbolic attention; None = `1 / sqrt(hidden_size / symbolic_attention_heads)`.
    trainable_symbols (`bool`):
        Train the symbol library of symbolic attention (else it stays at its random initialisation).
    max_relative_position (`int`):
        Clipping distance `K` of position-relative symbols (a table of `2K + 1` symbols).
    max_symbol_positions (`int`):
        Size of the positional symbol library; None = `max_position_embeddings`.
    shared_symbol_retriever (`bool`):
        One symbol retriever for all layers (else one per layer).
    tie_symbol_library (`bool`):
        With one retriever per layer, share one symbol library (symbolic attention and positional symbols).
    intermediate_size (`int`):
        Width of the feed-forward layers; None = `4 * hidden_size`, or `8/3 * hidden_size` for `swiglu`.
    hidden_act (`str`):
        Activation of the feed-forward layers; `swiglu` is the gated `down(silu(gate(x)) * up(x))`.
    norm_type (`str`):
        `rmsnorm` or `layernorm`.
    pre_norm (`bool`):
        Normalize the input of each sublayer (pre-norm); False normalizes after the residual (post-norm).
    position_embedding_type (`str`):
        `rope`, `learned` (absolute embeddings added to the inputs) or `none`.
    rope_theta (`float`):
        Base period of the RoPE frequencies.
    relational_bias (`str`):
        Attention graph of every head: one of `full`, `causal`, `sliding_window`, `sliding_window_bidirectional`,
        `sparse`, `graph` or a bias added with `register_relational_bias` (those the model type allows; see
        `relational_biases.py`), or a list with one per layer.
    relational_heads_bias (`str`):
        Attention graph of the relational heads only (a string or one per layer); None = `relational_bias`.
    sliding_window_size (`int`):
        Window `p` of the `sliding_window*` graphs: a token sees its `p` previous tokens (and, bidirectional, its `p`
        next ones) and itself.
    sparse_block_size (`int`):
        Local blocks of the `sparse` graph: tokens of one block see each other.
    sparse_global_tokens (`int`):
        The first tokens of the `sparse` graph, which see and are seen by every token.
    sparse_edges (`list[list[int]]`):
        Extra `[receiver, sender]` edges of the `sparse` graph.
    hidden_dropout (`float`):
        Dropout on the output of every sublayer (training only).
    symbol_dropout (`float`):
        Dropout of symbolic attention's weights (training only).
    attention_bias (`bool`):
        Bias of the key, value and symbol-value projections.
    attention_out_bias (`bool`):
        Bias of the attention output projections.
    relational_attn_implementation (`str`):
        Backend of the relational heads: `eager`, `sdpa`, `flex_attention`, or a compiled one that `import dat_hf`
        registers (e.g. `cpu`). None picks the fastest backend that supports each call, following
        `attn_implementation`; an explicit choice that cannot run a call raises.
"""

    # the fields every DAT config shares, in the format `auto_docstring` reads (each config's `__doc__` starts with
    # them; the type, `*optional*` and the default of each field come from the config class itself)
    fields_doc = __doc__

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_sensory_heads: int = 4
    num_relational_heads: int = 4
    num_sensory_key_value_heads: int | None = None
    num_relational_key_value_heads: int | None = None
    num_relations: int | None = None
    relation_dim: int | None = None
    relation_activation: str = "identity"
    symmetric_relations: bool = False
    share_attention_params: bool = False
    symbol_retrieval: str = "symbolic_attention"
    num_symbols: int = 64
    symbolic_attention_heads: int = 4
    symbolic_attention_scale: float | None = None
    trainable_symbols: bool = True
    max_relative_position: int = 64
    max_symbol_positions: int | None = None
    shared_symbol_retriever: bool = True
    tie_symbol_library: bool = False
    intermediate_size: int | None = None
    hidden_act: str = "swiglu"
    norm_type: str = "rmsnorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True
    position_embedding_type: str = "rope"
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    relational_bias: str | list[str] = "causal"
    relational_heads_bias: str | list[str] | None = None
    sliding_window_size: int | None = None
    sparse_block_size: int | None = None
    sparse_global_tokens: int = 0
    sparse_edges: list[list[int]] | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0
    symbol_dropout: float = 0.0
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    relational_attn_implementation: str | None = None

    # tensor parallelism (`tp_plan="auto"`), as Llama's: whole heads per rank (W_r by head: `dat_heads`), the relation
    # projections gathered (`dat_gather`: every head reads every relation); the styles and checks are
    # `tensor_parallel_dat.py`'s, and a model drops the rules naming modules its layers lack (`applicable_rules`)
    base_model_tp_plan = {
        "layers.*.dual_attn.sensory.q_proj": "colwise",
        "layers.*.dual_attn.sensory.k_proj": "colwise",
        "layers.*.dual_attn.sensory.v_proj": "colwise",
        "layers.*.dual_attn.sensory.o_proj": "rowwise",
        "layers.*.dual_attn.relational.q_attn_proj": "colwise",
        "layers.*.dual_attn.relational.k_attn_proj": "colwise",
        "layers.*.dual_attn.relational.symbol_proj": "colwise",
        "layers.*.dual_attn.relational.relation_proj": "dat_heads",
        "layers.*.dual_attn.relational.q_rel_proj": "dat_gather",
        "layers.*.dual_attn.relational.k_rel_proj": "dat_gather",
        "layers.*.dual_attn.relational.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    # a causal model (its stack is a decoder) takes only the relational biases a decoder may use (`relational_biases`)
    causal_model: ClassVar[bool] = False
    # the forward tensors a relational bias may be built from (`RelationalBias.inputs`) that this config's models take
    bias_inputs: ClassVar[tuple[str, ...]] = ("graph_adjacency",)

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            # the reference's default: 4d, or 2/3 of it for the gated swiglu
            self.intermediate_size = int(2 / 3 * 4 * self.hidden_size) if self.hidden_act == "swiglu" else 4 * self.hidden_size
        self.validate_dual_attention()
        super().__post_init__(**kwargs)

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def num_attention_heads(self) -> int:
        return self.num_sensory_heads + self.num_relational_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def sensory_kv_heads(self) -> int:
        return self.num_sensory_key_value_heads or self.num_sensory_heads

    @property
    def relational_kv_heads(self) -> int:
        return self.num_relational_key_value_heads or self.num_relational_heads

    @property
    def relations(self) -> int:
        return self.num_relations or self.num_relational_heads

    @property
    def relation_head_dim(self) -> int:
        return self.relation_dim or self.head_dim * self.num_relational_heads // max(self.relations, 1)

    @property
    def packed_cache_width(self) -> int:
        """Elements per token one layer caches (`cache_dat.PackedCache`): keys of both head types (the sensory
        heads' only without `share_attention_params`), sensory values, symbol values (not for position-relative
        symbols, whose table is not cached) and relation keys."""
        d, sensory, relational = self.head_dim, self.num_sensory_heads > 0, self.num_relational_heads > 0
        keys = (self.relational_kv_heads * d if relational else 0) + (
            self.sensory_kv_heads * d if sensory and not (self.share_attention_params and relational) else 0)
        values = self.sensory_kv_heads * d if sensory else 0
        if relational:
            values += (self.relational_kv_heads * d if self.symbol_retrieval != "position_relative" else 0) + (
                self.relations * self.relation_head_dim)
        return keys + values

    @property
    def num_key_value_heads(self) -> int:
        """Heads of `head_dim` a one-shape cache needs per token and layer for keys and for values alike, to hold
        DAT's packed layer (`packed_cache_width`, split in two halves): what Transformers' paged cache (continuous
        batching) sizes its pages from. Not a model width: the heads' own are `num_sensory_key_value_heads` and
        `num_relational_key_value_heads`."""
        return -(-self.packed_cache_width // (2 * self.head_dim))

    def layer_bias(self, layer_idx: int, relational: bool) -> str:
        """The relational bias (attention graph) of one layer's sensory or relational heads."""
        return self.layer_biases()[layer_idx][int(relational)]

    def layer_biases(self) -> list[tuple[str, str]]:
        """(sensory bias, relational bias) of every layer. (Read per forward and decoding step: each config field is
        read once, Transformers' config attributes being slow to get.)"""
        sensory, relational = self.relational_bias, self.relational_heads_bias
        relational = sensory if relational is None else relational
        return [tuple(bias[i] if isinstance(bias, list) else bias for bias in (sensory, relational))
                for i in range(self.num_hidden_layers)]

    @property
    def layer_types(self) -> list[str]:
        """Each (decoder) layer's cache type, as Transformers' caches read it: `sliding_attention` (the cache keeps
        the last `sliding_window` tokens) where both head types use the `sliding_window` graph, else
        `full_attention`. A bias's mask is built once per forward for every layer, sized by one kind of cache layer,
        so a model where some layer has the window on one head type only keeps full layers."""
        windows = [tuple(layer_type(bias) == "sliding_attention" for bias in pair) for pair in self.layer_biases()]
        one_sided = any(sensory != relational for sensory, relational in windows)
        return ["sliding_attention" if not one_sided and sensory else "full_attention" for sensory, _ in windows]

    @property
    def sliding_window(self) -> int | None:
        """`sliding_window_size` in Transformers' convention (the tokens a `sliding_attention` cache layer keeps:
        the window and the token itself, `sliding_window_size + 1`); setting it sets `sliding_window_size`."""
        return None if self.sliding_window_size is None else self.sliding_window_size + 1

    @sliding_window.setter
    def sliding_window(self, value: int | None):
        self.sliding_window_size = None if value is None else value - 1

    # ---- validation ----------------------------------------------------------------------------------------------
    def validate_dual_attention(self):
        """Raise a ValueError naming the field for every invalid value or combination. (`@strict` has checked the
        types, None included: a field whose annotation does not allow None never holds it.)"""
        for name in ("hidden_size", "max_position_embeddings", "symbolic_attention_heads", "num_symbols",
                     "max_relative_position", "intermediate_size", "num_sensory_key_value_heads",
                     "num_relational_key_value_heads", "num_relations", "relation_dim", "max_symbol_positions",
                     "sliding_window_size", "sparse_block_size"):
            _check_positive(name, getattr(self, name), allow_none=True)
        _check_layers("num_hidden_layers", self.num_hidden_layers)
        for name in ("num_sensory_heads", "num_relational_heads", "sparse_global_tokens"):
            if (value := getattr(self, name)) < 0:
                raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
        for name in ("attention_dropout", "hidden_dropout", "embedding_dropout", "symbol_dropout"):
            _check_probability(name, getattr(self, name))
        _check_floats(self)
        for name, choices in CHOICES.items():
            _check_choice(name, getattr(self, name), choices)

        if self.num_attention_heads == 0:
            raise ValueError("`num_sensory_heads` + `num_relational_heads` must be at least 1 (both are 0).")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by the total number of heads "
                f"`num_sensory_heads` + `num_relational_heads` ({self.num_attention_heads})."
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension; `hidden_size` / heads = {self.head_dim}.")
        for heads_name, kv_name in (("num_sensory_heads", "num_sensory_key_value_heads"),
                                    ("num_relational_heads", "num_relational_key_value_heads")):
            heads, kv = getattr(self, heads_name), getattr(self, kv_name)
            if kv is not None and heads > 0 and heads % kv != 0:
                raise ValueError(f"`{heads_name}` ({heads}) must be divisible by `{kv_name}` ({kv}).")
        total = self.head_dim * self.num_relational_heads
        if self.num_relational_heads > 0 and self.relation_dim is None and total % self.relations != 0:
            raise ValueError(
                f"`num_relations` ({self.relations}) must divide num_relational_heads * head_dim ({total}) "
                "when `relation_dim` is not given."
            )
        if self.share_attention_params:
            if self.num_sensory_heads != self.num_relational_heads:
                raise ValueError(
                    "`share_attention_params=True` needs `num_sensory_heads` == `num_relational_heads` "
                    f"({self.num_sensory_heads} != {self.num_relational_heads})."
                )
            if self.sensory_kv_heads != self.relational_kv_heads:
                raise ValueError(
                    "`share_attention_params=True` needs equal `num_sensory_key_value_heads` and "
                    "`num_relational_key_value_heads`."
                )
        if self.tie_symbol_library and self.symbol_retrieval == "position_relative":
            raise ValueError("`tie_symbol_library` is not available with `symbol_retrieval='position_relative'`.")
        if self.symbol_retrieval == "symbolic_attention" and self.hidden_size % self.symbolic_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `symbolic_attention_heads` "
                f"({self.symbolic_attention_heads})."
            )
        self._validate_biases()

    def _validate_biases(self):
        """The bias fields against the registry of relational biases (`relational_biases.check_bias_field`)."""
        for field_name in ("relational_bias", "relational_heads_bias"):
            if (value := getattr(self, field_name)) is not None:  # (None: `relational_heads_bias` follows the other)
                check_bias_field(self, field_name, value, self.num_hidden_layers, "num_hidden_layers",
                                 self.causal_model, self.bias_inputs)
        for edge in self.sparse_edges or []:
            if len(edge) != 2 or min(edge) < 0:
                raise ValueError(f"`sparse_edges` entries must be [receiver, sender] index pairs, got {edge!r}.")


@auto_docstring(
    custom_intro="Configuration of [`DATModel`] and [`DATForCausalLM`], the Dual Attention Transformer language model."
)
@strict
class DATConfig(DualAttentionConfig):
    __doc__ = DualAttentionConfig.fields_doc + r"""
    Example:

    ```python
    >>> from dat_hf import DATConfig, DATForCausalLM
    >>> config = DATConfig(vocab_size=1000, hidden_size=128, num_sensory_heads=2, num_relational_heads=2)
    >>> model = DATForCausalLM(config)
    ```
    """

    model_type = "dat"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # (the cache field: 5.24+, earlier)
    causal_model = True

    vocab_size: int = 32000
    tie_word_embeddings: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        _check_positive("vocab_size", self.vocab_size)
        super().__post_init__(**kwargs)

    @property
    def base_model_pp_plan(self) -> dict[str, tuple[list[str], list[str]]]:
        """Pipeline parallelism: the base model's stages, inputs and outputs (as Llama's)."""
        return {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                "layers": (["hidden_states", "symbols"], ["hidden_states"]),
                "norm": (["hidden_states"], ["hidden_states"])}


DUAL_ATTENTION_ARGS = DualAttentionConfig.fields_doc

__all__ = ["DualAttentionConfig", "DATConfig"]
