"""Preemption: a signal to some ranks stops every rank at the same step, with one complete checkpoint, and a resume
finds the newest complete checkpoint.

Kept because Transformers' JIT checkpoint (`--enable_jit_checkpoint`, `transformers.trainer_jit_checkpoint`, 5.17 to
5.25) acts in each process alone: the process that receives SIGTERM stops training and saves, the others train on,
so their collectives never meet (a hang), and its save writes `checkpoint-is-incomplete.txt` straight into
`checkpoint-N/` around the atomic save, leaving a folder that `get_last_checkpoint` picks and the resume refuses.

- `PreemptionCallback` (what `AtomicCheckpointTrainer` puts in place of Transformers' `JITCheckpointCallback`): the
  signal handler only notes the signal. At the end of every optimizer step each rank contributes its note to one
  all-reduce (a vector of world-size integers, over gloo on the CPU: no device synchronization); when any rank was
  signalled, every rank asks the Trainer for the step's checkpoint (its own atomic `_save_checkpoint`, the path of
  `--save_steps`) and for the end of training. The run's `Preemption` names the signal, the ranks it reached and the
  step. A process that has not ended `grace_seconds` after its signal (a rank stuck outside the training loop) says
  so, naming the signal and its rank, and exits with status 128 + the signal's number; the launcher (torchrun, the
  elastic agent) then ends the other ranks, as for a crash.
- `checkpoint_problem(folder)` / `last_complete_checkpoint(output_dir)`: what `--resume_from_checkpoint last` uses
  (in place of `transformers.trainer_utils.get_last_checkpoint`, which takes the newest folder as it is): the
  newest `checkpoint-N` that is whole, skipping and naming in one log line each newer folder that is incomplete
  (Transformers' marker, no `trainer_state.json`), or damaged (a truncated safetensors or torch file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import struct
import threading
import zipfile

import torch
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

logger = logging.get_logger(__name__)

DEFAULT_SIGNALS = ("SIGTERM",)
DEFAULT_GRACE_SECONDS = 60.0
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # written by Transformers' JIT checkpoint while it saves
CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
WEIGHTS = re.compile(r".*\.(safetensors|bin)$|pytorch_model_fsdp_\d+|global_step\d+")  # any layout Trainer saves


def parse_signals(names) -> tuple[signal.Signals, ...]:
    """`["SIGTERM", "usr1"]` (names, with or without `SIG`, or numbers) -> signals; a clear error for an unknown one.
    SIGKILL and SIGSTOP cannot be caught and are refused by name."""
    if isinstance(names, str):
        names = names.replace(",", " ").split()
    result = []
    for name in names:
        text = str(name).strip().upper()
        try:
            sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
                text if text.startswith("SIG") else f"SIG{text}"]
        except (KeyError, ValueError):
            raise ValueError(f"`preemption_signals`: {name!r} is not a signal (e.g. SIGTERM, SIGUSR1).") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"`preemption_signals`: {sig.name} cannot be caught; use SIGTERM or SIGUSR1.")
        if sig not in result:
            result.append(sig)
    if not result:
        raise ValueError("`preemption_signals` is empty: give at least one signal (e.g. SIGTERM).")
    return tuple(result)


def checked_settings(signals, grace_seconds) -> tuple[tuple[signal.Signals, ...], float]:
    """(the signals, the grace in seconds), or a ValueError naming the bad setting."""
    if not grace_seconds > 0:
        raise ValueError(f"`preemption_grace_seconds` must be positive, got {grace_seconds}.")
    return parse_signals(signals), float(grace_seconds)


@dataclasses.dataclass
class Preemption:
    """A run stopped by a signal: the signal, the ranks it had reached when they compared notes at the end of a step,
    the step every rank stopped (and saved) at."""

    signal: str
    ranks: list[int]
    step: int
    max_steps: int
    checkpoint: str

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process ended by that signal (143 for SIGTERM)."""
        return 128 + signal.Signals[self.signal].value

    def message(self) -> str:
        return (f"Training stopped by {self.signal} (received by rank {', '.join(map(str, self.ranks))}) at step "
                f"{self.step} of {self.max_steps}: saved {self.checkpoint}. Relaunch the same command with "
                "`--resume_from_checkpoint last` to continue.")

    def record(self) -> dict:
        return {"status": "stopped", **dataclasses.asdict(self)}


