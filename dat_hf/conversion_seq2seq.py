"""Conversion of the reference seq2seq models (`dual_attention.seq2seq_models`, 0.0.7) into `DATForSeq2SeqLM`.

`from_reference_model(ref)` (in `dat_hf.conversion`) dispatches here for `Seq2SeqDualAttnTransformer` and
`Seq2SeqTransformer`. Outputs match the reference (same source, same target prefix) to float precision. How the
reference maps, and what conversion does about its quirks:

- Decoder depth: `Seq2SeqDualAttnTransformer` builds `n_layers_enc` decoder blocks and ignores `n_layers_dec` (a bug
  of the reference). Conversion uses the blocks actually built: `decoder_layers = len(ref.layers.decoder_blocks)`
  (= `n_layers_enc` for the DAT, `n_layers_dec` for `Seq2SeqTransformer`). A warning notes a mismatch.
- Weight tying: the reference's `tie_weights=True` sets `target_embedder.weights = final_out` (a typo for `weight`),
  which ties nothing: the target embedding and the output layer are separate parameters. Conversion therefore sets
  `tie_word_embeddings=False`; source and target embeddings are separate too (`share_embeddings=False`,
  `encoder_vocab_size` = source vocabulary). The output layer has a bias (`lm_head_bias=True`).
- Positions: the reference adds a fixed sinusoidal table to `sqrt(d_model) * embedding`. Conversion stores the
  embedding matrices multiplied by `sqrt(d_model)` (the same float products) and the sinusoidal tables as `learned`
  position embeddings of `in_block_size` (encoder) and `out_block_size` (decoder) positions, which become trainable.
- No final norm in either stack (`final_norm=False`); no RoPE (the reference's seq2seq blocks receive none).
- One symbol retriever serves the reference's encoder and decoder; dat_hf gives each stack its own retriever, both
  initialised with the reference's weights (they are independent parameters after conversion).
- Cross-attention is standard multi-head attention (`cross_attention='sensory'`) with `n_heads_cross` heads for the
  DAT; `Seq2SeqTransformer`'s `DecoderBlock` uses `n_heads` for its cross-attention (it ignores `n_heads_cross`).
- The reference decoders must be causal (`Seq2SeqTransformer`'s `DecoderBlock` defaults to `causal=False`: pass
  `causal=True` in `decoder_kwargs`); a non-causal decoder is rejected.
- Only token inputs/outputs (`input_spec`/`output_spec` type 'token') and `out_dim == output vocab_size` convert.
"""

import math
import warnings

import torch

from .conversion import (
    _activation,
    _copy_linear,
    _copy_norm,
    _norm_kwargs,
    dual_attention_kwargs,
    load_dual_attention,
    load_encoder_block,
    load_feed_forward,
    load_symbol_retrievers,
    load_transformer_block,
    symbol_retriever_kwargs,
)

RETRIEVER_NAMES = {"SymbolicAttention": "symbolic_attention", "PositionalSymbolRetriever": "positional_symbols",
                   "PositionRelativeSymbolRetriever": "position_relative"}


def _check_specs(ref):
    for name in ("input_spec", "output_spec"):
        spec = getattr(ref, name)
        if spec.get("type") != "token":
            raise ValueError(f"Only token {name} converts (got type {spec.get('type')!r}).")
    if ref.out_dim != ref.output_spec["vocab_size"]:
        raise ValueError(f"out_dim ({ref.out_dim}) must equal the output vocab_size ({ref.output_spec['vocab_size']}).")


def _attention_kwargs(attn, prefix: str) -> dict:
    """Config fields of a reference `Attention` used as a (whole-model) sensory attention."""
    if attn.key_dim != attn.head_dim:
        raise ValueError(f"key_dim={attn.key_dim} != head_dim={attn.head_dim} is not supported.")
    if prefix == "cross":
        return dict(num_cross_attention_heads=attn.n_heads,
                    num_cross_attention_key_value_heads=None if attn.n_kv_heads == attn.n_heads else attn.n_kv_heads,
                    cross_attention_bias=attn.add_bias_kv, cross_attention_out_bias=attn.add_bias_out)
    return dict(num_sensory_heads=attn.n_heads, num_relational_heads=0,
                num_sensory_key_value_heads=None if attn.n_kv_heads == attn.n_heads else attn.n_kv_heads,
                attention_bias=attn.add_bias_kv, attention_out_bias=attn.add_bias_out, attention_dropout=attn.dropout)


def _block_kwargs(block) -> dict:
    ff = block.ff_block
    return dict(intermediate_size=ff.dff, hidden_act=_activation(ff.activation), mlp_bias=ff.use_bias,
                pre_norm=block.norm_first, hidden_dropout=block.dropout_rate, **_norm_kwargs(block.norm1))


def _merge(name: str, encoder: dict, decoder: dict) -> dict:
    """The encoder's and decoder's shared fields must agree (dat_hf has one set of dual-attention fields)."""
    for key in encoder.keys() & decoder.keys():
        if encoder[key] != decoder[key]:
            raise ValueError(
                f"{name}: encoder and decoder blocks differ in `{key}` ({encoder[key]!r} vs {decoder[key]!r}); "
                "dat_hf's seq2seq config shares these fields between the stacks."
            )
    return {**encoder, **decoder}


