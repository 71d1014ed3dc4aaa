"""Fault tolerance: a run killed mid-training (SIGKILL, in a subprocess) and relaunched with
`--resume_from_checkpoint last` ends with the same weights and losses as an uninterrupted run with the same seed;
checkpoints are safetensors and appear atomically (a run killed while saving leaves no partial `checkpoint-N`)."""

import sys

import pytest
from lm_helpers import REPO_ROOT, import_script, losses_by_step, run_group, subprocess_env, train_args
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

from dat_hf.training import parameters_digest

KILLED = REPO_ROOT / "tests" / "workers" / "killed_train.py"
STEPS, SAVE_EVERY = 12, 4


def run_args(out, *extra):
    return train_args(out, "--save_steps", str(SAVE_EVERY), *extra, max_steps=STEPS, lr=3e-3, seed=1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    train = import_script("train_causal_lm")
    out = tmp_path_factory.mktemp("uninterrupted")
    results = train.main(run_args(out))
    return out, parameters_digest(results["trainer"].model), losses_by_step(results["log_history"])


def kill_run(out, step, while_saving=False):
    cmd = [sys.executable, str(KILLED), "--kill_at_step", str(step), *(["--kill_while_saving"] if while_saving else []),
           *run_args(out)]
    proc = run_group(cmd, timeout=120, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == -9, proc.stderr[-4000:]  # SIGKILL: no clean-up ran
    assert not (out / "model.safetensors").exists()


def resume(out):
    train = import_script("train_causal_lm")
    results = train.main(run_args(out, "--resume_from_checkpoint", "last"))
    return parameters_digest(results["trainer"].model), losses_by_step(results["log_history"])


def test_checkpoints_are_safetensors(uninterrupted):
    out, _, _ = uninterrupted
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert set(checkpoints) == {f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)}
    for name in checkpoints:
        files = {p.name for p in (out / name).iterdir()}
        assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt")) and "model" in f for f in files)
        assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
        assert load_file(out / name / "model.safetensors")  # loads without unpickling
    assert not (out / ".staging").exists()


def test_killed_mid_training_resumes_to_the_same_weights(uninterrupted, tmp_path):
    _, digest, losses = uninterrupted
    out = tmp_path / "run"
    kill_run(out, step=6)  # after checkpoint-4, before checkpoint-8
    assert get_last_checkpoint(out).endswith("checkpoint-4")
    resumed_digest, resumed_losses = resume(out)
    assert resumed_losses == losses  # steps 1-4 restored from the checkpoint, 5-12 recomputed
    assert resumed_digest == digest


def test_killed_while_saving_leaves_no_partial_checkpoint(uninterrupted, tmp_path):
    _, digest, losses = uninterrupted
    out = tmp_path / "run"
    kill_run(out, step=8, while_saving=True)
    partial = out / ".staging" / "checkpoint-8"
    assert (partial / "model.safetensors").is_file() and not (partial / "trainer_state.json").exists()
    assert not (out / "checkpoint-8").exists()  # never renamed into place
    assert get_last_checkpoint(out).endswith("checkpoint-4")
    resumed_digest, resumed_losses = resume(out)
    assert resumed_losses == losses and resumed_digest == digest
    assert (out / "checkpoint-8" / "trainer_state.json").is_file() and not (out / ".staging").exists()


def test_resume_last_without_checkpoint_starts_from_scratch(tmp_path):
    """`--resume_from_checkpoint last` in an empty folder trains from step 0 (Trainer's `True` would raise)."""
    train = import_script("train_causal_lm")
    results = train.main(run_args(tmp_path / "fresh", "--resume_from_checkpoint", "last"))
    assert results["trainer"].state.global_step == results["trainer"].args.max_steps
    assert min(h["step"] for h in results["log_history"] if "loss" in h) == 1
