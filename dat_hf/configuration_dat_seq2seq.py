# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Configuration of the encoder-decoder Dual Attention Transformer (`model_type="dat_seq2seq"`).

One set of dual-attention fields (heads, symbols, relations, feed-forward, norms) describes both stacks, as in the
reference `Seq2SeqDualAttnTransformer`; the encoder and decoder differ in depth, attention graph, positions and
vocabulary. The decoder depth is `num_hidden_layers` (alias `decoder_layers`), so `DynamicCache(config=...)` and
`EncoderDecoderCache` size themselves from it.
"""

from huggingface_hub.dataclasses import strict
from transformers.utils import auto_docstring

from .configuration_dat import (
    DUAL_ATTENTION_ARGS,
    POSITION_EMBEDDINGS,
    DualAttentionConfig,
    _check_choice,
    _check_layers,
    _check_positive,
)
from .relational_biases import check_bias_field

CROSS_ATTENTION_TYPES = ("sensory", "dual")


@auto_docstring(
    custom_intro=r"""
    Configuration of [`DATSeq2SeqModel`] and [`DATForSeq2SeqLM`]: a bidirectional DAT encoder and a causal DAT
    decoder with cross-attention to the encoder. The dual-attention fields apply to both stacks; `num_hidden_layers`,
    `relational_bias`, `relational_heads_bias`, `position_embedding_type` and `max_position_embeddings` describe the
    decoder.
    """
)
@strict
class DATSeq2SeqConfig(DualAttentionConfig):
    __doc__ = DUAL_ATTENTION_ARGS + r"""
    encoder_layers (`int`):
        Depth of the encoder.
    num_hidden_layers (`int`):
        Depth of the decoder (alias `decoder_layers`).
    vocab_size (`int`):
        Target (decoder) vocabulary; also the size of the LM head.
    encoder_vocab_size (`int`):
        Source vocabulary; None = `vocab_size`.
    share_embeddings (`bool`):
        Encoder and decoder share one token embedding (needs equal vocabularies).
    tie_word_embeddings (`bool`):
        The LM head shares the decoder's token embedding.
    encoder_relational_bias (`str`):
        Attention graph of the encoder's heads (a string, or one per encoder layer; any bias but `graph`). The
        decoder's `relational_bias` must be a causal one.
    encoder_position_embedding_type (`str`):
        `rope`, `learned` or `none` for the source; None = `position_embedding_type`. With `none` and
        symbolic-attention symbols the encoder is permutation-equivariant.
    encoder_max_position_embeddings (`int`):
        Longest source; None = `max_position_embeddings`. Longer sources raise.
    cross_attention (`str`):
        `sensory` (standard multi-head cross-attention, as in the reference) or `dual` (sensory cross heads beside
        relational cross heads: target token i receives `sum_j a_ij (r(y_i, x_j) W_r + s_j W_s)` from the source
        tokens j, relations across the encoder/decoder bipartition with the source tokens' symbols `s_j`).
    num_cross_attention_heads (`int`):
        Sensory cross-attention heads; None = every head (`num_sensory_heads + num_relational_heads`) for `sensory`,
        `num_sensory_heads` for `dual` (where it may be 0).
    num_cross_relational_heads (`int`):
        Relational cross heads of `dual` cross-attention; None = `num_relational_heads`.
    num_cross_attention_key_value_heads (`int`):
        Key/value heads of the sensory cross heads (grouped-query attention); None = one per head.
    cross_attention_bias (`bool`):
        Bias of the cross-attention key and value projections.
    cross_attention_out_bias (`bool`):
        Bias of the cross-attention output projection.
    final_norm (`bool`):
        Normalize the output of each stack (the reference seq2seq models have no final norm).
    lm_head_bias (`bool`):
        Give the LM head a bias (the reference's output layer has one).
    decoder_start_token_id (`int`):
        First decoder token (`prepare_decoder_input_ids_from_labels` shifts the labels right behind it).

    Example:

    ```python
    >>> from dat_hf import DATSeq2SeqConfig, DATForSeq2SeqLM
    >>> config = DATSeq2SeqConfig(vocab_size=64, hidden_size=64, encoder_layers=2, decoder_layers=2,
    ...                           num_sensory_heads=2, num_relational_heads=2, pad_token_id=0, eos_token_id=1,
    ...                           decoder_start_token_id=3)
    >>> model = DATForSeq2SeqLM(config)
    ```
    """

    model_type = "dat_seq2seq"
    # (the cache field: "cache" from Transformers 5.24, "past_key_values" before)
    keys_to_ignore_at_inference = ["cache", "past_key_values", "encoder_last_hidden_state"]
    attribute_map = {"decoder_layers": "num_hidden_layers"}
    causal_model = True  # (the decoder's biases; the encoder's are checked by `_validate_encoder`)
    bias_inputs = ()  # no per-input graph: neither stack takes `graph_adjacency`
    # tensor parallelism: both stacks' layers and the decoder's cross-attention, named from the seq2seq base model
    # (which holds the plan of its encoder and decoder); token embeddings by vocabulary (as Llama's)
    base_model_tp_plan = {
        "encoder.embed_tokens": "embedding_rowwise", "decoder.embed_tokens": "embedding_rowwise",
        **{f"{stack}.{rule}": style for stack in ("encoder", "decoder")
           for rule, style in DualAttentionConfig.base_model_tp_plan.items()},
        **{rule.replace("layers.*.dual_attn", "decoder.layers.*.cross_attn"): style
           for rule, style in DualAttentionConfig.base_model_tp_plan.items() if ".dual_attn." in rule},
    }

    is_encoder_decoder: bool = True
    encoder_layers: int = 4
    vocab_size: int = 32000
    encoder_vocab_size: int | None = None
    share_embeddings: bool = True
    tie_word_embeddings: bool = True
    encoder_relational_bias: str | list[str] = "full"
    encoder_position_embedding_type: str | None = None
    encoder_max_position_embeddings: int | None = None
    cross_attention: str = "sensory"
    num_cross_attention_heads: int | None = None
    num_cross_relational_heads: int | None = None
    num_cross_attention_key_value_heads: int | None = None
    cross_attention_bias: bool = False
    cross_attention_out_bias: bool = False
    final_norm: bool = True
    lm_head_bias: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    decoder_start_token_id: int | None = None

    def __post_init__(self, **kwargs):
        # `decoder_layers` is an alias of `num_hidden_layers`: apply it before validation
        if "decoder_layers" in kwargs:
            self.num_hidden_layers = kwargs.pop("decoder_layers")
        self.validate_seq2seq()
        super().__post_init__(**kwargs)

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def source_vocab_size(self) -> int:
        return self.encoder_vocab_size or self.vocab_size

    @property
    def encoder_position_type(self) -> str:
        return self.encoder_position_embedding_type or self.position_embedding_type

    @property
    def encoder_max_positions(self) -> int:
        return self.encoder_max_position_embeddings or self.max_position_embeddings

    @property
    def cross_sensory_heads(self) -> int:
        if self.num_cross_attention_heads is not None:
            return self.num_cross_attention_heads
        return self.num_attention_heads if self.cross_attention == "sensory" else self.num_sensory_heads

    @property
    def cross_relational_heads(self) -> int:
        if self.cross_attention != "dual":
            return 0
        return self.num_relational_heads if self.num_cross_relational_heads is None else self.num_cross_relational_heads

    @property
    def cross_head_dim(self) -> int:
        return self.hidden_size // (self.cross_sensory_heads + self.cross_relational_heads)

    @property
    def decoder_uses_symbols(self) -> bool:
        """Whether the decoder needs a symbol retriever (its own relational heads, or `dual` cross-attention)."""
        return self.num_relational_heads > 0 or self.cross_relational_heads > 0

    def encoder_layer_bias(self, layer_idx: int) -> str:
        bias = self.encoder_relational_bias
        return bias[layer_idx] if isinstance(bias, list) else bias

    # ---- validation ----------------------------------------------------------------------------------------------
    def validate_seq2seq(self):
        """Raise a ValueError naming the field for every invalid seq2seq value or combination (the shared
        dual-attention fields and the decoder's biases are `DualAttentionConfig`'s)."""
        self._validate_vocabularies()
        self._validate_cross_attention()
        self._validate_encoder()

    def _validate_vocabularies(self):
        """The source and target vocabularies and the special token ids."""
        _check_positive("vocab_size", self.vocab_size)
        _check_positive("encoder_vocab_size", self.encoder_vocab_size, allow_none=True)
        if self.share_embeddings and self.encoder_vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"`share_embeddings=True` needs `encoder_vocab_size` ({self.encoder_vocab_size}) == `vocab_size` "
                f"({self.vocab_size}); set `share_embeddings=False` for separate vocabularies."
            )
        for name in ("pad_token_id", "decoder_start_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(f"`{name}` must be a token id in [0, vocab_size={self.vocab_size}), got {value!r}.")

    def _validate_cross_attention(self):
        """The cross-attention's kind, head counts and relation sizes."""
        _check_choice("cross_attention", self.cross_attention, CROSS_ATTENTION_TYPES)
        for name in ("num_cross_attention_heads", "num_cross_relational_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
        _check_positive("num_cross_attention_key_value_heads", self.num_cross_attention_key_value_heads, allow_none=True)
        if self.cross_attention == "sensory":
            if self.num_cross_relational_heads:
                raise ValueError(
                    f"`num_cross_relational_heads` ({self.num_cross_relational_heads}) needs `cross_attention='dual'`."
                )
            if self.cross_sensory_heads == 0:
                raise ValueError("`num_cross_attention_heads` must be at least 1 with `cross_attention='sensory'`.")
        else:
            if self.cross_relational_heads == 0:
                raise ValueError(
                    "`cross_attention='dual'` needs relational cross heads: set `num_cross_relational_heads` >= 1 "
                    "(it defaults to `num_relational_heads`, which is 0)."
                )
            if self.symbol_retrieval == "position_relative":
                raise ValueError(
                    "`cross_attention='dual'` is not available with `symbol_retrieval='position_relative'` (source and "
                    "target positions have no common offset); use 'symbolic_attention' or 'positional'."
                )
        total = self.cross_sensory_heads + self.cross_relational_heads
        if isinstance(self.hidden_size, int) and self.hidden_size % total != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by the number of cross-attention heads "
                f"`num_cross_attention_heads` + `num_cross_relational_heads` ({total})."
            )
        kv = self.num_cross_attention_key_value_heads
        if kv is not None and self.cross_sensory_heads % kv != 0:
            raise ValueError(
                f"`num_cross_attention_heads` ({self.cross_sensory_heads}) must be divisible by "
                f"`num_cross_attention_key_value_heads` ({kv})."
            )
        if self.cross_relational_heads > 0 and self.relation_dim is None:
            cross_total = self.cross_head_dim * self.cross_relational_heads
            relations = self.num_relations or self.cross_relational_heads
            if cross_total % relations != 0:
                raise ValueError(
                    f"`num_relations` ({relations}) must divide num_cross_relational_heads * cross head dim "
                    f"({cross_total}) when `relation_dim` is not given."
                )

    def _validate_encoder(self):
        """The encoder's depth, positions and relational biases (any self-attention bias its forward can build)."""
        _check_layers("encoder_layers", self.encoder_layers)
        _check_positive("encoder_max_position_embeddings", self.encoder_max_position_embeddings, allow_none=True)
        if self.encoder_position_embedding_type is not None:
            _check_choice("encoder_position_embedding_type", self.encoder_position_embedding_type, POSITION_EMBEDDINGS)
        enc_pos = self.encoder_position_type
        if enc_pos == "rope" and isinstance(self.hidden_size, int) and (self.hidden_size // max(self.num_attention_heads, 1)) % 2:
            raise ValueError("RoPE in the encoder needs an even head dimension (`encoder_position_embedding_type`).")
        check_bias_field(self, "encoder_relational_bias", self.encoder_relational_bias, self.encoder_layers,
                         "encoder_layers", decoder=False, inputs=self.bias_inputs)


__all__ = ["DATSeq2SeqConfig"]