class PreemptionCallback(TrainerCallback):
    """Stops every rank at the same step when any rank receives one of `signals` (see the module docstring).

    Args:
        trainer: the `Trainer` (its `args`, `state` and output folder name the checkpoint).
        signals: names or numbers (`("SIGTERM",)`; Slurm's `--signal=USR1@90` sends SIGUSR1 ahead of preemption).
        grace_seconds: how long a signalled process may take to reach the end of its step and save before it exits
            with a message (status 128 + the signal's number). Keep it below the scheduler's own grace (Kubernetes'
            `terminationGracePeriodSeconds`, Slurm's `KillWait` or `--signal` lead time, torchrun's
            `--shutdown-timeout`)."""

    def __init__(self, trainer, signals=DEFAULT_SIGNALS, grace_seconds: float = DEFAULT_GRACE_SECONDS):
        self.trainer = trainer
        self.signals, self.grace_seconds = checked_settings(signals, grace_seconds)
        self.received = 0  # the number of the first signal this process received, 0 before
        self.preemption: Preemption | None = None
        self._previous_handlers = {}
        self._group, self._device, self._group_ready = None, torch.device("cpu"), False
        self._watchdog = None

    # ---- the signal ------------------------------------------------------------------------------------------------
    def _rank(self) -> int:
        return self.trainer.args.process_index

    def _on_signal(self, signum, frame):
        if self.received:
            return
        self.received = signum
        name = signal.Signals(signum).name
        # (os.write: safe inside a signal handler, unlike logging's locks)
        os.write(2, f"[rank {self._rank()}] {name} received: every rank saves a checkpoint at the end of the current "
                    f"step and stops (within {self.grace_seconds:g} s).\n".encode())
        self._watchdog = threading.Timer(self.grace_seconds, self._give_up, args=(signum,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _give_up(self, signum):
        name = signal.Signals(signum).name
        os.write(2, f"[rank {self._rank()}] {name}: not stopped within {self.grace_seconds:g} s of the signal "
                    f"(step {self.trainer.state.global_step}); exiting without a new checkpoint (status "
                    f"{128 + signum}). `--resume_from_checkpoint last` resumes from the newest complete "
                    "checkpoint.\n".encode())
        os._exit(128 + signum)

    def _install(self):
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Preemption signals are handled only when training runs on the main thread: %s keep their "
                           "default action.", ", ".join(s.name for s in self.signals))
            return
        for sig in self.signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore(self):
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    # ---- agreement across ranks ------------------------------------------------------------------------------------
    def _setup_group(self):
        """The process group of the per-step all-reduce: the default group when it has gloo (CPU tensors), else one
        gloo group over every rank (created here, on every rank), else the default group on the training device."""
        import torch.distributed as dist

        if self._group_ready or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        self._group_ready = True
        if "gloo" in str(dist.get_backend()):
            return
        try:
            self._group = dist.new_group(backend="gloo")
        except (RuntimeError, ValueError):
            self._device = self.trainer.args.device

    def _signals_by_rank(self) -> list[int]:
        """Each rank's signal number (0: none), the same list on every rank (a collective: every rank calls it)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [self.received]
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=self._device)
        flags[dist.get_rank()] = self.received
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return flags.tolist()

    # ---- the Trainer's events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.preemption, self.received = None, 0
        self._setup_group()
        self._install()

    def on_step_end(self, args, state, control, **kwargs):
        by_rank = self._signals_by_rank()  # (every rank, every step: the ranks' collectives stay paired)
        if not any(by_rank):
            return
        ranks = [rank for rank, signum in enumerate(by_rank) if signum]
        name = signal.Signals(by_rank[ranks[0]]).name
        output_dir = self.trainer._get_output_dir(trial=None)
        self.preemption = Preemption(signal=name, ranks=ranks, step=state.global_step, max_steps=state.max_steps,
                                     checkpoint=os.path.join(output_dir, f"checkpoint-{state.global_step}"))
        # the step's checkpoint through the Trainer's own save (atomic), then the end of training, on every rank
        control.should_save = True
        control.should_evaluate = False
        control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        # training has stopped (and saved) in time: what follows `train()` is the caller's, without a deadline
        self._restore()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.preemption is not None and args.should_save:
            logger.warning(self.preemption.message())


@dataclasses.dataclass
class PreemptionArguments:
    """The scripts' arguments of preemption (beside `TrainingArguments.enable_jit_checkpoint`, which turns it on)."""

    preemption_signals: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_SIGNALS), metadata={
        "help": "With --enable_jit_checkpoint: the signals that make every rank save a checkpoint and stop (e.g. "
                "SIGTERM SIGUSR1; Slurm's --signal=USR1@120 sends SIGUSR1 ahead of preemption)."})
    preemption_grace_seconds: float = dataclasses.field(default=DEFAULT_GRACE_SECONDS, metadata={
        "help": "With --enable_jit_checkpoint: seconds a signalled process may take to save and stop before it exits "
                "anyway (status 128 + the signal's number); keep it below the scheduler's grace period."})

    def __post_init__(self):  # a bad value is refused here, before any data is read
        checked_settings(self.preemption_signals, self.preemption_grace_seconds)


