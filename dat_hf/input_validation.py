# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Checks of the forward inputs of every DAT model family, run once at the top of each family's forward.

The model files call them through a hook point (`kernel_hooks.check_inputs("name", ...)`, which runs
`kernel_hooks.INPUT_CHECKS["name"]`); `import dat_hf` installs them there (`install`). This file is not copied into a
saved folder's remote code: a model loaded as remote code without dat_hf runs unchecked, as Transformers' own models
do.

The same rules hold for every family (causal LM, sequence / token classification, vision, seq2seq encoder and
decoder):

- A bad input raises one `ValueError` whose message names the argument, what was expected and what was received
  (shape, dtype or range), before anything reaches torch.
- Token ids are `torch.long` or `torch.int` in `[0, vocab_size)`; `inputs_embeds` and `node_features` are floating
  `[batch, seq_len, width]`; labels are `torch.long` class indices in `[0, num_classes)` or -100 (ignored), or float
  targets for regression / multi-label classification; `pixel_values` are floating `[batch, channels, H, W]`.
- Padding masks `[batch, length]` hold 0/1 values (bool, integer or float; 1 = token, 0 = padding). 4-D masks are
  taken as given (custom attention masks).
- Empty inputs (a batch of 0 rows, a sequence of 0 tokens, an empty source or decoder input) are refused with a
  `ValueError`: no family returns empty outputs.

Checks of values (ranges, 0/1 masks) read a few numbers on the host; they are skipped while `torch.compile` or
`torch.export` traces (shape and dtype checks are not). `DAT_HF_VALIDATE_INPUTS=0` in the environment (read at import)
or `input_validation.ENABLED = False` turns every check off, for measuring their cost.
"""

import os

import torch

from .modeling_dat_vision import classification_problem
from .relational_biases import inputs_of

ENABLED = os.environ.get("DAT_HF_VALIDATE_INPUTS", "1").strip().lower() not in ("0", "false", "off", "no")
IGNORE_INDEX = -100


def _reads_values() -> bool:
    return ENABLED and not torch.compiler.is_compiling()


def _fail(name: str, expected: str, received: str):
    raise ValueError(f"`{name}` must be {expected}, got {received}.")


def _shape(tensor) -> list[int]:
    return list(tensor.shape)


def _check_tensor(name: str, value, rank: int, dims: str):
    if not isinstance(value, torch.Tensor):
        _fail(name, f"a tensor {dims}", type(value).__name__)
    if value.dim() != rank:
        _fail(name, f"a tensor of shape {dims}", f"shape {_shape(value)}")


def _check_not_empty(name: str, tensor, dims: str):
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(
            f"`{name}` is empty (shape {_shape(tensor)}, {dims}): DAT models take at least one sequence of at least "
            "one token (empty batches and empty sequences are refused)."
        )


def _value_range(tensor) -> tuple:
    low, high = torch.aminmax(tensor)
    return low.item(), high.item()


# ---- single arguments ----------------------------------------------------------------------------------------------
def check_token_ids(name: str, ids, vocab_size: int, vocab_field: str = "vocab_size"):
    """ids `[batch, seq_len]`, `torch.long` / `torch.int`, values in `[0, vocab_size)`."""
    _check_tensor(name, ids, 2, "[batch, seq_len]")
    if ids.dtype not in (torch.long, torch.int):
        _fail(name, "integer token ids (torch.long or torch.int)", f"dtype {ids.dtype}")
    _check_not_empty(name, ids, "[batch, seq_len]")
    if _reads_values():
        low, high = _value_range(ids)
        if low < 0 or high >= vocab_size:
            _fail(name, f"token ids in [0, {vocab_size - 1}] (`{vocab_field}` = {vocab_size})",
                  f"values in [{low}, {high}]")


def check_features(name: str, features, width: int, width_field: str):
    """Floating features `[batch, seq_len, width]` (`inputs_embeds`, `node_features`, encoder states)."""
    _check_tensor(name, features, 3, f"[batch, seq_len, {width_field}]")
    if not features.is_floating_point():
        _fail(name, "a floating-point tensor", f"dtype {features.dtype}")
    if features.shape[-1] != width:
        _fail(name, f"of shape [batch, seq_len, {width}] (`{width_field}` = {width})", f"shape {_shape(features)}")
    _check_not_empty(name, features, f"[batch, seq_len, {width_field}]")


def check_padding_mask(name: str, mask, shape: tuple, dims: str):
    """A `[batch, length]` mask of 0/1 values (bool, integer or float); None, 4-D masks and the `{bias: mask}` dicts
    that `generate` builds for compiled steps pass."""
    if mask is None or isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        return
    # (a static cache counts its length in a tensor; symbolic sizes stay symbolic: `torch.export` keeps them dynamic)
    shape = tuple(int(size) if isinstance(size, torch.Tensor) else size for size in shape)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
        received = _shape(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"`{name}` must have shape {dims} = {list(shape)} (1 = token, 0 = padding), got {received}.")
    if mask.dtype == torch.bool:
        return
    if mask.is_complex():
        _fail(name, "a bool, integer or float mask", f"dtype {mask.dtype}")
    if not _reads_values():
        return
    if mask.is_floating_point():
        bad = bool(((mask != 0) & (mask != 1)).any())
    else:
        low, high = _value_range(mask)
        bad = low < 0 or high > 1
    if bad:
        values = sorted(set(mask.unique().tolist()) - {0, 1})[:4]
        _fail(name, "0/1 values (1 = token, 0 = padding)", f"values {values}")


def check_position_ids(name: str, position_ids, batch_size: int, seq_len: int):
    """Given positions: integers `[batch or 1, seq_len]` (or `[seq_len]`)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.long, torch.int):
        received = (f"dtype {position_ids.dtype}" if isinstance(position_ids, torch.Tensor)
                    else type(position_ids).__name__)
        _fail(name, "an integer tensor (torch.long or torch.int)", received)
    rows = position_ids.shape[0] if position_ids.dim() == 2 else 1
    if position_ids.dim() not in (1, 2) or position_ids.shape[-1] != seq_len or rows not in (1, batch_size):
        _fail(name, f"of shape [batch, seq_len] = {[batch_size, seq_len]} (or [1, {seq_len}] for every row)",
              f"shape {_shape(position_ids)}")


