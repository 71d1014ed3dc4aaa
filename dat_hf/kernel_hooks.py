# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Where `import dat_hf` plugs into the model files: compiled kernels, for the few functions that are not attention,
and the input checks.

`@replaceable("name")` marks a PyTorch function of the model files (the reference: RoPE, the MLP's activation and
down projection); `register_kernel("name", function, accepts)` (called by `dat_hf.kernels` when `dat_hf` is
imported) adds an implementation for the inputs where `accepts(*args)` is true. A call runs the first registered
implementation that accepts its inputs, else the reference (always the reference while `torch.export` traces: an
exported program, ONNX or ExecuTorch, holds no compiled op of dat_hf's). This is Transformers' `use_kernel_func_from_hub` idea,
local and without downloads: a model loaded as Hub remote code, without `dat_hf`, runs the references.
Relational attention has its own registry of named backends (`relational_attention.py`).

`check_inputs("name", ...)` at the top of a forward runs the input check `INPUT_CHECKS["name"]`, which `import dat_hf`
installs (`dat_hf/input_validation.py`: a `ValueError` naming the bad argument; while `torch.compile` or
`torch.export` traces, only the checks of shapes and dtypes); a model loaded as remote code, without `dat_hf`, has
none and runs unchecked, as Transformers' own models do.
"""

import functools
from collections.abc import Callable

import torch

_KERNELS: dict[str, list[tuple[Callable, Callable[..., bool]]]] = {}


def register_kernel(name: str, function: Callable, accepts: Callable[..., bool]) -> None:
    """Add `function` as an implementation of the replaceable function `name`, used when `accepts(*args, **kwargs)`
    is true (registering the same function again replaces its entry)."""
    kernels = [entry for entry in _KERNELS.get(name, []) if entry[0] is not function]
    _KERNELS[name] = kernels + [(function, accepts)]


def registered_kernels(name: str) -> list[Callable]:
    """The implementations registered for `name`, in the order they are tried."""
    return [function for function, _ in _KERNELS.get(name, [])]


def replaceable(name: str):
    """Decorator: the function is the reference implementation of `name`; registered kernels may replace it."""

    def decorator(reference: Callable) -> Callable:
        @functools.wraps(reference)
        def dispatch(*args, **kwargs):
            if torch.compiler.is_exporting():
                return reference(*args, **kwargs)
            for function, accepts in _KERNELS.get(name, ()):
                if accepts(*args, **kwargs):
                    return function(*args, **kwargs)
            return reference(*args, **kwargs)

        dispatch.reference = reference
        return dispatch

    return decorator


INPUT_CHECKS: dict[str, Callable[..., None]] = {}


def check_inputs(name: str, *args, **kwargs) -> None:
    """Run the input check `name` if one is installed (`INPUT_CHECKS`), else nothing."""
    check = INPUT_CHECKS.get(name)
    if check is not None:
        check(*args, **kwargs)


__all__ = ["INPUT_CHECKS", "check_inputs", "register_kernel", "registered_kernels", "replaceable"]
