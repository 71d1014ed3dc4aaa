"""Progress of a training run: one clean line per logging step where there is no terminal for a progress bar (logs,
pipes, CI), and the loss curve as a PNG.

- `ProgressLinesCallback`: `step 40/200 (20%) | epoch 0.35 | loss 4.812 | lr 2.9e-03 | 12 s, ~48 s left`.
- `use_progress_lines(trainer)`: with `--disable_tqdm`, Trainer prints raw log dicts (`PrinterCallback`); this swaps
  them for the lines above (and turns Transformers' other progress bars off). With the progress bar on it does
  nothing.
- `save_loss_curve(log_history, path)`: training (and evaluation) loss against the step, with matplotlib's Agg
  backend (no display needed).
"""

from __future__ import annotations

import os
import time

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.utils.logging import disable_progress_bar


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(logs: dict, step: int, max_steps: int, elapsed: float) -> str | None:
    """The line for one `Trainer` log entry (training, evaluation or the end-of-training summary); None for other
    entries."""
    if "loss" in logs:
        parts = [f"step {step}/{max_steps} ({100 * step / max(max_steps, 1):.0f}%)"]
        if "epoch" in logs:
            parts.append(f"epoch {logs['epoch']:.2f}")
        parts.append(f"loss {logs['loss']:.4g}")
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        left = f", ~{_duration(elapsed / step * (max_steps - step))} left" if 0 < step < max_steps else ""
        parts.append(_duration(elapsed) + left)
        return " | ".join(parts)
    if "eval_loss" in logs:
        shown = {k[5:]: v for k, v in logs.items() if k.startswith("eval_") and isinstance(v, (int, float))
                 and not k.endswith(("_per_second", "runtime"))}
        return f"step {step}: eval " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
    if "train_runtime" in logs:
        loss = f", mean training loss {logs['train_loss']:.4g}" if "train_loss" in logs else ""
        return f"trained {step} steps in {_duration(logs['train_runtime'])}{loss}"
    return None


class ProgressLinesCallback(TrainerCallback):
    """Prints `progress_line` of each log entry on the main process (`prefix` before each line)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        elapsed = time.perf_counter() - self.start if self.start is not None else 0.0
        line = progress_line(logs, state.global_step, state.max_steps, elapsed)
        if line:
            print(self.prefix + line, flush=True)


def use_progress_lines(trainer, prefix: str = "") -> None:
    """With the progress bar off (`args.disable_tqdm`), print `ProgressLinesCallback` lines instead of raw dicts, and
    no other Transformers progress bar (e.g. saving shards)."""
    if trainer.args.disable_tqdm:
        disable_progress_bar()
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(ProgressLinesCallback(prefix))


def save_loss_curve(log_history: list[dict], path: str | os.PathLike, title: str | None = None) -> str:
    """Plot the training loss (and the evaluation loss, if logged) against the step; save a PNG at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    if not train and not evals:
        raise ValueError("`log_history` has no `loss` or `eval_loss` entries: set `logging_steps` to log the loss.")
    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if train:
        axes.plot(*zip(*train), marker="." if len(train) < 30 else None, label="training loss")
    if evals:
        axes.plot(*zip(*evals), marker="o", linestyle="--", label="evaluation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title or "Training loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    return str(path)
