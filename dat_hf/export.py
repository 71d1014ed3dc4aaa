# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Export DAT language models for ExecuTorch-style runtimes: Transformers' recipe with DAT's cache layers.

Transformers' `TorchExportableModuleForDecoderOnlyLM` initializes a `StaticCache` ahead with one shape for keys and
values (`early_initialization`) and registers its tensors as buffers of the exported program. DAT's layers cache keys
`[b, h_kv_s + h_kv_r, L, d_h]` and one value slot `[b, 1, L, width]` (sensory values | symbol values | relation keys),
so the recipe here sizes the cache with one forward of the model itself, forgets that token, and registers those
tensors; Transformers' forward (`input_ids`, `cache_position` -> logits) and `export` are reused as they are, and
`generate` here runs the program as ExecuTorch's runner does (`import dat_hf` is enough to reach `dat_hf.export`):

    exportable = DATExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=128)
    program = exportable.export(input_ids=prompt[:, :1], cache_position=torch.tensor([0]))
    tokens = DATExportableModuleForDecoderOnlyLM.generate(program, prompt, max_new_tokens=16)  # generate()'s tokens

Not Transformers' helpers (as of 5.24), which feed wrong cache positions:
`TorchExportableModuleWithStaticCache.generate` feeds the first new token at position `n + 1` (`len(response_tokens)`
after appending it) where a prompt of `n` tokens ends at `n - 1`, so slot `n` is never written and each new token sits
one position late (the tokens differ from `generate()`'s from the second new one on);
`TorchExportableModuleForDecoderOnlyLM.generate` feeds the prompt's last token a second time, at position `n` (they
differ from the first). Any model reads the empty slot: the causal mask rightly admits every slot before the query, as
the position claims the sequence is that long; an empty slot's zero key scores 0 and takes softmax weight (Llama's
logits move as DAT's do). tests/test_export.py records both positions.

