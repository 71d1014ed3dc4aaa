"""Build and load the compiled CPU kernels (`csrc/*.cpp`), once per machine, on first use or ahead of time.

    python -m dat_hf.kernels build     # build now (a Docker image, a cluster's login node), then no process waits
    python -m dat_hf.kernels status    # where the build is cached (writable or not), whether it is built and
                                       # verified, who builds it

The sources are compiled by calling the C++ compiler directly (no ninja, no `torch.utils.cpp_extension.load`) for
this machine's instruction set (`-march=native`). The first use logs one line (warning level) saying what is built,
where, and how to build ahead or switch it off.

Cache: `DAT_HF_KERNEL_CACHE`, else `TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`; one folder per build key
`dat_hf_cpu_<sources, flags, torch>_<capability>-<CPU instruction set>`: a cache shared by machines (a home folder on
a cluster, a Docker layer) never hands a binary to a CPU whose instruction set differs from the one it was built on.

A cached library is trusted only once verified, because mapping a damaged one can kill the process (a truncated file
gives SIGBUS): a build loads and calls its library in a child process, then records its size and sha256 in
`build.json`; a load first checks the file against that record (a few milliseconds), and only a library without a
record (an older build) is loaded in a child process first (then recorded). An entry that fails a check (truncated,
overwritten, another library) is moved aside to `.<key>.corrupt-<time>` and rebuilt, with one warning naming it; a
library that loads without the dat_hf operators falls back like any other failure. `status` runs the checks. A
read-only cache (a read-only mount, a build baked into an image) serves its verified build as it is.

Never a hang on a dead build: a build runs in a private folder (`.<key>.build-*`) that is renamed into place only
once it is complete, under an OS lock (`flock` on `<key>.lock`) that the kernel releases when its holder dies, so a
build killed at any point (Ctrl-C, `kill -9`) leaves nothing a later process waits on; the next build removes its
leftovers. Waiting for another live process's build and the build itself are bounded by `DAT_HF_KERNEL_BUILD_TIMEOUT`
seconds (default 600). The compiler processes (`c++` and its `cc1plus`, `as`, `ld`) run in a process group of their
own, watched by a small process that kills the whole group when the builder dies, however it dies (POSIX; Linux also
through a parent-death signal).

Whatever fails (no compiler, a read-only cache, a compile error, a timeout, a library that fails its checks,
`DAT_HF_CPU_KERNEL=0`) dat_hf runs its PyTorch backends, which compute the same results, after one warning saying why.
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
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # (included by the sources: part of the build's name)
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
    """The cache folder's name: sources (and the headers they include), flags and torch version, then the vector
    capability and a digest of the CPU's instruction set (the build uses `-march=native`)."""
    sources = SOURCES if sources is None else sources
    flags = _build_flags() if flags is None else flags
    digest = hashlib.sha1()
    for source in [*sources, *HEADERS]:
        digest.update(Path(source).name.encode() + b"\0" + Path(source).read_bytes())
    digest.update((" ".join(flags) + torch.__version__).encode())
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return f"dat_hf_cpu_{digest.hexdigest()[:12]}_{capability}-{cpu_instruction_set()}"


# ---- building -------------------------------------------------------------------------------------------------------
# The watchdog of a build's compilers: it leads their process group and kills the whole group (itself included) when
# the builder dies: its stdin (the builder's pipe) reaches end-of-file without "done" (any POSIX), or the parent-death
# signal arrives (Linux; it also covers a builder whose pipe a forked child still holds).
WATCHDOG = """
import os, signal, sys
def end(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    end()
sys.stdout.write("ready\\n")
sys.stdout.flush()
if sys.stdin.buffer.read() != b"done":
    end()
"""


def _in_group(pgid) -> dict:
    """Popen arguments that start a process in the process group `pgid` (0: a new group it leads)."""
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}


