#!/usr/bin/env python
"""Relational games learning curves: a vision DAT against a ViT of the same size and depth, over training-set sizes.

    # the documented sweep (docs/relational_games.md): one process, one thread, in the background
    OMP_NUM_THREADS=1 nohup nice -n 19 python scripts/relational_games.py --resume \\
        --output_json docs/relational_games/runs.json \\
        --output_png docs/relational_games/learning_curves.png > relational_games.log 2>&1 &

    # redraw the figure and print the table from a finished JSON
    python scripts/relational_games.py --plot_only --output_json docs/relational_games/runs.json \\
        --output_png docs/relational_games/learning_curves.png

The images come from `dat_hf.training.relational_games` (the task definitions are in its docstring): each model
trains on pentomino images and is tested on new pentomino images (in distribution) and on hexomino and striped-square
images (out of distribution). Both models are `DATForImageClassification` with 12x12 patches, i.e. one token per
grid cell (9 object tokens + CLS, mean-pooled), as the authors' relational-games models: `dat` has
`--sensory_heads` + `--relational_heads` heads per layer, positional symbols and symmetric relations (the authors'
choices for this benchmark), `vit` has the same total of heads, all sensory, and the same width, MLP and depth.

Every run trains for `--steps` optimizer steps (batch `--batch_size`, Adam with warmup and cosine decay) whatever
the training-set size, then is evaluated once. The JSON gets every run (accuracies, steps, parameters, CPU seconds)
after each run, so `--resume` continues an interrupted sweep; the PNG has one panel per task and test family
(mean over seeds, shaded min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import transformers
from transformers import PrinterCallback, Trainer, TrainingArguments, set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dat_hf import DATForImageClassification  # noqa: E402
from dat_hf.training import load_metric  # noqa: E402
from dat_hf.training.relational_games import (  # noqa: E402
    IMAGE_SIZE,
    LABEL_NAMES,
    TASKS,
    relational_games_dataset,
)
from train_image_classification import ModelArguments, build_config  # noqa: E402

MODELS = ("dat", "vit")
MODEL_NAMES = {"dat": "DAT", "vit": "ViT"}
EVAL_SETS = {"test": "pentominoes", "hexominoes": "hexominoes", "stripes": "stripes"}
EVAL_SEED = 10**6  # training sets use seeds below this, the evaluation sets this one


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS,
                   help="Relational games tasks to run.")
    p.add_argument("--train_sizes", nargs="+", type=int, default=[250, 500, 1000, 2000, 4000, 8000],
                   help="Training-set sizes (pentomino images) of the learning curves.")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="Seeds: each draws its own training set and model initialization.")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS,
                   help="`dat` (sensory + relational heads) and/or `vit` (the same heads, all sensory).")
    p.add_argument("--num_eval", type=int, default=2000, help="Images in each evaluation set (per task and family).")
    p.add_argument("--colors", default="shared", choices=("shared", "random"),
                   help="Colours of the objects: one per image (`shared`) or one per object (`random`).")
    p.add_argument("--hidden_size", type=int, default=128, help="Model width.")
    p.add_argument("--num_layers", type=int, default=2, help="Number of layers.")
    p.add_argument("--sensory_heads", type=int, default=2, help="Sensory heads per layer of the DAT.")
    p.add_argument("--relational_heads", type=int, default=2,
                   help="Relational heads per layer of the DAT (the ViT gets them as extra sensory heads).")
    p.add_argument("--intermediate_size", type=int, default=None, help="MLP width (default: 2 x hidden_size).")
    p.add_argument("--symmetric_relations", action=argparse.BooleanOptionalAction, default=True,
                   help="Symmetric relations r(x, y) = r(y, x) in the DAT (the authors' relational-games setting).")
    p.add_argument("--symbol_retrieval", default="positional",
                   choices=("positional", "position_relative", "symbolic_attention"),
                   help="Symbols of the DAT's relational heads.")
    p.add_argument("--config_overrides", default=None,
                   help="JSON object of further DATVisionConfig fields for both models, e.g. '{\"num_relations\": 4}'.")
    p.add_argument("--dropout", type=float, default=0.1, help="Dropout of the residual branches.")
    p.add_argument("--steps", type=int, default=1000, help="Optimizer steps per run (any training-set size).")
    p.add_argument("--batch_size", type=int, default=64, help="Training batch size.")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="Peak learning rate (Adam).")
    p.add_argument("--warmup_steps", type=int, default=100, help="Linear warmup steps before the cosine decay.")
    p.add_argument("--output_json", default="relational_games_runs.json",
                   help="JSON of every run (rewritten after each run).")
    p.add_argument("--output_png", default="relational_games_learning_curves.png", help="Learning-curve figure.")
    p.add_argument("--resume", action="store_true", help="Keep the runs already in --output_json and skip them.")
    p.add_argument("--plot_only", action="store_true", help="Only redraw the figure and table from --output_json.")
    return p.parse_args(argv)


# ---- one run ---------------------------------------------------------------------------------------------------------
def model_config(kind: str, args):
    """The DAT or the ViT of the sweep: same width, depth, MLP and number of heads; mean pooling over CLS + 9
    patch tokens and SwiGLU MLPs without biases (as the authors' relational-games models)."""
    relational = args.relational_heads if kind == "dat" else 0
    model_args = ModelArguments(
        patch_size=IMAGE_SIZE // 3, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.sensory_heads + args.relational_heads, num_relational_heads=relational,
        intermediate_size=args.intermediate_size or 2 * args.hidden_size, symbol_retrieval=args.symbol_retrieval,
        pooling="mean", hidden_dropout=args.dropout, max_relative_position=3,
        config_overrides=json.dumps({"hidden_act": "swiglu", "mlp_bias": False, "max_symbol_positions": 10,
                                     "relative_symbols_2d": args.symbol_retrieval == "position_relative",
                                     "symmetric_relations": args.symmetric_relations and kind == "dat",
                                     **json.loads(args.config_overrides or "{}")}),
    )
    return build_config(model_args, IMAGE_SIZE, 3, LABEL_NAMES)


def accuracy(eval_pred):
    """`compute_metrics`: the `accuracy` evaluate module (`load_metric`: shipped, loaded offline; the Hub's
    `evaluate.load("accuracy")` needs the network)."""
    predictions, labels = eval_pred
    return load_metric("accuracy").compute(predictions=np.asarray(predictions).reshape(-1),
                                           references=np.asarray(labels).reshape(-1))


def train_and_evaluate(task: str, size: int, seed: int, kind: str, eval_sets: dict, args) -> dict:
    """Train one model on `size` pentomino images of `task`; accuracies on its training set and on `eval_sets`."""
    set_seed(seed)
    train = relational_games_dataset(task, size, "pentominoes", seed=seed * 100_003 + size, colors=args.colors)
    model = DATForImageClassification(model_config(kind, args))
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=500, learning_rate=args.learning_rate, weight_decay=0.0,
            adam_beta2=0.99, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine", seed=seed,
            save_strategy="no", eval_strategy="no", logging_strategy="no", report_to="none", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train, compute_metrics=accuracy,
                          preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
        trainer.remove_callback(PrinterCallback)
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        metrics = trainer.evaluate(eval_dataset={"train": train, **eval_sets})
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "task": task, "model": kind, "train_size": size, "seed": seed,
        "accuracy": {name: round(metrics[f"eval_{name}_accuracy"], 4) for name in ("train", *eval_sets)},
        "steps": args.steps, "num_parameters": sum(p.numel() for p in model.parameters()),
        "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
    }


