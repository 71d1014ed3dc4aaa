# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Export DAT language models for ExecuTorch-style runtimes: Transformers' recipe with DAT's cache layers.

Transformers' `TorchExportableModuleForDecoderOnlyLM` initializes a `StaticCache` ahead with one shape for keys and
values (`early_initialization`) and registers its tensors as buffers of the exported program. DAT's layers cache keys
`[b, h_kv_s + h_kv_r, L, d_h]` and one value slot `[b, 1, L, width]` (sensory values | symbol values | relation keys),
so the recipe here sizes the cache with one forward of the model itself, forgets that token, and registers those
tensors; Transformers' forward (`input_ids`, `cache_position` -> logits), `export` and `generate` are reused as they
are:

    exportable = DATExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=128)
    program = exportable.export(input_ids=prompt[:, :1], cache_position=torch.tensor([0]))
    tokens = TorchExportableModuleWithStaticCache.generate(program, prompt, max_new_tokens=16)

While `torch.export` traces, DAT runs its PyTorch backends only (no compiled op of dat_hf's in the program). A plain
`torch.export.export` / `torch.onnx.export(..., dynamo=True)` of a model without a cache keeps batch and length
dynamic.
"""

import torch
from transformers import StaticCache
from transformers.integrations.executorch import (
    TorchExportableModuleForDecoderOnlyLM,
    TorchExportableModuleWithStaticCache,
)

from .cache_dat import DATStaticLayer


class DATExportableModuleWithStaticCache(TorchExportableModuleWithStaticCache):
    """`TorchExportableModuleWithStaticCache` whose static cache has DAT's layers, sized by one forward of the model
    (then emptied). Sliding-window layers become full ones of `max_cache_len` slots, as Transformers' recipe does
    (its exported step has no ring arithmetic); the masks still apply every layer's window."""

    def __init__(self, model, batch_size: int | None = None, max_cache_len: int | None = None, device=None):
        torch.nn.Module.__init__(self)
        cache_config = model.generation_config.cache_config or {}
        batch_size = batch_size or cache_config.get("batch_size")
        max_cache_len = max_cache_len or cache_config.get("max_cache_len")
        if batch_size is None or max_cache_len is None:
            raise ValueError("`batch_size` and `max_cache_len` must be given (or set in `generation_config.cache_config`)"
                             f"; got batch_size={batch_size}, max_cache_len={max_cache_len}.")
        device = device or cache_config.get("device", model.device)
        self.model = model
        self.static_cache = StaticCache(max_cache_len=max_cache_len, config=model.config.get_text_config())
        self.static_cache.layers = [DATStaticLayer(max_cache_len) for _ in self.static_cache.layers]
        with torch.no_grad():  # the first update sizes each layer (keys and values with their own widths)
            model(input_ids=torch.zeros(batch_size, 1, dtype=torch.long, device=device), cache=self.static_cache,
                  use_cache=True)
        for i, layer in enumerate(self.static_cache.layers):
            for tensor in (layer.keys, layer.values, layer.cumulative_length):
                tensor.zero_()
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)


class DATExportableModuleForDecoderOnlyLM(TorchExportableModuleForDecoderOnlyLM):
    """`TorchExportableModuleForDecoderOnlyLM` for DAT (see the module docstring): its `forward`, `export` and the
    static `generate` of `TorchExportableModuleWithStaticCache` are Transformers' own."""

    def __init__(self, model, batch_size: int | None = None, max_cache_len: int | None = None, device=None):
        torch.nn.Module.__init__(self)
        if not model.config.get_text_config().use_cache:
            raise ValueError("The model must have caching enabled (`config.use_cache=True`) to be exported with a cache.")
        self.model = DATExportableModuleWithStaticCache(model, batch_size, max_cache_len, device)


__all__ = ["DATExportableModuleForDecoderOnlyLM", "DATExportableModuleWithStaticCache"]