@contextlib.contextmanager
def _compiler_group(folder):
    """A process group for the compilers of one build, with its watchdog (see WATCHDOG); yields the group's id, or
    None where there are no process groups (then the compilers are only killed by the builder itself). Killed at
    the end of a failed build; released at the end of a finished one."""
    watchdog = None
    if hasattr(os, "killpg") and sys.executable:
        with contextlib.suppress(OSError):
            watchdog = subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHDOG, str(os.getpid())], cwd=folder,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, **_in_group(0))
            if watchdog.stdout.readline() != b"ready\n":  # it could not start (then it has ended)
                watchdog.wait()
                watchdog = None
    if watchdog is None:
        yield None
        return
    done = False
    try:
        yield watchdog.pid
        done = True
    finally:
        with contextlib.suppress(OSError):
            if done:
                watchdog.stdin.write(b"done")
            else:  # what still runs of a failed or interrupted build
                os.killpg(watchdog.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            watchdog.stdin.close()
        watchdog.stdout.close()
        watchdog.wait()


def _run_parallel(commands, cwd, deadline, log_path, jobs, group=None):
    """Run `commands` (argument lists), at most `jobs` at a time, in the process group `group` (None: this one),
    until `deadline` (time.monotonic); output to `log_path`. Raises KernelBuildError on a failure or the deadline,
    after killing what still runs (the whole group)."""
    pending, running = list(commands), []
    in_group = {} if group is None else _in_group(group)
    with open(log_path, "ab") as log:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    command = pending.pop(0)
                    log.write(("$ " + " ".join(command) + "\n").encode())
                    log.flush()
                    try:
                        process = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, **in_group)
                    except OSError as error:  # not executable, or its process group is gone
                        raise KernelBuildError(f"`{command[0]}` could not be started ({error})") from error
                    running.append((command, process))
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
            if running and group is not None:  # the drivers' own children (cc1plus, as) too
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
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


def _compile_into(folder, name, sources, flags, deadline, check):
    """Compile `sources` into `folder/<name>.so` (objects in parallel, then the link), check it in a child process
    (`check`, see `child_check`) and record it in `folder/build.json`."""
    path = _find_compiler()
    includes, ldflags = _torch_paths()
    objects, commands = [], []
    for source in sources:
        obj = os.path.join(folder, Path(source).stem + ".o")
        objects.append(obj)
        commands.append([path, *flags, *includes, f"-DTORCH_EXTENSION_NAME={name}", "-c", str(source), "-o", obj])
    log_path = os.path.join(folder, "build.log")
    jobs = max(1, min(len(commands), os.cpu_count() or 1))
    library = os.path.join(folder, f"{name}.so")
    with _compiler_group(folder) as group:
        _run_parallel(commands, folder, deadline, log_path, jobs, group)
        _run_parallel([[path, *objects, *ldflags, "-o", library]], folder, deadline, log_path, 1, group)
    failure = child_check(library, check, max(60.0, deadline - time.monotonic()))
    if failure:
        raise KernelBuildError(f"the library just built fails its check ({failure}); see {log_path}")
    _write_build_json(folder, {"sources": [Path(s).name for s in sources], "flags": flags, "torch": torch.__version__,
                               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "machine": platform.machine(), "built_by_pid": os.getpid(),
                               "built_at": time.strftime("%Y-%m-%d %H:%M:%S"), "library": _fingerprint(library)})


# ---- verifying ------------------------------------------------------------------------------------------------------
# What a child process runs to check a library (argv[1]): the kernels load as torch operators and compute; any shared
# library loads. A child, because loading a damaged library can kill the process that loads it (SIGBUS).
KERNEL_CHECK = """
import sys, torch
torch.ops.load_library(sys.argv[1])
missing = [op for op in OPS if not hasattr(torch.ops.dat_hf, op)]
if missing:
    sys.exit(f"it has no operator dat_hf::{missing[0]}" + (f" (nor {len(missing) - 1} more)" if missing[1:] else ""))
x = torch.randn(3, 8)
if not torch.allclose(torch.ops.dat_hf.swiglu_forward(x, x), torch.nn.functional.silu(x) * x, atol=1e-5):
    sys.exit("its SwiGLU operator computes wrong results")
"""
LIBRARY_CHECK = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
OPS = ("relational_attention_forward", "relational_attention_backward", "relational_attention_decode",
       "multi_linear", "symbolic_attention", "dual_attention_decode", "decoder_layer_decode", "swiglu_forward",
       "swiglu_backward", "rope")


def child_check(library, check=KERNEL_CHECK, timeout=None) -> str | None:
    """Load `library` in a child process that runs `check` (Python code; `sys.argv[1]` is the library's path, `OPS`
    the kernels' operator names): None when it passes, else what went wrong (a signal, the child's last line)."""
    code = f"OPS = {OPS!r}\n{check}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(torch.__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True, text=True, env=env,
                                stdin=subprocess.DEVNULL, timeout=timeout or DEFAULT_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"loading it in a child process took over {timeout or DEFAULT_TIMEOUT:g} s"
    except OSError as error:
        return f"no child process could load it ({error})"
    if result.returncode < 0:
        with contextlib.suppress(ValueError):
            return f"loading it in a child process killed the child with {signal.Signals(-result.returncode).name}"
        return f"loading it in a child process killed the child with signal {-result.returncode}"
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        return f"loading it in a child process failed: {lines[-1] if lines else f'exit status {result.returncode}'}"
    return None


