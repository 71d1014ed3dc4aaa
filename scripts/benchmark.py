#!/usr/bin/env python
"""Benchmark dat_hf DATForCausalLM against the authors' reference (`dual-attention`, converted weights) and
Transformers' LlamaForCausalLM of the same width, depth, total heads and FFN.

    python scripts/benchmark.py train --seq 256 512 1024 --repeats 3 --out runs/bench
    python scripts/benchmark.py generate --prompt 16 1024 --new-tokens 512 --out runs/bench
    python scripts/benchmark.py parts --seq 2048 4096 --repeats 5 --out runs/parts
    python scripts/benchmark.py train --device cuda --dtype bf16 --seq 1024 2048 4096 8192 --out runs/gpu

Every measurement runs in its own process (peak memory = that process's max RSS; "net" = peak minus the RSS once the
model and optimizer are built, i.e. what training adds); models alternate within each
repetition, so machine drift hits all alike, and each ratio is taken per repetition (the two workers ran back to back)
and summarized by its median, with the min-max spread beside it. Prints a table of medians and ratios, writes JSON
(every worker's figures too) and PNG scaling curves for `train` when matplotlib is available.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

IMPLS = ("dat_hf", "reference", "llama")


def model_kwargs(args):
    return dict(vocab=args.vocab, d=args.hidden, layers=args.layers, sa=args.sensory_heads, ra=args.relational_heads,
                dff=args.ffn, max_len=max(args.max_len, 2))


def build(impl, vocab, d, layers, sa, ra, dff, max_len, attn="sdpa"):
    import torch

    torch.manual_seed(0)
    if impl == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=sa + ra,
                             intermediate_size=dff, max_position_embeddings=max_len, tie_word_embeddings=True)
        config._attn_implementation = attn
        return LlamaForCausalLM(config)
    from dual_attention.language_models import DualAttnTransformerLM

    reference = DualAttnTransformerLM(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads_sa=sa, n_heads_ra=ra, dff=dff, dropout_rate=0.0,
        activation="swiglu", norm_first=True, max_block_size=max_len, norm_type="rmsnorm", pos_enc_type="RoPE",
        symbol_retrieval="symbolic_attention", symbol_retrieval_kwargs=dict(d_model=d, n_heads=4, n_symbols=64),
    )
    if impl == "reference":
        return reference
    import dat_hf

    model = dat_hf.from_reference_model(reference)
    model.config._attn_implementation = attn
    return model


def _logits(impl, model, x):
    return model(x)[0] if impl == "reference" else model(x).logits


class Device:
    """Where a worker runs: `sync()` before reading a clock; peak memory = max RSS on CPU, the allocator's peak on
    CUDA; `autocast()` for `--dtype bf16` (fp32 weights, bf16 matmuls)."""

    def __init__(self, args):
        import torch

        self.torch, self.name, self.bf16 = torch, args.device, args.dtype == "bf16"
        self.cuda = torch.device(args.device).type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def memory_gib(self):
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**30
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)

    def autocast(self):
        import contextlib

        if not self.bf16:
            return contextlib.nullcontext()
        return self.torch.autocast(self.torch.device(self.name).type, dtype=self.torch.bfloat16)


def worker_train(args):
    import torch

    torch.set_num_threads(args.threads)
    device = Device(args)
    model = build(args.impl, **model_kwargs(args)).train().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.compile:  # the first (warm-up) step compiles; dat_hf and Llama compile as one graph
        if args.impl == "dat_hf":  # compiled graphs call dat_hf's CPU kernel only when it is already loaded
            import dat_hf

            dat_hf.load_cpu_kernel()
        model = torch.compile(model, fullgraph=args.impl != "reference")
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    base = device.memory_gib()  # interpreter, libraries and the model (CPU); the model (CUDA)
    times = []
    for step in range(args.steps + 1):
        device.sync()
        start = time.perf_counter()
        with device.autocast():
            logits = _logits(args.impl, model, x)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        device.sync()
        if step > 0:  # the first step warms up
            times.append(time.perf_counter() - start)
    peak = device.memory_gib()
    # net = what training added on top of the process after the model was built (activations, gradients, AdamW)
    print(json.dumps({"time_s": statistics.median(times), "peak_gib": peak, "net_gib": peak - base}))


def worker_generate(args):
    import torch

    torch.set_num_threads(args.threads)
    device = Device(args)
    model = build(args.impl, **model_kwargs(args)).eval().to(args.device)
    if device.bf16:
        model = model.to(torch.bfloat16)
    x = torch.randint(0, args.vocab, (1, args.prompt), device=args.device)

    def generate(new_tokens):
        if args.impl == "reference":
            return model.generate(x, new_tokens, top_k=1)
        return model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def timed(new_tokens):
        device.sync()
        start = time.perf_counter()
        generate(new_tokens)
        device.sync()
        return time.perf_counter() - start

    with torch.no_grad():
        generate(2)  # warm-up: one-time costs (loading kernels, first allocations) are not per-token costs
        prefill = timed(1)  # the prompt's forward and the first token
        elapsed = timed(args.new_tokens)
    # decode = per-token latency after the prompt; with_prompt spreads the prompt's forward over the new tokens
    print(json.dumps({"decode_ms_per_token": 1000 * (elapsed - prefill) / max(1, args.new_tokens - 1),
                      "ms_per_token": 1000 * elapsed / args.new_tokens, "prefill_s": prefill}))


def run_worker(mode, impl, args, **extra):
    cmd = [sys.executable, __file__, f"_{mode}", "--impl", impl, "--threads", str(args.threads)]
    for key, value in {**vars(args), **extra}.items():
        if key in ("mode", "impl", "threads", "seq", "prompt", "out", "impls", "repeats", "func"):
            continue
        if isinstance(value, bool):
            cmd += [f"--{key.replace('_', '-')}"] if value else []
            continue
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key in ("seq", "prompt"):
        if key in extra:
            cmd += [f"--{key}", str(extra[key])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.mmap_threshold:  # glibc then maps every larger block on its own and unmaps it when freed
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarize(results, metric):
    values = [r[metric] for r in results if metric in r]
    return statistics.median(values) if values else None


def pair_ratios(runs, impl, other, metric):
    """`metric` of `impl` over `other`, one ratio per repetition (the two ran back to back, so a drift of the machine's
    speed between repetitions cancels), for the repetitions where both ran: {"median", "min", "max", "pairs"}."""
    pairs = [a[metric] / b[metric] for a, b in zip(runs.get(impl, []), runs.get(other, []))
             if a.get(metric) and b.get(metric)]
    if not pairs:
        return None
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs), "pairs": pairs}


def ratio_cell(ratio, spread=False):
    if ratio is None:
        return "-"
    return f"{ratio['median']:.2f}" + (f" [{ratio['min']:.2f}-{ratio['max']:.2f}]" if spread else "")


def main_train(args):
    table = {}
    for seq in args.seq:
        runs = {impl: [] for impl in args.impls}
        for _ in range(args.repeats):
            for impl in args.impls:
                skip = impl == "reference" and seq > args.reference_max_seq
                runs[impl].append({} if skip else run_worker("train", impl, args, seq=seq,
                                                             max_len=max(seq, args.max_len)))
        table[seq] = {impl: {"time_s": summarize(r, "time_s"), "peak_gib": summarize(r, "peak_gib"),
                             "net_gib": summarize(r, "net_gib"), "runs": r,
                             "errors": [x["error"] for x in r if "error" in x]} for impl, r in runs.items()}
        for impl, row in table[seq].items():
            row["ratios"] = {f"{metric}/{other}": pair_ratios(runs, impl, other, metric)
                             for metric in ("time_s", "peak_gib", "net_gib") for other in ("reference", "llama")
                             if other != impl}
    print(f"\ntrain step (fwd+bwd+AdamW), batch {args.batch}, d={args.hidden}, {args.layers} layers, "
          f"{args.sensory_heads}+{args.relational_heads} heads, ffn {args.ffn}, {args.threads} threads"
          + (", torch.compile" if args.compile else "") + f", {args.device} {args.dtype}"
          + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else ""))
    print("times and memory: medians over repetitions; ratios: median [min-max] of the per-repetition ratios")
    print(f"{'seq':>6} {'impl':>10} {'time s':>9} {'peak GiB':>9} {'net GiB':>8} {'t/ref':>17} {'t/llama':>17} "
          f"{'m/ref':>7} {'m/llama':>8} {'net/ref':>8} {'net/llama':>9}")
    for seq, row in table.items():
        for impl, r in row.items():
            def ratio(key, other, spread=False):
                return ratio_cell(r["ratios"].get(f"{key}/{other}"), spread)
            t = f"{r['time_s']:.3f}" if r["time_s"] else "-"
            m = f"{r['peak_gib']:.2f}" if r["peak_gib"] else "-"
            net = f"{r['net_gib']:.2f}" if r["net_gib"] else "-"
            print(f"{seq:>6} {impl:>10} {t:>9} {m:>9} {net:>8} {ratio('time_s', 'reference', True):>17} "
                  f"{ratio('time_s', 'llama', True):>17} {ratio('peak_gib', 'reference'):>7} "
                  f"{ratio('peak_gib', 'llama'):>8} {ratio('net_gib', 'reference'):>8} {ratio('net_gib', 'llama'):>9}")
    return table


def main_generate(args):
    table = {}
    for prompt in args.prompt:
        runs = {impl: [] for impl in args.impls}
        for _ in range(args.repeats):
            for impl in args.impls:
                runs[impl].append(run_worker("generate", impl, args, prompt=prompt,
                                             max_len=max(args.max_len, prompt + args.new_tokens)))
        table[prompt] = {impl: {key: summarize(r, key) for key in ("decode_ms_per_token", "ms_per_token", "prefill_s")}
                         | {"runs": r, "errors": [x["error"] for x in r if "error" in x]} for impl, r in runs.items()}
        for impl, row in table[prompt].items():
            row["ratios"] = {f"decode_ms_per_token/{other}": pair_ratios(runs, impl, other, "decode_ms_per_token")
                             for other in IMPLS if other != impl}
    print(f"\ngeneration, {args.new_tokens} new tokens (greedy, batch 1, {args.threads} threads, {args.device} "
          f"{args.dtype}); decode = ms per "
          "token after the prompt, with prompt = total time / new tokens")
    print("times: medians over repetitions; ratios: median [min-max] of the per-repetition ratios")
    print(f"{'prompt':>7} {'impl':>10} {'decode ms':>10} {'with prompt':>12} {'prefill s':>10} {'decode/llama':>17} "
          f"{'ref/dat_hf decode':>18}")
    for prompt, row in table.items():
        for impl, r in row.items():
            def cell(value, fmt):
                return format(value, fmt) if value else "-"
            vs_llama = ratio_cell(r["ratios"].get("decode_ms_per_token/llama"), spread=True)
            ref_over_ours = row.get("reference", {}).get("ratios", {}).get("decode_ms_per_token/dat_hf")
            ref_cell = f"{ref_over_ours['median']:.1f}" if impl == "dat_hf" and ref_over_ours else "-"
            print(f"{prompt:>7} {impl:>10} {cell(r['decode_ms_per_token'], '.2f'):>10} "
                  f"{cell(r['ms_per_token'], '.2f'):>12} {cell(r['prefill_s'], '.3f'):>10} {vs_llama:>17} "
                  f"{ref_cell:>18}")
    return table


def main_parts(args):
    """Where a train step's time goes: one layer's parts, forward and backward (sum of outputs as the loss), dat_hf
    beside Llama in one process, parts alternating within each repetition; medians over `--repeats` (after one
    warm-up repetition)."""
    import torch

    from dat_hf.kernels.cpu import load_cpu_kernel, relational_attention_op
    from dat_hf.masking_dat import AttentionMask

    torch.set_num_threads(args.threads)
    kwargs = model_kwargs(args) | {"max_len": max(args.max_len, *args.seq)}
    dat, llama = build("dat_hf", **kwargs).train(), build("llama", **kwargs).train()
    dat_layer, llama_layer = dat.model.layers[0], llama.model.layers[0]
    heads = args.sensory_heads + args.relational_heads
    head_dim = args.hidden // heads
    relations, relation_dim = dat.config.relations, dat.config.relation_head_dim
    kernel = load_cpu_kernel()
    causal = AttentionMask(None, None, True)
    table = {}
    for seq in args.seq:
        b, positions = args.batch, torch.arange(seq)[None]
        x0 = torch.randn(b, seq, args.hidden)
        dat_rope, llama_rope = dat.model.rotary_emb(x0, positions), llama.model.rotary_emb(x0, positions)
        with torch.no_grad():
            symbols = dat.model.symbol_retrievers(0, x0, positions)

        def dat_layer_fn(x):
            return dat_layer(x, dat.model.symbol_retrievers(0, x, positions), dat_rope, causal, causal)

        def leaves(*shapes):  # random inputs made once; each call gets fresh leaves of them (no copy)
            tensors = [torch.randn(*shape) for shape in shapes]
            return lambda: [t.detach().requires_grad_() for t in tensors]

        def heads_fn(num_heads):
            inputs = leaves(*[(b, num_heads, seq, head_dim)] * 3)
            # x only carries a gradient so that every part is timed alike
            return lambda x: torch.nn.functional.scaled_dot_product_attention(*inputs(), is_causal=True) + 0 * x.sum()

        kernel_inputs = leaves(*[(b, args.relational_heads, seq, head_dim)] * 3,
                               *[(b, seq, relations, relation_dim)] * 2)

        def relational_kernel_fn(x):
            out, rel = relational_attention_op(*kernel_inputs(), True, head_dim**-0.5, relation_dim**-0.5, None)
            return out.sum() + rel.sum() + 0 * x.sum()

        parts = {
            "dat_hf layer": dat_layer_fn,
            "llama layer": lambda x: llama_layer(x, attention_mask=None, position_ids=positions,
                                                 position_embeddings=llama_rope),
            "dat_hf symbol retrieval": lambda x: dat.model.symbol_retrievers(0, x, positions),
            "dat_hf attention": lambda x: dat_layer.dual_attn(dat_layer.input_layernorm(x), symbols, dat_rope, causal,
                                                              causal)[0],
            "llama attention": lambda x: llama_layer.self_attn(llama_layer.input_layernorm(x), attention_mask=None,
                                                               position_embeddings=llama_rope)[0],
            "dat_hf mlp": lambda x: dat_layer.mlp(dat_layer.post_attention_layernorm(x)),
            "llama mlp": lambda x: llama_layer.mlp(llama_layer.post_attention_layernorm(x)),
            f"sdpa {args.sensory_heads} heads": heads_fn(args.sensory_heads),
            f"sdpa {heads} heads": heads_fn(heads),
        }
        if kernel:
            parts["relational kernel"] = relational_kernel_fn
        times = {name: [] for name in parts}
        for rep in range(args.repeats + 1):
            for name, fn in parts.items():
                x = x0.clone().requires_grad_()
                start = time.perf_counter()
                out = fn(x)
                middle = time.perf_counter()
                out.sum().backward()
                end = time.perf_counter()
                if rep:  # the first repetition warms up
                    times[name].append((middle - start, end - middle))
        table[seq] = {name: {"fwd_ms": 1000 * statistics.median(f for f, _ in t),
                             "bwd_ms": 1000 * statistics.median(bw for _, bw in t),
                             "total_ms": 1000 * statistics.median(f + bw for f, bw in t)} for name, t in times.items()}
    print(f"\none layer's parts, fwd + bwd, batch {args.batch}, d={args.hidden}, {args.sensory_heads}+"
          f"{args.relational_heads} heads, ffn {args.ffn}, {args.threads} threads; medians of {args.repeats}")
    for seq, row in table.items():
        print(f"seq {seq}")
        for name, r in row.items():
            print(f"  {name:>26} fwd {r['fwd_ms']:8.1f} ms  bwd {r['bwd_ms']:8.1f} ms  total {r['total_ms']:8.1f} ms")
        pairs = [("dat_hf layer", "llama layer"), ("dat_hf attention", "llama attention"), ("dat_hf mlp", "llama mlp"),
                 ("relational kernel", f"sdpa {args.sensory_heads} heads")]
        for a, other in pairs:
            if a in row and other in row:
                print(f"  {a} / {other}: {row[a]['total_ms'] / row[other]['total_ms']:.2f}")
        if "relational kernel" in row:
            both = row["relational kernel"]["total_ms"] + row[f"sdpa {args.sensory_heads} heads"]["total_ms"]
            print(f"  (relational kernel + sdpa {args.sensory_heads} heads) / sdpa {heads} heads: "
                  f"{both / row[f'sdpa {heads} heads']['total_ms']:.2f}")
    return table


def plot(table, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    seqs = sorted(table)
    for impl in IMPLS:
        for ax, key, label in ((axes[0], "time_s", "train step (s)"), (axes[1], "peak_gib", "peak memory (GiB)")):
            points = [(s, table[s][impl][key]) for s in seqs if impl in table[s] and table[s][impl][key]]
            if points:
                ax.plot(*zip(*points), marker="o", label=impl)
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["train", "generate", "parts", "_train", "_generate"],
                   help="parts: one layer's components (attention, symbol retrieval, MLP, attention kernels), "
                        "dat_hf beside Llama in one process")
    p.add_argument("--impl", choices=IMPLS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS))
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--prompt", type=int, nargs="+", default=[16, 1024])
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sensory-heads", type=int, default=4)
    p.add_argument("--relational-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]; on CUDA peak memory is the allocator's peak")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: train under autocast (fp32 weights), generate with bf16 weights")
    p.add_argument("--reference-max-seq", type=int, default=2048)
    p.add_argument("--compile", action="store_true", help="train: torch.compile every model (fullgraph for dat_hf, Llama)")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="fixed glibc mmap threshold in bytes for every worker (e.g. 131072): peak RSS then follows the "
                        "live tensors instead of the allocator's heap, which by default keeps freed blocks mapped")
    p.add_argument("--out", default=None)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.mode == "_train":
        args.seq = args.seq[0]
        return worker_train(args)
    if args.mode == "_generate":
        args.prompt = args.prompt[0]
        return worker_generate(args)
    table = {"train": main_train, "generate": main_generate, "parts": main_parts}[args.mode](args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": table}, f, indent=2)
        if args.mode == "train":
            plot(table, os.path.join(args.out, "train_scaling.png"))


if __name__ == "__main__":
    main()
