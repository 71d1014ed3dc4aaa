"""Shared test setup: offline Hub, few threads (tiny models train much faster on 2 cores), tiny configs; the fuzzer's
seed, one per run however many workers (pytest-xdist) share it; the guard that keeps tests which start processes under
the `integration` marker; `shared_once`, for what the workers of a run build once between them.

Markers (setup.cfg): `slow` (quality runs, on demand), `integration` (tests that start processes: torchrun, servers,
whole scripts, fresh interpreters, kernel kills and rebuilds, wheel installs, compiler toolchains for minutes; CI runs
them once, `bash scripts/test.sh -m integration` runs them for anyone). The default suite runs neither.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "HF_MODULES_CACHE" not in os.environ:
    # remote code loaded by the tests is copied here, one folder per process (the suite's two workers would otherwise
    # copy the same module files at once); set before Transformers is imported, which reads it then
    import atexit
    import shutil
    import tempfile

    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="dat_hf_test_modules_")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import dat_hf  # noqa: E402,F401  (registers the Auto classes)
from dat_hf import DATConfig  # noqa: E402


def set_kernels_aside(monkeypatch, names=None):
    """No compiled kernel for the replaceable functions `names` (default: every one) in this test: their tables of the
    one registry (`kernel_hooks.BACKENDS`) emptied, restored afterwards."""
    from dat_hf import kernel_hooks

    for kind, table in kernel_hooks.BACKENDS.kinds.items():
        if kind not in kernel_hooks.HEAD_TYPES and (names is None or kind in names):
            for name in list(table):
                monkeypatch.delitem(table, name)


PYTORCH_RELATIONAL_BACKENDS = ("eager", "sdpa", "flex_attention")  # (the model files' own: what remote code runs)


def set_fast_paths_aside(monkeypatch):
    """Everything `import dat_hf` installs into the model files' hook points set aside in this test, as remote code
    runs without dat_hf: every replaceable's kernels (`set_kernels_aside`) and the compiled relational backends (all
    of `RELATIONAL_ATTENTION_FUNCTIONS` but the PyTorch ones), restored afterwards."""
    from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS

    set_kernels_aside(monkeypatch)
    for name in [name for name in RELATIONAL_ATTENTION_FUNCTIONS if name not in PYTORCH_RELATIONAL_BACKENDS]:
        monkeypatch.delitem(RELATIONAL_ATTENTION_FUNCTIONS, name)


def use_transformers_cache_layers(monkeypatch):
    """The caches `prepare_cache` fills keep Transformers' own behaviour in this test: `DynamicLayer`s, and sliding
    windows rolled oldest first (`DATStaticSlidingWindowLayer`), instead of DAT's in-place and ring layers."""
    from transformers.cache_utils import DynamicLayer

    from dat_hf import cache_dat

    monkeypatch.setattr(cache_dat, "DYNAMIC_LAYER", DynamicLayer)
    monkeypatch.setattr(cache_dat, "STATIC_SLIDING_LAYER", cache_dat.DATStaticSlidingWindowLayer)


def tiny_config(**overrides) -> DATConfig:
    """A tiny DAT language model config (d=32, 2 layers, 2+2 heads) for fast tests."""
    kwargs = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
        intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64,
        max_relative_position=8,
    )
    kwargs.update(overrides)
    return DATConfig(**kwargs)


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture(autouse=True)
def _transformers_verbosity():
    """Each test leaves Transformers' verbosity as it found it: scripts run in this process (lm_comparison.py,
    relational_games.py and train_causal_lm.py set it for their process, as does the server) would otherwise silence
    the warnings a later test of the same worker captures, a later test that differs from run to run on two workers."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    yield
    transformers_logging.set_verbosity(level)


def enable_checkpointing(model):
    """Turn on activation checkpointing: `activation_checkpointing_enable`, or on Transformers 5.17 (which has not
    that name) `gradient_checkpointing_enable`, a deprecated alias of it in later versions."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def set_torch_config(request, config_module, name: str, value):
    """Set a knob of one of torch's private config modules (`torch._dynamo.config`, `torch._inductor.config`) for one
    test, with the module's own `patch` (monkeypatch's undo deletes a config module's attribute, and every later use
    of the knob fails), where the installed torch has it: such knobs work around a torch release's bugs and may be
    gone in later releases, where the test then runs without the workaround instead of erroring."""
    if hasattr(config_module, name):
        patch = config_module.patch(**{name: value})
        patch.__enter__()
        request.addfinalizer(lambda: patch.__exit__(None, None, None))


