# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Where `import dat_hf` plugs into the model files (remote code without `dat_hf` runs the references, unchecked).

`@replaceable("name")` marks a reference function; `register_kernel("name", function, accepts)` adds an
implementation used when `accepts(*args)` (never while `torch.export` traces). `check_inputs("name", ...)` runs
`INPUT_CHECKS["name"]` if installed.
"""

import functools
from collections.abc import Callable

import torch

_KERNELS: dict[str, list[tuple[Callable, Callable[..., bool]]]] = {}


def register_kernel(name: str, function: Callable, accepts: Callable[..., bool]) -> None:
    """Add (or replace) `function` as an implementation of `name`, used when `accepts(*args, **kwargs)`."""
    kernels = [entry for entry in _KERNELS.get(name, []) if entry[0] is not function]
    _KERNELS[name] = kernels + [(function, accepts)]


def registered_kernels(name: str) -> list[Callable]:
    """The implementations registered for `name`, in trial order."""
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
    """Run the input check `name` if one is installed."""
    check = INPUT_CHECKS.get(name)
    if check is not None:
        check(*args, **kwargs)


__all__ = ["INPUT_CHECKS", "check_inputs", "register_kernel", "registered_kernels", "replaceable"]
