# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Vision Dual Attention Transformer (ViDAT): DATVisionModel and DATForImageClassification.

A ViT whose layers are DAT layers (sensory heads beside relational heads), as the authors' `VisionDualAttnTransformer`:

    patches = LayerNorm -> Linear -> LayerNorm of each flattened patch        (row-major on the patch grid)
    x       = [CLS | patches] + position embeddings                          (learned, interpolable)
    x       = DAT layers (bidirectional), symbols from one of the retrievers
    pooled  = x[CLS] or mean over tokens  ->  classifier

Position-relative symbols are either 1-D (offset `j - i` of the row-major sequence, as the reference) or 2-D
(`config.relative_symbols_2d`: the clipped offset `(dy, dx)` between the two patches on the grid; pairs involving the
CLS token use a dedicated row of the table), computed by the relational heads' blocked path from a precomputed
`[n, n]` bin index (no `[n, n, d]` tensor).
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple

from .configuration_dat_vision import DATVisionConfig
from .dual_attention import DATRotaryEmbedding
from .kernel_hooks import check_inputs
from .modeling_dat import (
    DAT_OUTPUT_ARGS,
    DATDecoderLayer,
    DATPreTrainedModel,
    init_dat_stack,
    plan_layers,
    recorded_outputs,
    run_dat_layers,
    stack_forward,
)


@auto_docstring(
    custom_args=DAT_OUTPUT_ARGS
    + r"""
pooler_output (`torch.FloatTensor` of shape `(batch_size, hidden_size)`):
    The CLS token's final state, or the mean over every token (`config.pooling`).
"""
)
@dataclass
class DATVisionModelOutput(BaseModelOutputWithPooling):
    relations: tuple[torch.FloatTensor, ...] | None = None


@auto_docstring(custom_args=DAT_OUTPUT_ARGS)
@dataclass
class DATImageClassifierOutput(ImageClassifierOutput):
    relations: tuple[torch.FloatTensor, ...] | None = None


def grid_relative_position_index(rows: int, cols: int, max_relative_position: int, device=None) -> torch.LongTensor:
    """Rows of the 2-D position-relative symbol table for a `[CLS | rows x cols patches]` sequence: `[n, n]` with
    `n = rows * cols + 1`. For receiver patch i at (y_i, x_i) and sender patch j at (y_j, x_j), with
    `dy = clip(y_j - y_i, -K, K)`, `dx = clip(x_j - x_i, -K, K)`: `(dy + K) * (2K + 1) + (dx + K)`. Every pair that
    involves the CLS token (index 0) uses the last row, `(2K + 1)^2`."""
    k = max_relative_position
    ys = torch.arange(rows, device=device).repeat_interleave(cols)
    xs = torch.arange(cols, device=device).repeat(rows)
    dy = (ys[None, :] - ys[:, None]).clamp(-k, k) + k
    dx = (xs[None, :] - xs[:, None]).clamp(-k, k) + k
    index = torch.full((rows * cols + 1, rows * cols + 1), (2 * k + 1) ** 2, dtype=torch.long, device=device)
    index[1:, 1:] = dy * (2 * k + 1) + dx
    return index


