#!/usr/bin/env python
"""Tensor parallelism on CPU: one training step (forward, backward, AdamW step; a fixed batch, fp32) of DAT
(`DATForCausalLM`) and of a Llama of the same width, depth, heads, FFN and vocabulary, sharded over `--tp` processes
(`from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))`, gloo, one thread each) beside the
same model in one process, and where the sharded step's time goes.

    python scripts/benchmark_tensor_parallel.py --out docs/benchmarks/tp      # dat-small at 2 layers, 4 x 256 tokens
    python scripts/benchmark_tensor_parallel.py --preset dat-343m --layers 2 --batch 1 --seq 512 --repeats 2
    python scripts/benchmark_tensor_parallel.py --preset '' --hidden 512 --layers 4 --sensory-heads 4 \\
        --relational-heads 4 --ffn 1536 --vocab 8192
    python scripts/benchmark_tensor_parallel.py --quick --out /tmp/tp                # a tiny model, in seconds (tests/)

Legs, per model:
- `tp`: `--tp` processes (torchrun, gloo), one thread each (OMP_NUM_THREADS=1), every layer sharded by the model's
  plan (DAT: `DATConfig.base_model_tp_plan`; Llama: Transformers' own), the LM head column-wise with its output
  gathered;
- `one`: the same saved weights in one process with `--threads` threads (default 2: on 2 cores, 1 x 2 threads
  against 2 x 1 threads is the fair comparison: the same cores, the same work);
- `one_1t`: one process, one thread (what a single rank of `tp` has to itself), unless `--threads 1`.

Everything runs in one torchrun of `--tp` processes (one start-up: importing Transformers takes longer than the
legs): the `tp` leg on every rank, the one-process legs on rank 0 alone while the other ranks wait blocked on the
rendezvous store (a socket read, no CPU), with torch's threads set to the leg's. Each repetition runs every leg
of a model, in an order rotated per repetition; a leg runs `--warmup` untimed steps, then `--steps` timed ones
(the `tp` leg: every rank waits at a barrier before each step; a step's time is the slowest rank's). A leg's time
is the median of its steps, per repetition; the table gives the median over repetitions, and the ratios (`tp` over
each one-process leg, and DAT's ratio over Llama's) as median [min-max] of the per-repetition ratios. Before the
timed steps every model instance runs `--warmup` steps (AdamW's state, first allocations); all instances of a model
run the same steps on the same batch from the same weights, so their losses (recorded for every step) and the
logits of the first forward must agree: `check` gives the differences.

Where the time goes: after the timed repetitions, each leg runs two steps under `torch.profiler` (the second is
read; on every rank for `tp`); each op's self time on the step's thread is put in one category: `collectives`
(all_reduce / all_gather / reduce_scatter / gloo and the functional collectives' waits: on CPU a wait is also the
time a rank waits for the other), `dtensor dispatch` (DTensor's own work: an op's self time above its
`PythonSubclass` dispatch, `PythonSubclass`, and `Redistribute`, `from_local` / `to_local` and their backward nodes
outside the ops they run), `dtensor copies` (the ops a redistribution or a wrapping runs beside its collectives:
e.g. the shards of the LM head's gathered logits concatenated, clones), `linears` (the 2-D matrix
products wherever they run: the projections, MLP, LM head, symbol retrieval's query; the modules are not hooked,
which would take the fused projections out of the step), `sensory attention` (DAT's sensory heads, Llama's self-attention: SDPA, RoPE
and reshapes for Llama), `relational attention` (DAT's relational heads: the relational kernel or backend),
`attention, shared` (DAT's dual attention outside both head types: RoPE, splits), `symbol retrieval`,
`optimizer`, `other ops` (embedding, norms, activations, loss) and `python` (no op: the interpreter between ops,
module calls, hooks). Backward ops go to the module whose forward made their autograd node (its sequence number).
The profiled step is slower than an unprofiled one (the profiler's cost per op: DTensor runs many more ops):
`profiled_step_s` is reported beside the median. Writes `tensor_parallel.json` under `--out`.
"""

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # noqa: E402  (the benchmark models, ratios)

