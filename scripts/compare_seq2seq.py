#!/usr/bin/env python
"""DAT vs Transformer on the math problem-solving task: same data, steps, seed, total heads and (nearly) the same
parameter count; exact-match accuracy of greedy answers on held-out problems, per module.

    OMP_NUM_THREADS=1 python scripts/compare_seq2seq.py --output_dir runs/compare --max_steps 3000

Both models are encoder-decoder `DATForSeq2SeqLM`s with the same width, depths and total heads per layer; the DAT
has `--relational_heads` of them relational (symbolic-attention symbols), the Transformer has 0. The Transformer's MLP
width is chosen so that its parameter count is the closest to the DAT's (both counts are reported). With
`--parallel` (default) the two runs train side by side in two processes (one thread each), so they see the same
machine load; `--no-parallel` trains them one after the other. Results: `<output_dir>/comparison.json` and a
Markdown table `<output_dir>/comparison.md` (also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script train_seq2seq.py


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--modules", default="arithmetic__add_or_sub,algebra__linear_1d")
    parser.add_argument("--n_train_per_module", type=int, default=20000)
    parser.add_argument("--n_test_per_module", type=int, default=500)
    parser.add_argument("--difficulty", default="easy")
    parser.add_argument("--max_steps", type=int, default=3000)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--encoder_layers", type=int, default=2)
    parser.add_argument("--decoder_layers", type=int, default=2)
    parser.add_argument("--total_heads", type=int, default=4)
    parser.add_argument("--relational_heads", type=int, default=2)
    parser.add_argument("--cross_attention", default="sensory", help="DAT cross-attention: sensory or dual.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--only", choices=["dat", "transformer"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def matched_intermediate_size(dat_params: int, base_kwargs: dict, tokenizer) -> tuple[int, int]:
    """The Transformer MLP width whose model has the parameter count closest to `dat_params`."""
    from dat_hf import DATForSeq2SeqLM

    from train_seq2seq import ModelArguments, build_config

    def count(width):
        args = ModelArguments(**{**base_kwargs, "intermediate_size": width})
        with _meta_device():
            model = DATForSeq2SeqLM(build_config(args, tokenizer))
        return sum(p.numel() for p in model.parameters())

    low, high = 8, 64 * base_kwargs["hidden_size"]
    while high - low > 1:  # parameters grow with the width
        mid = (low + high) // 2
        low, high = (mid, high) if count(mid) <= dat_params else (low, mid)
    best = min((low, high), key=lambda w: abs(count(w) - dat_params))
    return best, count(best)


class _meta_device:
    def __enter__(self):
        import torch

        self.ctx = torch.device("meta")
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


def run_one(args, name: str):
    """Train and evaluate one model in this process; writes `<output_dir>/<name>/exact_match.json`."""
    from dat_hf.training.math_data import build_char_tokenizer

    from train_seq2seq import ModelArguments, main

    tokenizer = build_char_tokenizer()
    heads = args.total_heads
    dat_kwargs = dict(hidden_size=args.hidden_size, encoder_layers=args.encoder_layers,
                      decoder_layers=args.decoder_layers, num_sensory_heads=heads - args.relational_heads,
                      num_relational_heads=args.relational_heads, cross_attention=args.cross_attention)
    if name == "dat":
        model_kwargs = dat_kwargs
    else:
        from dat_hf import DATForSeq2SeqLM

        from train_seq2seq import build_config

        with _meta_device():
            dat = DATForSeq2SeqLM(build_config(ModelArguments(**dat_kwargs), tokenizer))
        dat_params = sum(p.numel() for p in dat.parameters())
        base = dict(dat_kwargs, num_sensory_heads=heads, num_relational_heads=0, cross_attention="sensory")
        width, _ = matched_intermediate_size(dat_params, base, tokenizer)
        model_kwargs = dict(base, intermediate_size=width)
    argv = [
        "--output_dir", os.path.join(args.output_dir, name), "--use_cpu", "--report_to", "none",
        "--max_steps", str(args.max_steps), "--per_device_train_batch_size", str(args.batch_size),
        "--per_device_eval_batch_size", "128", "--learning_rate", str(args.learning_rate),
        "--lr_scheduler_type", "cosine", "--warmup_steps", str(max(1, args.max_steps // 20)), "--weight_decay", "0.01",
        "--seed", str(args.seed), "--eval_strategy", "no", "--save_strategy", "no",
        "--logging_steps", str(max(1, args.max_steps // 20)), "--math_modules", args.modules,
        "--n_train_per_module", str(args.n_train_per_module), "--n_test_per_module", str(args.n_test_per_module),
        "--math_difficulty", args.difficulty, "--problem_seed", str(args.seed), "--disable_tqdm", "true",
        "--dataloader_num_workers", "0",
    ]
    for key, value in model_kwargs.items():
        argv += [f"--{key}", str(value)]
    return main(argv)


def table(results: dict, args) -> str:
    modules = [m for m in args.modules.split(",") if m]
    header = "| model | relational heads | parameters | " + " | ".join(modules) + " | overall | train time (s) | mean train loss |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, label, nr in (("dat", "DAT", args.relational_heads), ("transformer", "Transformer", 0)):
        r = results[name]
        cells = [f"{100 * r[m]:.1f}%" for m in modules]
        lines.append(f"| {label} | {nr} of {args.total_heads} | {r['parameters']:,} | " + " | ".join(cells)
                     + f" | {100 * r['exact_match']:.1f}% | {r['train_seconds']:.0f} | {r['train_loss']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.only:
        run_one(args, args.only)
        return None
    start = time.time()
    if args.parallel:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        base = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        procs = {}
        for name in ("dat", "transformer"):
            log = open(os.path.join(args.output_dir, f"{name}.log"), "w")
            procs[name] = subprocess.Popen([*base, "--only", name], env=env, stdout=log, stderr=subprocess.STDOUT)
        for name, proc in procs.items():
            if proc.wait() != 0:
                raise RuntimeError(f"The {name} run failed; see {args.output_dir}/{name}.log")
    else:
        for name in ("dat", "transformer"):
            run_one(args, name)
    results = {name: json.load(open(os.path.join(args.output_dir, name, "exact_match.json")))
               for name in ("dat", "transformer")}
    import torch

    results["setup"] = dict(vars(args), wall_seconds=round(time.time() - start, 1), torch_threads=1 if args.parallel
                            else torch.get_num_threads(), cpu_count=os.cpu_count(),
                            load_average_at_end=os.getloadavg())
    with open(os.path.join(args.output_dir, "comparison.json"), "w") as f:
        json.dump(results, f, indent=2)
    markdown = table(results, args)
    with open(os.path.join(args.output_dir, "comparison.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)
    return results


if __name__ == "__main__":
    main()
