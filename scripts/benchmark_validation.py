#!/usr/bin/env python
"""Cost of dat_hf's input validation (`dat_hf.input_validation`, installed by `import dat_hf` into the model files'
hook point `kernel_hooks.check_inputs`): a training step and greedy decoding of the benchmark model
(`scripts/benchmark.py`'s `build("dat_hf", ...)`) with the checks on and off, alternating in one process (on, off,
off, on per repetition, so drift hits both alike); prints the median of each and the median of the per-repetition
ratios on / off, plus the time of the checks of ids, masks and labels alone per forward (through the hook point) and
its share of a step (the precise figure where the machine's noise exceeds the checks' cost).

    python scripts/benchmark_validation.py --repeats 15
    python scripts/benchmark_validation.py --seq 512 --batch 4 --new-tokens 64 --threads 2
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=3, help="training steps per measurement (median)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="sensory heads = relational heads")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def main():
    args = parse_args()
    import torch

    from benchmark import build
    from dat_hf import input_validation

    torch.set_num_threads(args.threads)
    max_len = max(args.seq, args.prompt + args.new_tokens)
    model_args = argparse.Namespace(vocab=args.vocab, hidden=args.hidden, layers=args.layers, sensory_heads=args.heads,
                                    relational_heads=args.heads, ffn=args.ffn, preset=None, attn="sdpa",
                                    relational_backend=None, relational_bias="causal", window=None)
    model = build("dat_hf", model_args, max_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    mask = torch.ones_like(x)
    prompt = torch.randint(0, args.vocab, (1, args.prompt))

    def train_step_s():
        times = []
        model.train()
        for _ in range(args.steps):
            start = time.perf_counter()
            model(input_ids=x, attention_mask=mask, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def generate_s(new_tokens):
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start

    def decode_ms_per_token():
        model.eval()
        with torch.no_grad():
            prefill = generate_s(1)
            return 1000 * (generate_s(args.new_tokens) - prefill) / (args.new_tokens - 1)

    measures = {"train step (s)": train_step_s, "decode (ms/token)": decode_ms_per_token}
    for measure in measures.values():  # warm-up
        measure()
    results = {name: {True: [], False: []} for name in measures}
    ratios = {name: [] for name in measures}
    for rep in range(args.repeats):
        for name, measure in measures.items():
            pair = {True: [], False: []}
            for enabled in (True, False, False, True):
                input_validation.ENABLED = enabled
                pair[enabled].append(measure())
            on, off = statistics.mean(pair[True]), statistics.mean(pair[False])
            results[name][True].append(on)
            results[name][False].append(off)
            ratios[name].append(on / off)
        print(f"repetition {rep + 1}/{args.repeats}: " + ", ".join(
            f"{name} on/off {ratios[name][-1]:.4f}" for name in measures), flush=True)
    input_validation.ENABLED = True

    print(f"\nbenchmark model: vocab {args.vocab}, d {args.hidden}, {args.layers} layers, {args.heads}+{args.heads} "
          f"heads, ffn {args.ffn}; train batch {args.batch} x {args.seq} (with attention_mask and labels), decode "
          f"{args.new_tokens} tokens after a {args.prompt}-token prompt; {args.threads} thread(s), {args.repeats} "
          "repetitions")
    for name in measures:
        ordered = sorted(ratios[name])
        print(f"{name:18s} on {statistics.median(results[name][True]):.5g}  off "
              f"{statistics.median(results[name][False]):.5g}  ratio on/off median {statistics.median(ordered):.4f} "
              f"[{ordered[0]:.4f}-{ordered[-1]:.4f}]")
    costs = check_costs(model, x, mask, args)
    for (name, seconds), measure, scale in zip(costs.items(), measures, (1.0, 1e-3)):
        step = statistics.median(results[measure][False]) * scale
        print(f"checks of one {name}: {1e6 * seconds:.1f} us = {100 * seconds / step:.3f}% of a {measure.split(' (')[0]}")


def check_costs(model, x, mask, args, calls=2000) -> dict:
    """Seconds of the checks alone, as one training forward and one decode step run them (through the hook point)."""
    import torch

    from dat_hf.kernel_hooks import check_inputs

    config = model.config
    decode_ids, decode_mask = x[:1, :1], torch.ones(1, args.prompt + args.new_tokens, dtype=torch.long)

    def train_checks():
        check_inputs("lm_labels", x, x, None, config.vocab_size)
        check_inputs("text_inputs", x, None, mask, None, 0, vocab_size=config.vocab_size,
                     hidden_size=config.hidden_size)

    def decode_checks():
        check_inputs("text_inputs", decode_ids, None, decode_mask, None, decode_mask.shape[1] - 1,
                     vocab_size=config.vocab_size, hidden_size=config.hidden_size)

    costs = {}
    for name, checks in (("train forward", train_checks), ("decode step", decode_checks)):
        start = time.perf_counter()
        for _ in range(calls):
            checks()
        costs[name] = (time.perf_counter() - start) / calls
    return costs


if __name__ == "__main__":
    main()
