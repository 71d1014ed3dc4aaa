# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Symbol retrievers: where each sender's symbol `s_j` comes from. Each has `forward(hidden_states,
symbol_library=None, **kwargs)` (`position_ids` `[b|1, n]` comes as a keyword argument).
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .kernel_hooks import replaceable


@replaceable("symbolic_attention")
def symbolic_attention(module, hidden_states, library):
    """`module`'s (a `SymbolicAttention`) retrieval: hidden_states `[b, n, d]`, library `[S, d]` -> symbols
    `[b, n, d]`, per head `softmax(scale q_h templates_h^T) library_h` with `q = x W_q^T + b_q`."""
    b, n, d = hidden_states.shape
    query = module.q_proj(hidden_states).view(b, n, module.num_heads, -1).transpose(1, 2)  # [b, h, n, d/h]
    key, value = module.heads_of(library, query.dtype)  # [1, h, S, d/h]
    if b > 1:
        key, value = key.expand(b, -1, -1, -1), value.expand(b, -1, -1, -1)
    symbols = nn.functional.scaled_dot_product_attention(query, key, value, scale=module.scale,
                                                         dropout_p=module.dropout if module.training else 0.0)
    return symbols.transpose(1, 2).reshape(b, n, d)


_PLAIN = (nn.Parameter, torch.Tensor)  # (not a tensor subclass: a quantized or distributed one)


class SymbolicAttention(nn.Module):
    """`s = Attn(q = x W_q, k = templates, v = library)`: hidden_states `[b, n, d]` -> symbols `[b, n, d]`."""

    def __init__(self, config, own_library: bool = True):
        super().__init__()
        self.config = config
        self.num_heads = config.symbolic_attention_heads
        self.scale = config.symbolic_attention_scale
        self.dropout = config.symbol_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.template_features = nn.Parameter(torch.empty(config.num_symbols, config.hidden_size))
        if own_library:
            self.symbol_library = nn.Parameter(torch.empty(config.num_symbols, config.hidden_size),
                                               requires_grad=config.trainable_symbols)

    def forward(self, hidden_states, symbol_library=None, **kwargs):
        library = self.symbol_library if symbol_library is None else symbol_library
        if self.training and torch.is_grad_enabled():
            # cheap to recompute: don't keep every layer's activations
            return checkpoint(self._retrieve, hidden_states, library, use_reentrant=False)
        return self._retrieve(hidden_states, library)

    def _retrieve(self, hidden_states, library):
        return symbolic_attention(self, hidden_states, library)

    def heads_of(self, library, dtype):
        """The templates and `library` `[S, d]` as per-head keys and values `[1, h, S, d/h]` in `dtype`. Without
        gradients, outside tracing, for plain parameters already in `dtype`, the views are kept between calls (a
        decoding step reads them once per layer) while both keep their storage (views follow in-place changes)."""
        templates = self.template_features
        if (torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or type(templates) not in _PLAIN or type(library) not in _PLAIN
                or not templates.dtype == library.dtype == dtype):
            return self._heads(templates, dtype), self._heads(library, dtype)
        stamp = (templates.data_ptr(), library.data_ptr(), templates.shape, library.shape)
        kept = self.__dict__.get("_kept_heads")
        if kept is None or kept[0] != stamp:
            kept = self.__dict__["_kept_heads"] = (stamp, (self._heads(templates, dtype), self._heads(library, dtype)))
        return kept[1]

    def _heads(self, tensor, dtype):
        view = tensor.view(-1, self.num_heads, tensor.shape[-1] // self.num_heads).transpose(0, 1)[None]
        return view if view.dtype == dtype else view.to(dtype)


class PositionalSymbols(nn.Module):
    """`s_j` = library[position_j]. position_ids `[b|1, n]` -> symbols `[b|1, n, d]`."""

    def __init__(self, config, own_library: bool = True):
        super().__init__()
        self.max_positions = config.max_symbol_positions or config.max_position_embeddings
        if own_library:
            self.symbol_library = nn.Parameter(torch.empty(self.max_positions, config.hidden_size))

    def forward(self, hidden_states, symbol_library=None, position_ids=None, **kwargs):
        library = self.symbol_library if symbol_library is None else symbol_library
        return nn.functional.embedding(position_ids, library).to(hidden_states.dtype)


class PositionRelativeSymbols(nn.Module):
    """`s_{ij}` = table[clip(j - i, -K, K) + K]; returns the table `[2K + 1, d]`."""

    def __init__(self, config, own_library: bool = True):
        super().__init__()
        self.max_relative_position = config.max_relative_position
        rows = 2 * config.max_relative_position + 1
        if getattr(config, "relative_symbols_2d", False):  # (dy, dx) grid offsets, plus one row for a CLS token
            rows = rows * rows + 1
        self.rel_pos_embeddings = nn.Parameter(torch.empty(rows, config.hidden_size))

    def forward(self, hidden_states, symbol_library=None, **kwargs):
        return self.rel_pos_embeddings.to(hidden_states.dtype)


SYMBOL_RETRIEVERS = {
    "symbolic_attention": SymbolicAttention,
    "positional": PositionalSymbols,
    "position_relative": PositionRelativeSymbols,
}


class SymbolRetrievers(nn.Module):
    """One retriever shared by all layers, or one per layer (optionally with a tied library)."""

    def __init__(self, config):
        super().__init__()
        cls = SYMBOL_RETRIEVERS[config.symbol_retrieval]
        self.shared = config.shared_symbol_retriever
        self.tied_library = config.tie_symbol_library and not self.shared
        n = 1 if self.shared else config.num_hidden_layers
        self.retrievers = nn.ModuleList([cls(config, own_library=(i == 0 or not self.tied_library)) for i in range(n)])
        # a shared feature-independent retriever runs once per forward
        self.feature_independent = config.symbol_retrieval != "symbolic_attention"

    def forward(self, layer_idx, hidden_states, position_ids):
        retriever = self.retrievers[0 if self.shared else layer_idx]
        library = self.retrievers[0].symbol_library if self.tied_library and layer_idx > 0 else None
        return retriever(hidden_states, symbol_library=library, position_ids=position_ids)


__all__ = ["symbolic_attention", "SymbolicAttention", "PositionalSymbols", "PositionRelativeSymbols",
           "SymbolRetrievers", "SYMBOL_RETRIEVERS"]
