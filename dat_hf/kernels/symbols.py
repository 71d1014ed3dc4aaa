"""Symbolic attention's per-head templates and library kept between decoding steps, installed by `import dat_hf` (the
model files never import this module: remote code alone forms the views at every call, `symbol_retrieval.symbol_heads`,
with the same results).
"""

import torch
from torch import nn

from ..kernel_hooks import register_kernel

_PLAIN = (nn.Parameter, torch.Tensor)


def takes_kept_views(module, library, dtype) -> bool:
    """Without gradients, outside tracing, plain parameters already in `dtype` (views of them follow in-place
    changes; a conversion would not)."""
    templates = module.template_features
    return (not (torch.is_grad_enabled() or torch.compiler.is_compiling()) and type(templates) in _PLAIN
            and type(library) in _PLAIN and templates.dtype == library.dtype == dtype)


def kept_symbol_heads(module, library, dtype):
    """The kernel of `symbol_retrieval.symbol_heads`: the per-head views `[1, h, S, d/h]` of `module`'s templates and
    `library`, kept while both parameters keep their storage (a decoding step reads them once per layer)."""
    templates = module.template_features
    stamp = (templates.data_ptr(), library.data_ptr(), templates.shape, library.shape)
    kept = module.__dict__.get("_symbol_heads")
    if kept is None or kept[0] != stamp:
        views = module._heads(templates, dtype), module._heads(library, dtype)
        kept = module.__dict__["_symbol_heads"] = (stamp, views)
    return kept[1]


def register() -> None:
    """Install the kept views into `symbol_retrieval.symbol_heads`."""
    register_kernel("symbol_heads", kept_symbol_heads, takes_kept_views)


__all__ = ["kept_symbol_heads", "register", "takes_kept_views"]