While `torch.export` traces, DAT runs its PyTorch backends only (no compiled op of dat_hf's in the program). A plain
`torch.export.export` / `torch.onnx.export(..., dynamo=True)` of a model without a cache keeps batch and length
dynamic, the length up to the longest sequence the model accepts where it has position tables (learned positions,
positional symbols: `max_sequence_length`): `dynamic_length(model)` is that `Dim`; one that allows more is refused by
`torch.export`, and the program refuses a longer input, naming the bound.
"""

import torch
from transformers import StaticCache
from transformers.integrations.executorch import (
    TorchExportableModuleForDecoderOnlyLM,
    TorchExportableModuleWithStaticCache,
)

from .cache_dat import DATStaticLayer
from .input_validation import position_limits


def _length_limit(model) -> tuple[str, int, str] | None:
    """(config field, limit, what) of the smallest position table of a DAT text model (learned positions: its
    `max_position_embeddings`; positional symbols: its `max_symbol_positions`), or None where it has none (RoPE and
    symbolic attention, as the released LMs)."""
    base = model.base_model
    return min(position_limits(base.config, getattr(base, "symbol_retrievers", None)), key=lambda limit: limit[1],
               default=None)


def max_sequence_length(model) -> int | None:
    """The longest sequence (cached and new tokens) a DAT text model accepts (its smallest position table), or None for
    any (RoPE and symbolic attention, as the released LMs)."""
    limit = _length_limit(model)
    return None if limit is None else limit[1]


def dynamic_length(model, name: str = "length", min: int = 1, max: int | None = None) -> torch.export.Dim:
    """The `torch.export.Dim` of the sequence length (dim 1 of `input_ids` `[b, n]` and `attention_mask` `[b, n]`),
    its `max` capped at `max_sequence_length(model)` (unbounded where the model has no position table and no `max` is
    given): the exported program takes the lengths the eager model does."""
    limit = max_sequence_length(model)
    if limit is not None and (max is None or max > limit):
        max = limit
    return torch.export.Dim(name, min=min, max=max)


def generate(exported_program: torch.export.ExportedProgram, input_ids: torch.LongTensor, max_new_tokens: int,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> torch.LongTensor:
    """Greedy decoding with a program of `DATExportableModuleForDecoderOnlyLM.export`: the tokens of
    `model.generate(input_ids, max_new_tokens=..., do_sample=False)`.

    One call per token, each at its own cache position (ExecuTorch's runner without parallel prefill): the prompt's
    tokens at `0 .. n-1`, then each new token at the next slot. A row that emitted `eos_token_id` continues with
    `pad_token_id` (default: the first EOS id), as in `generate`; decoding stops when every row has.

    Args:
        exported_program: the exported program (`input_ids` `[b, 1]`, `cache_position` `[1]` -> logits `[b, 1, V]`).
        input_ids: the prompts, `[b, n]` token ids (`b` the program's batch size: no padding).
        max_new_tokens: the tokens to generate (the program's cache must hold `n + max_new_tokens - 1` of them).
        eos_token_id, pad_token_id: as `generate`'s (which defaults to `model.generation_config.eos_token_id`; the
            program does not carry the generation config).

    Returns:
        `[b, n + new]` token ids, the prompt first (`new <= max_new_tokens`: fewer where every row ended).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = f"a tensor of shape {tuple(input_ids.shape)} ({input_ids.dtype})" if isinstance(
            input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"`input_ids` must be a [batch, length] tensor of token ids (tokenize the prompt first); "
                         f"got {got}.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be a non-negative integer; got {max_new_tokens!r}.")
    keys = next((buffer for name, buffer in exported_program.named_buffers()
                 if name.rsplit(".", 1)[-1].startswith("key_cache")), None)  # [b, heads, max_cache_len, d_h]
    if keys is None:
        raise ValueError("`exported_program` has no `key_cache` buffer: export it with "
                         "`DATExportableModuleForDecoderOnlyLM(model, batch_size, max_cache_len).export(...)`.")
    (batch_size, length), (cache_batch, max_cache_len) = input_ids.shape, (keys.shape[0], keys.shape[2])
    if batch_size != cache_batch:
        raise ValueError(f"`input_ids` has {batch_size} rows; the program was exported with batch_size={cache_batch}.")
    if length == 0:
        raise ValueError("`input_ids` has no tokens: the program needs at least one prompt token.")
    if length + max_new_tokens - 1 > max_cache_len:
        raise ValueError(f"A prompt of {length} tokens and max_new_tokens={max_new_tokens} need "
                         f"{length + max_new_tokens - 1} cache slots; the program has max_cache_len={max_cache_len}.")
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, dtype=torch.long).flatten().to(input_ids.device)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    step, tokens = exported_program.module(), input_ids
    done = torch.zeros(batch_size, dtype=torch.bool, device=input_ids.device)
    with torch.no_grad():
        for position in range(length + max_new_tokens - 1):  # (the last new token needs no call)
            logits = step(input_ids=tokens[:, position:position + 1],
                          cache_position=torch.tensor([position], device=input_ids.device))
            if position < length - 1:
                continue
            new = logits[:, -1].argmax(-1).masked_fill(done, pad)
            done |= torch.isin(new, eos)
            tokens = torch.cat([tokens, new[:, None]], dim=1)
            if done.all():
                break
    return tokens


class DATExportableModuleWithStaticCache(TorchExportableModuleWithStaticCache):
    """`TorchExportableModuleWithStaticCache` whose static cache has DAT's layers, sized by one forward of the model
    (then emptied). Sliding-window layers become full ones of `max_cache_len` slots, as Transformers' recipe does
    (its exported step has no ring arithmetic); the masks still apply every layer's window. `generate`: the module's
    (not `TorchExportableModuleWithStaticCache.generate`, which leaves slot `n` empty: see the module docstring)."""

    generate = staticmethod(generate)

    def __init__(self, model, batch_size: int | None = None, max_cache_len: int | None = None, device=None):
        torch.nn.Module.__init__(self)
        cache_config = model.generation_config.cache_config or {}
        batch_size = batch_size or cache_config.get("batch_size")
        max_cache_len = max_cache_len or cache_config.get("max_cache_len")
        if batch_size is None or max_cache_len is None:
            raise ValueError("`batch_size` and `max_cache_len` must be given (or set in "
                             f"`generation_config.cache_config`); got batch_size={batch_size}, "
                             f"max_cache_len={max_cache_len}.")
        limit = _length_limit(model)
        if limit is not None and max_cache_len > limit[1]:
            field, size, what = limit
            raise ValueError(f"max_cache_len={max_cache_len} needs more positions than the {what} hold: the cache "
                             f"must stay within `{field}` = {size}.")
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
    """`TorchExportableModuleForDecoderOnlyLM` for DAT (see the module docstring): its `forward` and `export` are
    Transformers' own; `generate(program, input_ids, max_new_tokens)` is the module's greedy loop, which gives
    `generate()`'s tokens (Transformers' own feeds the prompt's last token twice)."""

    generate = staticmethod(generate)

    def __init__(self, model, batch_size: int | None = None, max_cache_len: int | None = None, device=None):
        torch.nn.Module.__init__(self)
        if not model.config.get_text_config().use_cache:
            raise ValueError("The model must have caching enabled (`config.use_cache=True`) to be exported with a "
                             "cache.")
        self.model = DATExportableModuleWithStaticCache(model, batch_size, max_cache_len, device)


__all__ = ["DATExportableModuleForDecoderOnlyLM", "DATExportableModuleWithStaticCache", "dynamic_length", "generate",
           "max_sequence_length"]
