# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The registry of relational inductive biases: every attention graph a DAT head may attend over.

A relational bias is a graph on the tokens (receiver i may attend to sender j), classified in "On the relational
inductive biases of attention" (Table 1) by its relations and the symmetry group the attention is equivariant to.
Each entry says all that the rest of dat_hf needs to know about one bias: whether its graph is ordered (then its mask
is causal in any model), the config fields and forward inputs it is built from, which models may use it, and how its
mask is made. The configs validate their bias fields here (`check_bias_field`), and `masking_dat.py` builds every mask
from the entry (`build_attention_mask`, `prebuilt_masks`, `paged_masks`).

Adding a bias is one entry and its test:

    register_relational_bias(RelationalBias(
        "every_other", relations="tokens of the same parity", symmetry="translations by even offsets",
        ordered=False, mask_function=lambda config, device, **inputs: lambda b, h, q, kv: (q - kv) % 2 == 0))
"""

from dataclasses import dataclass
from typing import Callable

import torch

# the graph of encoder-decoder cross-attention (not a value of the self-attention fields)
CROSS_ATTENTION_BIAS = "bipartite"


@dataclass(frozen=True)
class RelationalBias:
    """One attention graph.

    name: the value of `relational_bias`, `relational_heads_bias` or `encoder_relational_bias` that selects it.
    relations: which senders a receiver relates to (Table 1's "Relations").
    symmetry: the token relabellings the attention is equivariant to under this graph (Table 1's "Symmetry Group").
    ordered: the graph respects the causal order on its own (receiver i sees senders j <= i only): its mask is
        causal in any model, an encoder too. (A causal model intersects every bias with the causal order:
        `is_ordered`.)
    decoder: a causal model (the language model, the seq2seq decoder) may use it.
    cross: the graph between two sequences (cross-attention), which the self-attention fields refuse.
    config_fields: the config fields that define the graph; at least one of them must be set.
    inputs: the forward's tensors the graph comes from (e.g. `graph_adjacency` `[b, n, n]`): a model whose forward
        takes none (`bias_inputs` of its config) refuses it, and so does a KV cache.
    window: a sliding window of `sliding_window_size` = p tokens (two-sided unless ordered), built by Transformers'
        window masks (index arithmetic, ring caches, blocks of receivers) instead of `mask_function`.
    layer_type: the cache layer type, as Transformers names it, that holds what a receiver sees under this bias
        (`sliding_attention`: the last tokens of the window; `full_attention`: all of them), and whose mask
        continuous batching builds; None: a full cache layer, and continuous batching cannot serve the bias.
    mask_function: None (every pair, before the order and the padding), or `(config, device, attention_mask=None,
        graph_adjacency=None) -> mask_mod`, where `mask_mod(batch_idx, head_idx, q_idx, kv_idx) -> bool` is a
        Transformers mask function (index tensors in, True = attend) that `masking_dat.py` intersects with the
        padding and, where ordered, the causal order; `attention_mask` is the 2-D padding mask `[b, kv]` or None.
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


def register_relational_bias(bias: RelationalBias) -> RelationalBias:
    """Add `bias` to the registry (configs accept its name from now on); a name is registered once."""
    if bias.name in RELATIONAL_BIASES:
        raise ValueError(f"A relational bias named {bias.name!r} is already registered.")
    RELATIONAL_BIASES[bias.name] = bias
    return bias


def unregister_relational_bias(name: str) -> RelationalBias:
    """Remove the bias `name` from the registry -> its entry."""
    return RELATIONAL_BIASES.pop(name)


def relational_bias(name: str) -> RelationalBias:
    """The registry entry of `name` (ValueError naming the registered biases if there is none)."""
    if not isinstance(name, str) or name not in RELATIONAL_BIASES:
        raise ValueError(f"Unknown relational bias {name!r}; registered: {list(RELATIONAL_BIASES)}.")
    return RELATIONAL_BIASES[name]


def is_ordered(name: str, causal: bool) -> bool:
    """The one rule for whether the mask of bias `name` is causal: ordered graphs in any model, every graph in a
    causal model (`causal`: the stack is a decoder)."""
    return causal or relational_bias(name).ordered


def self_attention_biases(decoder: bool = False, inputs=None) -> list[str]:
    """The names a self-attention field accepts: every registered self-attention bias, or (`decoder`) those a causal
    model may use; with `inputs` (the forward tensors a model takes) only those built from them."""
    return [name for name, bias in RELATIONAL_BIASES.items() if not bias.cross and (bias.decoder or not decoder)
            and (inputs is None or set(bias.inputs) <= set(inputs))]


def inputs_of(names) -> set[str]:
    """The forward tensors (e.g. `graph_adjacency`) that the biases `names` are built from."""
    return {field for name in names for field in relational_bias(name).inputs}


def layer_type(name: str) -> str | None:
    """The cache layer type of bias `name` (`RelationalBias.layer_type`; None for an unregistered name)."""
    bias = RELATIONAL_BIASES.get(name)
    return None if bias is None else bias.layer_type


def paged_biases() -> list[str]:
    """The biases continuous batching serves (those whose mask Transformers' manager builds for a cache layer type)."""
    return [name for name, bias in RELATIONAL_BIASES.items() if bias.layer_type is not None]


def check_bias_field(config, field: str, value, num_layers: int, layers_field: str, decoder: bool,
                     inputs=()) -> None:
    """Validate one bias field of `config` (a name, or a list of one per layer) against the registry; a ValueError
    names the field. `decoder`: the stack is causal; `inputs`: the forward tensors its model takes."""
    if isinstance(value, list) and len(value) != num_layers:
        raise ValueError(f"`{field}` has {len(value)} entries but `{layers_field}` is {num_layers}.")
    known = self_attention_biases()
    for name in value if isinstance(value, list) else [value]:
        if not isinstance(name, str) or name not in known:
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


# ---- the mask functions of the built-in biases --------------------------------------------------------------------
def token_positions(attention_mask):
    """Each token's index among the real tokens of its row (`[b, kv]`), so that padding does not move a fixed graph;
    None without a 2-D padding mask (cache indices are then the positions)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sparse_mask_function(config, device, attention_mask=None, graph_adjacency=None):
    """The fixed `sparse` graph over token positions (real tokens only: padding never shifts it): local blocks of
    `sparse_block_size`, the first `sparse_global_tokens` tokens seen by and seeing all, extra `sparse_edges`."""
    block, n_global = config.sparse_block_size, config.sparse_global_tokens
    positions = token_positions(attention_mask)
    edges = None
    # CODEPATH: no released checkpoint; dat_hf's `sparse` relational bias given as an explicit edge list (else local
    # blocks and global tokens only).
    if config.sparse_edges:
        size = max(max(e) for e in config.sparse_edges) + 1
        edges = torch.zeros(size, size, dtype=torch.bool, device=device)
        index = torch.tensor(config.sparse_edges, device=device)
        edges[index[:, 0], index[:, 1]] = True

    def sparse_fn(batch_idx, head_idx, q_idx, kv_idx):
        if positions is not None:  # (a static cache's slots beyond the padding mask hold no tokens yet)
            last = positions.shape[1] - 1
            q_idx, kv_idx = positions[batch_idx, q_idx.clamp(max=last)], positions[batch_idx, kv_idx.clamp(max=last)]
        allowed = q_idx == kv_idx
        if block is not None:
            same_block = torch.div(q_idx, block, rounding_mode="floor") == torch.div(kv_idx, block, rounding_mode="floor")
            allowed = allowed | same_block
        if n_global > 0:
            allowed = allowed | (q_idx < n_global) | (kv_idx < n_global)
        if edges is not None:
            n = edges.shape[0]
            inside = (q_idx < n) & (kv_idx < n)
            allowed = allowed | (inside & edges[q_idx.clamp(max=n - 1), kv_idx.clamp(max=n - 1)])
        return allowed

    return sparse_fn


def graph_mask_function(config, device, attention_mask=None, graph_adjacency=None):
    """The graph of each input: `graph_adjacency` bool `[b, n, n]` (True = receiver i attends to sender j)."""

    def graph_fn(batch_idx, head_idx, q_idx, kv_idx):
        return graph_adjacency[batch_idx, q_idx, kv_idx]

    return graph_fn


# ---- the registry (the paper's Table 1, as dat_hf names the graphs) ----------------------------------------------
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


__all__ = ["CROSS_ATTENTION_BIAS", "RELATIONAL_BIASES", "RelationalBias", "check_bias_field", "inputs_of",
           "is_ordered", "layer_type", "paged_biases", "register_relational_bias", "relational_bias",
           "self_attention_biases", "unregister_relational_bias"]
