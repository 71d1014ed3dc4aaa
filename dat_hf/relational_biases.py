# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The registry of relational inductive biases: the attention graphs (receiver i may attend to sender j) of "On the
relational inductive biases of attention" (Table 1). Configs validate against it; `masking_dat.py` builds the masks.
Adding a bias is one entry:

    register_relational_bias(RelationalBias(
        "every_other", relations="tokens of the same parity", symmetry="translations by even offsets",
        ordered=False, mask_function=lambda config, device, **inputs: lambda b, h, q, kv: (q - kv) % 2 == 0))

Every mask function is checked once it can be built (at registration, or for a config that sets its fields): it must
give one bool per (receiver, sender) pair.
"""

from dataclasses import dataclass
from typing import Callable

import torch

# the encoder-decoder cross-attention graph
CROSS_ATTENTION_BIAS = "bipartite"


@dataclass(frozen=True)
class RelationalBias:
    """One attention graph.

    name: the value of `relational_bias`, `relational_heads_bias` or `encoder_relational_bias` that selects it.
    relations, symmetry: Table 1's "Relations" and "Symmetry Group".
    ordered: the graph is causal on its own (its mask is causal in any model, encoders too).
    decoder: a causal model may use it. cross: a cross-attention graph (refused by the self-attention fields).
    config_fields: the config fields that define the graph (at least one must be set).
    inputs: forward tensors the graph comes from (e.g. `graph_adjacency` `[b, n, n]`; refused with a KV cache).
    window: a sliding window of `sliding_window_size` tokens (two-sided unless ordered), not `mask_function`.
    layer_type: Transformers' cache layer type for it: `sliding_attention` (the cache keeps the last window of tokens:
        window biases only) or `full_attention` (None too).
    mask_function: None (every pair) or `(config, device, attention_mask=None, graph_adjacency=None) -> mask_mod`,
        a Transformers mask function `(batch_idx, head_idx, q_idx, kv_idx) -> bool` (True = attend), intersected
        with the padding and, where ordered, the causal order.
    """

    name: str
    relations: str
    symmetry: str
    ordered: bool
    decoder: bool = True
    cross: bool = False
    config_fields: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    window: bool = False
    layer_type: str | None = None
    mask_function: Callable | None = None


RELATIONAL_BIASES: dict[str, RelationalBias] = {}


CACHE_LAYER_TYPES = ("full_attention", "sliding_attention")


def register_relational_bias(bias: RelationalBias) -> RelationalBias:
    """Add `bias` to the registry. ValueError naming the bias if its name is taken, its `layer_type` is not a cache
    layer type its graph fits, or its mask function does not give one bool per pair (checked here unless it is
    built from config fields or forward inputs: then for each config that selects it, `check_bias_field`)."""
    if bias.name in RELATIONAL_BIASES:
        raise ValueError(f"A relational bias named {bias.name!r} is already registered.")
    if bias.layer_type not in (None, *CACHE_LAYER_TYPES):
        raise ValueError(f"Relational bias {bias.name!r}: `layer_type` must be None or one of {CACHE_LAYER_TYPES}, "
                         f"got {bias.layer_type!r}.")
    if bias.layer_type == "sliding_attention" and not bias.window:
        raise ValueError(f"Relational bias {bias.name!r}: `layer_type`='sliding_attention' keeps only the last "
                         "`sliding_window` tokens in the cache, which only a window graph (`window=True`) fits.")
    if bias.mask_function is not None and not callable(bias.mask_function):
        raise ValueError(f"Relational bias {bias.name!r}: `mask_function` must be None or a callable "
                         f"`(config, device, attention_mask=None, graph_adjacency=None) -> mask function`, got "
                         f"{bias.mask_function!r}.")
    if bias.mask_function is not None and not bias.config_fields and not bias.inputs:
        from transformers import PreTrainedConfig

        check_mask_function(bias, PreTrainedConfig())
    RELATIONAL_BIASES[bias.name] = bias
    return bias


def mask_function_of(bias: RelationalBias, config, device, **inputs) -> Callable | None:
    """Bias `bias`'s mask function `(batch_idx, head_idx, q_idx, kv_idx) -> bool` for `config` (None: every pair),
    from the forward `inputs` it is built from. ValueError naming the bias if one of its inputs is missing, or its
    `mask_function` does not return a callable."""
    if bias.mask_function is None:
        return None
    missing = [name for name in bias.inputs if inputs.get(name) is None]
    if missing:  # (every path that builds masks: a forward, `generate`'s masks built ahead for a static cache)
        raise ValueError(f"The relational bias {bias.name!r} needs `{missing[0]}` with each input (a forward "
                         f"argument: `model(..., {missing[0]}=...)`), and none was given.")
    function = bias.mask_function(config, device, **inputs)
    if not callable(function):
        raise ValueError(f"Relational bias {bias.name!r}: its `mask_function` returned {function!r}, not a mask "
                         "function `(batch_idx, head_idx, q_idx, kv_idx) -> bool` (for every pair, register it with "
                         "`mask_function=None`).")
    return function


def pair_mask(function: Callable, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
    """A mask function over receivers at `q_positions` `[m]` and senders at `kv_positions` `[n]` (batch and head 0),
    evaluated per pair as Transformers' mask builders do (under `vmap`) -> `[m, n]`."""
    zero = q_positions.new_zeros((), dtype=torch.long)
    over_senders = torch.vmap(lambda q, kv: function(zero, zero, q, kv), in_dims=(None, 0))
    return torch.vmap(over_senders, in_dims=(0, None))(q_positions, kv_positions)