def position_limits(config, symbol_retrievers) -> list[tuple[str, int, str]]:
    """(config field, limit, what) of the position tables of a stack: learned position embeddings and positional
    symbols."""
    limits = []
    # CODEPATH: input check. Learned positions have a longest position (the paper's ViDAT and math models, the
    # reference LM's `pos_enc_type='pos_emb'`); RoPE (the released LMs) has none.
    if config.position_embedding_type == "learned":
        limits.append(("max_position_embeddings", config.max_position_embeddings, "learned positions"))
    # CODEPATH: input check. Positional symbols (the paper's relational-games models; no released weights) index a
    # table; symbolic attention (the released LMs) and position-relative symbols do not.
    if config.symbol_retrieval == "positional" and symbol_retrievers is not None:
        limits.append(("max_symbol_positions", symbol_retrievers.retrievers[0].max_positions, "positional symbols"))
    return limits


def check_position_range(name: str, position_ids, limits):
    """Positions (given, or counted over the cache and padding) index the position tables: in `[0, limit)`.

    While `torch.export` traces (values unread), the length `n` of position_ids `[b|1, n]` must stay within each
    table instead: the comparison guards the symbolic length, so the program's dynamic length is capped at the
    smallest table (`torch.export` refuses a `Dim` that allows more, and the program refuses a longer input, naming
    the bound) rather than failing in the table lookup. Packed sequences longer than a table (given positions that
    restart) export only up to its size."""
    if limits and ENABLED and torch.compiler.is_exporting():
        length = position_ids.shape[-1]
        for field, limit, what in limits:
            if length > limit:
                raise ValueError(f"`{name}`: a sequence of {length} tokens is too long for the {what}: an exported "
                                 f"length must stay within `{field}` = {limit}.")
    if not limits or not _reads_values():
        return
    low, high = _value_range(position_ids)
    if low < 0:
        _fail(name, "non-negative positions", f"position {low}")
    for field, limit, what in limits:
        if high >= limit:
            raise ValueError(
                f"Position {high} is out of range for the {what}: `{name}` (given, or counted over the sequence and "
                f"its cache) must stay below `{field}` = {limit}."
            )


def check_token_labels(name: str, labels, shape: tuple | None, num_classes: int, classes_field: str):
    """`torch.long` labels of the inputs' shape, class indices in `[0, num_classes)` or -100 (ignored)."""
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.long:
        received = f"dtype {labels.dtype}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        _fail(name, "a torch.long tensor of class indices", received)
    if shape is not None and tuple(labels.shape) != tuple(shape):
        _fail(name, f"of shape {list(shape)} (one target per token, as the inputs)", f"shape {_shape(labels)}")
    check_label_range(name, labels, num_classes, classes_field)


