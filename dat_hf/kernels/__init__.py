"""Compiled kernels and fast paths for dat_hf, registered with the model files' registries when `dat_hf` is
imported.

The model files never import this package, so a model loaded as Hub remote code without `dat_hf` runs the PyTorch
backends (`eager`, `sdpa`, `flex_attention`), the reference functions.

- `contracts`: what each op that takes over a whole step computes (every config field and module type
  classified), and whether it may run a given module, decided once.
- `cpu`: relational attention for CPU float32 (backend `"cpu"`: flash-style forward and backward, one-op decoding
  step), RoPE and the MLP's SwiGLU in one pass each; C++ sources in `csrc/`, built on first use (`cpu_build`) or
  ahead with `python -m dat_hf.kernels build` (`status` shows the cache).
- `mlp`: the MLP's activation recomputed in backward (any device), with the SwiGLU op on CPU.
- `projections`: a layer's input projections as one matrix product over the concatenated weights.
- `tensor_parallel`: a layer's input projections under tensor parallelism as one local product, one all-reduce.
- `triton_relational`: relational attention in Triton for CUDA (backend `"triton"`), registered when the `triton`
  package imports; its kernels run on CPU tensors when `TRITON_INTERPRET=1` is set before `dat_hf` is imported.
"""

from . import contracts, cpu, mlp, projections, tensor_parallel
from .cpu import cpu_kernel_ready, load_cpu_kernel

cpu.register()
mlp.register()
projections.register()
tensor_parallel.register()

try:
    import triton  # noqa: F401
except ImportError:  # no Triton (e.g. not Linux x86-64): the PyTorch backends run on CUDA
    triton = None
if triton is not None:
    from . import triton_relational

    triton_relational.register()

__all__ = ["cpu_kernel_ready", "load_cpu_kernel"]