def seq2seq_config(ref, **overrides):
    """A `DATSeq2SeqConfig` describing a reference `Seq2SeqDualAttnTransformer` or `Seq2SeqTransformer`."""
    from .configuration_dat_seq2seq import DATSeq2SeqConfig

    _check_specs(ref)
    name = type(ref).__name__
    is_dat = "DualAttn" in name
    enc_blocks, dec_blocks = ref.layers.encoder_blocks, ref.layers.decoder_blocks
    if len(dec_blocks) != ref.n_layers_dec:
        warnings.warn(
            f"The reference {name} built {len(dec_blocks)} decoder blocks although n_layers_dec={ref.n_layers_dec} "
            f"(it uses n_layers_enc); the converted model has decoder_layers={len(dec_blocks)}.",
            stacklevel=3,
        )
    enc, dec = enc_blocks[0], dec_blocks[0]
    if not dec.causal:
        raise ValueError(f"{name}: the reference decoder blocks are not causal (`causal=False`); only causal decoders "
                         "convert (pass `causal=True` in `decoder_kwargs`).")
    encoder_kwargs = _block_kwargs(enc)
    decoder_kwargs = _block_kwargs(dec)
    if is_dat:
        encoder_kwargs.update(dual_attention_kwargs(enc.dual_attn, False))
        decoder_kwargs.update(dual_attention_kwargs(dec.dual_attn, False))
    else:
        encoder_kwargs.update(_attention_kwargs(enc.self_attn, "self"))
        decoder_kwargs.update(_attention_kwargs(dec.self_attn, "self"))
    kwargs = _merge(name, encoder_kwargs, decoder_kwargs)
    kwargs.update(_attention_kwargs(dec.cross_attn, "cross"))
    d = ref.d_model
    kwargs.update(
        hidden_size=d,
        encoder_layers=len(enc_blocks),
        num_hidden_layers=len(dec_blocks),
        vocab_size=ref.output_spec["vocab_size"],
        encoder_vocab_size=ref.input_spec["vocab_size"],
        share_embeddings=False,
        tie_word_embeddings=False,
        lm_head_bias=ref.layers.final_out.bias is not None,
        final_norm=False,
        position_embedding_type="learned",
        encoder_position_embedding_type="learned",
        max_position_embeddings=ref.out_block_size,
        encoder_max_position_embeddings=ref.in_block_size,
        encoder_relational_bias="causal" if enc.causal else "full",
        relational_bias="causal",
        cross_attention="sensory",
    )
    if is_dat and kwargs["num_relational_heads"] > 0:
        retriever = ref.layers.symbol_retriever
        retriever_name = type(retriever).__name__
        if retriever_name not in RETRIEVER_NAMES:
            raise ValueError(f"Unsupported reference symbol retriever {retriever_name}.")
        kwargs.update(symbol_retriever_kwargs([retriever], len(dec_blocks), RETRIEVER_NAMES[retriever_name], {}))
    kwargs.update(overrides)
    return DATSeq2SeqConfig(**kwargs)


@torch.no_grad()
def _load_sensory(ours, ref_attn):
    """A reference `Attention` into the sensory heads of a dat_hf DualAttention (0 relational heads) or
    DATCrossAttention (no RoPE in the reference seq2seq models)."""
    mine = ours.sensory
    _copy_linear(mine.q_proj, ref_attn.wq)
    _copy_linear(mine.k_proj, ref_attn.wk)
    _copy_linear(mine.v_proj, ref_attn.wv)
    _copy_linear(mine.o_proj, ref_attn.wo)


@torch.no_grad()
def _sinusoidal_table(ref_pos_embedder, length):
    return ref_pos_embedder.pe[:length].detach()


@torch.no_grad()
def convert_seq2seq(ref, **overrides):
    """A dat_hf `DATForSeq2SeqLM` with the weights of a reference `Seq2SeqDualAttnTransformer` /
    `Seq2SeqTransformer` (eval mode)."""
    from .modeling_dat_seq2seq import DATForSeq2SeqLM

    config = seq2seq_config(ref, **overrides)
    model = DATForSeq2SeqLM(config)
    layers = ref.layers
    is_dat = "DualAttn" in type(ref).__name__
    for ours, ref_embed, ref_pos in ((model.model.encoder, layers.source_embedder, layers.source_pos_embedder),
                                     (model.model.decoder, layers.target_embedder, layers.target_pos_embedder)):
        scale = ref_pos.scale
        if scale != 1 and not math.isclose(scale, math.sqrt(ref.d_model)):
            raise ValueError(f"Unexpected positional-encoding scale {scale}.")
        ours.embed_tokens.weight.copy_(ref_embed.weight.detach() * scale)
        ours.embed_positions.weight.copy_(_sinusoidal_table(ref_pos, ours.embed_positions.num_embeddings))
    model.lm_head.weight.copy_(layers.final_out.weight.detach())
    if config.lm_head_bias:
        model.lm_head.bias.copy_(layers.final_out.bias.detach())

    for ours, theirs in zip(model.model.encoder.layers, layers.encoder_blocks):
        (load_encoder_block if is_dat else load_transformer_block)(ours, theirs, rope=False)
    for ours, theirs in zip(model.model.decoder.layers, layers.decoder_blocks):
        _copy_norm(ours.input_layernorm, theirs.norm1)
        _copy_norm(ours.cross_attention_layernorm, theirs.norm2)
        _copy_norm(ours.post_attention_layernorm, theirs.norm3)
        if is_dat:
            load_dual_attention(ours.dual_attn, theirs.dual_attn, rope=False)
        else:
            _load_sensory(ours.dual_attn, theirs.self_attn)
        _load_sensory(ours.cross_attn, theirs.cross_attn)
        load_feed_forward(ours.mlp, theirs.ff_block)
    if is_dat and config.num_relational_heads > 0:
        for stack in (model.model.encoder, model.model.decoder):
            load_symbol_retrievers(stack.symbol_retrievers, [layers.symbol_retriever])
    return model.eval()


CONVERTERS = {
    "Seq2SeqDualAttnTransformer": convert_seq2seq,
    "Seq2SeqTransformer": convert_seq2seq,
}

__all__ = ["CONVERTERS", "convert_seq2seq", "seq2seq_config"]
