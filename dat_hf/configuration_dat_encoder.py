# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Configuration of the bidirectional DAT stack: `DATEncoderConfig` (`model_type="dat_encoder"`)."""

from huggingface_hub.dataclasses import strict
from transformers.utils import auto_docstring

from .configuration_dat import DUAL_ATTENTION_ARGS, DualAttentionConfig, _check_positive, _check_probability


@auto_docstring(
    custom_intro=r"""
    Configuration of [`DATEncoderModel`] and [`DATForTokenClassification`]: a bidirectional DAT stack (no causal order
    imposed), so every relational bias is allowed (`full` by default; `graph` for node classification).
    """
)
@strict
class DATEncoderConfig(DualAttentionConfig):
    __doc__ = DUAL_ATTENTION_ARGS + r"""
    vocab_size (`int`):
        Token vocabulary (inputs may also be `inputs_embeds` or `node_features`).
    num_node_features (`int`):
        When set, [`DATForTokenClassification`] accepts `node_features` `[b, n, num_node_features]` and projects them
        to `hidden_size`.

    Example:

    ```python
    >>> from dat_hf import DATEncoderConfig, DATForTokenClassification
    >>> config = DATEncoderConfig(hidden_size=32, num_sensory_heads=2, num_relational_heads=2, relational_bias="graph",
    ...                           position_embedding_type="none", num_node_features=34, num_labels=2)
    >>> model = DATForTokenClassification(config)
    ```
    """

    model_type = "dat_encoder"

    relational_bias: str | list[str] = "full"
    vocab_size: int = 32000
    pad_token_id: int | None = None
    num_node_features: int | None = None
    classifier_dropout: float = 0.0

    def __post_init__(self, **kwargs):
        _check_positive("vocab_size", self.vocab_size)
        _check_positive("num_node_features", self.num_node_features, allow_none=True)
        _check_probability("classifier_dropout", self.classifier_dropout)
        super().__post_init__(**kwargs)


__all__ = ["DATEncoderConfig"]