# ---- finding the checkpoint to resume from ---------------------------------------------------------------------------
def _safetensors_problem(path) -> str | None:
    """Why a safetensors file is not whole (its header does not parse, or the file is shorter than its tensors), or
    None."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError
            header = json.loads(f.read(length))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return f"{os.path.basename(path)} is damaged (its header does not parse)"
    if size < 8 + length + end:
        return f"{os.path.basename(path)} is truncated ({size:,} of {8 + length + end:,} bytes)"
    return None


def _torch_file_problem(path) -> str | None:
    """Why a file of `torch.save` (a zip archive: optimizer, scheduler, RNG states) is not whole, or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError):
        return f"{os.path.basename(path)} is truncated or damaged"
    return None


def checkpoint_problem(folder) -> str | None:
    """Why `folder` (a `checkpoint-N`) cannot be resumed from, or None when it looks whole: Transformers' marker of an
    unfinished save, no (or unreadable) `trainer_state.json`, no model weights, a truncated or damaged safetensors or
    torch file. Reads headers and archive directories only (no tensors)."""
    folder = os.fspath(folder)
    if os.path.exists(os.path.join(folder, INCOMPLETE_MARKER)):
        return f"it holds {INCOMPLETE_MARKER} (a save that did not finish)"
    state = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"no {TRAINER_STATE_NAME}"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)["global_step"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{TRAINER_STATE_NAME} is damaged"
    names = os.listdir(folder)
    if not any(WEIGHTS.fullmatch(name) for name in names):
        return "no model weights"
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".safetensors"):
                problem = _safetensors_problem(path)
            elif name.endswith((".pt", ".pth", ".bin")):
                problem = _torch_file_problem(path)
            else:
                continue
            if problem:
                return problem if root == folder else f"{os.path.relpath(root, folder)}/{problem}"
    return None


def last_complete_checkpoint(output_dir, log: bool = True) -> str | None:
    """The newest `checkpoint-N` in `output_dir` that `checkpoint_problem` finds whole (None when there is none or
    the folder does not exist); logs (warning, when `log`: on one process) one line naming each newer folder it
    skipped and why."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := CHECKPOINT_NAME.match(name)) and os.path.isdir(os.path.join(output_dir, name))),
                   reverse=True)
    skipped = []
    found = None
    for _, name in steps:
        problem = checkpoint_problem(os.path.join(output_dir, name))
        if problem is None:
            found = os.path.join(output_dir, name)
            break
        skipped.append(f"{name} ({problem})")
    if skipped and log:
        logger.warning("Resuming skips %d incomplete checkpoint%s in %s: %s; %s.", len(skipped),
                       "s" if len(skipped) > 1 else "", output_dir, "; ".join(skipped),
                       f"resuming from {os.path.basename(found)}" if found else "starting from scratch")
    return found


__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_SIGNALS",
    "Preemption",
    "PreemptionArguments",
    "PreemptionCallback",
    "checkpoint_problem",
    "last_complete_checkpoint",
    "parse_signals",
]
