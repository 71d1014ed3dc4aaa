"""The differential fuzzer's fresh seed is shown by `pytest -q` (as `scripts/test.sh` runs the suite, on two xdist
workers): the report header that names it is hidden by -q, so `conftest.py` repeats it at the end of any run in which
a test drew from it, and the workers draw from the controller's seed (one seed per run, the one printed)."""

import os
import subprocess
import sys
import types

import conftest
import pytest
from lm_helpers import REPO_ROOT, subprocess_env

LINE = "fuzz seed: 3 (replay: pytest tests/test_fuzz_attention.py --fuzz-seed 3)"


def test_the_summary_repeats_the_seed_a_test_drew_from():
    lines = []
    reporter = types.SimpleNamespace(write_line=lines.append)
    conftest.pytest_terminal_summary(reporter, types.SimpleNamespace(fuzz_seed=3, fuzz_seed_used=False))
    assert lines == []  # no test drew from it: no line
    conftest.pytest_terminal_summary(reporter, types.SimpleNamespace(fuzz_seed=3, fuzz_seed_used=True))
    assert lines == [LINE]


def test_workers_draw_from_the_controllers_seed_and_report_its_use():
    shared = os.environ[conftest.SHARED_DIR]  # (this run's, which the worker below then takes as well)
    controller = types.SimpleNamespace(fuzz_seed=3, fuzz_seed_used=False, shared_dir=shared)
    node = types.SimpleNamespace(config=controller, workerinput={})
    conftest.pytest_configure_node(node)
    worker = types.SimpleNamespace(workerinput=node.workerinput, getoption=lambda name, default=None: None)
    conftest.pytest_configure(worker)
    assert worker.fuzz_seed == 3 and worker.fuzz_seed_used is False and os.environ[conftest.SHARED_DIR] == shared

    worker.fuzz_seed_used, worker.workeroutput = True, {}  # a test of this worker took the `fuzz_seed` fixture
    conftest.pytest_sessionfinish(types.SimpleNamespace(config=worker))
    conftest.pytest_testnodedown(types.SimpleNamespace(config=controller, workeroutput=worker.workeroutput), None)
    assert controller.fuzz_seed_used is True


@pytest.mark.integration
@pytest.mark.parametrize("workers", ["0", "2"])
def test_quiet_run_prints_the_fuzz_seed(workers):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers,
           "tests/test_fuzz_attention.py", "-k", "fresh_seed", "--fuzz-seed", "3"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines().count(LINE) == 1, proc.stdout
