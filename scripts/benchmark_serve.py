#!/usr/bin/env python
"""Serving throughput: output tokens/s of DAT (`DATForCausalLM`) and a Llama of the same width, depth, heads, FFN and
vocabulary, for 1, 4, 16 and 64 concurrent requests of mixed prompt lengths, served three ways side by side:

- continuous batching: Transformers' manager (`init_continuous_batching`, what `generate_batch` and `transformers
  serve --continuous-batching` run) over its paged cache, started once per model (its construction is timed apart,
  as `setup_s`); the requests are added at once and timed until the last one finishes;
- sequential: one `generate` per request, one after the other;
- padded: one `generate` over all the requests, left-padded to the longest prompt.

    python scripts/benchmark_serve.py --repeats 3 --out docs/benchmarks/serve_cpu
    python scripts/benchmark_serve.py --concurrency 16 64 --new-tokens 64 --device cuda --dtype bf16 --hidden 1024 \\
        --sensory-heads 8 --relational-heads 8 --ffn 4096 --vocab 32000
    python scripts/benchmark_serve.py --preset dat-343m --layers 24 --concurrency 16 --out /tmp/serve_343m
    python scripts/benchmark_serve.py --quick --out /tmp/serve      # a tiny model, in seconds (tests/)

Prompts are seeded (lengths uniform in `--prompt-lengths`, a fresh draw for each concurrency, the same for both
models); decoding is greedy with end-of-sequence disabled, so that every request yields `--new-tokens` tokens, and the
continuous-batching and padded tokens are compared with the sequential ones (`tokens_equal`). Each repetition runs
each model in a process of its own, the ways in a rotating order; ratios are taken per repetition and reported as
median [min-max]. Also reported: the bytes per token each model's caches hold (the paged cache's pages, from its
allocators; the dynamic cache of a `generate`, from its keys and values) and the FLOP model's DAT / Llama ratio of a
decoding step (`scripts/benchmark.py`'s `macs_per_token`). Writes `serve.json` under `--out`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # noqa: E402  (the benchmark model, the FLOP model, ratios)

MODELS = ("dat_hf", "llama")
WAYS = ("continuous", "sequential", "padded")
# `--quick`: a tiny model whose logits spread (greedy tokens vary), two concurrencies, in this process
QUICK = dict(in_process=True, init=0.3, hidden=64, layers=2, sensory_heads=2, relational_heads=2, ffn=128, vocab=256,
             concurrency=[1, 4], prompt_lengths=[4, 12], new_tokens=6, repeats=1, threads=1, page_size=16,
             max_batch_tokens=64)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


# ---- the models and the requests ---------------------------------------------------------------------------------
def model_configs(args):
    """(DAT config, Llama config): `scripts/benchmark.py`'s benchmark model at this script's sizes (SwiGLU, RMSNorm,
    64 symbols; Llama with all heads as self-attention heads, tied embeddings), weights drawn with `--init`."""
    shapes = argparse.Namespace(preset=args.preset, layers=args.layers, vocab=args.vocab, hidden=args.hidden,
                                sensory_heads=args.sensory_heads, relational_heads=args.relational_heads,
                                ffn=args.ffn, relational_bias="causal", window=None)
    dat = benchmark.dat_config(shapes, args.prompt_lengths[1] + args.new_tokens)
    llama = benchmark.llama_config(dat)
    for config in (dat, llama):
        config.initializer_range = args.init
        config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, None, None
    return dat, llama


def build_model(name, args):
    import torch

    from dat_hf import DATForCausalLM
    from transformers import LlamaForCausalLM

    dat, llama = model_configs(args)
    config = dat if name == "dat_hf" else llama
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = (DATForCausalLM if name == "dat_hf" else LlamaForCausalLM)(config).eval()
    return model.to(args.device, getattr(torch, DTYPES[args.dtype]))


def request_prompts(args, concurrency):
    """`concurrency` prompts (lists of token ids, none of them the padding id 0), lengths uniform in
    `--prompt-lengths`, drawn with `--seed` and the concurrency."""
    import torch

    generator = torch.Generator().manual_seed(args.seed * 1000 + concurrency)
    low, high = args.prompt_lengths
    lengths = torch.randint(low, high + 1, (concurrency,), generator=generator)
    return [torch.randint(1, args.vocab, (int(n),), generator=generator).tolist() for n in lengths]


def generation_config(args):
    """Greedy, exactly `--new-tokens` tokens (no end-of-sequence token)."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            eos_token_id=None, pad_token_id=0, bos_token_id=None)


