"""Build and load the compiled CPU kernels (`csrc/*.cpp`), once per machine, on first use or ahead of time.

    python -m dat_hf.kernels build     # build now (a Docker image, a cluster's login node), then no process waits
    python -m dat_hf.kernels status    # where the build is cached, whether it is built, who is building it

The sources are compiled by calling the C++ compiler directly (no ninja, no `torch.utils.cpp_extension.load`) for
this machine's instruction set (`-march=native`). The first use logs one line (warning level) saying what is built,
where, and how to build ahead or switch it off.

Cache: `DAT_HF_KERNEL_CACHE`, else `TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`; one folder per build key
`dat_hf_cpu_<sources, flags, torch>_<capability>-<CPU instruction set>`: a cache shared by machines (a home folder on
a cluster, a Docker layer) never hands a binary to a CPU whose instruction set differs from the one it was built on.

Never a hang on a dead build: a build runs in a private folder (`.<key>.build-*`) that is renamed into place only
once it is complete, under an OS lock (`flock` on `<key>.lock`) that the kernel releases when its holder dies, so a
build killed at any point (Ctrl-C, `kill -9`) leaves nothing a later process waits on; the next build removes its
leftovers. Waiting for another live process's build and the build itself are bounded by `DAT_HF_KERNEL_BUILD_TIMEOUT`
seconds (default 600). The compiler processes die with the process that started them (Linux).

Whatever fails (no compiler, a read-only cache, a compile error, a timeout, `DAT_HF_CPU_KERNEL=0`) dat_hf runs its
PyTorch backends, which compute the same results, after one warning saying why.
"""

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
DEFAULT_TIMEOUT = 600.0
_STATE = {"loaded": False, "tried": False, "error": None}
WHAT = "the compiled CPU kernels (relational attention, RoPE, SwiGLU, decoding projections)"


class KernelBuildError(RuntimeError):
    """A build that could not be done; the message says why and what to do."""


# ---- configuration --------------------------------------------------------------------------------------------------
def cpu_kernel_enabled() -> bool:
    """False when `DAT_HF_CPU_KERNEL` is 0/false/off/no (then nothing is compiled)."""
    return os.environ.get("DAT_HF_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "off", "no")


def build_timeout() -> float:
    value = os.environ.get("DAT_HF_KERNEL_BUILD_TIMEOUT", "")
    try:
        timeout = float(value) if value.strip() else DEFAULT_TIMEOUT
    except ValueError:
        raise KernelBuildError(f"DAT_HF_KERNEL_BUILD_TIMEOUT must be a number of seconds, got {value!r}") from None
    if not timeout > 0:
        raise KernelBuildError(f"DAT_HF_KERNEL_BUILD_TIMEOUT must be positive, got {value!r}")
    return timeout


def cache_root() -> Path:
    """Where builds are cached: `DAT_HF_KERNEL_CACHE`, else `TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`."""
    root = os.environ.get("DAT_HF_KERNEL_CACHE") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root or Path.home() / ".cache" / "torch_extensions").expanduser()


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def cpu_instruction_set(cpuinfo="/proc/cpuinfo") -> str:
    """A short digest of this CPU's architecture and instruction-set extensions (Linux: the `flags` of
    /proc/cpuinfo; elsewhere the processor's description), what `-march=native` compiles for."""
    description = platform.machine()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features", "isa"):  # x86, ARM, RISC-V
                    description += " " + " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        description += " " + platform.processor()
    return hashlib.sha1(description.encode()).hexdigest()[:8]


