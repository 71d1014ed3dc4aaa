# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Configuration of the vision Dual Attention Transformer (ViDAT): `DATVisionConfig` (`model_type="dat_vision"`).

It shares every dual-attention field and its validation with `DATConfig` (through `DualAttentionConfig`) and adds the
image fields: image and patch size, channels, pooling, and the labels (`id2label` / `label2id`, `num_labels`).
"""

from huggingface_hub.dataclasses import strict
from transformers.utils import auto_docstring

from .configuration_dat import (
    DUAL_ATTENTION_ARGS,
    DualAttentionConfig,
    _check_choice,
    _check_positive,
    _check_probability,
)

POOLINGS = ("cls", "mean")


def _pair(name, value) -> tuple[int, int]:
    """An int or a [height, width] pair of positive ints -> (height, width); ValueError naming the field."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"`{name}` must be an int or a [height, width] pair, got {value!r}.")
        for v in value:
            _check_positive(name, v)
        return int(value[0]), int(value[1])
    _check_positive(name, value)
    return int(value), int(value)


@auto_docstring(
    custom_intro=r"""
    Configuration of [`DATVisionModel`] and [`DATForImageClassification`], the vision Dual Attention Transformer (a
    ViT whose layers have sensory and relational heads; with `num_relational_heads=0` a plain ViT).

    The image is cut into `patch_size` patches (row-major on the patch grid), each flattened as (row, column, channel)
    and embedded by `LayerNorm -> Linear -> LayerNorm` (as the authors' `VisionDualAttnTransformer`; `patch_norm=False`
    drops the two norms). A CLS token is prepended (index 0); learned position embeddings cover the CLS token and every
    patch. The encoder is bidirectional (`relational_bias="full"` by default; every bias is allowed and the 1-D biases
    act on the row-major patch order).

    Small models: the shared `initializer_range` default (0.02) suits wide models; a tiny one (say 64 wide) learns
    several times faster from about `hidden_size ** -0.5` (what `scripts/train_image_classification.py` uses). The
    CLS token and position embeddings start at unit scale when `patch_norm` is on (the reference's init).
    """
)
@strict
class DATVisionConfig(DualAttentionConfig):
    __doc__ = DUAL_ATTENTION_ARGS + r"""
    image_size (`int`):
        Input resolution, an int or `[height, width]`. Other sizes need `interpolate_pos_encoding=True`.
    patch_size (`int`):
        Patch size, an int or `[height, width]`; it must divide `image_size`.
    num_channels (`int`):
        Image channels (1 for grayscale, 3 for RGB).
    pooling (`str`):
        `cls` (the CLS token's final state) or `mean` (the mean over every token, CLS included, as the reference).
    relative_symbols_2d (`bool`):
        With `symbol_retrieval="position_relative"`, the symbol of sender j for receiver i embeds the clipped 2-D
        offset `(dy, dx)` between their patches on the grid (each clipped to `max_relative_position`) instead of the
        1-D offset `j - i` of the row-major sequence. The table has `(2K + 1)^2 + 1` rows: row
        `(dy + K) * (2K + 1) + dx + K` for two patches, and a last row for every pair involving the CLS token (which
        has no place on the grid).
    patch_norm (`bool`):
        LayerNorm before and after the patch projection (the reference's patch embedding).
    final_norm (`bool`):
        A norm after the last layer (as ViT; the reference has none).
    classifier_dropout (`float`):
        Dropout before the classification head.
    position_embedding_type (`str`):
        `learned` (ViT), `none`, or `rope` (1-D RoPE over the row-major sequence, CLS at position 0).

    Example:

    ```python
    >>> from dat_hf import DATVisionConfig, DATForImageClassification
    >>> config = DATVisionConfig(image_size=28, patch_size=4, num_channels=1, hidden_size=64, num_hidden_layers=2,
    ...                          num_sensory_heads=2, num_relational_heads=2, num_labels=10)
    >>> model = DATForImageClassification(config)
    ```
    """

    model_type = "dat_vision"

    image_size: int | list[int] | tuple[int, ...] = 224
    patch_size: int | list[int] | tuple[int, ...] = 16
    num_channels: int = 3
    pooling: str = "cls"
    relative_symbols_2d: bool = False
    patch_norm: bool = True
    final_norm: bool = True
    classifier_dropout: float = 0.0
    # vision defaults of shared fields
    relational_bias: str | list[str] = "full"
    position_embedding_type: str = "learned"
    hidden_act: str = "gelu"
    norm_type: str = "layernorm"
    mlp_bias: bool = True

    def __post_init__(self, **kwargs):
        self.validate_vision()
        super().__post_init__(**kwargs)

    @property
    def image_hw(self) -> tuple[int, int]:
        return _pair("image_size", self.image_size)

    @property
    def patch_hw(self) -> tuple[int, int]:
        return _pair("patch_size", self.patch_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        """(rows, columns) of the patch grid at `image_size`."""
        (h, w), (ph, pw) = self.image_hw, self.patch_hw
        return h // ph, w // pw

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid_size
        return rows * cols

    def validate_vision(self):
        """Raise a ValueError naming the field for every invalid image field."""
        (h, w), (ph, pw) = _pair("image_size", self.image_size), _pair("patch_size", self.patch_size)
        if h % ph != 0 or w % pw != 0:
            raise ValueError(
                f"`image_size` ({h}x{w}) must be divisible by `patch_size` ({ph}x{pw}) in both height and width."
            )
        _check_positive("num_channels", self.num_channels)
        _check_choice("pooling", self.pooling, POOLINGS)
        _check_probability("classifier_dropout", self.classifier_dropout)
        if self.relative_symbols_2d and self.symbol_retrieval != "position_relative":
            raise ValueError(
                "`relative_symbols_2d=True` needs `symbol_retrieval='position_relative'`, got "
                f"{self.symbol_retrieval!r}."
            )


__all__ = ["DATVisionConfig"]