# ---- the three ways ----------------------------------------------------------------------------------------------
def sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def sequential(model, prompts, args):
    """One `generate` per request -> the new tokens of each."""
    import torch

    tokens = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=args.device), generation_config=generation_config(args))
        tokens.append(out[0, len(prompt):].tolist())
    return tokens


def padded(model, prompts, args):
    """One `generate` over every request, left-padded -> the new tokens of each."""
    import torch

    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    out = model.generate(ids.to(args.device), attention_mask=mask.to(args.device),
                         generation_config=generation_config(args))
    return out[:, longest:].tolist()


def start_manager(model, args):
    """Transformers' continuous-batching manager of `model`, its paged cache sized for the largest concurrency (not
    from the machine's free memory, which on CPU is most of its RAM), flash attention not swapped in (both models
    run SDPA), started."""
    from transformers import ContinuousBatchingConfig

    config = generation_config(args)
    config.min_new_tokens, config.eos_token_id = None, -1  # (end-of-sequence disabled the manager's way)
    pages = -(-(args.prompt_lengths[1] + args.new_tokens) // args.page_size)
    cb_config = ContinuousBatchingConfig(page_size=args.page_size, num_blocks=max(args.concurrency) * pages + 1,
                                         max_batch_tokens=args.max_batch_tokens, auto_switch_to_flash=False)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.warmup()  # (builds the paged cache; on CUDA also captures the manager's graphs)
    manager.start()
    return manager


def continuous(manager, prompts, args):
    """Every request added to the running manager at once -> the new tokens of each, once all have finished."""
    ids = manager.add_requests(inputs=prompts, max_new_tokens=args.new_tokens)
    done = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=args.request_timeout)
        if result is None:
            fatal = manager.background_thread_status.fatal_error
            raise RuntimeError(f"continuous batching stopped with {len(done)} of {len(ids)} requests done: "
                               f"{fatal or f'no result for {args.request_timeout} s'}")
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"continuous batching: request {result.request_id} failed: {result.error}")
            done[result.request_id] = result.generated_tokens
    return [done[i] for i in ids]


# ---- the cache's bytes per token ---------------------------------------------------------------------------------
def paged_bytes_per_token(cache) -> int:
    """Bytes one token takes in a `PagedAttentionCache`, every layer: each allocator's page (`tokens_per_page` tokens
    of one layer) times its layers, over the tokens a page holds."""
    return int(sum(allocator.bytes_per_page * len(allocator.layer_indices) / allocator.tokens_per_page
                   for allocator in cache.cache_allocators.values()))


def dynamic_bytes_per_token(model, prompt, args) -> int:
    """Bytes one token takes in the cache of a `generate` (a `DynamicCache`): its layers' keys and values over the
    tokens it holds (batch 1; a DAT layer's keys and values are views of buffers with spare room: the views count)."""
    import torch

    config = generation_config(args)
    config.return_dict_in_generate = True
    out = model.generate(torch.tensor([prompt], device=args.device), generation_config=config)
    cache = next(getattr(out, name) for name in ("cache", "past_key_values") if getattr(out, name, None) is not None)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return held // cache.get_seq_length()


# ---- one model, every concurrency and way (a worker process) -----------------------------------------------------
def ready_manager(model, warm, args, result):
    """The started manager, warmed up on the `warm` prompts (its construction and those requests timed as
    `setup_s`), its paged cache's bytes per token put in `result`; None, its error in `result`, when it cannot serve
    the model."""
    manager = None
    try:
        start = time.perf_counter()
        manager = start_manager(model, args)
        continuous(manager, warm, args)
        result["setup_s"] = time.perf_counter() - start
        result["paged_bytes_per_token"] = paged_bytes_per_token(manager.batch_processor.cache)
    except Exception as error:  # noqa: BLE001 (a model the manager cannot serve: the other ways still run)
        result["continuous_error"] = f"{type(error).__name__}: {error}"
        if manager is not None:  # (its running thread would keep the process alive)
            manager.stop(block=True)
            manager.destroy()
        return None
    return manager


