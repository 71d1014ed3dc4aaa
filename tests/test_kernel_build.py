"""The compiled kernels' build (`dat_hf/kernels/cpu_build.py`, `python -m dat_hf.kernels`) as a dependency that
never hangs, never kills the interpreter and always says what it does:

- a build killed with SIGKILL in the middle leaves nothing a later process waits on: the next process builds
  within a bound (and removes the dead build's folder), and no compiler of the dead build keeps running; a live
  builder that holds the lock too long ends the wait after `DAT_HF_KERNEL_BUILD_TIMEOUT` with an error naming it;
- no compiler on PATH, a read-only cache: `build_extension` returns False after exactly one warning saying why;
- a cached library that is truncated, zero-filled or another library is never loaded: it is moved aside and rebuilt
  (or, without a compiler, the PyTorch backends run) after one warning naming it; `status` and `build` say so;
- the first build logs one line (what, where, how to build ahead, how to skip it); the cache key holds the CPU's
  instruction set;
- `python -m dat_hf.kernels build`, then a fresh process loads the kernels with no build line and no wait; `status`.
The generic build machinery is exercised on a one-function C++ file (fast); the damaged kernel library on a copy of
the machine's built kernels (built once); the slow test kills a real build, and one rebuilds a damaged library.
"""

import contextlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import unittest.mock
from pathlib import Path

import pytest
from conftest import WHERE

from dat_hf.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[1]
HAS_CXX = shutil.which("c++") is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler on this machine")

# A child that imports cpu_build.py as a plain file (torch only: ~1 s instead of dat_hf's ~5 s) and builds a
# one-function library into the cache named by argv.
PROBE_CHILD = textwrap.dedent("""
    import ctypes, importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[1])
    cpu_build = importlib.util.module_from_spec(spec); spec.loader.exec_module(cpu_build)
    start = time.monotonic()
    try:
        library, built = cpu_build.ensure_built(name="probe", sources=[sys.argv[3]], flags=["-O0", "-fPIC"],
                                                root=sys.argv[2], check=cpu_build.LIBRARY_CHECK)
    except cpu_build.KernelBuildError as error:
        print(f"FAILED after {time.monotonic() - start:.1f} s: {error}", flush=True)
        sys.exit(3)
    print(f"RESULT {ctypes.CDLL(str(library)).dat_hf_probe()} built={built} {time.monotonic() - start:.1f} s",
          flush=True)
""")


@pytest.fixture
def probe(tmp_path):
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int dat_hf_probe() { return 42; }\n')
    hung = tmp_path / "bin" / "hung-c++"  # a compiler that never finishes
    hung.parent.mkdir()
    hung.write_text("#!/bin/sh\nexec sleep 120\n")
    hung.chmod(0o755)
    return {"source": str(source), "cache": str(tmp_path / "cache"), "hung": str(hung)}


