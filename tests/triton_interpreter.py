"""Triton's interpreter (`TRITON_INTERPRET=1`) as the checks of the Triton kernel use it on CPU tensors.

Triton 3.6's interpreter cannot run `range(0, n)` over a runtime integer `n` with NumPy >= 2.4: it holds `n` as a
1-element array and its `tensor.__index__` reads it with `int(array)`, which NumPy 2.4 rejects ("only 0-dimensional
arrays can be converted to Python scalars"; triton-lang/triton#9171). `patch_runtime_loop_bounds` reads it as Triton
does from triton-lang/triton#9172 on, where needed.
"""

import torch


def takes_runtime_loop_bounds() -> bool:
    """Whether Triton's interpreter runs `range(0, n)` over a runtime integer `n`."""
    import triton
    import triton.language as tl

    @triton.jit
    def count(out, n):
        total = 0
        for _ in range(0, n):
            total += 1
        tl.store(out, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 2)
    except triton.runtime.errors.InterpreterError:
        return False
    return out.item() == 2


def patch_runtime_loop_bounds() -> None:
    """Make the interpreter read a 1-element array as an index (`int(array.squeeze())`) if it cannot already."""
    if takes_runtime_loop_bounds():
        return
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_reading_one_element_arrays(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor_reading_one_element_arrays
    assert takes_runtime_loop_bounds()