def serve_every_way(model, manager, prompts, ways, args):
    """The requests served each way in turn -> ({way: {"seconds", "tokens_per_s"} or {"error"}}, {way: the new
    tokens of each request}, {way: the relational backend that ran, for DAT})."""
    serve = {"sequential": sequential, "padded": padded, "continuous": lambda m, p, a: continuous(manager, p, a)}
    row, tokens, backends = {}, {}, {}
    for way in ways:
        if way == "continuous" and manager is None:
            row[way] = {"error": "no manager"}
            continue
        sync(args.device)
        start = time.perf_counter()
        try:
            tokens[way] = serve[way](model, prompts, args)
        except Exception as error:  # noqa: BLE001 (reported in its cell)
            row[way] = {"error": f"{type(error).__name__}: {error}"}
            continue
        sync(args.device)
        seconds = time.perf_counter() - start
        counts = {len(t) for t in tokens[way]}
        if counts != {args.new_tokens}:
            row[way] = {"error": f"requests yielded {sorted(counts)} tokens, not {args.new_tokens}"}
            continue
        row[way] = {"seconds": seconds, "tokens_per_s": len(prompts) * args.new_tokens / seconds}
        if (backend := benchmark.relational_backend(model)) is not None:
            backends[way] = backend
    return row, tokens, backends


def measure_model(name, args, repetition=0):
    """Every concurrency served every way by one model, the ways' order rotated by the repetition -> {"concurrency":
    {c: {way: {"seconds", "tokens_per_s"} or {"error"}}}, "tokens_equal": {c: {way: requests whose tokens equal
    the sequential ones}}, "distinct_tokens": {c: mean distinct tokens per sequential request}, bytes per token of
    both caches, the manager's setup time, the relational backends}."""
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(name, args)
    ways = WAYS[repetition % 3:] + WAYS[:repetition % 3]
    result = {"parameters": sum(p.numel() for p in model.parameters()), "ways_order": list(ways),
              "concurrency": {}, "tokens_equal": {}, "distinct_tokens": {}, "backend": {}}
    warm = request_prompts(args, 2)
    with torch.no_grad():
        sequential(model, warm, args)  # (one-time costs are not per-token costs)
        padded(model, warm, args)
        result["dynamic_bytes_per_token"] = dynamic_bytes_per_token(model, warm[0], args)
        manager = ready_manager(model, warm, args, result)
        for concurrency in args.concurrency:
            key = str(concurrency)  # (keys as JSON has them)
            row, tokens, backends = serve_every_way(model, manager, request_prompts(args, concurrency), ways, args)
            if manager is None:
                row["continuous"] = {"error": result["continuous_error"]}
            result["concurrency"][key] = row
            result["backend"].update(backends)
            if "sequential" in tokens:
                result["tokens_equal"][key] = {way: sum(a == b for a, b in zip(t, tokens["sequential"]))
                                               for way, t in tokens.items() if way != "sequential"}
                result["distinct_tokens"][key] = statistics.mean(len(set(t)) for t in tokens["sequential"])
            progress(f"{name} repetition {repetition + 1}, {concurrency} requests: " + ", ".join(
                f"{way} {cell['tokens_per_s']:.1f} tokens/s" if "tokens_per_s" in cell else f"{way} failed"
                for way, cell in row.items()))
        if manager is not None:
            manager.stop(block=True)
            manager.destroy()
    return result


def run_worker(name, args, repetition):
    """`measure_model` in a process of its own (this checkout's dat_hf first on its path) -> its result, or
    {"error": its last line of stderr}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [benchmark.CHECKOUT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--repetition", str(repetition),
           "--worker-args", json.dumps(vars(args))]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)  # (stderr: its progress, shown)
    if done.returncode != 0:
        return {"error": f"worker {name} exited with {done.returncode} (its stderr is above)"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- summaries ---------------------------------------------------------------------------------------------------
def decode_flop_ratio(args, concurrency) -> float:
    """DAT / Llama multiply-adds per decoded token (`benchmark.macs_per_token`, relations formed once per pair), at
    the mean context of the concurrency's requests over their decoding (the count is linear in the context)."""
    dat, _ = model_configs(args)
    prompts = request_prompts(args, concurrency)
    context = statistics.mean(map(len, prompts)) + (args.new_tokens + 1) / 2
    return benchmark.macs_per_token(dat, context, "eager") / benchmark.macs_per_token(dat, context, "llama")


