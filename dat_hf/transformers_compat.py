# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""What differs between the supported Transformers releases (`transformers>=5.17,<6`), mapped onto the installed one:

- 5.24 renamed the cache `past_key_values` -> `cache` (forwards, `generate()` inputs, mask builders, outputs): DAT's
  forwards take `cache` and accept `past_key_values`; what dat_hf hands Transformers uses `CACHE_NAME`.
- 5.17 has no `transformers.modeling_utils.slice_logits_to_keep`.
- DAT's layers use 5.24's paged cache API (`paged_cache_limits`).
"""

import dataclasses
import functools
import inspect
import textwrap
import warnings

import torch
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPast

# the oldest and newest releases tested (constraints/floor.txt, constraints/tested.txt)
TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")

# the installed release's name of the cache argument and output field
CACHE_NAME = ("cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
              else "past_key_values")
LEGACY_CACHE_NAME = "past_key_values"
# the cache's names an output may carry (Trainer's `keys_to_ignore_at_inference`, accelerate's device placement)
CACHE_NAMES = ["cache", "past_key_values"]


# the `cache` argument for `auto_docstring` (releases before 5.24 do not document it)
CACHE_ARG_DOC = """cache (`~cache_utils.Cache`, *optional*):
    The cache of the tokens seen so far (keys, values, symbol values and relation keys of every layer), as returned
    by an earlier forward with `use_cache=True`; the model returns it updated. Also accepted as `past_key_values`
    (its name before Transformers 5.24, deprecated since)."""


def takes_cache(function):
    """Innermost decorator of a forward with `cache`: also accept `past_key_values=` (a `FutureWarning` from 5.24;
    ValueError if both are given), and document `cache`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if LEGACY_CACHE_NAME in kwargs:
            if CACHE_NAME == "cache":
                warnings.warn("`past_key_values` is deprecated since Transformers 5.24: pass the cache as `cache`.",
                              FutureWarning, stacklevel=2)
            legacy = kwargs.pop(LEGACY_CACHE_NAME)
            if kwargs.get("cache") is not None and legacy is not None:
                raise ValueError("Pass the cache once, as `cache` (`past_key_values` is its former name), not both.")
            if kwargs.get("cache") is None:
                kwargs["cache"] = legacy
        return function(*args, **kwargs)

    # (before the method's own arguments, indented as a method's docstring)
    wrapper.__doc__ = "\n" + textwrap.indent(CACHE_ARG_DOC, " " * 8) + "\n" + (function.__doc__ or "").lstrip("\n")
    return wrapper


def cache_kwargs(cache) -> dict:
    """`{CACHE_NAME: cache}`."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The cache a `ModelOutput` (or `model_kwargs` dict) carries."""
    if isinstance(outputs, dict):
        return outputs.get(CACHE_NAME)
    return getattr(outputs, CACHE_NAME, None)


# what `PagedCache` uses of 5.24's `PagedAttentionCache`: this `update` signature and `layer_to_allocator`
PAGED_CACHE_UPDATE = ["self", "key_states", "value_states", "layer_idx", "kwargs"]


def paged_cache_limits() -> str | None:
    """Why the installed Transformers' paged cache cannot hold DAT's layers, or None when it can."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    parameters = list(inspect.signature(PagedAttentionCache.update).parameters)
    if parameters != PAGED_CACHE_UPDATE or "layer_to_allocator" not in inspect.getsource(PagedAttentionCache.__init__):
        return (f"transformers {transformers.__version__}'s paged cache "
                f"(`PagedAttentionCache.update({', '.join(parameters[1:])})`) "
                f"is not the one DAT's layers use (Transformers {TESTED_TRANSFORMERS[1]}: "
                f"`update({', '.join(PAGED_CACHE_UPDATE[1:])})`); install transformers=={TESTED_TRANSFORMERS[1]}")
    return None


try:  # (Transformers 5.18+)
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # pragma: no cover (Transformers 5.17)

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """`hidden_states` `[b, n, d]` at the positions whose logits are wanted: an `int`, the last ones (0: all); a
        1D tensor, those positions; a 2D int `[b, k]`, per-sample; a 2D bool `[b, n]`, flattened `[true, d]`."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        if isinstance(logits_to_keep, int):
            logits_to_keep = slice(-logits_to_keep, None)
        return hidden_states[:, logits_to_keep, :]


__all__ = ["CACHE_NAME", "CACHE_NAMES", "TESTED_TRANSFORMERS", "cache_kwargs",
           "output_cache", "paged_cache_limits", "slice_logits_to_keep", "takes_cache"]
