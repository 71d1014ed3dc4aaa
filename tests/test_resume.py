"""Fault tolerance: a run killed mid-training (SIGKILL, in a subprocess) and relaunched with
`--resume_from_checkpoint last` ends with the same weights and losses as an uninterrupted run with the same seed;
checkpoints are safetensors and appear atomically (a run killed while saving leaves no partial `checkpoint-N`). A
resumed run names its checkpoint and step in one line, without Trainer's false missing-key warning for tied weights."""

import contextlib
import logging
import sys

import pytest
from lm_helpers import REPO_ROOT, import_script, losses_by_step, run_group, subprocess_env, train_args
from conftest import tiny_config
from safetensors.torch import load_file
from torch.nn.modules.module import _IncompatibleKeys
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dat_hf import DATForCausalLM
from dat_hf.training import AtomicCheckpointTrainer, checkpoint_problem, parameters_digest

pytestmark = pytest.mark.xdist_group("resume")  # (one worker: the module-scoped fixtures built once)

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


@contextlib.contextmanager
def transformers_warnings():
    """The messages Transformers' loggers emit meanwhile (its library logger does not propagate to the root)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("transformers").removeHandler(handler)


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


@pytest.mark.integration
def test_killed_mid_training_resumes_to_the_same_weights(uninterrupted, tmp_path, capsys):
    _, digest, losses = uninterrupted
    out = tmp_path / "run"
    kill_run(out, step=6)  # after checkpoint-4, before checkpoint-8
    assert get_last_checkpoint(out).endswith("checkpoint-4")
    capsys.readouterr()
    with transformers_warnings() as warnings:
        resumed_digest, resumed_losses = resume(out)
    assert resumed_losses == losses  # steps 1-4 restored from the checkpoint, 5-12 recomputed
    assert resumed_digest == digest
    assert f"Resuming from {out / 'checkpoint-4'} (step 4)\n" in capsys.readouterr().out
    assert not [w for w in warnings if "missing keys" in w], warnings  # lm_head.weight is tied: loaded exactly


@pytest.mark.integration
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


@pytest.mark.parametrize("tied", [True, False])
def test_only_tied_missing_keys_are_left_out_of_the_load_warning(tied, tmp_path):
    """A missing key that is the same parameter as a loaded one is no warning; any other missing key still is."""
    model = DATForCausalLM(tiny_config(tie_word_embeddings=tied))
    trainer = AtomicCheckpointTrainer(model=model, args=TrainingArguments(tmp_path, use_cpu=True, report_to="none"))
    with transformers_warnings() as warnings:
        trainer._issue_warnings_after_load(_IncompatibleKeys(["lm_head.weight", "model.norm.weight"], []))
    named = ["model.norm.weight"] if tied else ["lm_head.weight", "model.norm.weight"]
    assert warnings == [f"There were missing keys in the checkpoint model loaded: {named}."]


DAMAGED = ("marker only", "truncated safetensors", "no trainer state")  # (test_preemption.DAMAGES)


@pytest.mark.parametrize("damage", DAMAGED)
def test_last_resumes_from_the_checkpoint_before_a_damaged_newest_one(uninterrupted, tmp_path, damage, capsys,
                                                                     caplog):
    """The newest checkpoint left incomplete or damaged (as a preempted or crashed save leaves it): `last` resumes
    from the one before, names the folder it skipped and why in one line, and the run still ends with the
    uninterrupted run's weights and losses."""
    import shutil

    from test_preemption import DAMAGES

    done, digest, losses = uninterrupted
    out = tmp_path / "run"
    for step in (4, 8):
        shutil.copytree(done / f"checkpoint-{step}", out / f"checkpoint-{step}")
    apply, reason = DAMAGES[damage]
    apply(out / "checkpoint-8")
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="dat_hf.training.preemption"):
        resumed_digest, resumed_losses = resume(out)
    warnings = [r.getMessage() for r in caplog.records]
    skipped = [w for w in warnings if "Resuming skips" in w]
    assert len(skipped) == 1 and f"checkpoint-8 ({reason}" in skipped[0], warnings
    assert skipped[0].endswith("resuming from checkpoint-4."), skipped
    assert f"Resuming from {out / 'checkpoint-4'} (step 4)\n" in capsys.readouterr().out
    assert resumed_losses == losses and resumed_digest == digest
    assert checkpoint_problem(out / "checkpoint-8") is None  # saved again, whole


def test_a_signal_stops_the_run_with_a_checkpoint_never_as_finished(uninterrupted, tmp_path):
    """`--enable_jit_checkpoint --preemption_signals SIGUSR1`: a SIGUSR1 mid-training saves that step's checkpoint
    (atomically: no marker, no staging folder), records the stop in `training_run.json`, writes no final model and
    ends the command with status 128 + 10; the relaunch with `last` ends with the uninterrupted run's weights."""
    import json
    import os
    import signal
    import threading

    from transformers import TrainerCallback

    _, digest, losses = uninterrupted
    train = import_script("train_causal_lm")
    out = tmp_path / "run"
    flags = ("--enable_jit_checkpoint", "--preemption_signals", "SIGUSR1", "--resume_from_checkpoint", "last")

    class SignalAtStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 5:  # during step 6
                os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.getsignal(signal.SIGUSR1)
    status = train.cli(run_args(out, *flags), callbacks=[SignalAtStep()])
    assert status == 128 + signal.SIGUSR1 and signal.getsignal(signal.SIGUSR1) is before
    # stopped in time: no deadline left running (it would end this process after the grace)
    deadlines = [t for t in threading.enumerate() if isinstance(t, threading.Timer)
                 and getattr(t.function, "__name__", None) == "_give_up"]
    assert all(t.finished.is_set() for t in deadlines), deadlines  # (cancelled: its thread may still be ending)
    record = json.loads((out / "training_run.json").read_text())
    assert record["status"] == "stopped" and record["signal"] == "SIGUSR1" and record["ranks"] == [0], record
    assert record["step"] == 6 and record["max_steps"] == STEPS and record["checkpoint"] == str(out / "checkpoint-6")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert checkpoint_problem(out / "checkpoint-6") is None and not (out / ".staging").exists()
    assert not {"model.safetensors", "train_results.json", "eval_results.json", "README.md"} & set(os.listdir(out))

    resumed_digest, resumed_losses = resume(out)
    assert resumed_losses == losses and resumed_digest == digest
    assert json.loads((out / "training_run.json").read_text())["status"] == "finished"


def test_resuming_cpu_ranks_on_transformers_5_17_is_refused_by_name():
    """Transformers 5.17 loads a multi-process CPU run's optimizer state onto `cpu:0`, which torch cannot restore:
    refused before loading, naming the release that works; other releases, devices, one process and sharded states
    resume."""
    import types

    import torch

    from dat_hf.training import cpu_ranks_resume_refusal

    def args(world_size=2, device="cpu"):
        return types.SimpleNamespace(world_size=world_size, device=torch.device(device))

    refusal = cpu_ranks_resume_refusal(args(), sharded=False, version="5.17.0")
    assert "2 processes on the CPU needs Transformers >= 5.18: 5.17.0 loads" in refusal and "cpu:0" in refusal
    for case, version in (((args(), False), "5.18.0"), ((args(), False), "5.25.0"), ((args(1), False), "5.17.0"),
                          ((args(device="cuda"), False), "5.17.0"), ((args(), True), "5.17.0")):
        assert cpu_ranks_resume_refusal(case[0], sharded=case[1], version=version) is None, (case, version)