def summarize(runs, args):
    """Per-repetition worker results {model: [result, ...]} -> the table: per concurrency, each model's median
    tokens/s per way and continuous batching's (and the padded batch's) speed-up over sequential; DAT / Llama tokens/s
    each way and speed-up, and the FLOP model's DAT / Llama; per model, bytes per token of both caches."""
    cells = {c: {m: [r.get("concurrency", {}).get(str(c), {}) for r in runs[m]] for m in runs}
             for c in args.concurrency}
    table = {"concurrency": {}, "memory": {}}
    for c, by_model in cells.items():
        row = {}
        for model, reps in by_model.items():
            ways = {way: [rep.get(way, {}) for rep in reps] for way in WAYS}
            speedup = benchmark.pair_ratios(ways, "continuous", "sequential", "tokens_per_s")
            row[model] = {way: benchmark.summarize(cell, "tokens_per_s") for way, cell in ways.items()}
            row[model]["speedup"] = speedup
            row[model]["padded_speedup"] = benchmark.pair_ratios(ways, "padded", "sequential", "tokens_per_s")
            row[model]["errors"] = sorted({cell["error"] for cell in sum(ways.values(), []) if "error" in cell})
            row[model]["tokens_equal"] = [r.get("tokens_equal", {}).get(str(c)) for r in runs[model]]
        if set(MODELS) <= set(row):
            row["dat_hf/llama"] = {
                "tokens_per_s": {way: benchmark.pair_ratios({m: [rep.get(way, {}) for rep in by_model[m]]
                                                             for m in MODELS}, "dat_hf", "llama", "tokens_per_s")
                                 for way in WAYS},
                "speedup": benchmark.pair_ratios(
                    {m: [{"s": s} for s in (row[m]["speedup"] or {}).get("pairs", [])] for m in MODELS},
                    "dat_hf", "llama", "s"),
                "decode_flop_ratio": decode_flop_ratio(args, c)}
        table["concurrency"][c] = row
    for model, results in runs.items():
        done = [r for r in results if "dynamic_bytes_per_token" in r]
        table["memory"][model] = {key: done[0].get(key) if done else None
                                  for key in ("paged_bytes_per_token", "dynamic_bytes_per_token")}
        table["memory"][model]["setup_s"] = benchmark.summarize(done, "setup_s")
    table["acceptance"] = acceptance(table, args)
    return table


def acceptance(table, args) -> dict:
    """Issue 42's bars at 16 requests (or the nearest concurrency measured): DAT's continuous-batching speed-up at
    least 0.8x Llama's; DAT's time per token under continuous batching over Llama's at most the FLOP model's ratio;
    the paged cache at most the dynamic cache's bytes per token."""
    c = min(args.concurrency, key=lambda n: abs(n - 16))
    ratios = table["concurrency"][c].get("dat_hf/llama", {})
    speedup, tps = ratios.get("speedup"), ratios.get("tokens_per_s", {}).get("continuous")
    memory = table["memory"].get("dat_hf", {})
    paged, dynamic = memory.get("paged_bytes_per_token"), memory.get("dynamic_bytes_per_token")
    return {"concurrency": c,
            "speedup_ratio": speedup and speedup["median"], "speedup_ok": speedup and speedup["median"] >= 0.8,
            "time_ratio": tps and 1 / tps["median"], "flop_ratio": ratios.get("decode_flop_ratio"),
            "time_ok": tps and 1 / tps["median"] <= ratios["decode_flop_ratio"],
            "paged_bytes_ok": paged and dynamic and paged <= dynamic}


