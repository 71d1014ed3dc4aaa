"""Time one decoding step of the relational heads' CPU op over a packed cache, for masks that allow every slot, a
causal step's slots (a static cache longer than the tokens so far) and a sliding window: the op reads only the senders
from the first to the last a row's mask allows.

    python scripts/benchmark_decode_op.py [--slots 2176] [--position 2100] [--window 256] [--threads 1]

Shapes default to the benchmark model's relational heads (4 heads of 32, 4 relations of 32); the cache is flushed from
the CPU caches before each call (a decoding step reads it from memory); medians over `--repeats` calls, the masks
alternating.
"""

import argparse
import json
import statistics
import time

import torch

import dat_hf.kernels.cpu as kernel


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=2176, help="cache slots (a static cache's length)")
    p.add_argument("--position", type=int, default=2100, help="the decoded token's slot")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--relations", type=int, default=4)
    p.add_argument("--relation-dim", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)
    if not kernel.load_cpu_kernel():
        raise SystemExit("the CPU kernel did not build")
    torch.set_num_threads(args.threads)
    h, d, R, d_r, n = args.heads, args.head_dim, args.relations, args.relation_dim, args.slots
    g = torch.Generator().manual_seed(0)
    # the in-place cache layout: keys [1, h, slots, d], one flat value row [symbol values | relation keys] per slot
    key = torch.randn(1, h, n, d, generator=g)
    flat = torch.randn(1, n, h * d + R * d_r, generator=g)
    values = flat[..., : h * d].view(1, n, h, d).transpose(1, 2)
    k_rel = flat[..., h * d:].view(1, n, R, d_r)
    query, q_rel = torch.randn(1, h, 1, d, generator=g), torch.randn(1, 1, R, d_r, generator=g)
    relation_proj = torch.randn(h, d, R, generator=g)
    slot = torch.arange(n)
    masks = {"every slot": slot >= 0, "causal": slot <= args.position,
             f"window {args.window}": (slot <= args.position) & (slot > args.position - args.window)}
    flush = torch.empty(16 << 20)  # 64 MiB written between calls
    times = {name: [] for name in masks}
    for _ in range(args.repeats):
        for name, mask in masks.items():
            flush.fill_(1.0)
            start = time.perf_counter()
            kernel.relational_decode_op(query, key, values, q_rel, k_rel, relation_proj, 0.1, 0.1,
                                        mask[None, None, None])
            times[name].append(time.perf_counter() - start)
    result = {name: {"senders": int(masks[name].sum()), "us": statistics.median(t) * 1e6} for name, t in times.items()}
    for name, r in result.items():
        print(f"{name:>12}: {r['senders']:>5} senders of {n} slots, {r['us']:.0f} us")
    print(json.dumps({"args": vars(args), "results": result}))


if __name__ == "__main__":
    main()
