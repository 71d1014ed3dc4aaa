"""Conversion of the authors' vision models (`dual_attention.vision_models`, 0.0.7) into `DATForImageClassification`.

- `VisionDualAttnTransformer` -> DAT vision model; `VisionTransformer` (the plain ViT baseline) -> 0 relational heads.
- `to_patch_embedding = [Rearrange, LayerNorm(patch_dim), Linear, LayerNorm(d)]` -> `patch_embeddings.norm_in`,
  `.projection`, `.norm_out` (same (row, column, channel) patch flattening); `pos_embedding` -> `position_embeddings`,
  `cls_token` -> `cls_token`, `final_out` -> `classifier`. The reference has no final norm (`final_norm=False`).
- The reference's image_shape is `(channels, width, height)` with patches split as `(h p1) (w p2)`,
  `p1 = patch_height`: `image_size = [img_height, img_width]`, `patch_size = [patch_height, patch_width]`.
- One symbol retriever serves every layer, recomputed from each layer's input (`shared_symbol_retriever=True`).
- The reference's SymbolicAttention applies its dropout even in eval mode: outputs match only with `dropout=0`.
"""

import torch

from .conversion import (
    _activation,
    _copy_linear,
    _copy_norm,
    _norm_kwargs,
    dual_attention_kwargs,
    load_encoder_block,
    load_symbol_retrievers,
    load_transformer_block,
    symbol_retriever_kwargs,
)

REFERENCE_VISION_SYMBOLS = {"symbolic_attention": "symbolic_attention", "positional_symbols": "positional_symbols",
                            "position_relative": "position_relative"}


def vision_config(ref, **overrides):
    """`DATVisionConfig` describing a reference `VisionDualAttnTransformer` / `VisionTransformer`."""
    from .configuration_dat_vision import DATVisionConfig

    block = ref.encoder_blocks[0]
    ff = block.ff_block
    kwargs = dict(
        image_size=[ref.img_height, ref.img_width], patch_size=[ref.patch_height, ref.patch_width],
        num_channels=ref.img_channels, num_labels=ref.num_classes, pooling=ref.pool,
        hidden_size=ref.d_model, num_hidden_layers=ref.n_layers, intermediate_size=ff.dff,
        hidden_act=_activation(ref.activation), mlp_bias=ff.use_bias, pre_norm=ref.norm_first,
        position_embedding_type="learned", patch_norm=True, final_norm=False,
        hidden_dropout=ref.dropout_rate, embedding_dropout=ref.dropout_rate,
        relational_bias="full", **_norm_kwargs(block.norm1),
    )
    if type(ref).__name__ == "VisionTransformer":
        attn = block.self_attn
        if attn.key_dim != attn.head_dim:
            raise ValueError(f"key_dim={attn.key_dim} != head_dim={attn.head_dim} is not supported.")
        kwargs.update(num_sensory_heads=ref.n_heads, num_relational_heads=0,
                      num_sensory_key_value_heads=attn.n_kv_heads, attention_bias=attn.add_bias_kv,
                      attention_out_bias=attn.add_bias_out, attention_dropout=ref.dropout_rate)
    else:
        if ref.symbol_retrieval not in REFERENCE_VISION_SYMBOLS:
            raise ValueError(f"Reference symbol retrieval {ref.symbol_retrieval!r} has no dat_hf equivalent "
                             f"(supported: {sorted(REFERENCE_VISION_SYMBOLS)}).")
        kwargs.update(dual_attention_kwargs(block.dual_attn, pos_enc_rope=False))
        if ref.n_heads_ra > 0:
            kwargs.update(symbol_retriever_kwargs([ref.symbol_retriever] * ref.n_layers, ref.n_layers,
                                                  ref.symbol_retrieval, {}))
            if ref.symbol_retrieval == "position_relative":
                ra = block.dual_attn.relational_attention
                if not getattr(ra, "use_relative_positional_symbols", False):
                    raise ValueError("The reference uses position-relative symbols without "
                                     "`ra_kwargs['use_relative_positional_symbols']=True`; it cannot run.")
    kwargs.update(overrides)
    return DATVisionConfig(**kwargs)


@torch.no_grad()
def convert_vision_model(ref, **overrides):
    """A `DATForImageClassification` with the weights of a reference vision model (eval mode, identical logits)."""
    from .modeling_dat_vision import DATForImageClassification

    config = vision_config(ref, **overrides)
    model = DATForImageClassification(config)
    embeddings = model.model.embeddings
    _, norm_in, projection, norm_out = ref.to_patch_embedding
    _copy_norm(embeddings.patch_embeddings.norm_in, norm_in)
    _copy_linear(embeddings.patch_embeddings.projection, projection)
    _copy_norm(embeddings.patch_embeddings.norm_out, norm_out)
    embeddings.cls_token.copy_(ref.cls_token.detach())
    embeddings.position_embeddings.copy_(ref.pos_embedding.detach()[:, : config.num_patches + 1])
    is_dat = type(ref).__name__ != "VisionTransformer"
    for ours, theirs in zip(model.model.layers, ref.encoder_blocks):
        (load_encoder_block if is_dat else load_transformer_block)(ours, theirs, False)
    if is_dat and config.num_relational_heads > 0:
        load_symbol_retrievers(model.model.symbol_retrievers, [ref.symbol_retriever] * ref.n_layers)
    _copy_linear(model.classifier, ref.final_out)
    return model.eval()


CONVERTERS = {
    "VisionDualAttnTransformer": convert_vision_model,
    "VisionTransformer": convert_vision_model,
}

__all__ = ["CONVERTERS", "convert_vision_model", "vision_config"]