class DATVisionPatchEmbeddings(nn.Module):
    """pixel_values `[b, c, H, W]` -> patch embeddings `[b, (H / p_h) * (W / p_w), d]`. Each patch is flattened as
    (row, column, channel) (the reference's `Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)')`) and embedded by
    `LayerNorm -> Linear -> LayerNorm` (`patch_norm`) or a plain Linear."""

    def __init__(self, config: DATVisionConfig):
        super().__init__()
        self.patch_size = config.patch_hw
        self.num_channels = config.num_channels
        patch_dim = self.patch_size[0] * self.patch_size[1] * config.num_channels
        # CODEPATH: patch norms: the reference `VisionDualAttnTransformer`, i.e. the paper's ViDAT (ImageNet, CIFAR; no
        # released weights); a plain linear (ViT's): no released checkpoint, a dat_hf option.
        self.norm_in = nn.LayerNorm(patch_dim, eps=config.norm_eps) if config.patch_norm else nn.Identity()
        self.projection = nn.Linear(patch_dim, config.hidden_size)
        # CODEPATH: as `norm_in`.
        self.norm_out = nn.LayerNorm(config.hidden_size, eps=config.norm_eps) if config.patch_norm else nn.Identity()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixel_values.shape
        ph, pw = self.patch_size
        patches = pixel_values.reshape(b, c, h // ph, ph, w // pw, pw).permute(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(b, (h // ph) * (w // pw), ph * pw * c)
        return self.norm_out(self.projection(self.norm_in(patches)))


class DATVisionEmbeddings(nn.Module):
    """pixel_values `[b, c, H, W]` -> `[CLS | patches]` + position embeddings `[b, 1 + N, d]`, and the grid (rows, cols)."""

    def __init__(self, config: DATVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embeddings = DATVisionPatchEmbeddings(config)
        self.cls_token = nn.Parameter(torch.empty(1, 1, config.hidden_size))
        self.position_embeddings = None
        # CODEPATH: learned: the paper's ViDAT (ImageNet, CIFAR, relational games; the reference's `pos_embedding`);
        # `rope` / `none`: no released checkpoint, dat_hf options.
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Parameter(torch.empty(1, config.num_patches + 1, config.hidden_size))
        self.dropout = nn.Dropout(config.embedding_dropout)

    def interpolate_pos_encoding(self, rows: int, cols: int) -> torch.Tensor:
        """Position embeddings `[1, 1 + rows * cols, d]` for a `rows x cols` patch grid: the patch embeddings of the
        training grid are resized bicubically (as ViT), the CLS embedding is kept."""
        rows0, cols0 = self.config.grid_size
        if (rows, cols) == (rows0, cols0) and not torch.jit.is_tracing():
            return self.position_embeddings
        cls_pos, patch_pos = self.position_embeddings[:, :1], self.position_embeddings[:, 1:]
        dim = patch_pos.shape[-1]
        patch_pos = patch_pos.reshape(1, rows0, cols0, dim).permute(0, 3, 1, 2)
        patch_pos = nn.functional.interpolate(
            patch_pos.float(), size=(rows, cols), mode="bicubic", align_corners=False
        ).to(cls_pos.dtype)
        return torch.cat([cls_pos, patch_pos.permute(0, 2, 3, 1).reshape(1, rows * cols, dim)], dim=1)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False):
        (ph, pw), (h, w) = self.config.patch_hw, pixel_values.shape[-2:]
        rows, cols = h // ph, w // pw
        dtype = self.patch_embeddings.projection.weight.dtype
        patches = self.patch_embeddings(pixel_values.to(dtype))
        embeddings = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1).to(patches.dtype), patches], dim=1)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.interpolate_pos_encoding(rows, cols).to(embeddings.dtype)
        return self.dropout(embeddings), (rows, cols)


@auto_docstring
class DATVisionPreTrainedModel(DATPreTrainedModel):
    config: DATVisionConfig
    base_model_prefix = "model"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _no_split_modules = ["DATVisionEmbeddings", "DATDecoderLayer"]

    auto_classes = {
        "AutoConfig": "configuration_dat_vision.DATVisionConfig",
        "AutoModel": "modeling_dat_vision.DATVisionModel",
        "AutoModelForImageClassification": "modeling_dat_vision.DATForImageClassification",
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DATVisionEmbeddings):
            # with `patch_norm` the patch embeddings leave a LayerNorm at unit scale: the CLS token and the positions
            # start at the same scale (standard normal, as the reference), else they would be invisible at first
            # CODEPATH: patch norms: the paper's ViDAT (the reference); without: a dat_hf option (no checkpoint).
            std = 1.0 if self.config.patch_norm else self.config.initializer_range
            init.normal_(module.cls_token, mean=0.0, std=std)
            if module.position_embeddings is not None:
                init.normal_(module.position_embeddings, mean=0.0, std=std)


