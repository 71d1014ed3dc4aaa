"""Preemption as a cluster does it (docs/training.md, "Preemption"): a signal to some ranks stops every rank at one
step with one complete checkpoint, the job exits within a bounded time, and the relaunch with `last` ends with the
weights of a run that was never stopped.

Integration (processes): the page's commands run as written (`torchrun`, 2 processes, gloo; `...` given a tiny run of
60 steps), interrupted from outside once the first checkpoint exists, as a scheduler does: SIGKILL to one rank then
the relaunch; SIGKILL to one rank under `--max-restarts 1`; SIGTERM to one rank only; SIGTERM to every process of the
job; SIGTERM to one of two agents (two torchrun agents on 127.0.0.1, c10d rendezvous); SIGUSR1 to torchrun with
`--signals-to-handle ...,SIGUSR1`. Each job exits within 60 s of the signal and, relaunched with the same command, ends
with the uninterrupted run's weights (max abs difference 0.0, float32 on CPU).

The default suite: which checkpoint folders `last` skips and why, the signals and settings refused by name, the
Trainer's handlers (Transformers' JIT callback replaced, DDP without the unused-parameter search), and every DAT
family using every parameter in a training forward.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from lm_helpers import REPO_ROOT, kill_tagged, subprocess_env, tagged_env, tagged_processes, train_args
from safetensors.torch import load_file, save_file

from dat_hf.training.preemption import (
    INCOMPLETE_MARKER,
    PreemptionArguments,
    checkpoint_problem,
    last_complete_checkpoint,
    parse_signals,
)

pytestmark = pytest.mark.xdist_group("preemption")  # (one worker: the runs share the uninterrupted reference)

PAGE = REPO_ROOT / "docs" / "training.md"
STEPS, SAVE_EVERY = 60, 5
EXIT_WITHIN = 60.0  # seconds from the signal to the end of every process of the job


# ---- the checkpoint `last` resumes from (default suite) --------------------------------------------------------------
def fake_checkpoint(folder: Path, step: int) -> Path:
    """A folder shaped as Trainer's checkpoint (model, optimizer, trainer state), small."""
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, folder / "model.safetensors")
    torch.save({"state": {0: torch.ones(8)}}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def truncate(path: Path):
    """Cut a file to half its length (a save killed while writing it)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def marker_only(folder: Path):
    """What Transformers' JIT checkpoint leaves when it is stopped: the folder holding only its marker."""
    for path in folder.iterdir():
        path.unlink()
    (folder / INCOMPLETE_MARKER).write_text("Checkpoint started at step 8 and in progress...")


DAMAGES = {  # how a checkpoint folder can be left, and the reason `checkpoint_problem` names
    "marker only": (marker_only, f"it holds {INCOMPLETE_MARKER}"),
    "marker beside the files": (lambda f: (f / INCOMPLETE_MARKER).write_text("..."), f"it holds {INCOMPLETE_MARKER}"),
    "truncated safetensors": (lambda f: truncate(f / "model.safetensors"), "model.safetensors is truncated"),
    "safetensors header": (lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64),
                           "model.safetensors is damaged"),
    "truncated torch file": (lambda f: truncate(f / "optimizer.pt"), "optimizer.pt is truncated or damaged"),
    "no trainer state": (lambda f: (f / "trainer_state.json").unlink(), "no trainer_state.json"),
    "damaged trainer state": (lambda f: (f / "trainer_state.json").write_text("{"), "trainer_state.json is damaged"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "no model weights"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_last_skips_a_damaged_newest_checkpoint_and_says_why(tmp_path, damage, caplog):
    fake_checkpoint(tmp_path / "checkpoint-5", 5)
    newest = fake_checkpoint(tmp_path / "checkpoint-10", 10)
    assert checkpoint_problem(newest) is None
    apply, reason = DAMAGES[damage]
    apply(newest)
    assert reason in checkpoint_problem(newest)
    with caplog.at_level("WARNING", logger="dat_hf.training.preemption"):
        assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "checkpoint-10 (" in lines[0] and reason in lines[0], lines
    assert "resuming from checkpoint-5" in lines[0]


def test_last_takes_the_newest_whole_checkpoint_by_step(tmp_path, caplog):
    assert last_complete_checkpoint(tmp_path / "absent") is None
    assert last_complete_checkpoint(tmp_path) is None  # no checkpoint: from scratch
    for step in (5, 10, 40):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    (tmp_path / "checkpoint-9x").mkdir()  # not a checkpoint name
    (tmp_path / ".staging" / "checkpoint-45").mkdir(parents=True)  # a save in progress
    with caplog.at_level("WARNING"):
        assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-40")  # 40 > 10 as numbers
    assert not caplog.records
    for step in (10, 40):
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").unlink()
    with caplog.at_level("WARNING"):
        assert last_complete_checkpoint(tmp_path, log=False) == str(tmp_path / "checkpoint-5")
    assert not caplog.records  # (log=False: the other ranks)
    (tmp_path / "checkpoint-5" / INCOMPLETE_MARKER).write_text("...")
    with caplog.at_level("WARNING"):
        assert last_complete_checkpoint(tmp_path) is None
    assert "skips 3 incomplete checkpoints" in caplog.text and "starting from scratch" in caplog.text


def test_bad_preemption_settings_are_refused_by_name():
    assert parse_signals("SIGTERM,usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals(["TERM", str(int(signal.SIGUSR1)), "SIGTERM"]) == (signal.SIGTERM, signal.SIGUSR1)
    for bad, message in ((["SIGNOPE"], "'SIGNOPE' is not a signal"), (["SIGKILL"], "SIGKILL cannot be caught"),
                         ([], "is empty")):
        with pytest.raises(ValueError, match=re.escape(message)):
            PreemptionArguments(preemption_signals=bad)
    with pytest.raises(ValueError, match="`preemption_grace_seconds` must be positive, got 0"):
        PreemptionArguments(preemption_grace_seconds=0)


# ---- the Trainer: its preemption handler and DDP's settings (default suite) ------------------------------------------
def tiny_trainer(tmp_path, model=None, **arguments):
    from transformers import TrainingArguments

    from conftest import tiny_config
    from dat_hf import DATForCausalLM
    from dat_hf.training import AtomicCheckpointTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2,
                             per_device_train_batch_size=2, save_strategy="no", logging_strategy="no", **arguments)
    data = [{"input_ids": torch.arange(8) % 97, "labels": torch.arange(8) % 97}] * 4
    return AtomicCheckpointTrainer(model=model or DATForCausalLM(tiny_config()), args=args, train_dataset=data)


def test_the_trainer_stops_on_every_rank_in_place_of_transformers_jit_checkpoint(tmp_path):
    from transformers.trainer_callback import TrainerCallback

    before = signal.getsignal(signal.SIGTERM)
    trainer = tiny_trainer(tmp_path, enable_jit_checkpoint=True)
    assert trainer.args.enable_jit_checkpoint  # (off only while Trainer's __init__ reads it)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "JITCheckpointCallback" not in names and names.count("PreemptionCallback") == 1, names
    assert signal.getsignal(signal.SIGTERM) is before  # nothing installed before `train()`

    seen = {}

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    trainer.add_callback(Look())
    trainer.train()
    assert getattr(seen["handler"], "__func__", None) is type(trainer.preemption_callback)._on_signal
    assert signal.getsignal(signal.SIGTERM) is before and trainer.preemption is None  # restored; not stopped
    assert tiny_trainer(tmp_path).preemption_callback is None  # without the flag: Trainer as it is


def test_ddp_runs_without_the_unused_parameter_search_for_dat_models(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    trainer = tiny_trainer(tmp_path)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False
    assert trainer.args.ddp_find_unused_parameters is None  # the user's arguments are left as they were
    explicit = tiny_trainer(tmp_path, ddp_find_unused_parameters=True)
    assert explicit.accelerator.ddp_handler.find_unused_parameters is True
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2))
    assert tiny_trainer(tmp_path, model=llama).accelerator.ddp_handler.find_unused_parameters is True  # Trainer's


def family_models():
    """One model of each DAT class a Trainer trains, across the variants that change which modules exist."""
    from conftest import tiny_config
    from test_seq2seq import seq2seq_config
    from test_vision import vision_config

    from dat_hf import (
        DATEncoderConfig,
        DATForCausalLM,
        DATForImageClassification,
        DATForSeq2SeqLM,
        DATForSequenceClassification,
        DATForTokenClassification,
    )

    lm_variants = {
        "default": {}, "sensory only": dict(num_relational_heads=0), "relational only": dict(num_sensory_heads=0),
        "positional symbols": dict(symbol_retrieval="positional"),
        "position-relative symbols": dict(symbol_retrieval="position_relative"),
        "untied, learned positions": dict(tie_word_embeddings=False, position_embedding_type="learned"),
        "sliding window, GQA": dict(relational_bias="sliding_window", sliding_window_size=3,
                                    num_sensory_key_value_heads=1),
    }
    for name, overrides in lm_variants.items():
        yield f"causal LM, {name}", DATForCausalLM(tiny_config(**overrides)), "lm"
    yield "sequence classification", DATForSequenceClassification(tiny_config(num_labels=3, pad_token_id=0)), "seq"
    encoder = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
                   intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, num_labels=3)
    yield "token classification", DATForTokenClassification(DATEncoderConfig(**encoder)), "token"
    # node features in place of tokens: the token embeddings go unused (DDP must search)
    yield "node classification", DATForTokenClassification(DATEncoderConfig(**encoder, num_node_features=5)), "node"
    for name in ("default", "dual-cross", "only-cross-relational", "relative-relu-postnorm", "unshared-untied-gqa"):
        from test_seq2seq import CONFIGS

        yield f"seq2seq, {name}", DATForSeq2SeqLM(seq2seq_config(**CONFIGS[name])), "seq2seq"
    yield "vision", DATForImageClassification(vision_config()), "vision"
    yield "vision, relational only", DATForImageClassification(vision_config(num_sensory_heads=0)), "vision"