def check_mask_function(bias: RelationalBias, config) -> None:
    """ValueError naming `bias` unless its mask function, built for `config`, gives one bool per pair (on 3 x 3)."""
    function = mask_function_of(bias, config, torch.device("cpu"))
    if function is None:
        return
    positions = torch.arange(3)
    try:
        allowed = pair_mask(function, positions, positions)
    except Exception as error:  # (vmap's message names what the function returned)
        raise ValueError(f"Relational bias {bias.name!r}: its mask function fails on index tensors (it must give "
                         f"one bool per (receiver, sender) pair): {type(error).__name__}: {error}") from error
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool or allowed.shape != (3, 3):
        what = (f"{allowed.dtype} of shape {tuple(allowed.shape)}" if isinstance(allowed, torch.Tensor)
                else type(allowed).__name__)
        raise ValueError(f"Relational bias {bias.name!r}: its mask function gives {what} over 3 receivers and 3 "
                         "senders, not one bool per pair.")


def unregister_relational_bias(name: str) -> RelationalBias:
    """Remove bias `name` -> its entry."""
    return RELATIONAL_BIASES.pop(name)


def relational_bias(name: str) -> RelationalBias:
    """The registry entry of `name` (ValueError if none)."""
    if not isinstance(name, str) or name not in RELATIONAL_BIASES:
        raise ValueError(f"Unknown relational bias {name!r}; registered: {list(RELATIONAL_BIASES)}.")
    return RELATIONAL_BIASES[name]


def is_ordered(name: str, causal: bool) -> bool:
    """Whether bias `name`'s mask is causal: ordered graphs always, every graph in a decoder (`causal`)."""
    return causal or relational_bias(name).ordered


def self_attention_biases(decoder: bool = False, inputs=None) -> list[str]:
    """The names a self-attention field accepts (`decoder`: causal-model ones; `inputs`: only those built from them)."""
    return [name for name, bias in RELATIONAL_BIASES.items() if not bias.cross and (bias.decoder or not decoder)
            and (inputs is None or set(bias.inputs) <= set(inputs))]


def inputs_of(names) -> set[str]:
    """The forward tensors (e.g. `graph_adjacency`) the biases `names` are built from."""
    return {field for name in names for field in relational_bias(name).inputs}


def layer_type(name: str) -> str | None:
    """The cache layer type of bias `name` (None if unregistered)."""
    bias = RELATIONAL_BIASES.get(name)
    return None if bias is None else bias.layer_type or "full_attention"


def check_bias_field(config, field: str, value, num_layers: int, layers_field: str, decoder: bool,
                     inputs=()) -> None:
    """Validate a bias field (a name, or one per layer); ValueError naming the field. `decoder`: a causal stack;
    `inputs`: the forward tensors its model takes."""
    if isinstance(value, list) and len(value) != num_layers:
        raise ValueError(f"`{field}` has {len(value)} entries but `{layers_field}` is {num_layers}.")
    known = self_attention_biases()
    for name in value if isinstance(value, list) else [value]:
        if name not in known:
            raise ValueError(f"`{field}` entries must be in {known}, got {name!r}.")
        bias = RELATIONAL_BIASES[name]
        if decoder and not bias.decoder:
            raise ValueError(f"`{field}`={name!r} is not allowed for `{config.model_type}` models (allowed: "
                             f"{self_attention_biases(decoder, inputs)}).")
        missing = [item for item in bias.inputs if item not in inputs]
        if missing:
            raise ValueError(f"`{field}`={name!r} needs `{missing[0]}` with each input, which `{config.model_type}` "
                             f"models do not take (allowed: {self_attention_biases(decoder, inputs)}).")
        if bias.config_fields and all(getattr(config, item, None) is None for item in bias.config_fields):
            raise ValueError(f"`{field}`={name!r} needs " + " or ".join(f"`{item}`" for item in bias.config_fields)
                             + " to be set.")
        if bias.config_fields and not bias.inputs:
            check_mask_function(bias, config)  # (registration checked the others)


