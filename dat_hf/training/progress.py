"""The loss curve of a training run as a PNG (Trainer has no plot of its `log_history`). Progress while training is
Trainer's own: its progress bar, or with `--disable_tqdm` one logged dict per logging step (`PrinterCallback`).
"""

from __future__ import annotations

import os


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