# ---- the differential fuzzer (tests/test_fuzz_attention.py) -------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--fuzz-seed", type=int, default=None,
                     help="replay one case of the differential fuzzer (the seed a failure printed); default: a fresh "
                          "seed per run, printed in the header and at the end")
    parser.addoption("--fuzz-cases", type=int, default=2000,
                     help="random cases of the slow fuzz test (`-m slow`)")
    parser.addoption("--ci-leg", choices=["floor", "newest", "integration"], default=None,
                     help="run what tests/ci_legs.txt gives this CI leg (.ci/run): `floor`, `newest` (each module's "
                          "default tests where it lists the leg, its integration tests where it lists "
                          "`<leg>-integration`), `integration` (the integration tests of the modules that list it)")


def pytest_configure(config):
    import random

    seed = config.getoption("--fuzz-seed", default=None)
    workerinput = getattr(config, "workerinput", None)  # (an xdist worker: the controller drew the run's seed)
    if workerinput is not None and "fuzz_seed" in workerinput:
        seed = workerinput["fuzz_seed"]
    config.fuzz_seed = seed if seed is not None else random.SystemRandom().randrange(10**6, 2**31)
    config.fuzz_seed_used = False
    # the folder of what the run builds once for all its workers (`shared_once`): the controller's
    if workerinput is not None and "shared_dir" in workerinput:
        os.environ[SHARED_DIR] = workerinput["shared_dir"]
    else:
        import shutil
        import tempfile

        config.shared_dir = os.environ[SHARED_DIR] = tempfile.mkdtemp(prefix="dat_hf_tests_")
        config.add_cleanup(lambda: shutil.rmtree(config.shared_dir, ignore_errors=True))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist, in the controller) every worker draws from the controller's seed (one seed per run, as printed) and
    builds what it shares into the controller's folder."""
    node.workerinput["fuzz_seed"] = node.config.fuzz_seed
    node.workerinput["shared_dir"] = node.config.shared_dir


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(xdist, in the controller) a worker's test drew from the seed: the controller's summary prints it."""
    if getattr(node, "workeroutput", {}).get("fuzz_seed_used"):
        node.config.fuzz_seed_used = True


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fuzz_seed_used"] = session.config.fuzz_seed_used


def fuzz_seed_line(config) -> str:
    return f"fuzz seed: {config.fuzz_seed} (replay: pytest tests/test_fuzz_attention.py --fuzz-seed {config.fuzz_seed})"


def pytest_report_header(config):  # shown unless -q
    return fuzz_seed_line(config)


def pytest_terminal_summary(terminalreporter, config):
    """The seed again at the end, where -q (scripts/test.sh) still shows it, when a test drew from it."""
    if config.fuzz_seed_used:
        terminalreporter.write_line(fuzz_seed_line(config))


@pytest.fixture
def fuzz_seed(request):
    request.config.fuzz_seed_used = True
    return request.config.fuzz_seed



# ---- CI's legs (tests/ci_legs.txt) -----------------------------------------------------------------------------------
CI_LEGS_FILE = Path(__file__).with_name("ci_legs.txt")


def ci_legs() -> dict[str, list[str]]:
    """{test module's file name: the legs tests/ci_legs.txt lists for it}."""
    rows = {}
    for line in CI_LEGS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, *legs = line.split()
            assert module not in rows, f"{module} is listed twice in {CI_LEGS_FILE.name}"
            rows[module] = legs
    return rows


def in_ci_leg(item, leg: str, legs: dict) -> bool:
    """Whether `item` runs in the CI leg `leg` (`--ci-leg`): see tests/ci_legs.txt."""
    listed = legs.get(item.path.name, [])
    integration = item.get_closest_marker("integration") is not None
    if leg == "integration":
        return integration and "integration" in listed
    return f"{leg}-integration" in listed if integration else leg in listed


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """With `--ci-leg`, deselect what that leg of CI does not run; `slow` tests get an hour's timeout. Then (an xdist
    worker, `--dist loadgroup`) the `xdist_group` of each item, as the `@group` suffix of its node id by which the
    controller groups them, where pytest-xdist's own suffix did not take: on pytest 9.2, whose node ids are
    structured, xdist 3.8 still writes the former `_nodeid` field and the groups are silently lost (pytest-xdist issue
    1386); once xdist sets it, the id already ends with it and nothing is done here."""
    leg = config.getoption("--ci-leg")
    if leg is not None:
        legs = ci_legs()
        selected = {item: in_ci_leg(item, leg, legs) for item in items}
        config.hook.pytest_deselected(items=[item for item, keep in selected.items() if not keep])
        items[:] = [item for item, keep in selected.items() if keep]
    for item in items:  # (a quality run trains for minutes: an hour, in place of setup.cfg's timeout)
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(3600))
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                  for mark in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(groups))
        if groups and not item.nodeid.endswith(suffix):
            from _pytest.nodes import coerce_node_id

            item._id = coerce_node_id(item.nodeid + suffix)


