# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The bidirectional DAT stack: DATEncoderModel, DATForTokenClassification (every relational bias; `graph` for node
classification, the GAT use case)."""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import TokenClassifierOutput
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple

from .configuration_dat_encoder import DATEncoderConfig
from .kernel_hooks import check_inputs
from .modeling_dat import DAT_OUTPUT_ARGS, DATModel, DATPreTrainedModel, recorded_outputs


ENCODER_AUTO_CLASSES = {
    "AutoConfig": "configuration_dat_encoder.DATEncoderConfig",
    "AutoModel": "modeling_dat_encoder.DATEncoderModel",
    "AutoModelForTokenClassification": "modeling_dat_encoder.DATForTokenClassification",
}


@auto_docstring(
    custom_intro=r"""
    The bidirectional DAT stack: no causal order is imposed, so `full`, `sliding_window_bidirectional`, `sparse` and
    `graph` biases see both directions (`causal` and `sliding_window` stay ordered). input_ids `[b, n]` (or
    inputs_embeds `[b, n, d]`) -> last_hidden_state `[b, n, d]`.
    """
)
class DATEncoderModel(DATModel):

    config: DATEncoderConfig
    is_causal = False
    auto_classes = ENCODER_AUTO_CLASSES


@auto_docstring(custom_args=DAT_OUTPUT_ARGS)
@dataclass
class DATTokenClassifierOutput(TokenClassifierOutput):
    relations: tuple[torch.FloatTensor, ...] | None = None


@auto_docstring(
    custom_intro=r"""
    Classifies every token (node) from a bidirectional DAT stack: the GAT use case with `relational_bias='graph'`.

    input_ids `[b, n]`, inputs_embeds `[b, n, d]` or node_features `[b, n, num_node_features]` (with
    `config.num_node_features`), plus graph_adjacency `[b, n, n]` for `graph` layers -> logits `[b, n, num_labels]`
    (cross-entropy loss with `labels` `[b, n]`, -100 = ignored).
    """
)
class DATForTokenClassification(DATPreTrainedModel):

    config: DATEncoderConfig
    auto_classes = ENCODER_AUTO_CLASSES

    def __init__(self, config: DATEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = DATEncoderModel(config)
        # CODEPATH: no released checkpoint; dat_hf's node classification (node features instead of tokens, e.g.
        # scripts/node_classification_karate.py). Token inputs otherwise.
        self.node_proj = nn.Linear(config.num_node_features, config.hidden_size) if config.num_node_features else None
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        node_features: torch.FloatTensor | None = None,
        graph_adjacency: torch.BoolTensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATTokenClassifierOutput:
        r"""
        node_features (`torch.FloatTensor` of shape `(batch_size, sequence_length, num_node_features)`, *optional*):
            Node features, projected to `hidden_size` (instead of `input_ids` / `inputs_embeds`).
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            The class index of every token (node) in `[0, num_labels)`; -100 is ignored.
        graph_adjacency (`torch.BoolTensor` of shape `(batch_size, sequence_length, sequence_length)`, *optional*):
            Per-instance attention graph of the layers whose relational bias is `graph` (True: token i may attend to j).

        Returns:
            [`DATTokenClassifierOutput`] (a tuple with `return_dict=False`): `logits` `(batch_size, sequence_length,
            num_labels)`, `loss` with `labels`, and on request the hidden states, the attention weights of every head
            and the relations.
        """
        check_inputs("token_classification", self.config, input_ids, inputs_embeds, node_features, labels)
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
        return DATTokenClassifierOutput(loss=loss, logits=logits, **recorded_outputs(outputs))


__all__ = ["DATEncoderModel", "DATForTokenClassification", "DATTokenClassifierOutput"]