MODELS = ("dat_hf", "llama")
# `--quick`: a tiny model, one repetition of one timed step (tests)
QUICK = dict(preset=None, hidden=32, layers=1, sensory_heads=2, relational_heads=2, ffn=64, vocab=64, batch=2,
             seq=16, steps=1, warmup=1, repeats=1)
SCOPE = "tp_benchmark::"  # record_function names of the profiled modules
STEP = "tp_benchmark_step#"
CATEGORIES = ("collectives", "dtensor dispatch", "dtensor copies", "linears", "sensory attention",
              "relational attention", "attention, shared", "symbol retrieval", "optimizer", "other ops", "python")
COLLECTIVE_MARKS = ("c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                    "broadcast", "barrier", "wait_tensor", "_wrap_tensor_autograd", "all_to_all")
DTENSOR_NAMES = ("PythonSubclass", "Redistribute", "NestedRedistribute", "_FromTorchTensor", "_ToTorchTensor")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::einsum",
           "aten::_addmm_activation")
# the projections' products: 2-D (attention's own products are batched: bmm, baddbmm, matmul on 4-D tensors)
LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::_addmm_activation")
EVALUATE = "autograd::engine::evaluate_function: "


def legs(args) -> list[str]:
    return ["tp", "one"] + (["one_1t"] if args.threads != 1 else [])


def leg_label(leg, args) -> str:
    return {"tp": f"TP {args.tp}x1", "one": f"1x{args.threads}", "one_1t": "1x1"}[leg]


# ---- the models --------------------------------------------------------------------------------------------------
def model_configs(args):
    """(DAT config, Llama config): `scripts/benchmark.py`'s benchmark model (a preset's shapes at `--layers` depth, or
    the small model of `--hidden`, `--ffn`, `--vocab` and the heads), causal relational bias; Llama with all the
    heads as self-attention heads, tied embeddings."""
    shapes = argparse.Namespace(preset=args.preset or None, layers=args.layers, vocab=args.vocab, hidden=args.hidden,
                                sensory_heads=args.sensory_heads, relational_heads=args.relational_heads,
                                ffn=args.ffn, relational_bias="causal", window=None)
    dat = benchmark.dat_config(shapes, args.seq)
    return dat, benchmark.llama_config(dat)


def save_models(args, workdir) -> dict:
    """Each model built with `--seed` and saved under `workdir` -> {model: folder}."""
    import torch
    from transformers import LlamaForCausalLM

    from dat_hf import DATForCausalLM

    dat, llama = model_configs(args)
    folders = {}
    for name in args.models:
        torch.manual_seed(args.seed)
        model = DATForCausalLM(dat) if name == "dat_hf" else LlamaForCausalLM(llama)
        folders[name] = os.path.join(workdir, name)
        model.save_pretrained(folders[name])
    return folders


def shapes(args) -> dict:
    dat, llama = model_configs(args)
    return {"hidden": dat.hidden_size, "layers": dat.num_hidden_layers, "sensory_heads": dat.num_sensory_heads,
            "relational_heads": dat.num_relational_heads, "sensory_kv_heads": dat.sensory_kv_heads,
            "relational_kv_heads": dat.relational_kv_heads, "ffn": dat.intermediate_size, "vocab": dat.vocab_size,
            "symbols": dat.num_symbols, "llama_heads": llama.num_attention_heads}


