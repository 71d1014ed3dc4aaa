"""Time one decoding step of the relational heads over a packed cache, for masks that allow every slot, a causal
step's slots (a static cache longer than the tokens so far) and a sliding window.

    python scripts/benchmark_decode_op.py [--slots 2176] [--position 2100] [--window 256] [--threads 1]
    python scripts/benchmark_decode_op.py --device cuda --dtype bf16 --heads 8 --kv-heads 4 --head-dim 64 \\
        --relations 8 --relation-dim 64 --slots 8192 --position 8100          # DAT-343M's relational heads

On CPU it times the CPU kernel's decoding op (`cpu`), which reads only the senders from the first to the last a
row's mask allows. On CUDA (`--backend triton`) it times the Triton kernel with its senders split among programs
(`triton`, as decoding runs) and with one program per batch row (`triton-one-program`, `SPLIT_SENDERS` raised past
the cache), beside SDPA over twice the heads (`sdpa-2h`, the self-attention of a Llama of the same width) as a
yardstick, with the bandwidth each reaches. Shapes default to the benchmark model's relational heads (4 heads of
32, 4 relations of 32); the cache is flushed from the caches before each call (a decoding step reads it from memory);
medians over `--repeats` calls, the masks alternating.
"""

import argparse
import json
import statistics
import time

import torch

import dat_hf.kernels.cpu as cpu_kernel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(args, device, dtype):
    """The step's tensors in the in-place cache layout: keys `[1, h_kv, slots, d]`, one flat value row [symbol values
    | relation keys] per slot; the query, relation query and W_r."""
    h, h_kv, d, R, d_r, n = args.heads, args.kv_heads or args.heads, args.head_dim, args.relations, args.relation_dim, \
        args.slots
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    key, flat = randn(1, h_kv, n, d), randn(1, n, h_kv * d + R * d_r)
    values = flat[..., : h_kv * d].view(1, n, h_kv, d).transpose(1, 2)
    k_rel = flat[..., h_kv * d:].view(1, n, R, d_r)
    return dict(query=randn(1, h, 1, d), key=key, values=values, q_rel=randn(1, 1, R, d_r), k_rel=k_rel,
                relation_proj=randn(h, d, R))


def step_functions(args, t, device):
    """{name: step(mask `[1, 1, 1, slots]` bool)} for `--backend`."""
    if args.backend == "cpu":
        if not cpu_kernel.load_cpu_kernel():
            raise SystemExit("the CPU kernel did not build")
        return {"cpu": lambda mask: cpu_kernel.relational_decode_op(
            t["query"], t["key"], t["values"], t["q_rel"], t["k_rel"], t["relation_proj"], 0.1, 0.1, mask)}
    from dat_hf.kernels import triton_relational

    if device.type != "cuda" and not triton_relational.INTERPRETED:
        raise SystemExit("--backend triton runs on CUDA, or on CPU with TRITON_INTERPRET=1 (Triton's interpreter)")

    def triton_step(split_senders):
        def step(mask):
            default, triton_relational.SPLIT_SENDERS = triton_relational.SPLIT_SENDERS, split_senders
            try:
                return triton_relational.relational_attention_op(t["query"], t["key"], t["values"], t["q_rel"],
                                                                 t["k_rel"], False, 0.1, 0.1, mask)
            finally:
                triton_relational.SPLIT_SENDERS = default
        return step

    h, n, d = 2 * args.heads, args.slots, args.head_dim
    q2, k2, v2 = (torch.randn(1, h, m, d, device=device, dtype=t["query"].dtype) for m in (1, n, n))
    return {"triton": triton_step(triton_relational.SPLIT_SENDERS),
            "triton-one-program": triton_step(1 << 40),
            "sdpa-2h": lambda mask: torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=2176, help="cache slots (a static cache's length)")
    p.add_argument("--position", type=int, default=2100, help="the decoded token's slot")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--relations", type=int, default=4)
    p.add_argument("--relation-dim", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--backend", choices=["cpu", "triton"],
                   help="the CPU kernel's op, or the Triton kernel with and without splits beside SDPA (default: cpu "
                        "on CPU, triton on CUDA; on CPU triton needs TRITON_INTERPRET=1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="on CUDA (the CPU kernel runs fp32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.backend = args.backend or ("triton" if cuda else "cpu")
    t = inputs(args, device, DTYPES[args.dtype] if args.backend == "triton" else torch.float32)
    steps = step_functions(args, t, device)
    slot = torch.arange(args.slots, device=device)
    masks = {"every slot": slot >= 0, "causal": slot <= args.position,
             f"window {args.window}": (slot <= args.position) & (slot > args.position - args.window)}
    flush = torch.empty((64 if cuda else 16) << 20, device=device)  # written between calls: past every cache level
    h_kv = args.kv_heads or args.heads
    slot_bytes = (2 * h_kv * args.head_dim + args.relations * args.relation_dim) * t["key"].element_size()
    sdpa_bytes = 2 * 2 * args.heads * args.head_dim * t["key"].element_size()
    times = {(step, name): [] for step in steps for name in masks}
    for i in range(args.repeats + (3 if cuda else 0)):  # (on CUDA the first calls compile and autotune)
        for (step, name), record in times.items():
            mask = masks[name][None, None, None]
            flush.fill_(1.0)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[step](mask)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                start = time.perf_counter()
                steps[step](mask)
                elapsed = time.perf_counter() - start
            if i >= (3 if cuda else 0):
                record.append(elapsed)
    result = {}
    for (step, name), record in times.items():
        senders = int(masks[name].sum())
        seconds = statistics.median(record)
        read = senders * (sdpa_bytes if step == "sdpa-2h" else slot_bytes)
        result.setdefault(step, {})[name] = {"senders": senders, "us": seconds * 1e6, "GB/s": read / seconds / 1e9}
    for step, rows in result.items():
        for name, r in rows.items():
            print(f"{step:>18} {name:>12}: {r['senders']:>6} senders of {args.slots} slots, {r['us']:8.1f} us, "
                  f"{r['GB/s']:7.1f} GB/s")
    print(json.dumps({"args": vars(args), "results": result}))


if __name__ == "__main__":
    main()