def cell(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def report(table, args):
    dat, _ = model_configs(args)
    heads = dat.num_sensory_heads + dat.num_relational_heads
    print(f"\nserving throughput, output tokens/s ({args.new_tokens} new tokens per request, greedy, prompts of "
          f"{args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens; d={dat.hidden_size}, {dat.num_hidden_layers} "
          f"layers, {dat.num_sensory_heads}+{dat.num_relational_heads} heads vs {heads} Llama heads, ffn "
          f"{dat.intermediate_size}, vocabulary {dat.vocab_size}; {args.device} {args.dtype}, {args.threads} threads; "
          f"medians of {args.repeats}; ratios: median [min-max] of the per-repetition ratios)")
    print(f"{'requests':>8} {'model':>7} {'continuous':>10} {'sequential':>10} {'padded':>8} {'CB speed-up':>17} "
          f"{'padded speed-up':>17}")
    for c, row in table["concurrency"].items():
        for model in MODELS:
            if model in row:
                r = row[model]
                print(f"{c:>8} {model:>7} {cell(r['continuous']):>10} {cell(r['sequential']):>10} "
                      f"{cell(r['padded']):>8} {benchmark.ratio_cell(r['speedup'], True):>17} "
                      f"{benchmark.ratio_cell(r['padded_speedup'], True):>17}"
                      + "".join(f"\n         error: {e}" for e in r["errors"]))
    print("\nDAT / Llama: tokens/s each way (its inverse: time per token), continuous batching's speed-up, the FLOP "
          f"model's work per decoded token\n{'requests':>8}" + "".join(f" {way:>17}" for way in WAYS)
          + f" {'speed-up':>17} {'FLOPs':>6}")
    for c, row in table["concurrency"].items():
        ratios = row.get("dat_hf/llama", {})
        print(f"{c:>8}" + "".join(f" {benchmark.ratio_cell(ratios.get('tokens_per_s', {}).get(way), True):>17}"
                                  for way in WAYS)
              + f" {benchmark.ratio_cell(ratios.get('speedup'), True):>17} "
              f"{cell(ratios.get('decode_flop_ratio'), '.2f'):>6}")
    print("\ncache bytes per token (every layer): " + "; ".join(
        f"{model} paged {m['paged_bytes_per_token']}, dynamic {m['dynamic_bytes_per_token']} (manager setup "
        f"{cell(m['setup_s'], '.2f')} s)" for model, m in table["memory"].items()))
    print("acceptance: " + json.dumps(table["acceptance"]))


def progress(message):
    print(f"[benchmark_serve] {message}", file=sys.stderr, flush=True)


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="requests served at once")
    p.add_argument("--prompt-lengths", type=int, nargs=2, default=[8, 96], metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--preset", help="a dat_hf preset's shapes (e.g. dat-343m: d=1024, 8 + 8 heads, 4 key/value heads "
                                    "each, 1,024 symbols, vocabulary 50,304) at --layers depth, instead of --hidden, "
                                    "--ffn, --vocab and the heads")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sensory-heads", type=int, default=4, help="DAT's sensory heads (Llama: sensory + relational)")
    p.add_argument("--relational-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--init", type=float, default=0.1,
                   help="initializer_range: spread logits, so that greedy tokens vary and depend on the prefix")
    p.add_argument("--page-size", type=int, default=256, help="the paged cache's tokens per page (Transformers' "
                                                                "default)")
    p.add_argument("--max-batch-tokens", type=int, default=1024, help="tokens per continuous-batching step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS) of every worker")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds to wait for the manager's next result before giving up")
    p.add_argument("--in-process", action="store_true",
                   help="measure every model in this process (no worker processes: one start-up for all)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 and 4 requests of 4-12 tokens, 6 new "
                                                        "tokens, one repetition, in this process (tests)")
    p.add_argument("--out", help="folder of serve.json")
    p.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--repetition", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-args", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.worker:  # (one model, in its own process): the result as the last line of stdout
        worker = argparse.Namespace(**json.loads(args.worker_args))
        print(json.dumps(measure_model(args.worker, worker, args.repetition)))
        return
    sys.path.insert(0, benchmark.CHECKOUT)  # (this checkout's dat_hf, ahead of an installed one)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    low, high = args.prompt_lengths
    if not 1 <= low <= high:
        parser().error(f"--prompt-lengths {low} {high}: need 1 <= MIN <= MAX")
    from dat_hf.transformers_compat import paged_cache_limits

    # (before 5.24 the manager also swaps Llama's attention while it runs, so `generate` beside it fails)
    if (why := paged_cache_limits()) is not None:
        parser().error(f"DAT's continuous batching needs another Transformers: {why}")
    runs = {model: [] for model in args.models}
    start = time.perf_counter()
    for repetition in range(args.repeats):
        for model in args.models:
            runs[model].append(measure_model(model, args, repetition) if args.in_process
                               else run_worker(model, args, repetition))
    table = summarize(runs, args)
    table["wall_s"] = time.perf_counter() - start
    report(table, args)
    print(f"wall time {table['wall_s']:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "serve.json"), "w") as f:
            json.dump({"args": vars(args), "results": table, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
