"""2-process data-parallel training on CPU: `torchrun --nproc_per_node 2` (gloo) running scripts/train_causal_lm.py
with `--use_cpu` (needed for real DDP on CPU: without it the two processes train independently)."""

import json
import sys
import time

import psutil
import pytest
from lm_helpers import REPO_ROOT, TREE_VARIABLE, run_group, subprocess_env, tagged_processes, train_args


@pytest.mark.integration
def test_torchrun_two_process_ddp(tmp_path):
    out = tmp_path / "ddp"
    # the tokenizer is trained by rank 0 and read back by rank 1; checkpoints at steps 6 and 12
    args = train_args(out, "--save_steps", "6", max_steps=12, lr=1e-2, batch_size=4, pretrained_tokenizer=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / "tests" / "workers" / "ddp_train.py"), *args]
    start = time.perf_counter()
    proc = run_group(cmd, timeout=180, cwd=REPO_ROOT, env=subprocess_env())
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"2-process DDP (torchrun, gloo, 12 steps): {wall:.1f} s wall")

    for r, rec in enumerate(ranks):
        assert rec["rank"] == r and rec["world_size"] == 2 and rec["dist_world_size"] == 2
        assert rec["dist_initialized"] and rec["backend"] == "gloo" and rec["parallel_mode"].endswith("DISTRIBUTED")
        assert rec["wrapped"] == "DistributedDataParallel"
        # each rank sees half of the training blocks (DistributedSampler)
        assert rec["batches_per_rank"] == -(-rec["train_blocks"] // (2 * 4))
    # gradients were all-reduced: bit-identical parameters on both ranks
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["eval_loss"] == pytest.approx(ranks[1]["eval_loss"])
    losses = dict(ranks[0]["losses"])
    assert len(losses) == 12 and losses[12] < losses[1] - 0.3  # the loss falls
    assert ranks[0]["vocab"] == ranks[1]["vocab"] == 320
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()  # rank 0 saved
    assert (out / "checkpoint-6" / "trainer_state.json").is_file() and (out / "checkpoint-12").is_dir()
    assert {p.name for p in (out / "checkpoint-12").glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert not (out / ".staging").exists()


STUCK_LAUNCHER = """
import subprocess, sys, time
# a worker as torchrun starts one: in a session of its own, writing to the launcher's pipes, stuck
subprocess.Popen([sys.executable, "-c", "import time; print('worker', flush=True); time.sleep(600)"],
                 start_new_session=True)
time.sleep(600)
"""


@pytest.mark.integration
def test_a_timed_out_launch_kills_its_workers_in_their_own_sessions():
    """`run_group`, which every torchrun test runs through: past its timeout it kills the launcher and its workers
    (torchrun starts each in a session of its own), so a stuck worker cannot hold the pipes open and the test ends."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 5 s(.|\n)*killed:\n\d+ \(\w+\): .*python -c(.|\n)*"
                                             r"\d+ \(\w+\): .*print\('worker'"):
        run_group([sys.executable, "-c", STUCK_LAUNCHER], timeout=5, env=subprocess_env())
    assert time.monotonic() - start < 60

    def worker_left(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE and "print('worker'" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    time.sleep(0.5)  # (SIGKILL is delivered at once; the process may take a moment to be gone)
    assert not [p for p in psutil.process_iter() if worker_left(p)]
    assert TREE_VARIABLE not in subprocess_env() and not tagged_processes("no such tag")  # (each launch its own tag)
