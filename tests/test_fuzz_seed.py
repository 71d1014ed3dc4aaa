"""The differential fuzzer's fresh seed is shown by `pytest -q` (as `scripts/test.sh` runs the suite): the report
header that names it is hidden by -q, so `conftest.py` repeats it at the end of any run in which a test drew from it."""

import subprocess
import sys

from lm_helpers import REPO_ROOT, subprocess_env


def test_quiet_run_prints_the_fuzz_seed():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_attention.py",
           "-k", "fresh_seed", "--fuzz-seed", "3"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    line = "fuzz seed: 3 (replay: pytest tests/test_fuzz_attention.py --fuzz-seed 3)"
    assert proc.stdout.splitlines().count(line) == 1, proc.stdout