# ---- the mask functions of the built-in biases --------------------------------------------------------------------
def sparse_mask_function(config, device, attention_mask=None, graph_adjacency=None):
    """The `sparse` graph over real-token positions: blocks of `sparse_block_size`, the first `sparse_global_tokens`
    tokens global, plus `sparse_edges`."""
    block, n_global = config.sparse_block_size, config.sparse_global_tokens
    positions = None  # with a 2-D padding mask, each token's index among its row's real tokens `[b, kv]`
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    edges = None
    # CODEPATH: edge list: no released checkpoint (dat_hf's `sparse` bias only).
    if config.sparse_edges:
        size = max(max(e) for e in config.sparse_edges) + 1
        edges = torch.zeros(size, size, dtype=torch.bool, device=device)
        index = torch.tensor(config.sparse_edges, device=device)
        edges[index[:, 0], index[:, 1]] = True

    def sparse_fn(batch_idx, head_idx, q_idx, kv_idx):
        if positions is not None:  # clamped: a static cache's slots past the padding mask are empty
            last = positions.shape[1] - 1
            q_idx, kv_idx = positions[batch_idx, q_idx.clamp(max=last)], positions[batch_idx, kv_idx.clamp(max=last)]
        allowed = q_idx == kv_idx
        if block is not None:
            allowed = allowed | (q_idx // block == kv_idx // block)
        if n_global > 0:
            allowed = allowed | (q_idx < n_global) | (kv_idx < n_global)
        if edges is not None:
            n = edges.shape[0]
            inside = (q_idx < n) & (kv_idx < n)
            allowed = allowed | (inside & edges[q_idx.clamp(max=n - 1), kv_idx.clamp(max=n - 1)])
        return allowed

    return sparse_fn


def graph_mask_function(config, device, attention_mask=None, graph_adjacency=None):
    """Each input's graph: `graph_adjacency` bool `[b, n, n]` (True = i attends to j)."""
    return lambda batch_idx, head_idx, q_idx, kv_idx: graph_adjacency[batch_idx, q_idx, kv_idx]


# ---- the built-in biases (the paper's Table 1) --------------------------------------------------------------------
register_relational_bias(RelationalBias(
    "full", relations="fully connected", symmetry="permutations", ordered=False, decoder=False))
register_relational_bias(RelationalBias(
    "causal", relations="previous elements", symmetry="translations", ordered=True, layer_type="full_attention"))
register_relational_bias(RelationalBias(
    "sliding_window", relations="p previous elements", symmetry="translations", ordered=True, window=True,
    config_fields=("sliding_window_size",), layer_type="sliding_attention"))
register_relational_bias(RelationalBias(
    "sliding_window_bidirectional", relations="p previous and p next elements", symmetry="translations",
    ordered=False, decoder=False, window=True, config_fields=("sliding_window_size",)))
register_relational_bias(RelationalBias(
    "sparse", relations="a fixed graph: local blocks, global tokens, edges",
    symmetry="the fixed graph's automorphisms (arbitrary)", ordered=False,
    config_fields=("sparse_block_size", "sparse_edges"), mask_function=sparse_mask_function))
register_relational_bias(RelationalBias(
    "graph", relations="each input's own graph", symmetry="each input graph's automorphisms (dynamic)",
    ordered=False, inputs=("graph_adjacency",), mask_function=graph_mask_function))
register_relational_bias(RelationalBias(
    CROSS_ATTENTION_BIAS, relations="a bipartition: every target token to every source token",
    symmetry="block permutations (source and target tokens each permuted among themselves)", ordered=False,
    decoder=False, cross=True))


__all__ = ["CACHE_LAYER_TYPES", "CROSS_ATTENTION_BIAS", "RELATIONAL_BIASES", "RelationalBias", "check_bias_field",
           "check_mask_function", "inputs_of", "is_ordered", "layer_type", "mask_function_of",
           "pair_mask", "register_relational_bias", "relational_bias", "self_attention_biases",
           "unregister_relational_bias"]
