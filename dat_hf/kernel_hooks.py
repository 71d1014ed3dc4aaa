# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The one registry of what computes DAT (`BACKENDS`), and where `import dat_hf` plugs into the model files (remote
code without `dat_hf` runs the references, unchecked).

    BACKENDS.of("relational").register("mine", function, supports, preferred_on=("cuda",), mask_format="tensor")
    BACKENDS.of("sensory").register("sdpa", function)            # by `attn_implementation`
    register_kernel("rotary", function, accepts)                 # a compiled kernel of `@replaceable("rotary")`

Each kind (a head type, a `@replaceable` function's name) has one table of named entries (`Backend`);
a head type's backends are chosen per forward by the attention plan, a replaceable function's kernels are tried in
registration order (never while `torch.export` traces).
`check_inputs("name", ...)` runs `INPUT_CHECKS["name"]` if installed.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch


class Backend(NamedTuple):
    """One registered implementation. `supports`: for a head type, `supports(call)` -> None or why it cannot run the
    call (None: any call); for a replaceable function, `supports(*args, **kwargs)` -> whether it takes the call.
    `preferred_on`: the devices where automatic selection puts it first; `mask_format`: the mask it takes
    (`attention_plan.MASK_FORMATS`)."""

    function: Callable
    supports: Callable | None = None
    preferred_on: tuple[str, ...] = ()
    mask_format: str = "tensor"


class BackendTable(dict):
    """One kind's entries, name -> `Backend`. `unavailable`: (name, device type) -> the error that took a backend out
    of automatic selection (clear it to retry)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.unavailable = kind, {}

    def register(self, name: str, function: Callable, supports: Callable | None = None, preferred_on=(),
                 mask_format: str = "tensor") -> None:
        self[name] = Backend(function, supports, tuple(preferred_on), mask_format)

    def installed(self, name: str, default=None):
        """The function (or class) registered as `name`, else `default` (what remote code alone runs)."""
        entry = self.get(name)
        return default if entry is None else entry.function

    def backend(self, name: str) -> Backend:
        if name not in self:
            raise ValueError(f"Unknown {self.kind} attention backend {name!r}; registered: {sorted(self)} (compiled "
                             "backends are registered by `import dat_hf`).")
        return self[name]


class Backends:
    """Every kind's table: the head types `sensory` and `relational`, and each `@replaceable` function's name."""

    def __init__(self):
        self.kinds: dict[str, BackendTable] = {}

    def of(self, kind: str) -> BackendTable:
        return self.kinds.setdefault(kind, BackendTable(kind))


BACKENDS = Backends()
HEAD_TYPES = ("sensory", "relational")


def register_kernel(name: str, function: Callable, accepts: Callable[..., bool]) -> None:
    """Add (or replace) `function` as a kernel of the replaceable function `name`, used when `accepts(*args,
    **kwargs)`."""
    BACKENDS.of(name).register(f"{function.__module__}.{function.__qualname__}", function, accepts)


def registered_kernels(name: str) -> list[Callable]:
    """The kernels registered for `name`, in trial order."""
    return [backend.function for backend in BACKENDS.of(name).values()]


def replaceable(name: str):
    """Decorator: the function is the reference implementation of `name`; registered kernels may replace it."""
    kernels = BACKENDS.of(name)

    def decorator(reference: Callable) -> Callable:
        @functools.wraps(reference)
        def dispatch(*args, **kwargs):
            if torch.compiler.is_exporting():
                return reference(*args, **kwargs)
            for function, accepts, _, _ in kernels.values():
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


__all__ = ["BACKENDS", "HEAD_TYPES", "INPUT_CHECKS", "Backend", "BackendTable", "check_inputs", "register_kernel",
           "registered_kernels", "replaceable"]