def start_probe(probe, **env):
    return subprocess.Popen([sys.executable, "-c", PROBE_CHILD, cpu_build.__file__, probe["cache"], probe["source"]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def wait_until_building(process, cache, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        holder = cpu_build.building_now(cache, "probe")
        if holder is not None and list(Path(cache).glob(".probe.build-*")):
            return holder
        assert process.poll() is None, f"the builder exited early: {process.communicate()}"
        time.sleep(0.05)
    raise AssertionError("the build never started")


@pytest.mark.integration
@needs_cxx
def test_killed_build_then_a_new_process_builds_within_a_bound(probe):
    first = start_probe(probe, CXX=probe["hung"])
    holder = wait_until_building(first, probe["cache"])
    assert f"process {first.pid}" in holder
    os.kill(first.pid, signal.SIGKILL)  # mid-build, as kill -9 (its compiler dies with it)
    first.wait(10)
    assert list(Path(probe["cache"]).glob(".probe.build-*")), "the killed build should have left its private folder"
    assert cpu_build.building_now(probe["cache"], "probe") is None  # the OS released the dead builder's lock

    start = time.monotonic()
    second = start_probe(probe)
    out, err = second.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert second.returncode == 0, (out, err)
    assert "RESULT 42 built=True" in out
    assert elapsed < 60, f"the build after a killed one took {elapsed:.0f} s"
    assert err.count("dat_hf: building") == 1 and "python -m dat_hf.kernels build" in err
    assert "DAT_HF_CPU_KERNEL=0" in err
    assert not list(Path(probe["cache"]).glob(".probe.build-*"))  # the dead build's leftovers are gone

    third = start_probe(probe)  # built: loads with no build and no line
    out, err = third.communicate(timeout=60)
    assert "RESULT 42 built=False" in out and "dat_hf:" not in err


@pytest.mark.integration
@needs_cxx
def test_a_live_builder_that_takes_too_long_ends_the_wait_with_its_name(probe):
    first = start_probe(probe, CXX=probe["hung"])
    try:
        wait_until_building(first, probe["cache"])
        lines = []
        start = time.monotonic()
        with pytest.raises(cpu_build.KernelBuildError, match=rf"process {first.pid} .*held the build lock"):
            cpu_build.ensure_built(name="probe", sources=[probe["source"]], flags=["-O0", "-fPIC"],
                                   root=probe["cache"], timeout=2, announce=lines.append)
        assert time.monotonic() - start < 10
        assert len(lines) == 1 and f"waiting for process {first.pid}" in lines[0]
    finally:
        first.kill()
        first.wait()


@needs_cxx
def test_the_build_itself_is_bounded(probe):
    lines = []
    start = time.monotonic()
    os.environ["CXX"], saved = probe["hung"], os.environ.get("CXX")
    try:
        with pytest.raises(cpu_build.KernelBuildError, match="did not finish within"):
            cpu_build.ensure_built(name="probe", sources=[probe["source"]], flags=["-O0"], root=probe["cache"],
                                   timeout=1.5, announce=lines.append)
    finally:
        os.environ.pop("CXX") if saved is None else os.environ.__setitem__("CXX", saved)
    assert time.monotonic() - start < 10
    assert len(lines) == 1 and lines[0].startswith("dat_hf: building")
    assert cpu_build.built_library(probe["cache"], "probe") is None
    assert not list(Path(probe["cache"]).glob(".probe.build-*"))  # a failed build cleans up after itself


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build, "_STATE", {"loaded": False, "tried": False, "error": None})
    monkeypatch.setenv("DAT_HF_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DAT_HF_CPU_KERNEL", raising=False)
    return tmp_path / "cache"


def test_no_compiler_on_path_falls_back_with_one_warning(fresh_state, monkeypatch, tmp_path, caplog):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert cpu_build.build_extension() is False
        assert cpu_build.build_extension() is False  # tried once: no second warning
    messages = [r.getMessage() for r in caplog.records if r.name == cpu_build.__name__]
    assert len(messages) == 1, messages
    assert "no C++ compiler found" in messages[0] and "PyTorch backends" in messages[0]
    assert "DAT_HF_CPU_KERNEL=0" in messages[0]
    assert not fresh_state.exists()  # nothing was written


def read_only_runner():
    """argv prefix that runs a command unable to write a 0o555 folder (root ignores modes unless it drops
    CAP_DAC_OVERRIDE), or None."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv"):
        return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    return None


@pytest.mark.integration
@pytest.mark.skipif(read_only_runner() is None, reason="running as root without setpriv: no read-only folder")
def test_read_only_cache_falls_back_with_one_warning(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    child = textwrap.dedent("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[1])
        cpu_build = importlib.util.module_from_spec(spec); spec.loader.exec_module(cpu_build)
        print("LOADED", cpu_build.build_extension(), cpu_build.build_extension())
    """)
    env = {**os.environ, "DAT_HF_KERNEL_CACHE": str(cache / "sub"), "DAT_HF_CPU_KERNEL": "1"}
    result = subprocess.run([*read_only_runner(), sys.executable, "-c", child, cpu_build.__file__],
                            capture_output=True, text=True, env=env, timeout=120)
    cache.chmod(0o755)
    assert "LOADED False False" in result.stdout, result
    lines = [line for line in result.stderr.splitlines() if "dat_hf" in line]
    assert len(lines) == 1, result.stderr
    assert "is not writable" in lines[0] and str(cache / "sub") in lines[0] and "DAT_HF_KERNEL_CACHE" in lines[0]
    assert not (cache / "sub").exists()


def test_cache_key_holds_the_instruction_set(tmp_path, monkeypatch):
    base = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
    (tmp_path / "a").write_text(base)
    (tmp_path / "b").write_text(base.replace("fma", "fma avx512f avx512bw"))
    (tmp_path / "c").write_text("processor\t: 0\nflags\t\t: avx2 fma fpu avx sse sse2\n")  # same set, reordered
    a, b, c = (cpu_build.cpu_instruction_set(tmp_path / n) for n in "abc")
    assert a != b and a == c
    monkeypatch.setattr(cpu_build, "cpu_instruction_set", lambda: b)
    assert cpu_build.build_name().endswith("-" + b)
    assert cpu_build.build_name().startswith("dat_hf_cpu_")


@pytest.mark.integration
@needs_cxx
def test_build_ahead_then_a_fresh_process_neither_builds_nor_waits():
    env = {**os.environ, "DAT_HF_CPU_KERNEL": "1"}
    built = subprocess.run([sys.executable, "-m", "dat_hf.kernels", "build"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=600)
    assert built.returncode == 0, built.stderr
    assert "built in" in built.stdout and cpu_build.build_name() in built.stdout
    child = textwrap.dedent("""
        import time
        import torch
        import dat_hf
        from dat_hf.kernels.cpu import load_cpu_kernel
        start = time.monotonic()
        print("READY", load_cpu_kernel(), f"{time.monotonic() - start:.2f}")
        x = torch.randn(3, 5)
        print("SWIGLU", torch.allclose(torch.ops.dat_hf.swiglu_forward(x, x), torch.nn.functional.silu(x) * x))
    """)
    fresh = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=300)
    ready = [line.split() for line in fresh.stdout.splitlines() if line.startswith("READY")]
    assert ready and ready[0][1] == "True", fresh.stderr
    assert float(ready[0][2]) < 5, f"loading a built kernel took {ready[0][2]} s"
    assert "SWIGLU True" in fresh.stdout
    assert "dat_hf: building" not in fresh.stderr and "dat_hf: waiting" not in fresh.stderr
    status = subprocess.run([sys.executable, "-m", "dat_hf.kernels", "status"], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300)
    fields = dict(line.split(None, 1) for line in status.stdout.splitlines() if line.strip())
    assert fields["built"].endswith(".so") and fields["building_now"] == "None", status.stdout
    assert fields["build"] == cpu_build.build_name()


@pytest.mark.parametrize("where", WHERE)
def test_status_of_an_empty_cache(tmp_path, where):
    status, fields = run_kernels_cli("status", tmp_path, where)
    assert status.returncode == 0, status.stderr
    assert fields["cache"] == str(tmp_path) and fields["built"] == "None" and fields["writable"] == "True"
    assert fields["check"] == "not built"
    assert list(tmp_path.iterdir()) == []  # status writes nothing


@pytest.mark.slow
@needs_cxx
def test_killed_real_build_then_build_ahead_then_no_wait(tmp_path):
    """The real kernels: a first forward's build killed with SIGKILL, `python -m dat_hf.kernels build` finishes
    within 300 s on 2 loaded cores, and a fresh process then loads them without building."""
    env = {**os.environ, "DAT_HF_KERNEL_CACHE": str(tmp_path), "DAT_HF_CPU_KERNEL": "1"}
    first = subprocess.Popen([sys.executable, "-c", "import dat_hf; from dat_hf.kernels.cpu import load_cpu_kernel; "
                              "load_cpu_kernel()"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".dat_hf_cpu_*.build-*/build.log")):
        assert first.poll() is None and time.monotonic() < deadline, "the first process never started its build"
        time.sleep(0.1)
    time.sleep(2)  # compilers running
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    start = time.monotonic()
    built = subprocess.run([sys.executable, "-m", "dat_hf.kernels", "build"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=400)
    elapsed = time.monotonic() - start
    assert built.returncode == 0 and "built in" in built.stdout, built.stderr
    assert elapsed < 300, elapsed
    print(f"build after a killed build: {elapsed:.1f} s")
    fresh = subprocess.run([sys.executable, "-c", "import dat_hf; from dat_hf.kernels.cpu import load_cpu_kernel; "
                            "print('READY', load_cpu_kernel())"], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert "READY True" in fresh.stdout and "dat_hf: building" not in fresh.stderr, fresh.stderr


# ---- damaged cache entries ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory):
    """A valid shared library that is not the one a build produced."""
    folder = tmp_path_factory.mktemp("foreign")
    (folder / "other.cpp").write_text('extern "C" int other_library(int x) { return 2 * x + 1; }\n')
    subprocess.run(["c++", "-shared", "-fPIC", "-O1", str(folder / "other.cpp"), "-o", str(folder / "other.so")],
                   check=True, timeout=120)
    return folder / "other.so"


def damage(library: Path, kind: str, foreign: Path):
    """Cut `library` to half its size (a full disk, a killed copy), zero it, or replace it with another library; and
    for `*-unrecorded`, drop its record from build.json (a build by an older dat_hf)."""
    size = library.stat().st_size
    if kind.startswith("truncated"):
        os.truncate(library, size // 2)
    elif kind.startswith("zero-filled"):
        library.write_bytes(bytes(size))
    else:
        shutil.copyfile(foreign, library)
    if kind.endswith("-unrecorded"):
        info = json.loads((library.parent / "build.json").read_text())
        del info["library"]
        (library.parent / "build.json").write_text(json.dumps(info))


# what each damage's warning says failed
FAILED_CHECK = {"truncated": "its size is", "zero-filled": "its sha256 differs", "foreign": "its (size is|sha256)",
                "truncated-unrecorded": r"build\.json has no record of it, and loading it in a child process "
                                        "(killed the child with SIGBUS|failed)",
                "foreign-unrecorded": r"build\.json has no record of it, and loading it in a child process failed: "
                                      "it has no operator dat_hf::"}


@needs_cxx
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", ["truncated", "zero-filled", "foreign", "truncated-unrecorded"])
def test_a_damaged_library_is_moved_aside_and_rebuilt(probe, foreign_library, kind, where):
    """The rebuild `ensure_built` does on a damaged library: here (it never loads the library itself), and in a child
    that then loads and calls the rebuilt library."""
    build = dict(name="probe", sources=[probe["source"]], flags=["-O0", "-fPIC"], root=probe["cache"],
                 check=cpu_build.LIBRARY_CHECK)
    lines = []
    library, built = cpu_build.ensure_built(**build, announce=lines.append)  # here: nothing is loaded in this process
    assert built and len(lines) == 1
    damage(library, kind, foreign_library)

    if where == "in-process":
        lines = []
        assert cpu_build.ensure_built(**build, announce=lines.append) == (library, True)
    else:
        rebuild = start_probe(probe)  # a child, which loads the library: a SIGBUS would show here, not kill pytest
        out, err = rebuild.communicate(timeout=120)
        assert rebuild.returncode == 0 and "RESULT 42 built=True" in out, (out, err)
        lines = [line for line in err.splitlines() if "dat_hf" in line]
    assert len(lines) == 1, lines
    assert re.search(rf"^dat_hf: {re.escape(str(library))} fails its check \({FAILED_CHECK[kind]}", lines[0]), lines
    aside = list(Path(probe["cache"]).glob(".probe.corrupt-*"))
    assert len(aside) == 1 and f"moved it aside to {aside[0]}; rebuilding" in lines[0]

    lines = []  # the rebuilt library passes the check of its record: no build, no line
    assert cpu_build.ensure_built(**build, announce=lines.append) == (library, False) and lines == []


@pytest.fixture(scope="module")
def real_build():
    """The machine's built kernels (the default cache, as `python -m dat_hf.kernels build` makes it; built once)."""
    if not HAS_CXX:
        pytest.skip("no C++ compiler on this machine")
    library, _ = cpu_build.ensure_built()
    return library.parent


@pytest.fixture
def copied_build(real_build, tmp_path):
    """A cache holding a copy of the built kernels; its library."""
    shutil.copytree(real_build, tmp_path / "cache" / real_build.name)
    return tmp_path / "cache" / real_build.name / f"{real_build.name}.so"


# A first forward in a child process: the CPU float32 forward with whatever backend is chosen, against eager.
FORWARD_CHILD = textwrap.dedent("""
    import torch
    from dat_hf import DATConfig, DATForCausalLM
    torch.manual_seed(0)
    model = DATForCausalLM(DATConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_sensory_heads=2,
                                     num_relational_heads=2, intermediate_size=64, num_symbols=8,
                                     symbolic_attention_heads=2, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        logits = model(ids).logits
        backend = model.model.layers[0].dual_attn.relational.relational_attention_backend
        model.config.relational_attn_implementation = "eager"
        reference = model(ids).logits
    print("FORWARD", backend, bool(torch.isfinite(logits).all()), (logits - reference).abs().max().item())
""")


def run_forward(cache, **env):
    result = subprocess.run([sys.executable, "-c", FORWARD_CHILD], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "DAT_HF_KERNEL_CACHE": str(cache), "DAT_HF_CPU_KERNEL": "1", **env},
                            timeout=600)
    forward = [line.split() for line in result.stdout.splitlines() if line.startswith("FORWARD")]
    assert result.returncode == 0 and forward, result
    return forward[0][1], forward[0][2] == "True" and float(forward[0][3]) < 1e-4, result.stderr


def run_kernels_cli(command, cache, where="fresh-interpreter", **env):
    """`python -m dat_hf.kernels COMMAND` with the kernel cache `cache`: in a fresh interpreter, or its `main` in this
    process (`where="in-process"`). -> (a CompletedProcess, the printed `name value` fields)."""
    env = {"DAT_HF_KERNEL_CACHE": str(cache), **env}
    if where == "in-process":
        from dat_hf.kernels.__main__ import main

        out, err = io.StringIO(), io.StringIO()
        with unittest.mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            returncode = main([command])
        result = subprocess.CompletedProcess([command], returncode, out.getvalue(), err.getvalue())
    else:
        result = subprocess.run([sys.executable, "-m", "dat_hf.kernels", command], capture_output=True, text=True,
                                cwd=ROOT, env={**os.environ, **env}, timeout=600)
    assert "Traceback" not in result.stderr and result.returncode in (0, 1), result
    fields = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    return result, fields


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["truncated", "foreign-unrecorded"])
def test_a_damaged_kernel_library_gives_a_working_forward(copied_build, foreign_library, kind):
    """Without a compiler to rebuild it (a rebuild: the probe's test above, the slow test below), the PyTorch backends
    run after one warning naming the library; it is never loaded (a truncated one would kill the process)."""
    damage(copied_build, kind, foreign_library)
    backend, matches, err = run_forward(copied_build.parents[1], CXX="/nonexistent/c++")
    assert backend != "cpu" and matches
    lines = [line for line in err.splitlines() if "dat_hf" in line]
    assert len(lines) == 1, err
    assert re.search(rf"{re.escape(str(copied_build))} fails its check \({FAILED_CHECK[kind]}", lines[0]), lines
    assert "no C++ compiler found" in lines[0] and "Using the PyTorch backends" in lines[0]


VERIFIED = "verified: size and sha256 match build.json; loaded and called in a child process"
UNRECORDED = "verified: loaded and called in a child process; build.json has no record of it"
NEXT = "; the next use or `python -m dat_hf.kernels build` moves it aside and rebuilds it"


@pytest.mark.parametrize("kind", ["built", "unrecorded", "truncated", "zero-filled", "foreign", "truncated-unrecorded",
                                  "foreign-unrecorded", "absent"])
def test_status_tells_the_state_of_the_cache(copied_build, foreign_library, kind, monkeypatch):
    monkeypatch.setenv("DAT_HF_KERNEL_CACHE", str(copied_build.parents[1]))
    if kind == "unrecorded":  # a build by an older dat_hf, intact
        info = json.loads((copied_build.parent / "build.json").read_text())
        (copied_build.parent / "build.json").write_text(json.dumps({**info, "library": None}))
    elif kind == "absent":
        shutil.rmtree(copied_build.parent)
    elif kind != "built":
        damage(copied_build, kind, foreign_library)
    before = {path: path.read_bytes() for path in copied_build.parents[1].rglob("*") if path.is_file()}
    fields = cpu_build.status()  # here: status never loads the library in its own process
    assert fields["writable"] is True
    if kind in ("built", "unrecorded"):
        assert fields["built"] == str(copied_build)
        assert fields["check"] == {"built": VERIFIED, "unrecorded": UNRECORDED}[kind]
    else:
        assert fields["built"] is None
        expected = "not built" if kind == "absent" else rf"corrupt: ({FAILED_CHECK[kind]}).*{re.escape(NEXT)}"
        assert re.fullmatch(expected, fields["check"]), fields["check"]
    assert before == {path: path.read_bytes() for path in copied_build.parents[1].rglob("*") if path.is_file()}


@pytest.fixture
def read_only(monkeypatch):
    """`read_only(folder)` takes the write bits off `folder` and everything in it (restored after the test); as root,
    whom modes do not stop, `os.access` then answers by the mode bits, as for any other user."""
    folders = []

    def make(folder: Path):
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        folders.append(folder)

    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs: access(path, mode, *args, **kwargs) and
                            not (mode & os.W_OK and not os.stat(path).st_mode & 0o222))
    yield make
    for folder in folders:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


READ_ONLY = (r"the cache is read-only: build the kernels where it is writable \(`python -m dat_hf.kernels build`\) or "
             "set DAT_HF_KERNEL_CACHE to a writable folder")


@pytest.mark.parametrize("kind", ["built", "absent", "truncated"])
def test_status_of_a_read_only_cache(copied_build, foreign_library, read_only, kind, monkeypatch):
    """A cache that cannot be written (a build baked into an image, a read-only mount): a complete build is reported
    built and verified, the cache read-only; a missing or damaged build is reported with what to do instead of
    rebuilding (no build can be written there)."""
    cache = copied_build.parents[1]
    if kind == "absent":
        shutil.rmtree(copied_build.parent)
    elif kind == "truncated":
        damage(copied_build, kind, foreign_library)
    read_only(cache)
    assert not cpu_build.cache_writable(cache) and not cpu_build.cache_writable(cache / "sub" / "folder")
    monkeypatch.setenv("DAT_HF_KERNEL_CACHE", str(cache))
    fields = cpu_build.status()
    assert fields["writable"] is False and fields["cache"] == str(cache)
    if kind == "built":
        assert fields["built"] == str(copied_build) and fields["check"] == VERIFIED
    else:
        expected = "not built" if kind == "absent" else rf"corrupt: {FAILED_CHECK[kind]} .*"
        assert fields["built"] is None and re.fullmatch(rf"{expected}; {READ_ONLY}", fields["check"]), fields["check"]
    result, printed = run_kernels_cli("status", cache, "in-process")
    assert result.returncode == 0 and printed["writable"] == "False" and printed["built"] == str(fields["built"])


@pytest.mark.integration
@pytest.mark.skipif(read_only_runner() is None, reason="running as root without setpriv: no read-only folder")
def test_status_of_a_read_only_cache_in_a_fresh_interpreter(copied_build, read_only):
    """`python -m dat_hf.kernels status` by a process that cannot write the cache (as root: without
    CAP_DAC_OVERRIDE): built and verified, the cache read-only; the kernels load from it."""
    cache = copied_build.parents[1]
    read_only(cache)
    env = {**os.environ, "DAT_HF_KERNEL_CACHE": str(cache), "DAT_HF_CPU_KERNEL": "1"}
    status = subprocess.run([*read_only_runner(), sys.executable, "-m", "dat_hf.kernels", "status"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    fields = dict(line.split(None, 1) for line in status.stdout.splitlines() if line.strip())
    assert status.returncode == 0 and fields["writable"] == "False", status
    assert fields["built"] == str(copied_build) and fields["check"] == VERIFIED, status.stdout
    load = subprocess.run([*read_only_runner(), sys.executable, "-c", "import dat_hf; from dat_hf.kernels.cpu import "
                           "load_cpu_kernel; print('READY', load_cpu_kernel())"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert "READY True" in load.stdout and "dat_hf:" not in load.stderr, load


@pytest.mark.parametrize("where", WHERE)
def test_status_and_build_commands_on_a_truncated_library(copied_build, where):
    cache = copied_build.parents[1]
    size = copied_build.stat().st_size
    os.truncate(copied_build, size // 2)
    result, fields = run_kernels_cli("status", cache, where)
    assert result.returncode == 0 and fields["built"] == "None"
    assert fields["check"] == f"corrupt: its size is {size // 2} bytes where build.json records {size}{NEXT}"

    result, _ = run_kernels_cli("build", cache, where, CXX="/nonexistent/c++")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"dat_hf: the CPU kernels could not be built: {copied_build} fails its check "
                                     f"({fields['check'][len('corrupt: '):-len(NEXT)]}), and no C++ compiler found "
                                     "(`/nonexistent/c++` is not on PATH; install g++ or clang, or set CXX)")


@pytest.mark.slow
def test_a_truncated_kernel_library_is_rebuilt_by_build_and_by_a_forward(copied_build, foreign_library):
    """The real rebuilds (minutes on 2 loaded cores): `python -m dat_hf.kernels build` on a truncated library, and a
    first forward on a foreign one, each rebuild, and the forward then runs the compiled kernel."""
    cache = copied_build.parents[1]
    damage(copied_build, "truncated", foreign_library)
    result, _ = run_kernels_cli("build", cache)
    assert result.returncode == 0 and "built in" in result.stdout and "already" not in result.stdout, result
    assert re.search(rf"^dat_hf: {re.escape(str(copied_build))} fails its check \(its size is .*moved it aside to "
                     rf".*rebuilding", result.stderr), result.stderr
    result, fields = run_kernels_cli("status", cache)
    assert fields["built"] == str(copied_build) and fields["check"].startswith("verified: size and sha256 match")

    damage(copied_build, "foreign", foreign_library)
    backend, matches, err = run_forward(cache)
    assert backend == "cpu" and matches
    lines = [line for line in err.splitlines() if "dat_hf" in line]
    assert len(lines) == 1 and f"{copied_build} fails its check" in lines[0] and "rebuilding" in lines[0], err


# ---- a killed builder's compilers ------------------------------------------------------------------------------------
def processes_working_in(folder) -> dict:
    """pid -> name of the live processes whose working folder is inside `folder` (a build's compilers run in its
    private folder; zombies have none)."""
    found = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and os.readlink(entry / "cwd").startswith(str(folder) + os.sep):
                found[int(entry.name)] = (entry / "comm").read_text().strip()
    return found


@pytest.mark.integration
@needs_cxx
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_builder_leaves_no_compiler_running(tmp_path):
    """SIGKILL to a process building the real kernels while `cc1plus` runs: within 5 s no process of its build
    (the compiler drivers, their `cc1plus`/`as`, the watchdog) is left."""
    child = textwrap.dedent("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[1])
        cpu_build = importlib.util.module_from_spec(spec); spec.loader.exec_module(cpu_build)
        cpu_build.ensure_built(root=sys.argv[2])
    """)
    cache = tmp_path / "cache"
    builder = subprocess.Popen([sys.executable, "-c", child, cpu_build.__file__, str(cache)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not {"cc1plus", "cc1", "as"} & set(processes_working_in(cache).values()):
        assert builder.poll() is None and time.monotonic() < deadline, "the build never started its compilers"
        time.sleep(0.05)
    running = processes_working_in(cache)
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()
    builder.stderr.close()
    start = time.monotonic()
    while processes_working_in(cache) and time.monotonic() - start < 5:
        time.sleep(0.05)
    assert not processes_working_in(cache), f"left running: {processes_working_in(cache)} (were {running})"
    print(f"compilers of the killed build gone after {time.monotonic() - start:.2f} s (were {running})")