def test_every_dat_model_uses_every_parameter_in_a_training_forward():
    """What lets DDP run without `find_unused_parameters` (`uses_every_parameter`): after one forward and backward
    of each family, every parameter has a gradient, but for node classification (node features, no tokens)."""
    from dat_hf.training import uses_every_parameter

    torch.manual_seed(0)
    for name, model, kind in family_models():
        model.train()
        if kind == "node":
            batch = dict(node_features=torch.randn(2, 9, 5), labels=torch.randint(0, 3, (2, 9)))
        elif kind == "vision":
            batch = dict(pixel_values=torch.randn(2, 1, 16, 16), labels=torch.tensor([0, 2]))
        elif kind == "seq2seq":
            batch = dict(input_ids=torch.randint(3, 40, (2, 7)), labels=torch.randint(3, 50, (2, 5)))
        else:
            ids = torch.randint(1, 97, (2, 9))
            labels = {"lm": ids, "seq": torch.tensor([0, 2]), "token": torch.randint(0, 3, (2, 9))}[kind]
            batch = dict(input_ids=ids, labels=labels)
        model(**batch).loss.backward()
        unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert uses_every_parameter(model) is not bool(unused), (name, unused)
        if kind == "node":
            assert unused == ["model.embed_tokens.weight"], unused