def check_label_range(name: str, labels, num_classes: int, classes_field: str):
    if not _reads_values() or labels.numel() == 0:
        return
    low, high = _value_range(labels)
    if low == IGNORE_INDEX:  # the lowest real label
        low = labels.masked_fill(labels == IGNORE_INDEX, 0).min().item()
    if low < 0 or high >= num_classes:
        _fail(name, f"class indices in [0, {num_classes - 1}] (`{classes_field}` = {num_classes}) or -100 (ignored)",
              f"label {low if low < 0 else high}")


# ---- per family ------------------------------------------------------------------------------------------------------
def input_shape(input_ids, inputs_embeds) -> tuple | None:
    """(batch, seq_len) of whichever input is a tensor, else None."""
    source = input_ids if input_ids is not None else inputs_embeds
    return tuple(source.shape[:2]) if isinstance(source, torch.Tensor) and source.dim() >= 2 else None


def validate_text_inputs(input_ids, inputs_embeds, attention_mask=None, position_ids=None, past_length: int = 0, *,
                         vocab_size: int, hidden_size: int, vocab_field: str = "vocab_size", prefix: str = ""):
    """Token inputs of a DAT stack (decoder, encoder, seq2seq encoder or decoder with `prefix="decoder_"`): exactly one
    of ids `[b, n]` / embeddings `[b, n, hidden_size]`, a padding mask `[b, past_length + n]`, positions `[b|1, n]`."""
    if not ENABLED:
        return
    ids_name, embeds_name = f"{prefix}input_ids", f"{prefix}inputs_embeds"
    if (input_ids is None) == (inputs_embeds is None):
        got = "neither" if input_ids is None else "both"
        raise ValueError(f"Give exactly one of `{ids_name}` or `{embeds_name}`, got {got}.")
    if input_ids is not None:
        check_token_ids(ids_name, input_ids, vocab_size, vocab_field)
    else:
        check_features(embeds_name, inputs_embeds, hidden_size, "hidden_size")
    batch_size, seq_len = input_shape(input_ids, inputs_embeds)
    check_padding_mask(f"{prefix}attention_mask", attention_mask, (batch_size, past_length + seq_len),
                       "[batch, past + seq_len]")
    if position_ids is not None:
        check_position_ids(f"{prefix}position_ids", position_ids, batch_size, seq_len)


def validate_positions(config, symbol_retrievers, position_ids, name: str = "position_ids"):
    """The resolved positions of a forward against the stack's position tables (`position_limits`)."""
    if ENABLED:
        check_position_range(name, position_ids, position_limits(config, symbol_retrievers))


def check_graph_adjacency(adjacency, batch_size: int, seq_len: int):
    if adjacency is None:
        raise ValueError("`relational_bias='graph'` needs `graph_adjacency`, a bool tensor [batch, n, n].")
    if adjacency.dtype != torch.bool:
        raise ValueError(f"`graph_adjacency` must be a bool tensor, got dtype {adjacency.dtype}.")
    if tuple(adjacency.shape) != (batch_size, seq_len, seq_len):
        raise ValueError(
            f"`graph_adjacency` must have shape [batch, n, n] = {[batch_size, seq_len, seq_len]}, "
            f"got {list(adjacency.shape)}."
        )


def validate_graph_inputs(biases, graph_adjacency, batch_size: int, seq_len: int, cache=None):
    """`graph_adjacency` `[b, n, n]` (bool) when one of the layers' `biases` is built from it (`graph`; no KV
    cache)."""
    # CODEPATH: input check. The `graph` bias (a dat_hf feature, no released checkpoint) takes an adjacency per input.
    if not ENABLED or "graph_adjacency" not in inputs_of(biases):
        return
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("The `graph` relational bias does not support a KV cache (`graph_adjacency` is per input).")
    check_graph_adjacency(graph_adjacency, batch_size, seq_len)


def validate_lm_labels(labels, input_ids, inputs_embeds, vocab_size: int, vocab_field: str = "vocab_size"):
    """Language-model labels: the inputs' shape `[b, n]`, token ids or -100."""
    if ENABLED and labels is not None:
        check_token_labels("labels", labels, input_shape(input_ids, inputs_embeds), vocab_size, vocab_field)


