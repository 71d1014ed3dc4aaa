"""Compiled kernels for dat_hf, registered with the model files' registries when `dat_hf` is imported.

The model files never import this package, so a model loaded as Hub remote code without `dat_hf` runs the PyTorch
backends (`eager`, `sdpa`, `flex_attention`) and the reference functions.

- `cpu`: relational attention for CPU float32 (backend `"cpu"`: flash-style forward and backward, one-op decoding
  step), RoPE and the MLP's SwiGLU in one pass each; C++ sources in `csrc/`, built on first use (`cpu_build`) or
  ahead with `python -m dat_hf.kernels build` (`status` shows the cache).
- `mlp`: the MLP's activation recomputed in backward (any device), with the SwiGLU op on CPU.
- `triton_relational`: relational attention in Triton for CUDA (backend `"triton"`), registered when the `triton`
  package imports; its kernels run on CPU tensors when `TRITON_INTERPRET=1` is set before `dat_hf` is imported.
"""

from . import cpu, mlp
from .cpu import cpu_kernel_ready, load_cpu_kernel

cpu.register()
mlp.register()

try:
    import triton  # noqa: F401
except ImportError:  # no Triton (e.g. not Linux x86-64): the PyTorch backends run on CUDA
    triton = None
if triton is not None:
    from . import triton_relational

    triton_relational.register()

__all__ = ["cpu_kernel_ready", "load_cpu_kernel"]
