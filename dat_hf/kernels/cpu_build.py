"""Build and load the compiled CPU kernels (`csrc/*.cpp`) on first use.

The sources are compiled with `torch.utils.cpp_extension.load` the first time a kernel is needed (about 10-20 s,
cached under `TORCH_EXTENSIONS_DIR` or `~/.cache/torch_extensions`, in a folder named after the sources' hash), for
this machine's vector unit. They register the `torch.ops.dat_hf.*` operators. Without a C++ compiler, or with
`DAT_HF_CPU_KERNEL=0`, nothing is compiled and dat_hf runs its PyTorch backends.
"""

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_STATE = {"loaded": False, "tried": False, "error": None}


def _build_flags():
    """Compiler flags for this machine's vector unit (the same capability PyTorch dispatches its own kernels to)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp"]
    if capability in ("AVX512", "AVX2"):
        flags += ["-march=native", f"-DCPU_CAPABILITY_{capability}", f"-DCPU_CAPABILITY={capability}"]
    return flags


def cpu_kernel_enabled() -> bool:
    """False when `DAT_HF_CPU_KERNEL` is 0/false/off/no (then nothing is compiled)."""
    return os.environ.get("DAT_HF_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "off", "no")


def build_extension() -> bool:
    """Build (once per machine) and load the extension; True on success. A failed build is logged once (at warning
    level) and returns False: the PyTorch backends compute the same things."""
    if _STATE["loaded"] or _STATE["tried"] or not cpu_kernel_enabled():
        return _STATE["loaded"]
    _STATE["tried"] = True
    try:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        from torch.utils import cpp_extension

        flags = _build_flags()
        digest = hashlib.sha1()
        for source in SOURCES:
            digest.update(source.read_bytes())
        digest.update((" ".join(flags) + torch.__version__).encode())
        name = f"dat_hf_cpu_{digest.hexdigest()[:12]}"
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        build_dir = os.path.join(root, name)
        os.makedirs(build_dir, exist_ok=True)
        logger.info("dat_hf: building the CPU kernels in %s", build_dir)
        cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=build_dir, is_python_module=False, verbose=False)
        _STATE["loaded"] = True
    except Exception as error:  # no compiler, no BLAS symbol, ...: the PyTorch backends compute the same thing
        _STATE["error"] = error
        logger.warning("dat_hf: the compiled CPU kernels are unavailable (%s); using the PyTorch backends (set "
                       "DAT_HF_CPU_KERNEL=0 to skip the build).", error)
    return _STATE["loaded"]


__all__ = ["SOURCES", "build_extension", "cpu_kernel_enabled"]