def validate_token_classification(config, input_ids, inputs_embeds, node_features, labels):
    """Node / token classification: `node_features` `[b, n, num_node_features]` (instead of ids or embeddings) and
    labels `[b, n]` in `[0, num_labels)` or -100."""
    if not ENABLED:
        return
    if node_features is not None:
        if not config.num_node_features:
            raise ValueError("`node_features` needs `config.num_node_features` (the width of the node features).")
        if input_ids is not None or inputs_embeds is not None:
            raise ValueError("Give only one of `input_ids`, `inputs_embeds` or `node_features`.")
        check_features("node_features", node_features, config.num_node_features, "num_node_features")
        inputs_embeds = node_features
    if labels is not None:
        check_token_labels("labels", labels, input_shape(input_ids, inputs_embeds), config.num_labels, "num_labels")


def validate_classification_labels(config, labels, *inputs):
    """Labels of a sequence / image classifier for its problem type: `[b]` class indices (single-label), `[b,
    num_labels]` float targets (multi-label) or `b * num_labels` float targets (regression); `b` is the batch of the
    first of `inputs` (input_ids, inputs_embeds, pixel_values) that is a tensor."""
    if not ENABLED or labels is None:
        return
    if not isinstance(labels, torch.Tensor):
        _fail("labels", "a tensor", type(labels).__name__)
    batch_size = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    problem, num_labels = classification_problem(config, labels), config.num_labels
    per_example = 1 if problem == "single_label_classification" else num_labels
    expected_count = None if batch_size is None else batch_size * per_example
    if problem == "single_label_classification":
        check_token_labels("labels", labels, None, num_labels, "num_labels")
        expected = f"one class index per example ([{batch_size}])"
    elif problem in ("multi_label_classification", "regression"):
        if not labels.is_floating_point():
            _fail("labels", f"float targets for {problem.replace('_', ' ')}", f"dtype {labels.dtype}")
        if (problem == "multi_label_classification" and batch_size is not None
                and labels.shape != (batch_size, num_labels)):
            _fail("labels", f"of shape {[batch_size, num_labels]} (one 0/1 target per class) for multi-label "
                  "classification", f"shape {_shape(labels)}")
        expected = f"{expected_count} regression targets ([batch, num_labels])"
    else:
        raise ValueError(f"Unknown `problem_type` {problem!r} (`config.problem_type`).")
    if expected_count is not None and labels.numel() != expected_count:
        _fail("labels", expected, f"shape {_shape(labels)}")