# ---- summary ---------------------------------------------------------------------------------------------------------
def group_runs(runs: list[dict]) -> dict:
    """{(task, model, size, eval set): [accuracy of each seed]}."""
    groups = {}
    for run in runs:
        for name, value in run["accuracy"].items():
            groups.setdefault((run["task"], run["model"], run["train_size"], name), []).append(value)
    return groups


def summary_table(runs: list[dict]) -> str:
    """Markdown table: mean ± std over seeds (number of seeds) of each task, size and model, per evaluation set."""
    groups = group_runs(runs)
    keys = sorted({(t, s) for t, _, s, _ in groups}, key=lambda k: (TASKS.index(k[0]), k[1]))
    models = [m for m in MODELS if any(k[1] == m for k in groups)]
    header = "| task | train size | " + " | ".join(f"{MODEL_NAMES[m]} {e}" for e in EVAL_SETS for m in models) + " |"
    lines = [header, "|" + "---|" * (2 + len(EVAL_SETS) * len(models))]
    for task, size in keys:
        cells = []
        for e in EVAL_SETS:
            for m in models:
                values = groups.get((task, m, size, e))
                cells.append(f"{np.mean(values):.3f} ± {np.std(values):.3f} ({len(values)})" if values else "-")
        lines.append(f"| {task} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def images_to_reach(sizes: list[int], accuracies: list[float], target: float) -> float | None:
    """Training images at which a learning curve (mean accuracy per size) first reaches `target`, interpolated
    linearly in log(size) between the two sizes around the crossing; None when it never does."""
    for i, (size, acc) in enumerate(zip(sizes, accuracies)):
        if acc >= target:
            if i == 0:
                return float(size)
            (s0, a0), (s1, a1) = (sizes[i - 1], accuracies[i - 1]), (size, acc)
            return float(np.exp(np.log(s0) + (target - a0) / (a1 - a0) * (np.log(s1) - np.log(s0))))
    return None


def efficiency_table(runs: list[dict], targets=(0.7, 0.8, 0.9)) -> str:
    """Markdown table: training images each model needs to reach each target accuracy (mean over seeds), per task
    and evaluation set; `> N` when the largest size N does not reach it."""
    groups = group_runs(runs)
    tasks = [t for t in TASKS if any(k[0] == t for k in groups)]
    models = [m for m in MODELS if any(k[1] == m for k in groups)]
    lines = ["| task | evaluation | " + " | ".join(f"{MODEL_NAMES[m]} {t:.0%}" for t in targets for m in models) + " |",
             "|" + "---|" * (2 + len(targets) * len(models))]
    for task in tasks:
        for e in EVAL_SETS:
            cells = []
            for target in targets:
                for m in models:
                    sizes = sorted({k[2] for k in groups if k[:2] == (task, m) and k[3] == e})
                    needed = images_to_reach(sizes, [np.mean(groups[(task, m, s, e)]) for s in sizes], target)
                    cells.append(f"{needed:,.0f}" if needed is not None else f"> {max(sizes):,}" if sizes else "-")
            lines.append(f"| {task} | {e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_learning_curves(runs: list[dict], path: str):
    """One panel per (evaluation set, task): accuracy vs training-set size, mean over seeds, shaded min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_runs(runs)
    tasks = [t for t in TASKS if any(k[0] == t for k in groups)]
    all_sizes = sorted({k[2] for k in groups})
    fig, axes = plt.subplots(len(EVAL_SETS), len(tasks), figsize=(3.2 * len(tasks), 2.6 * len(EVAL_SETS)),
                             sharex=True, sharey=True, squeeze=False)
    colors = {"dat": "tab:blue", "vit": "tab:orange"}
    for row, (eval_name, family) in enumerate(EVAL_SETS.items()):
        for col, task in enumerate(tasks):
            ax = axes[row][col]
            for kind in MODELS:
                sizes = sorted({k[2] for k in groups if k[0] == task and k[1] == kind and k[3] == eval_name})
                if not sizes:
                    continue
                values = [groups[(task, kind, s, eval_name)] for s in sizes]
                ax.plot(sizes, [np.mean(v) for v in values], "o-", color=colors[kind], label=MODEL_NAMES[kind], ms=3)
                ax.fill_between(sizes, [min(v) for v in values], [max(v) for v in values], color=colors[kind],
                                alpha=0.2)
            ax.axhline(0.5, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.set_xticks(all_sizes, [f"{s:g}" for s in all_sizes], fontsize=7)
            ax.minorticks_off()
            ax.set_ylim(0.4, 1.02)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(task)
            if col == 0:
                ax.set_ylabel(f"accuracy: {family}\n({'in' if eval_name == 'test' else 'out of'} distribution)")
            if row == len(EVAL_SETS) - 1:
                ax.set_xlabel("training images (pentominoes)")
    axes[0][0].legend(loc="lower right")
    fig.suptitle("Relational games: held-out accuracy vs training images\n(mean over seeds, shaded min-max)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- sweep -----------------------------------------------------------------------------------------------------------
# settings that may differ between the invocations writing one JSON (each run records its own task, size, seed,
# model and steps); every other setting must agree
PER_RUN = ("tasks", "train_sizes", "seeds", "models", "steps", "resume", "plot_only", "output_json", "output_png")


def shared_settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in PER_RUN}


def load_runs(args) -> list[dict]:
    """The runs already in --output_json; a ValueError when its shared settings differ from these arguments."""
    if not os.path.exists(args.output_json):
        return []
    with open(args.output_json) as f:
        saved = json.load(f)
    if not args.plot_only and saved["settings"] != shared_settings(args):
        changed = sorted(k for k in set(saved["settings"]) | set(shared_settings(args))
                         if saved["settings"].get(k) != shared_settings(args).get(k))
        raise ValueError(f"--resume: {args.output_json} was written with other settings ({', '.join(changed)}); "
                         "use the same ones or another --output_json.")
    return saved["runs"]


def save(path: str, args, runs: list[dict]):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        total = round(sum(r["cpu_seconds"] for r in runs), 1)
        json.dump({"settings": shared_settings(args), "total_cpu_seconds": total, "runs": runs}, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    runs = load_runs(args) if args.resume or args.plot_only else []
    if not args.plot_only:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        done = {(r["task"], r["model"], r["train_size"], r["seed"]) for r in runs}
        todo = [(t, s, seed, m) for t in args.tasks for s in args.train_sizes for seed in args.seeds
                for m in args.models if (t, m, s, seed) not in done]
        print(f"{len(todo)} runs to do ({len(done)} already in {args.output_json})", flush=True)
        eval_sets = {}
        for i, (task, size, seed, kind) in enumerate(todo):
            if task not in eval_sets:
                eval_sets = {task: {name: relational_games_dataset(task, args.num_eval, family, EVAL_SEED, args.colors)
                                    for name, family in EVAL_SETS.items()}}
            run = train_and_evaluate(task, size, seed, kind, eval_sets[task], args)
            runs.append(run)
            save(args.output_json, args, runs)
            acc = run["accuracy"]
            print(f"[{i + 1}/{len(todo)}] {task} {kind} n={size} seed={seed}: train {acc['train']:.3f} "
                  f"test {acc['test']:.3f} hexominoes {acc['hexominoes']:.3f} stripes {acc['stripes']:.3f} "
                  f"({run['cpu_seconds']:.0f} CPU s)", flush=True)
    if runs:
        plot_learning_curves(runs, args.output_png)
        print(summary_table(runs))
        print(efficiency_table(runs))
        print(f"total CPU time of the runs: {sum(r['cpu_seconds'] for r in runs) / 3600:.2f} h")
    return runs


if __name__ == "__main__":
    main()