# ---- the worker (every rank of the torchrun) ---------------------------------------------------------------------
def train_step(model, optimizer, batch):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class Worker:
    """One rank: the sharded model of each model (every rank) and its one-process instances (rank 0)."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.keys = itertools.count()

    def progress(self, message):
        if self.rank == 0:
            print(f"[benchmark_tensor_parallel] {message}", file=sys.stderr, flush=True)

    def rank0_only(self, fn):
        """`fn()` on rank 0 while the other ranks wait on the store (blocked in a socket read, not spinning);
        -> its result on rank 0, None elsewhere."""
        key = f"tp_benchmark/{next(self.keys)}"
        if self.rank == 0:
            try:
                return fn()
            finally:
                self.store.set(key, "done")
        self.store.wait([key])
        return None

    def with_threads(self, threads, fn):
        torch = self.torch
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(1)

    def load(self, folder, tp):
        import dat_hf  # noqa: F401  (registers the Auto classes)
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        kwargs = {"distributed_config": DistributedConfig(tp_plan="auto")} if tp else {}
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", **kwargs).train()
        return model, self.torch.optim.AdamW(model.parameters(), lr=self.args.lr)

    def steps(self, instance, batch, n, tp):
        """`n` training steps -> (seconds of each, the loss of each, torch's threads); for `tp` on every rank, each
        step after a barrier, its time the slowest rank's, the threads of each rank."""
        model, optimizer = instance
        times, losses = [], []
        for _ in range(n):
            if tp:
                self.dist.barrier()
            start = time.perf_counter()
            losses.append(train_step(model, optimizer, batch))
            times.append(time.perf_counter() - start)
        threads = self.torch.get_num_threads()
        if tp:
            every = [None] * self.world
            self.dist.all_gather_object(every, (times, threads))
            times = [max(ts) for ts in zip(*(t for t, _ in every))]
            threads = [count for _, count in every]
        return times, [loss.item() for loss in losses], threads

    def run_leg(self, instances, leg, batch, n):
        """`n` steps of one leg -> (times, losses, threads) on rank 0, None elsewhere (one-process legs)."""
        if leg == "tp":
            return self.steps(instances["tp"], batch, n, tp=True)
        threads = self.args.threads if leg == "one" else 1
        return self.rank0_only(lambda: self.with_threads(threads, lambda: self.steps(instances[leg], batch, n, False)))

    def first_forward(self, instances, batch):
        """Logits and loss of every instance before any step -> their differences from the `tp` leg's (rank 0)."""
        torch = self.torch
        with torch.no_grad():
            out = instances["tp"][0](input_ids=batch, labels=batch)
        tp_logits, tp_loss = out.logits.float(), out.loss.item()

        def compare():
            diffs = {}
            for leg in legs(self.args)[1:]:
                with torch.no_grad():
                    one = instances[leg][0](input_ids=batch, labels=batch)
                diffs[leg] = {"logits_max_diff": (one.logits.float() - tp_logits).abs().max().item(),
                              "loss_diff": abs(one.loss.item() - tp_loss)}
            from torch.distributed.tensor import DTensor

            # (the one-process instances hold plain tensors: nothing of the sharded model's loading leaked into them)
            plain = all(not isinstance(p, DTensor) for leg in legs(self.args)[1:]
                        for p in instances[leg][0].parameters())
            return {"loss": tp_loss, "legs": diffs, "one_process_plain_tensors": plain}

        return self.rank0_only(compare)

    def profile_leg(self, instances, leg, batch):
        """Two steps of one leg under torch.profiler, the modules marked; the second step's breakdown (every rank
        for `tp`, gathered on rank 0)."""

        def run():
            from torch.profiler import ProfilerActivity, profile, record_function

            model, optimizer = instances[leg]
            handles = mark_modules(model)
            try:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for i in range(2):
                        if leg == "tp":
                            self.dist.barrier()
                        with record_function(f"{STEP}{i}"):
                            train_step(model, optimizer, batch)
            finally:
                for handle in handles:
                    handle.remove()
            return breakdown(prof.events(), f"{STEP}1")

        if leg == "tp":
            mine = run()
            every = [None] * self.world
            self.dist.all_gather_object(every, mine)
            return {f"rank{r}": b for r, b in enumerate(every)}
        threads = self.args.threads if leg == "one" else 1
        return self.rank0_only(lambda: self.with_threads(threads, run))

    def run(self):
        args, torch = self.args, self.torch
        folders = save_models(args, args.workdir) if self.rank == 0 else None
        folders = self.broadcast(folders)
        batch = torch.randint(0, model_configs(args)[0].vocab_size, (args.batch, args.seq),
                              generator=torch.Generator().manual_seed(args.seed))
        result = {"shapes": shapes(args), "world_size": self.world, "models": {}}
        for name in args.models:
            self.progress(f"{name}: loading")
            instances = {"tp": self.load(folders[name], tp=True)}
            for leg in legs(args)[1:]:
                loaded = self.rank0_only(lambda: self.load(folders[name], tp=False))
                instances[leg] = loaded
            tp_model = instances["tp"][0]
            entry = {"tp_size": getattr(tp_model, "_tp_size", None),
                     "parameters": sum(p.numel() for p in instances["one"][0].parameters()) if self.rank == 0 else None,
                     "relational_backend": {}, "check": self.first_forward(instances, batch),
                     "legs": {leg: [] for leg in legs(args)}, "losses": {leg: [] for leg in legs(args)}}
            # every instance: the same warm-up steps (AdamW's state, first allocations), then the repetitions
            for leg in legs(args):
                out = self.run_leg(instances, leg, batch, args.warmup)
                if out is not None:
                    entry["losses"][leg] += out[1]
            for rep in range(args.repeats):
                order = legs(args)[rep % len(legs(args)):] + legs(args)[:rep % len(legs(args))]
                for leg in order:
                    out = self.run_leg(instances, leg, batch, args.warmup + args.steps)
                    if out is None:
                        continue
                    times, losses, threads = out
                    timed = times[args.warmup:]
                    entry["legs"][leg].append({"time_s": statistics.median(timed), "times": timed,
                                               "threads": threads})
                    entry["losses"][leg] += losses
                    self.progress(f"{name} repetition {rep + 1}/{args.repeats} {leg_label(leg, args)}: "
                                  f"{statistics.median(timed):.4f} s per step")
            if self.rank == 0:
                entry["relational_backend"] = {leg: benchmark.relational_backend(model)
                                               for leg, (model, _) in instances.items()}
            if not args.no_profile:
                entry["profile"] = {}
                for leg in legs(args):
                    entry["profile"][leg] = self.profile_leg(instances, leg, batch)
                    self.progress(f"{name} profiled {leg_label(leg, args)}")
            result["models"][name] = entry
            del instances
        if self.rank == 0:
            with open(os.path.join(args.workdir, "result.json"), "w") as f:
                json.dump(result, f)
        self.dist.barrier()
        self.dist.destroy_process_group()

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


def worker_main(args):
    Worker(args).run()


# ---- where the time goes -----------------------------------------------------------------------------------------
def module_scope(module):
    """The profiling scope of a module, or None. Not the linears: a hook on them would take the fused projections
    (one matrix product for a layer's inputs, `kernels.tensor_parallel` under tensor parallelism) out of the profiled
    step; their 2-D products (`LINEAR_OPS`) are counted as linears wherever they run."""
    return {"SensoryAttention": "sensory", "LlamaAttention": "sensory", "RelationalAttention": "relational",
            "DualAttention": "dual_attn", "SymbolRetrievers": "symbols"}.get(type(module).__name__)


def mark_modules(model) -> list:
    """A record_function range `tp_benchmark::<scope>` around every call of the modules that have a scope (entered
    before the modules' other pre-hooks, e.g. tensor parallelism's input redistribution, left after their hooks)
    -> the hooks' handles."""
    from torch.autograd.profiler import record_function

    handles = []
    for module in model.modules():
        scope = module_scope(module)
        if scope is None:
            continue
        ranges = []

        def enter(mod, inputs, scope=scope, ranges=ranges):
            ranges.append(record_function(SCOPE + scope))
            ranges[-1].__enter__()

        def leave(mod, inputs, output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


def breakdown(events, step_name) -> dict:
    """The profiled step `step_name` -> {"profiled_step_s", "ms": {category: milliseconds}, "share": {category:
    fraction of the step}, "collective_calls": {c10d op: calls}, "top_ops": [[name, self ms], ...],
    "top_ops_by_category": {category: [[name, self ms], ...]}}: each event's self time on the step's thread, in one
    category (see the module docstring)."""
    step = next(e for e in events if e.name == step_name)
    start, end = step.time_range.start, step.time_range.end
    inside = [e for e in events if e.thread == step.thread and e is not step
              and start <= e.time_range.start and e.time_range.end <= end]

    def chain(e):  # the event and its ancestors, up to (not including) the step
        while e is not None and e is not step:
            yield e
            e = e.cpu_parent

    def base_name(name):
        name = name.removeprefix(EVALUATE)
        return name.removesuffix("Backward") if name.removesuffix("Backward") in DTENSOR_NAMES else name

    forward_scope = {}  # autograd sequence number -> the scope of the forward op that made the node

    def scope_of(e):
        for a in chain(e):
            if a.name.startswith(SCOPE):
                return a.name[len(SCOPE):]
            if a.name.startswith("Optimizer."):
                return "optimizer"
            if a.name.startswith(EVALUATE):
                return forward_scope.get(a.sequence_nr)
        return None

    for e in inside:  # forward ops first (they precede their backward)
        if e.sequence_nr is not None and e.sequence_nr >= 0 and e.sequence_nr not in forward_scope and not any(
                a.name.startswith(EVALUATE) for a in chain(e)):
            forward_scope[e.sequence_nr] = scope_of(e)

    def category(e):
        if e.name.startswith(SCOPE):
            return "python"
        names = [a.name for a in chain(e)]
        if any(mark in name.lower() for name in names for mark in COLLECTIVE_MARKS):
            return "collectives"
        if base_name(e.name) in DTENSOR_NAMES or any(c.name == "PythonSubclass" for c in e.cpu_children):
            return "dtensor dispatch"
        if any(base_name(n) in DTENSOR_NAMES[1:] for n in names[1:]):  # (inside a redistribution or a wrapping)
            return "dtensor copies" if e.name.startswith("aten::") else "dtensor dispatch"
        scope = scope_of(e)
        if scope == "optimizer":
            return "optimizer"
        if e.name in LINEAR_OPS:
            return "linears"
        if scope in ("sensory", "relational", "symbols"):
            return {"sensory": "sensory attention", "relational": "relational attention",
                    "symbols": "symbol retrieval"}[scope]
        if e.name in MATMULS:
            return "linears"
        return "attention, shared" if scope == "dual_attn" else "other ops"

    ms = dict.fromkeys(CATEGORIES, 0.0)
    ops = {c: {} for c in CATEGORIES}  # category -> op name -> self ms
    for e in inside:
        self_ms, kind = e.self_cpu_time_total / 1000, category(e)
        ms[kind] += self_ms
        ops[kind][e.name] = ops[kind].get(e.name, 0.0) + self_ms
    ms["python"] += step.self_cpu_time_total / 1000
    total_ms = step.cpu_time_total / 1000

    def top(named, n):
        return [[name, round(value, 3)] for name, value in sorted(named.items(), key=lambda item: -item[1])[:n]]

    every = {}
    for named in ops.values():
        for name, value in named.items():
            every[name] = every.get(name, 0.0) + value
    calls = {}  # the process group's own ops: one per collective the step ran
    for e in inside:
        if e.name.startswith("c10d::"):
            calls[e.name] = calls.get(e.name, 0) + 1
    return {"profiled_step_s": total_ms / 1000, "ms": ms, "share": {k: v / total_ms for k, v in ms.items()},
            "collective_calls": calls, "top_ops": top(every, 15),
            "top_ops_by_category": {c: top(named, 5) for c, named in ops.items() if named}}


# ---- summaries ---------------------------------------------------------------------------------------------------
def summarize(raw, args) -> dict:
    """The worker's result -> per model: each leg's median time per step, `tp` over each one-process leg (median
    [min-max] of the per-repetition ratios), the differences of losses and logits; DAT over Llama: each ratio and
    each leg's time."""
    table = {"models": {}}
    for name, entry in raw["models"].items():
        runs = entry["legs"]
        row = {leg: {"time_s": benchmark.summarize(reps, "time_s"), "time_s_per_rep": [r["time_s"] for r in reps]}
               for leg, reps in runs.items()}
        row["ratios"] = {f"tp/{leg}": benchmark.pair_ratios(runs, "tp", leg, "time_s") for leg in legs(args)[1:]}
        losses = entry["losses"]
        check = dict(entry["check"] or {})
        check["loss_max_diff"] = {leg: max((abs(a - b) for a, b in zip(losses["tp"], losses[leg])), default=None)
                                  for leg in legs(args)[1:]}
        check["steps_compared"] = len(losses["tp"])
        row["check"] = check
        row["tp_size"], row["parameters"] = entry["tp_size"], entry["parameters"]
        row["relational_backend"] = entry["relational_backend"]
        if "profile" in entry:
            row["profile"] = entry["profile"]
        table["models"][name] = row
    if set(MODELS) <= set(table["models"]):
        per_rep = {name: [{"ratio": r} for r in (table["models"][name]["ratios"]["tp/one"] or {}).get("pairs", [])]
                   for name in MODELS}
        table["dat_hf/llama"] = {
            "tp/one": benchmark.pair_ratios(per_rep, "dat_hf", "llama", "ratio"),
            "time_s": {leg: benchmark.pair_ratios({m: raw["models"][m]["legs"][leg] for m in MODELS}, "dat_hf",
                                                  "llama", "time_s") for leg in legs(args)}}
    return table


def cell(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def report(table, raw, args):
    s = raw["shapes"]
    print(f"\none training step (forward + backward + AdamW), batch {args.batch} x {args.seq} tokens, fp32, CPU; "
          + (f"preset {args.preset} at " if args.preset else "") + f"d={s['hidden']}, {s['layers']} layers, "
          f"{s['sensory_heads']}+{s['relational_heads']} heads ({s['sensory_kv_heads']}+{s['relational_kv_heads']} "
          f"key/value), ffn {s['ffn']}, vocabulary {s['vocab']}, {s['symbols']} symbols; Llama {s['llama_heads']} "
          f"heads. TP {args.tp}x1 = {args.tp} processes (torchrun, gloo) x 1 thread; 1xN = one process, N threads. "
          f"Times: median s per step ({args.steps} steps after {args.warmup} warm-up, per repetition), median of "
          f"{args.repeats} repetitions; ratios: median [min-max] of the per-repetition ratios")
    names = [leg_label(leg, args) for leg in legs(args)]
    print(f"{'model':>7}" + "".join(f" {n:>9}" for n in names)
          + "".join(f" {'TP/' + n:>19}" for n in names[1:]) + f" {'loss diff':>10} {'logits diff':>11}")
    for name, row in table["models"].items():
        check = row["check"]
        logits = max((d["logits_max_diff"] for d in (check.get("legs") or {}).values()), default=None)
        loss = max((d for d in check["loss_max_diff"].values() if d is not None), default=None)
        print(f"{name:>7}" + "".join(f" {cell(row[leg]['time_s']):>9}" for leg in legs(args))
              + "".join(f" {benchmark.ratio_cell(row['ratios'][f'tp/{leg}'], True):>19}" for leg in legs(args)[1:])
              + f" {cell(loss, '.1e'):>10} {cell(logits, '.1e'):>11}")
    if "dat_hf/llama" in table:
        ratios = table["dat_hf/llama"]
        print(f"DAT / Llama: TP/{names[1]} ratio {benchmark.ratio_cell(ratios['tp/one'], True)}; time per step "
              + ", ".join(f"{leg_label(leg, args)} {benchmark.ratio_cell(ratios['time_s'][leg], True)}"
                          for leg in legs(args)))
    profiled = [(name, leg) for name, row in table["models"].items() for leg in legs(args)
                if (row.get("profile") or {}).get(leg)]
    if not profiled:
        return
    print("\nwhere the time goes: one profiled step (TP: rank 0), ms (share of the step)")
    columns = [(f"{name} {leg_label(leg, args)}", table["models"][name]["profile"][leg]) for name, leg in profiled]
    columns = [(label, p["rank0"] if "rank0" in p else p) for label, p in columns]
    print(f"{'':>20}" + "".join(f" {label:>17}" for label, _ in columns))
    for category in CATEGORIES:
        print(f"{category:>20}" + "".join(f" {p['ms'][category]:>9.1f} ({100 * p['share'][category]:>4.1f}%)"
                                          for _, p in columns))
    print(f"{'profiled step':>20}" + "".join(f" {1000 * p['profiled_step_s']:>9.1f} ms      " for _, p in columns))
    for name, row in table["models"].items():
        tp = (row.get("profile") or {}).get("tp")
        if tp and len(tp) > 1:
            dtensor = {rank: b["share"]["dtensor dispatch"] + b["share"]["dtensor copies"] for rank, b in tp.items()}
            calls = ", ".join(f"{op.removeprefix('c10d::')} {n}" for op, n in tp["rank0"]["collective_calls"].items())
            print(f"{name} TP, collectives per step: {calls}")
            print(f"{name} TP, every rank: collectives " + ", ".join(
                f"{rank} {100 * b['share']['collectives']:.1f}%" for rank, b in tp.items())
                + "; dtensor dispatch + copies " + ", ".join(f"{rank} {100 * v:.1f}%" for rank, v in dtensor.items()))


# ---- the run -----------------------------------------------------------------------------------------------------
def progress(message):
    print(f"[benchmark_tensor_parallel] {message}", file=sys.stderr, flush=True)


def launch(args, workdir) -> dict:
    """The torchrun of `--tp` processes (one thread each; this checkout's dat_hf first on the path) -> rank 0's
    result."""
    worker_args = dict(vars(args), workdir=workdir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.tp),
           os.path.abspath(__file__), "--worker-args", json.dumps(worker_args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [benchmark.CHECKOUT, env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # (its output passes through)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"the torchrun ran past --timeout {args.timeout} s and was killed")
    if code != 0:
        raise SystemExit(f"the torchrun exited with {code} (its output is above)")
    with open(os.path.join(workdir, "result.json")) as f:
        return json.load(f)


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--preset", default="dat-small",
                   help="a dat_hf preset's shapes at --layers depth (default dat-small: d=256, 4 + 4 heads, ffn 682, "
                        "vocabulary 4,096); '' for --hidden, --ffn, --vocab and the heads")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--sensory-heads", type=int, default=4, help="DAT's sensory heads (Llama: sensory + relational)")
    p.add_argument("--relational-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel processes (one thread each)")
    p.add_argument("--threads", type=int, default=2, help="threads of the one-process leg (a 1-thread leg runs too "
                                                          "unless this is 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per leg and repetition")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (and before the repetitions)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled steps")
    p.add_argument("--timeout", type=float, default=1800, help="seconds the torchrun may take")
    p.add_argument("--quick", action="store_true", help="a tiny model (d=32, 1 layer, 2 + 2 heads), batch 2 x 16, one "
                                                        "repetition of one step (tests)")
    p.add_argument("--out", help="folder of tensor_parallel.json")
    p.add_argument("--worker-args", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.worker_args:  # (a rank of the torchrun)
        worker_main(argparse.Namespace(**json.loads(args.worker_args)))
        return
    sys.path.insert(0, benchmark.CHECKOUT)  # (this checkout's dat_hf, ahead of an installed one)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if min(args.tp, args.threads, args.steps, args.repeats, args.batch, args.seq) < 1 or args.warmup < 0:
        parser().error("--tp, --threads, --steps, --repeats, --batch and --seq must be positive, --warmup >= 0")
    start, load_start = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="benchmark_tp_") as workdir:
        raw = launch(args, workdir)
    table = summarize(raw, args)
    table["wall_s"] = time.perf_counter() - start
    # (the machine's load averages over 1, 5 and 15 minutes before and after: other work makes the times noisy)
    table["loadavg"] = {"start": list(load_start), "end": list(os.getloadavg()), "cpus": os.cpu_count()}
    table["shapes"] = raw["shapes"]
    report(table, raw, args)
    print(f"wall time {table['wall_s']:.0f} s; load average {table['loadavg']['start'][0]:.2f} before, "
          f"{table['loadavg']['end'][0]:.2f} after")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tensor_parallel.json"), "w") as f:
            json.dump({"args": vars(args), "results": table, "runs": raw}, f, indent=2)


if __name__ == "__main__":
    main()