def _build_flags():
    """Compiler flags for this machine's vector unit (the same capability PyTorch dispatches its own kernels to)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", "-fPIC", "-std=c++20", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    if capability in ("AVX512", "AVX2"):
        flags += ["-march=native", f"-DCPU_CAPABILITY_{capability}", f"-DCPU_CAPABILITY={capability}"]
    return flags


def _torch_paths():
    torch_dir = Path(torch.__file__).parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    return [f"-I{path}" for path in includes], ["-shared", "-fopenmp", f"-L{torch_dir / 'lib'}", "-lc10",
                                                  "-ltorch_cpu", "-ltorch"]


def build_name(sources=None, flags=None) -> str:
    """The cache folder's name: sources, flags and torch version, then the vector capability and a digest of the CPU's
    instruction set (the build uses `-march=native`)."""
    sources = SOURCES if sources is None else sources
    flags = _build_flags() if flags is None else flags
    digest = hashlib.sha1()
    for source in sources:
        digest.update(Path(source).name.encode() + b"\0" + Path(source).read_bytes())
    digest.update((" ".join(flags) + torch.__version__).encode())
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return f"dat_hf_cpu_{digest.hexdigest()[:12]}_{capability}-{cpu_instruction_set()}"


# ---- building -------------------------------------------------------------------------------------------------------
def _die_with_parent():  # runs in the child between fork and exec (Linux): the compiler dies with its parent
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_parallel(commands, cwd, deadline, log_path, jobs):
    """Run `commands` (argument lists), at most `jobs` at a time, until `deadline` (time.monotonic); output to
    `log_path`. Raises KernelBuildError on a failure or the deadline, after killing what still runs."""
    pending, running = list(commands), []
    with open(log_path, "ab") as log:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    command = pending.pop(0)
                    log.write(("$ " + " ".join(command) + "\n").encode())
                    log.flush()
                    preexec = _die_with_parent if sys.platform.startswith("linux") else None
                    running.append((command, subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                                              stdin=subprocess.DEVNULL, preexec_fn=preexec)))
                for command, process in list(running):
                    code = process.poll()
                    if code is None:
                        continue
                    running.remove((command, process))
                    if code != 0:
                        raise KernelBuildError(f"`{Path(command[0]).name}` failed (exit status {code}) on "
                                               f"{command[-3] if '-c' in command else 'the link step'}: "
                                               f"{_log_tail(log_path)}")
                if time.monotonic() > deadline:
                    raise KernelBuildError("the build did not finish within DAT_HF_KERNEL_BUILD_TIMEOUT="
                                           f"{build_timeout():g} s")
                time.sleep(0.05)
        finally:
            for _, process in running:
                with contextlib.suppress(OSError):
                    process.kill()
                process.wait()


def _log_tail(log_path, lines=6):
    with contextlib.suppress(OSError):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = [line.rstrip() for line in f if line.strip() and not line.startswith("$ ")]
        return " | ".join(text[-lines:]) or "no output"
    return "no output"


def _find_compiler() -> str:
    cxx = compiler()
    path = shutil.which(cxx)
    if path is None:
        raise KernelBuildError(f"no C++ compiler found (`{cxx}` is not on PATH; install g++ or clang, or set CXX)")
    return path


def _compile_into(folder, name, sources, flags, deadline):
    """Compile `sources` into `folder/<name>.so` (objects in parallel, then the link)."""
    path = _find_compiler()
    includes, ldflags = _torch_paths()
    objects, commands = [], []
    for source in sources:
        obj = os.path.join(folder, Path(source).stem + ".o")
        objects.append(obj)
        commands.append([path, *flags, *includes, f"-DTORCH_EXTENSION_NAME={name}", "-c", str(source), "-o", obj])
    log_path = os.path.join(folder, "build.log")
    jobs = max(1, min(len(commands), os.cpu_count() or 1))
    _run_parallel(commands, folder, deadline, log_path, jobs)
    library = os.path.join(folder, f"{name}.so")
    _run_parallel([[path, *objects, *ldflags, "-o", library]], folder, deadline, log_path, 1)
    with open(os.path.join(folder, "build.json"), "w", encoding="utf-8") as f:
        json.dump({"sources": [Path(s).name for s in sources], "flags": flags, "torch": torch.__version__,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
                   "built_by_pid": os.getpid(), "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


@contextlib.contextmanager
def _build_lock(root, name, deadline, announce):
    """Hold `<root>/<name>.lock` (flock: released by the OS when the holder dies, so never stale); waits for a live
    holder until `deadline`, then raises KernelBuildError naming it. Without flock (not POSIX): no lock (concurrent
    builds then each use a private folder and the first rename wins)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = os.path.join(root, f"{name}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _lock_holder(path)
                if not waited:
                    announce(f"dat_hf: waiting for {holder} to finish building the CPU kernels in {root} (at most "
                             f"{max(0.0, deadline - time.monotonic()):.0f} s; DAT_HF_KERNEL_BUILD_TIMEOUT)")
                    waited = True
                if time.monotonic() > deadline:
                    raise KernelBuildError(f"{holder} has held the build lock {path} longer than "
                                           f"DAT_HF_KERNEL_BUILD_TIMEOUT={build_timeout():g} s") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": platform.node(), "since": time.time()}).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _lock_holder(path) -> str:
    with contextlib.suppress(OSError, ValueError):
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
        return f"process {owner['pid']} on {owner['host']}"
    return "another process"


def building_now(root=None, name=None) -> str | None:
    """Who holds the build lock of `name` now (None when nobody: a dead holder's lock is released by the OS)."""
    root, name = Path(root or cache_root()), name or build_name()
    path = root / f"{name}.lock"
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _lock_holder(path)
    finally:
        os.close(fd)


def built_library(root=None, name=None) -> Path | None:
    """The cached library of this machine's build key, if it is built."""
    name = name or build_name()
    library = Path(root or cache_root()) / name / f"{name}.so"
    return library if library.is_file() else None


def ensure_built(name=None, sources=None, flags=None, root=None, timeout=None, announce=None) -> tuple[Path, bool]:
    """The path of the built library (building it if needed) and whether this call built it. Raises
    KernelBuildError (the reason, and what to do) when it cannot be built or waited for within `timeout` s."""
    sources = [Path(s) for s in (SOURCES if sources is None else sources)]
    flags = _build_flags() if flags is None else flags
    name = name or build_name(sources, flags)
    root = Path(root or cache_root())
    timeout = build_timeout() if timeout is None else timeout
    announce = announce or logger.warning
    deadline = time.monotonic() + timeout
    library = built_library(root, name)
    if library is not None:
        return library, False
    _find_compiler()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _build_lock(str(root), name, deadline, announce):
            library = built_library(root, name)
            if library is not None:  # built by the process we waited for
                return library, False
            for leftover in root.glob(f".{name}.build-*"):  # of builds that were killed (we hold the lock)
                shutil.rmtree(leftover, ignore_errors=True)
            private = tempfile.mkdtemp(prefix=f".{name}.build-", dir=root)
            try:
                announce(f"dat_hf: building {WHAT} for this CPU ({torch.backends.cpu.get_cpu_capability()}), once per "
                         f"machine (10-120 s); cached in {root / name}. Build ahead with `python -m dat_hf.kernels "
                         "build`; skip with DAT_HF_CPU_KERNEL=0 (the PyTorch backends compute the same results).")
                _compile_into(private, name, sources, flags, deadline)
                os.chmod(private, 0o755)  # mkdtemp's 0o700 would hide a shared cache from its other users
                try:
                    os.rename(private, root / name)  # the build appears complete or not at all
                except OSError:
                    if built_library(root, name) is None:  # not a concurrent builder's rename (no flock)
                        raise
            finally:
                shutil.rmtree(private, ignore_errors=True)
    except PermissionError as error:
        raise KernelBuildError(f"the kernel cache {root} is not writable ({error.strerror}: {error.filename}); set "
                               "DAT_HF_KERNEL_CACHE to a writable folder, or build it there with `python -m "
                               "dat_hf.kernels build`") from error
    except OSError as error:
        raise KernelBuildError(f"the kernel cache {root} cannot be used ({error.strerror or error}: "
                               f"{error.filename}); set DAT_HF_KERNEL_CACHE to a writable folder") from error
    return root / name / f"{name}.so", True


def build_extension() -> bool:
    """Build (once per machine) and load the extension; True on success. A failed build is logged once (at warning
    level) and returns False: the PyTorch backends compute the same things."""
    if _STATE["loaded"] or _STATE["tried"] or not cpu_kernel_enabled():
        return _STATE["loaded"]
    _STATE["tried"] = True
    try:
        library, _ = ensure_built()
        try:
            torch.ops.load_library(str(library))
        except Exception as error:  # e.g. a library built against another torch with the same version string
            raise KernelBuildError(f"{library} does not load ({error}); delete {library.parent} to rebuild it") \
                from error
        _STATE["loaded"] = True
    except Exception as error:  # noqa: BLE001 (any failure leaves the PyTorch backends, which compute the same)
        _STATE["error"] = error
        logger.warning("dat_hf: %s are unavailable: %s. Using the PyTorch backends (same results, slower on CPU); set "
                       "DAT_HF_CPU_KERNEL=0 to skip the build.", WHAT, error)
    return _STATE["loaded"]


def status() -> dict:
    """What `python -m dat_hf.kernels status` prints."""
    name = build_name()
    library = built_library(name=name)
    return {"enabled": cpu_kernel_enabled(), "cache": str(cache_root()), "build": name,
            "built": str(library) if library else None, "building_now": building_now(name=name),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "compiler": shutil.which(compiler()),
            "timeout_s": os.environ.get("DAT_HF_KERNEL_BUILD_TIMEOUT") or DEFAULT_TIMEOUT}


__all__ = ["SOURCES", "KernelBuildError", "build_extension", "build_name", "built_library", "building_now",
           "cache_root", "cpu_kernel_enabled", "ensure_built", "status"]