# ---- the page's commands, interrupted (integration) ------------------------------------------------------------------
def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def page_commands() -> dict[str, list[str]]:
    """The Preemption section's commands by what they are for: plain, max-restarts, two-nodes, sigusr1."""
    from test_training_recipes import bash_commands

    found = {}
    for command in bash_commands(section(PAGE.read_text(encoding="utf-8"), "Preemption")):
        words = shlex.split(command)  # (leading `NAME=value` words: the command's environment)
        name = ("max-restarts" if "--max-restarts" in words else "two-nodes" if "--nnodes" in words
                else "sigusr1" if "--signals-to-handle" in words else "plain")
        assert name not in found, f"two {name} commands in the Preemption section"
        found[name] = words
    return found


def test_the_page_has_each_preemption_command():
    commands = page_commands()
    assert set(commands) == {"plain", "max-restarts", "two-nodes", "sigusr1"}, commands
    for words in commands.values():
        words = launcher_words(words)[1]
        assert words[0] == "torchrun" and "scripts/train_causal_lm.py" in words and words[-1] == "..."
        for flag in ("--use_cpu", "--enable_jit_checkpoint"):
            assert flag in words, (flag, words)
        assert words[words.index("--resume_from_checkpoint") + 1] == "last"
    assert "SIGUSR1" in commands["sigusr1"][commands["sigusr1"].index("--preemption_signals") + 1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_words(words: list[str]) -> tuple[dict, list[str]]:
    """({variable: value} of the command's leading `NAME=value` words, the command from its launcher on)."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words[0].split("=", 1)
        env[name], words = value, words[1:]
    return env, words


def argv(words: list[str], out: Path, port: int) -> list[str]:
    """A page command as this interpreter runs it: on `port`, `...` given the tiny run's arguments."""
    rest = list(launcher_words(words)[1][1:])
    launcher = []
    if "--rdzv_endpoint" in rest:
        rest[rest.index("--rdzv_endpoint") + 1] = f"127.0.0.1:{port}"
    elif "--standalone" not in rest:  # (--standalone finds a free port itself)
        launcher = ["--master_port", str(port)]
    tiny = train_args(out, "--save_steps", str(SAVE_EVERY), max_steps=STEPS, lr=3e-3, seed=1)
    i = rest.index("...")
    return [sys.executable, "-m", "torch.distributed.run", *launcher, *rest[:i], *tiny, *rest[i + 1:]]


class Job:
    """One or more torchrun agents (each in its own session, output to a file), with their workers by rank."""

    def __init__(self, commands: list[list[str]], folder: Path, name: str, env: dict):
        self.logs = [folder / f"{name}-{i}.log" for i in range(len(commands))]
        self.agents = []
        env, self.tag = tagged_env(subprocess_env(**env))
        for cmd, log in zip(commands, self.logs):
            with open(log, "w") as f:
                self.agents.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                                    start_new_session=True))

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)

    def workers(self) -> dict[int, tuple[int, int]]:
        """{global rank: (worker pid, its agent's pid)} of the running workers (their parent is an agent)."""
        agents = {agent.pid for agent in self.agents}
        found = {}
        for process in tagged_processes(self.tag):
            with contextlib.suppress(psutil.Error):
                if process.ppid() in agents and "RANK" in (env := process.environ()):
                    found[int(env["RANK"])] = (process.pid, process.ppid())
        return found

    def wait(self, timeout: float) -> list[int]:
        """Every agent's exit status; the whole job killed (and the test failed) past `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            codes = [agent.wait(timeout=max(0.1, deadline - time.monotonic())) for agent in self.agents]
        except subprocess.TimeoutExpired:
            killed = self.kill()
            raise AssertionError(f"the job did not exit within {timeout:.0f} s (killed:\n{killed})\n"
                                 f"{self.output()[-6000:]}") from None
        assert not (left := self.kill()), f"processes of the job left running after its agents:\n{left}"
        return codes

    def kill(self) -> str:
        """Kill every process of the job (agents and workers, each worker in a session of its own); which."""
        return kill_tagged(self.tag)


def launch(kind: str, out: Path, name: str) -> Job:
    words = page_commands()[kind]
    port = free_port()
    agents = 2 if kind == "two-nodes" else 1
    return Job([argv(words, out, port) for _ in range(agents)], out.parent, name, launcher_words(words)[0])


def run(kind: str, out: Path, name: str, timeout: float = 240) -> tuple[list[int], str]:
    job = launch(kind, out, name)
    codes = job.wait(timeout)
    return codes, job.output()


def wait_until(predicate, timeout: float, job: Job, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(agent.poll() is not None for agent in job.agents):
            job.kill()
            raise AssertionError(f"{what}: not reached\n{job.output()[-6000:]}")
        time.sleep(0.05)


def final_weights(out: Path) -> dict:
    return load_file(out / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("preemption") / "uninterrupted"
    codes, output = run("plain", out, "uninterrupted")
    assert codes == [0], output[-6000:]
    assert json.loads((out / "training_run.json").read_text())["status"] == "finished"
    assert "did not find any unused parameters" not in output  # DDP runs without the search (every parameter used)
    return final_weights(out)


SCENARIOS = {  # name: (command, signal, whom it reaches, whether the job stops by itself before its relaunch)
    "SIGKILL to one rank": ("plain", signal.SIGKILL, "rank 1"),
    "SIGKILL to one rank, --max-restarts 1": ("max-restarts", signal.SIGKILL, "rank 1"),
    "SIGTERM to one rank": ("plain", signal.SIGTERM, "rank 1"),
    "SIGTERM to the whole job": ("plain", signal.SIGTERM, "every process"),
    "SIGTERM to one of two agents": ("two-nodes", signal.SIGTERM, "agent of rank 1"),
    "SIGUSR1 to torchrun": ("sigusr1", signal.SIGUSR1, "agent of rank 1"),
}


def deliver(job: Job, sig: signal.Signals, whom: str) -> list[int]:
    """Send the signal; the ranks it reaches (an agent forwards it to its workers)."""
    workers = job.workers()
    pid, agent = workers[1]
    if whom == "rank 1":
        os.kill(pid, sig)
        return [1]
    if whom == "agent of rank 1":
        os.kill(agent, sig)
        return sorted(rank for rank, (_, parent) in workers.items() if parent == agent)
    for process in tagged_processes(job.tag):  # as a scheduler ends a job: every process of it, agents and workers
        process.send_signal(sig)
    return sorted(workers)


@pytest.mark.integration
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_preempted_job_stops_in_bounded_time_and_resumes_to_the_same_weights(uninterrupted, tmp_path, scenario):
    kind, sig, whom = SCENARIOS[scenario]
    out = tmp_path / "run"
    job = launch(kind, out, "interrupted")
    wait_until(lambda: (out / f"checkpoint-{SAVE_EVERY}").is_dir() and len(job.workers()) == 2, 180, job,
               f"checkpoint-{SAVE_EVERY} with both ranks running")
    sent = time.monotonic()
    reached = deliver(job, sig, whom)
    codes = job.wait(EXIT_WITHIN + 60)
    took = time.monotonic() - sent
    output = job.output()
    print(f"\n{scenario}: exit status {codes} {took:.1f} s after the signal")
    assert took < EXIT_WITHIN, output[-6000:]
    assert not (out / ".staging").exists() or sig == signal.SIGKILL

    if kind == "max-restarts":  # torchrun restarted the ranks, which resumed by themselves
        assert codes == [0], output[-6000:]
        assert "Resuming from" in output
    else:
        assert all(code != 0 for code in codes), output[-6000:]
        assert not (out / "model.safetensors").exists()  # a stopped run is never saved as finished
        if sig != signal.SIGKILL:
            record = json.loads((out / "training_run.json").read_text())
            # the ranks the signal had reached when the ranks compared notes (a forwarded signal may reach one late)
            assert record["status"] == "stopped" and record["signal"] == sig.name, record
            assert record["ranks"] and set(record["ranks"]) <= set(reached), (record, reached)
            assert SAVE_EVERY < record["step"] < STEPS and record["max_steps"] == STEPS
            stopped_at = Path(record["checkpoint"])
            assert stopped_at == out / f"checkpoint-{record['step']}" and checkpoint_problem(stopped_at) is None
            assert f"Training stopped by {sig.name} (received by rank {', '.join(map(str, record['ranks']))})" in output
            assert "train_results.json" not in os.listdir(out) and "README.md" not in os.listdir(out)
        codes, output = run(kind, out, "relaunched")  # the same command again
        assert codes == [0] * len(codes), output[-6000:]
        assert "Resuming from" in output
    assert json.loads((out / "training_run.json").read_text())["status"] == "finished"
    difference = max_difference(final_weights(out), uninterrupted)
    print(f"{scenario}: max abs difference to the uninterrupted run {difference}")
    assert difference == 0.0


STUCK = """
import os, signal, time, types
from dat_hf.training.preemption import PreemptionCallback
trainer = types.SimpleNamespace(args=types.SimpleNamespace(process_index=3), state=types.SimpleNamespace(global_step=7))
callback = PreemptionCallback(trainer, ["SIGTERM"], grace_seconds=1)
callback.on_train_begin(None, None, None)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(120)  # stuck outside the training loop: no step ends
"""


@pytest.mark.integration
def test_a_signalled_process_that_cannot_stop_exits_after_its_grace_naming_the_signal_and_rank():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=60,
                          env=subprocess_env())
    took = time.monotonic() - start
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "[rank 3] SIGTERM received: every rank saves a checkpoint" in proc.stderr
    assert "[rank 3] SIGTERM: not stopped within 1 s of the signal (step 7)" in proc.stderr
    assert took < 30, took  # (the import, then the 1 s grace)