# a test's `where` parameter: its check in this process (the default suite) and in a fresh interpreter (integration)
WHERE = ["in-process", pytest.param("fresh-interpreter", marks=pytest.mark.integration)]


# ---- the integration guard: a test that starts a process is marked `integration` -------------------------------------
# Every `subprocess.Popen` is seen. One that test code (under tests/: the first caller outside the standard library)
# starts with an interpreter or a launcher fails that test unless it is marked `integration` (or `slow`): such tests
# cost seconds each (an interpreter that imports dat_hf takes ~6 s) and belong to CI's integration run, with an
# in-process test of the same contract in the default suite. Processes that library or script code starts (the kernel
# build's compiler and its check, Inductor's compile workers, the linter) are not counted.
REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_CODE = str(REPO_ROOT / "tests") + os.sep
LAUNCHERS = {"bash", "sh", "torchrun", "accelerate", "deepspeed", "dat-hf-serve"}
_started = pytest.StashKey[list]()
_running = []  # the test item whose setup, call or teardown runs now
_popen_init = subprocess.Popen.__init__


def _program(args, shell) -> str | None:
    """The interpreter or launcher `args` starts, else None."""
    argv = [os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else str(a)
            for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else list(args))]
    words = argv[0].split() if shell and argv else argv  # (a wrapper such as `setpriv ... python` counts too)
    if any(word == sys.executable or os.path.basename(word) in LAUNCHERS or os.path.basename(word).startswith("python")
           for word in words[:4]):
        return " ".join(argv[:3])
    return None


def _started_by_test_code() -> bool:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == subprocess.__file__
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(TEST_CODE)


def _watched_popen_init(self, *args, **kwargs):
    if _running:
        program = _program(args[0] if args else kwargs.get("args"), kwargs.get("shell", False))
        if program is not None and _started_by_test_code():
            _running[-1].stash.setdefault(_started, []).append(program)
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _watched_popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(_started, [])
    unmarked = item.get_closest_marker("integration") is None and item.get_closest_marker("slow") is None
    if call.when == "teardown" and started and unmarked and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {len(started)} process(es) ({started[0]!r}"
                           f"{', ...' if len(started) > 1 else ''}) without the `integration` marker: mark it "
                           "`@pytest.mark.integration` (CI runs those once; `bash scripts/test.sh -m integration`) "
                           "and keep an in-process test of its contract in the default suite (tests/conftest.py)")


# ---- built once per run, whatever the number of workers --------------------------------------------------------------
SHARED_DIR = "DAT_HF_TEST_SHARED"  # (environment variable: the run's folder, made by the controller, removed after)


def shared_once(name: str, build) -> Path:
    """The folder `build(folder)` filled, built once per test run: by the first worker to ask, under a file lock,
    while the others wait for it (pytest-xdist gives each worker its own session fixtures). Without xdist, once."""
    import shutil

    import filelock

    folder = Path(os.environ[SHARED_DIR]) / name
    with filelock.FileLock(f"{folder}.lock"):
        if not (folder / ".complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # (a build that failed half-way)
            folder.mkdir()
            build(folder)
            (folder / ".complete").touch()
    return folder


@pytest.fixture(scope="session")
def untrained_lm_folder() -> Path:
    """A tiny untrained DAT language model and the run's tokenizer, saved once per run
    (`lm_helpers.save_untrained_lm`); read-only: copy it to change it."""
    from lm_helpers import save_untrained_lm

    return shared_once("untrained_lm", save_untrained_lm)