def _fingerprint(library) -> dict:
    """size and sha256 of a file."""
    digest = hashlib.sha256()
    with open(library, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": os.path.getsize(library), "sha256": digest.hexdigest()}


def _write_build_json(folder, record):
    """Write `folder/build.json` whole or not at all."""
    path = os.path.join(folder, "build.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def verify(library, check=KERNEL_CHECK, deep=False, record=True) -> tuple[bool, str]:
    """Whether the cached `library` is the one its build produced, and how that was found (or what failed). Checks
    its size and sha256 against its `build.json`; without a record (a build by an older dat_hf), or with `deep`,
    loads it in a child process (`child_check`), then (`record`) records it if it passed. Loads nothing here."""
    library = Path(library)
    try:
        with open(library.parent / "build.json", encoding="utf-8") as f:
            info = json.load(f)
        expected = info.get("library") if isinstance(info, dict) else None
    except (OSError, ValueError):
        info, expected = None, None
    try:
        found = _fingerprint(library)
    except OSError as error:
        return False, f"it cannot be read ({error.strerror or error})"
    recorded = isinstance(expected, dict)
    if recorded and found["size"] != expected.get("size"):
        return False, f"its size is {found['size']} bytes where build.json records {expected.get('size')}"
    if recorded and found["sha256"] != expected.get("sha256"):
        return False, "its sha256 differs from the one build.json records"
    how = ["size and sha256 match build.json"] if recorded else []
    if deep or not recorded:
        failure = child_check(library, check)
        if failure:
            return False, failure if recorded else f"build.json has no record of it, and {failure}"
        how.append("loaded and called in a child process")
        if not recorded:
            how.append("build.json has no record of it")
            with contextlib.suppress(OSError):  # a read-only cache: checked again by the next process
                if record:
                    _write_build_json(library.parent, {**(info if isinstance(info, dict) else {}), "library": found})
                    how[-1] = "recorded in build.json"
    return True, "; ".join(how)


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
    """The cached library of this machine's build key, if there is one (not verified: see `verify`)."""
    name = name or build_name()
    library = Path(root or cache_root()) / name / f"{name}.so"
    return library if library.is_file() else None


def _move_aside(root, name) -> Path:
    """Rename the cache entry `root/name` to `root/.<name>.corrupt-<time>` (replacing an older one); its path."""
    for older in root.glob(f".{name}.corrupt-*"):
        shutil.rmtree(older, ignore_errors=True)
    aside = root / f".{name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(root / name, aside)
    return aside


def ensure_built(name=None, sources=None, flags=None, root=None, timeout=None, announce=None, check=KERNEL_CHECK,
                 deep=False) -> tuple[Path, bool]:
    """The path of the built and verified library (building it if needed) and whether this call built it. A cached
    library that fails `verify` (with `deep`, also a load in a child process) is moved aside and rebuilt. Raises
    KernelBuildError (the reason, and what to do) when it cannot be built or waited for within `timeout` s."""
    sources = [Path(s) for s in (SOURCES if sources is None else sources)]
    flags = _build_flags() if flags is None else flags
    name = name or build_name(sources, flags)
    root = Path(root or cache_root())
    timeout = build_timeout() if timeout is None else timeout
    announce = announce or logger.warning
    deadline = time.monotonic() + timeout
    library = built_library(root, name)
    failed = None  # why the cached library is not trusted
    if library is not None:
        verified, how = verify(library, check, deep)
        if verified:
            return library, False
        failed = f"{library} fails its check ({how})"
    try:
        _find_compiler()
        root.mkdir(parents=True, exist_ok=True)
        with _build_lock(str(root), name, deadline, announce):
            library = built_library(root, name)
            what = f"building {WHAT}"
            if library is not None:  # as found before the lock, or (re)built by the process we waited for
                verified, how = verify(library, check, deep)
                if verified:
                    return library, False
                failed = f"{library} fails its check ({how})"
                what = f"{failed}: moved it aside to {_move_aside(root, name)}; rebuilding {WHAT}"
            for leftover in root.glob(f".{name}.build-*"):  # of builds that were killed (we hold the lock)
                shutil.rmtree(leftover, ignore_errors=True)
            private = tempfile.mkdtemp(prefix=f".{name}.build-", dir=root)
            try:
                announce(f"dat_hf: {what} for this CPU ({torch.backends.cpu.get_cpu_capability()}), once per "
                         f"machine (1-3 minutes on 2 cores); cached in {root / name}. Build ahead with `python -m "
                         "dat_hf.kernels build`; skip with DAT_HF_CPU_KERNEL=0 (the PyTorch backends compute the same "
                         "results).")
                _compile_into(private, name, sources, flags, deadline, check)
                os.chmod(private, 0o755)  # mkdtemp's 0o700 would hide a shared cache from its other users
                try:
                    os.rename(private, root / name)  # the build appears complete or not at all
                except OSError:
                    if built_library(root, name) is None:  # not a concurrent builder's rename (no flock)
                        raise
            finally:
                shutil.rmtree(private, ignore_errors=True)
    except PermissionError as error:
        raise KernelBuildError(_also(failed, f"the kernel cache {root} is not writable ({error.strerror}: "
                                             f"{error.filename}); set DAT_HF_KERNEL_CACHE to a writable folder, or "
                                             "build it there with `python -m dat_hf.kernels build`")) from error
    except OSError as error:
        raise KernelBuildError(_also(failed, f"the kernel cache {root} cannot be used ({error.strerror or error}: "
                                             f"{error.filename}); set DAT_HF_KERNEL_CACHE to a writable folder")) \
            from error
    except KernelBuildError as error:
        if failed is None:
            raise
        raise KernelBuildError(_also(failed, str(error))) from error
    return root / name / f"{name}.so", True


def _also(failed, message) -> str:
    return message if failed is None else f"{failed}, and {message}"


def build_extension() -> bool:
    """Build (once per machine), verify and load the extension; True on success. A failure is logged once (at
    warning level) and returns False: the PyTorch backends compute the same things."""
    if _STATE["loaded"] or _STATE["tried"] or not cpu_kernel_enabled():
        return _STATE["loaded"]
    _STATE["tried"] = True
    try:
        library, _ = ensure_built()  # verified: it loads in this process without harm
        try:
            torch.ops.load_library(str(library))
        except Exception as error:  # e.g. a library built against another torch with the same version string
            raise KernelBuildError(f"{library} does not load ({error}); delete {library.parent} to rebuild it") \
                from error
        missing = [op for op in OPS if not hasattr(torch.ops.dat_hf, op)]
        if missing:
            raise KernelBuildError(f"{library} loads but has no operator dat_hf::{missing[0]}; delete "
                                   f"{library.parent} to rebuild it")
        _STATE["loaded"] = True
    except Exception as error:  # noqa: BLE001 (any failure leaves the PyTorch backends, which compute the same)
        _STATE["error"] = error
        logger.warning("dat_hf: %s are unavailable: %s. Using the PyTorch backends (same results, slower on CPU); set "
                       "DAT_HF_CPU_KERNEL=0 to skip the build.", WHAT, error)
    return _STATE["loaded"]


def cache_writable(root=None) -> bool:
    """Whether a build can be written into the cache `root` (default `cache_root()`): the folder, or the nearest one
    above it that exists (a build makes the rest), is writable here. False for a read-only cache (a read-only mount, a
    cache baked into an image for other users), whose verified build is used as it is."""
    folder = Path(root or cache_root()).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK | os.X_OK)


def status() -> dict:
    """What `python -m dat_hf.kernels status` prints: `built` is the library when it passes every check (its record
    in build.json and a load in a child process), `check` what the checks found, `writable` whether a build could be
    written there (a read-only cache's verified build is used as it is; a missing or damaged one cannot be built
    there). Writes nothing."""
    root, name = cache_root(), build_name()
    library, writable = built_library(root, name), cache_writable(root)
    then = ("the next use or `python -m dat_hf.kernels build` moves it aside and rebuilds it" if writable else
            "the cache is read-only: build the kernels where it is writable (`python -m dat_hf.kernels build`) or set "
            "DAT_HF_KERNEL_CACHE to a writable folder")
    check = "not built" if writable else f"not built; {then}"
    if library is not None:
        verified, how = verify(library, deep=True, record=False)
        check = f"verified: {how}" if verified else f"corrupt: {how}; {then}"
        library = library if verified else None
    return {"enabled": cpu_kernel_enabled(), "cache": str(root), "writable": writable, "build": name,
            "built": str(library) if library else None, "check": check, "building_now": building_now(root, name),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "compiler": shutil.which(compiler()),
            "timeout_s": os.environ.get("DAT_HF_KERNEL_BUILD_TIMEOUT") or DEFAULT_TIMEOUT}


__all__ = ["HEADERS", "KERNEL_CHECK", "LIBRARY_CHECK", "OPS", "SOURCES", "KernelBuildError", "build_extension", "build_name",
           "built_library", "building_now", "cache_root", "cache_writable", "child_check", "cpu_kernel_enabled",
           "ensure_built", "status", "verify"]