def validate_pixel_values(config, pixel_values, interpolate_pos_encoding: bool, symbol_retrievers=None):
    """`pixel_values` `[b, num_channels, H, W]`, floating, with H and W multiples of the patch size (and the model's
    `image_size` unless the position embeddings are interpolated or absent)."""
    if not ENABLED:
        return
    if pixel_values is None:
        raise ValueError("`pixel_values` must be a tensor [batch, channels, height, width], got None.")
    _check_tensor("pixel_values", pixel_values, 4, "[batch, channels, height, width]")
    if not pixel_values.is_floating_point():
        _fail("pixel_values", "a floating-point tensor (the image processor's output)", f"dtype {pixel_values.dtype}")
    batch_size, channels, height, width = pixel_values.shape
    if batch_size == 0:
        _check_not_empty("pixel_values", pixel_values, "[batch, channels, height, width]")
    if channels != config.num_channels:
        raise ValueError(
            f"`pixel_values` has {channels} channels but the model expects `num_channels` = {config.num_channels} "
            "(convert the images, e.g. with the image processor's `do_convert_rgb` / `do_convert_grayscale`)."
        )
    (ph, pw), (eh, ew) = config.patch_hw, config.image_hw
    if height < ph or width < pw or height % ph != 0 or width % pw != 0:
        raise ValueError(f"`pixel_values`: image size {height}x{width} is not divisible by the patch size {ph}x{pw} "
                         "(`patch_size`).")
    if not interpolate_pos_encoding and (height, width) != (eh, ew) and config.position_embedding_type == "learned":
        raise ValueError(
            f"`pixel_values`: input image size {height}x{width} doesn't match the model's `image_size` {eh}x{ew}; "
            "pass `interpolate_pos_encoding=True` to interpolate the position embeddings."
        )
    num_tokens = 1 + (height // ph) * (width // pw)
    # CODEPATH: input check. Positional symbols (the paper's relational-games models; no released weights) cover a
    # fixed number of tokens; the paper's ViDAT uses position-relative symbols.
    if config.symbol_retrieval == "positional" and symbol_retrievers is not None:
        limit = symbol_retrievers.retrievers[0].max_positions
        if num_tokens > limit:
            raise ValueError(
                f"`pixel_values`: the image gives {num_tokens} tokens (CLS + patches) but the positional symbols cover "
                f"only `max_symbol_positions` = {limit}."
            )


def validate_source_length(seq_len: int, limit: int, field: str):
    """A seq2seq source no longer than the encoder's positions."""
    if ENABLED and seq_len > limit:
        raise ValueError(
            f"`input_ids`: the source has {seq_len} tokens, more than `{field}` = {limit}; truncate it (e.g. "
            f"`tokenizer(..., truncation=True, max_length={limit})`)."
        )


def validate_encoder_states(encoder_hidden_states, encoder_attention_mask, batch_size: int, hidden_size: int):
    """The decoder's view of the source: encoder states `[b, m, hidden_size]` (same batch as the target) and the source
    padding mask `[b, m]` (the seq2seq model's `attention_mask`)."""
    if not ENABLED:
        return
    if encoder_hidden_states is None:
        raise ValueError("The decoder needs `encoder_hidden_states` (the encoder's output, `encoder_outputs`).")
    check_features("encoder_outputs", encoder_hidden_states, hidden_size, "hidden_size")
    if encoder_hidden_states.shape[0] != batch_size:
        raise ValueError(
            f"Batch size mismatch: {batch_size} target sequences (`decoder_input_ids`/`labels`) but "
            f"{encoder_hidden_states.shape[0]} source sequences (`input_ids`/`encoder_outputs`)."
        )
    check_padding_mask("attention_mask", encoder_attention_mask, tuple(encoder_hidden_states.shape[:2]),
                       "[batch, source_len]")


def validate_seq2seq_inputs(input_ids, inputs_embeds, decoder_input_ids, decoder_inputs_embeds, labels,
                            vocab_size: int):
    """`DATForSeq2SeqLM`'s target: `decoder_input_ids`, `decoder_inputs_embeds` or `labels` (from which the decoder
    inputs are built), with the source's batch size; labels `[b, n]` (the decoder inputs' shape) of token ids or
    -100."""
    if not ENABLED:
        return
    decoder_inputs = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
    target = decoder_inputs if decoder_inputs is not None else labels
    if target is None:
        raise ValueError(
            "DATForSeq2SeqLM needs `labels` (training: decoder inputs are built by shifting them right) or "
            "`decoder_input_ids` / `decoder_inputs_embeds`."
        )
    if labels is not None:
        if isinstance(labels, torch.Tensor) and labels.dim() != 2:
            _fail("labels", "of shape [batch, target_len]", f"shape {_shape(labels)}")
        if isinstance(labels, torch.Tensor):
            _check_not_empty("labels", labels, "[batch, target_len]")
        shape = input_shape(decoder_input_ids, decoder_inputs_embeds)
        check_token_labels("labels", labels, shape, vocab_size, "vocab_size")
    source = input_shape(input_ids, inputs_embeds)
    if source is not None and isinstance(target, torch.Tensor) and target.dim() >= 1 and source[0] != target.shape[0]:
        raise ValueError(
            f"Batch size mismatch: {source[0]} source sequences (`input_ids`) but {target.shape[0]} target "
            "sequences (`decoder_input_ids`/`labels`)."
        )


def install(hooks):
    """Put these checks into `hooks` (`kernel_hooks.INPUT_CHECKS`, under the names the model files call)."""
    hooks.update(
        text_inputs=validate_text_inputs, positions=validate_positions, graph_inputs=validate_graph_inputs,
        lm_labels=validate_lm_labels, classification_labels=validate_classification_labels,
        token_classification=validate_token_classification, pixel_values=validate_pixel_values,
        source_length=validate_source_length, encoder_states=validate_encoder_states,
        seq2seq_inputs=validate_seq2seq_inputs,
    )


__all__ = [
    "ENABLED",
    "check_token_ids",
    "check_features",
    "check_padding_mask",
    "check_position_ids",
    "check_position_range",
    "check_token_labels",
    "install",
    "position_limits",
    "validate_classification_labels",
    "validate_positions",
    "validate_encoder_states",
    "validate_graph_inputs",
    "validate_lm_labels",
    "validate_pixel_values",
    "validate_seq2seq_inputs",
    "validate_source_length",
    "validate_text_inputs",
    "validate_token_classification",
]