@auto_docstring(
    custom_intro=r"""
    The ViDAT encoder. pixel_values `[b, c, H, W]` -> last_hidden_state `[b, 1 + N, d]` (CLS first) and pooler_output
    `[b, d]` (CLS state or mean over tokens, `config.pooling`).
    """
)
class DATVisionModel(DATVisionPreTrainedModel):

    def __init__(self, config: DATVisionConfig):
        super().__init__(config)
        self.embeddings = DATVisionEmbeddings(config)
        # CODEPATH: rope: no released checkpoint, a dat_hf option; the paper's ViDAT uses learned positions.
        if config.position_embedding_type == "rope":
            self.rotary_emb = DATRotaryEmbedding(config)
        # CODEPATH: relational heads: the paper's ViDAT (ImageNet: 10 sensory + 6 relational heads; CIFAR: 6 + 6);
        # none: its ViT baselines (16 / 12 heads). No final norm: the reference's vision models (converted with
        # `final_norm=False`); a final norm: dat_hf's default (as ViT). No released weights.
        layers = [DATDecoderLayer(config, i, is_causal=False) for i in range(config.num_hidden_layers)]
        init_dat_stack(self, config, layers, uses_symbols=config.num_relational_heads > 0, final_norm=config.final_norm)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.patch_embeddings

    @stack_forward
    @auto_docstring
    def forward(
        self,
        pixel_values: torch.FloatTensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        graph_adjacency: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATVisionModelOutput:
        r"""
        interpolate_pos_encoding (`bool`, *optional*):
            Interpolate the learned position embeddings to the input's patch grid (images of another size than
            `config.image_size`).
        graph_adjacency (`torch.BoolTensor` of shape `(batch_size, 1 + num_patches, 1 + num_patches)`, *optional*):
            Per-image attention graph (CLS token first) of the layers whose relational bias is `graph`.

        Returns:
            [`DATVisionModelOutput`] (a tuple with `return_dict=False`): `last_hidden_state` `(batch_size, 1 +
            num_patches, hidden_size)`, `pooler_output` `(batch_size, hidden_size)`, and on request the hidden states,
            the attention weights of every head and the relations.
        """
        check_inputs("pixel_values", self.config, pixel_values, bool(interpolate_pos_encoding), self.symbol_retrievers)
        for key in ("output_relations", "output_hidden_states"):
            kwargs.pop(key, None)
        hidden_states, (rows, cols) = self.embeddings(pixel_values, bool(interpolate_pos_encoding))
        batch_size, seq_len, _ = hidden_states.shape
        position_ids = torch.arange(seq_len, device=hidden_states.device)[None].expand(batch_size, -1)
        position_embeddings = None
        # CODEPATH: rope: a dat_hf option (no released checkpoint); learned positions (the paper's ViDAT) are added by
        # the embeddings.
        if self.config.position_embedding_type == "rope":
            position_embeddings = self.rotary_emb(hidden_states, position_ids)

        layer_biases, plan = plan_layers(self, hidden_states, None, position_ids=position_ids,
                                         graph_adjacency=graph_adjacency, causal=False,
                                         output_attentions=kwargs.get("output_attentions", False))
        relative_position_index = None
        # CODEPATH: 2-D grid offsets: no released checkpoint (dat_hf's `relative_symbols_2d`); the paper's ViDAT uses
        # the reference's 1-D offsets over the row-major patch sequence.
        if self.config.relative_symbols_2d and self.symbol_retrievers is not None:
            relative_position_index = grid_relative_position_index(
                rows, cols, self.config.max_relative_position, hidden_states.device)

        hidden_states = run_dat_layers(
            self.layers, self.symbol_retrievers, hidden_states, position_ids, layer_biases, plan,
            position_embeddings=position_embeddings, relative_position_index=relative_position_index, **kwargs,
        )
        hidden_states = self.norm(hidden_states)
        # CODEPATH: cls: the paper's ImageNet ViDAT; mean: its CIFAR and relational-games models. No released weights.
        pooled = hidden_states[:, 0] if self.config.pooling == "cls" else hidden_states.mean(dim=1)
        return DATVisionModelOutput(last_hidden_state=hidden_states, pooler_output=pooled)


def classification_problem(config, labels) -> str:
    """The loss of an HF classifier (as `ForSequenceClassificationLoss`): `config.problem_type`, else regression for
    one label, single-label for long / int labels, multi-label otherwise."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


@auto_docstring(
    custom_intro=r"""
    ViDAT with a linear head on the pooled state. pixel_values `[b, c, H, W]` -> logits `[b, num_labels]`.

    With `labels`: cross-entropy (integer labels, `num_labels > 1`), BCE-with-logits (float multi-hot labels) or MSE
    (`num_labels == 1`), or as `config.problem_type` says, like every HF classifier.
    """
)
class DATForImageClassification(DATVisionPreTrainedModel):

    accepts_loss_kwargs = False

    def __init__(self, config: DATVisionConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = DATVisionModel(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        pixel_values: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        graph_adjacency: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DATImageClassifierOutput:
        r"""
        labels (`torch.Tensor` of shape `(batch_size,)` or `(batch_size, num_labels)`, *optional*):
            Class indices in `[0, num_labels)` (single-label), multi-hot targets (multi-label) or regression targets.
        interpolate_pos_encoding (`bool`, *optional*):
            Interpolate the position embeddings to the input's patch grid.
        graph_adjacency (`torch.BoolTensor` of shape `(batch_size, 1 + num_patches, 1 + num_patches)`, *optional*):
            Per-image attention graph (CLS token first) of the layers whose relational bias is `graph`.

        Returns:
            [`DATImageClassifierOutput`] (a tuple with `return_dict=False`): `logits` `(batch_size, num_labels)`,
            `loss` with `labels`, and on request the hidden states, the attention weights of every head and the
            relations.
        """
        check_inputs("classification_labels", self.config, labels, pixel_values)
        kwargs.pop("num_items_in_batch", None)
        outputs: DATVisionModelOutput = self.model(
            pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, graph_adjacency=graph_adjacency, **kwargs
        )
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            self.config.problem_type = classification_problem(self.config, labels)
            loss = self.loss_function(labels, logits, self.config)
        return DATImageClassifierOutput(loss=loss, logits=logits, **recorded_outputs(outputs))


__all__ = [
    "DATVisionPreTrainedModel",
    "DATVisionModel",
    "DATForImageClassification",
    "DATVisionModelOutput",
    "DATImageClassifierOutput",
    "grid_relative_position_index",
]
