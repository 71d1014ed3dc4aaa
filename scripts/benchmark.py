#!/usr/bin/env python
"""Benchmark dat_hf's DATForCausalLM against Transformers' LlamaForCausalLM (same width, depth, total heads and FFN)
and the authors' reference (`dual-attention`, converted weights).

    python scripts/benchmark.py train --seq 1024 2048 4096 --repeats 5
    python scripts/benchmark.py generate --prompt 1024 --new-tokens 512 --repeats 3
    python scripts/benchmark.py generate --prompt 1024 --cache static --compile --impls dat_hf llama
    python scripts/benchmark.py generate --prompt 1024 --compile --compile-options cpp_wrapper=True --skip-guards
    python scripts/benchmark.py train --preset dat-343m --layers 2 --batch 1 --seq 1024 4096 --impls dat_hf llama
    python scripts/benchmark.py train --relational-bias sliding_window --window 256 --seq 2048 8192 --impls dat_hf
    python scripts/benchmark.py train --device cuda --dtype bf16 --preset dat-343m --seq 1024 2048 4096 8192
    python scripts/benchmark.py parts --seq 2048 4096 --repeats 5
    python scripts/benchmark.py train --impls dat_hf llama --baseline main=/tmp/main --baseline 6f2d11b=/tmp/6f2d11b

`dat_hf` is the checkout this script is in (its folder comes first on every worker's PYTHONPATH, ahead of an editable
install of another checkout); each `--baseline NAME=DIR` is dat_hf imported from the checkout DIR (e.g.
`git worktree add --detach /tmp/6f2d11b 6f2d11b`), run by this script's workers and reported as NAME beside the others.

Every measurement runs in its own process (peak memory = that process's max RSS on CPU, the allocator's peak on
CUDA; "net" = peak minus the memory once the model and optimizer are built); the implementations alternate within
each repetition, so a drift of the machine's speed hits all alike, and each ratio is taken per repetition and
summarised by its median [min-max]. Training tables also give the FLOP model's dat_hf / Llama ratio for the backend
that ran (relations formed once per pair for all heads, or fused values), the limit a measured ratio can approach;
generation tables give it for a decoding step.
Prints a table of medians and ratios, writes JSON (every worker's figures too) and, for `train`, a PNG.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

# glibc: never serve a block by its own mmap, never give freed memory back (every freed block is reused)
HEAP_ONLY_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
IMPLS = ("dat_hf", "reference", "llama", "baseline", "dat_hf_causal")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout whose dat_hf `dat_hf` measures


# ---- the models ------------------------------------------------------------------------------------------------------
def dat_config(args, max_len, causal=False):
    """The dat_hf config of the benchmark (a preset's shapes at `--layers` depth, or the small benchmark model), with
    `--relational-bias` (or the causal bias)."""
    import dat_hf  # noqa: F401  (also registers the compiled backends)
    from dat_hf import DATConfig

    bias = dict(relational_bias="causal" if causal else args.relational_bias, sliding_window_size=args.window)
    if args.preset:
        from dat_hf.training import load_preset_config

        overrides = dict(max_position_embeddings=max_len, **bias)
        if args.layers:
            overrides["num_hidden_layers"] = args.layers
        return load_preset_config(args.preset, **overrides)
    return DATConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers or 4,
                     num_sensory_heads=args.sensory_heads, num_relational_heads=args.relational_heads,
                     intermediate_size=args.ffn, max_position_embeddings=max_len, hidden_act="swiglu",
                     norm_type="rmsnorm", num_symbols=64, symbolic_attention_heads=4, **bias)


def llama_config(config):
    """Llama of the DAT config's width, depth, vocabulary and FFN, with all its heads as self-attention heads."""
    from transformers import LlamaConfig

    heads = config.num_sensory_heads + config.num_relational_heads
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
                       num_key_value_heads=heads, intermediate_size=config.intermediate_size,
                       max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True,
                       sliding_window=None)


def reference_model(config):
    """The authors' language model with the benchmark config's shapes (the small model, or a preset's at `--layers`
    depth; its feed-forward layers always have biases); `dat_hf.from_reference_model` gives dat_hf its weights."""
    from dual_attention.language_models import DualAttnTransformerLM

    for field, supported in (("symbol_retrieval", "symbolic_attention"), ("position_embedding_type", "rope")):
        if getattr(config, field) != supported:
            raise ValueError(f"the benchmark builds the reference with {field}={supported!r} only, not "
                             f"{getattr(config, field)!r}")
    attention = dict(add_bias_kv=config.attention_bias, add_bias_out=config.attention_out_bias)
    return DualAttnTransformerLM(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads_sa=config.num_sensory_heads, n_heads_ra=config.num_relational_heads, dff=config.intermediate_size,
        dropout_rate=0.0, activation=config.hidden_act, norm_first=config.pre_norm,
        max_block_size=config.max_position_embeddings, norm_type=config.norm_type, pos_enc_type="RoPE",
        sa_kwargs=dict(n_kv_heads=config.num_sensory_key_value_heads, **attention),
        ra_kwargs=dict(n_kv_heads=config.num_relational_key_value_heads, n_relations=config.num_relations,
                       rel_proj_dim=config.relation_dim, rel_activation=config.relation_activation,
                       symmetric_rels=config.symmetric_relations, **attention),
        symbol_retrieval="symbolic_attention",
        symbol_retrieval_kwargs=dict(d_model=config.hidden_size, n_heads=config.symbolic_attention_heads,
                                     n_symbols=config.num_symbols),
        symbol_retriever_config=dict(shared_symbol_retriever=config.shared_symbol_retriever),
    )


def build(impl, args, max_len):
    import torch

    torch.manual_seed(0)
    config = dat_config(args, max_len, causal=impl == "dat_hf_causal")
    if impl == "llama":
        from transformers import LlamaForCausalLM

        llama = llama_config(config)
        llama._attn_implementation = args.attn
        return LlamaForCausalLM(llama)
    if impl == "reference" or not args.preset or args.from_reference:  # dat_hf converted: the reference's weights
        reference = reference_model(config)
        if impl == "reference":
            return reference
        import dat_hf

        model = dat_hf.from_reference_model(reference)
        model.config.relational_bias, model.config.sliding_window_size = config.relational_bias, args.window
    else:
        from dat_hf import DATForCausalLM

        model = DATForCausalLM(config)
    model.config._attn_implementation = args.attn
    if args.relational_backend:
        model.config.relational_attn_implementation = args.relational_backend
    return model


def relational_backend(model):
    """The backend the relational heads ran last (dat_hf models), or None."""
    for module in model.modules():
        if hasattr(module, "relational_attention_backend"):
            return module.relational_attention_backend
    return None


# ---- the FLOP model --------------------------------------------------------------------------------------------------
def macs_per_token(config, context, backend="llama", device="cpu"):
    """Multiply-adds of one token's forward, with `context` senders per receiver on average: the LM head, and in
    every layer the projections, MLP, symbol retrieval and attention. Relational attention costs, per (receiver, sender) pair,
    `h d_h` (scores) + `R d_r` (relations, once for all heads) + `h R` (weighted relations) + `h d_h` (symbols) when
    relations are formed per pair (the compiled kernels, the reference), `h (c d_h + d_v)` with `d_v = d_h + R d_r`
    with fused values (flex_attention, scores once per value chunk: `c` chunks off CPU, 1 on CPU), `2 h d_v` with
    SDPA's zero-padded queries and keys; `backend="llama"` counts Llama's layers."""
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_sensory_heads + config.num_relational_heads
    d_h = d // heads
    head = d * config.vocab_size  # the LM head (tied to the embeddings), the same in both models
    if backend == "llama":
        return head + layers * (4 * d * d + 3 * d * f + 2 * heads * d_h * context)
    h_s, h_r = config.num_sensory_heads, config.num_relational_heads
    kv_s, kv_r = config.sensory_kv_heads, config.relational_kv_heads
    rel = config.relations * config.relation_head_dim
    projections = d * ((h_s + h_r) * d_h + (kv_s + 2 * kv_r) * d_h + kv_s * d_h + 2 * rel) + d * d  # + W_o
    symbols = d * d + 2 * config.num_symbols * d if config.symbol_retrieval == "symbolic_attention" else 0
    per_pair = 2 * h_s * d_h
    if backend == "sdpa":  # queries and keys zero-padded to the value width
        per_pair += 2 * h_r * (d_h + rel)
    elif backend == "flex_attention":
        from dat_hf.relational_attention_fused import flex_value_chunks

        chunks = len(flex_value_chunks(d_h + rel, d_h, device.split(":")[0]))
        per_pair += h_r * (chunks * d_h + d_h + rel)
    else:  # relations formed once per pair (the compiled kernels and the reference)
        per_pair += 2 * h_r * d_h + rel + h_r * config.relations
    return head + layers * (projections + 3 * d * f + symbols + per_pair * context)


def flop_ratio(args, seq, backend, window=None):
    """dat_hf / Llama MACs of a causal training sequence of `seq` tokens (senders per receiver: (seq + 1) / 2, or
    the window's)."""
    config = dat_config(args, seq)
    context = (seq + 1) / 2 if not window else min(window + 1, (seq + 1) / 2)
    return (macs_per_token(config, context, backend or "sdpa", args.device)
            / macs_per_token(config, (seq + 1) / 2, "llama"))


def decode_flop_ratio(args, prompt):
    """dat_hf / Llama MACs of a decoding step, averaged over the generation (senders per step: the prompt and half the
    new tokens, or dat_hf's window; relations formed once per pair, as every decoding step's backend forms them)."""
    context = prompt + (args.new_tokens + 1) / 2
    dat_context = min(args.window + 1, context) if args.relational_bias == "sliding_window" else context
    config = dat_config(args, max(args.max_len, prompt + args.new_tokens))
    return macs_per_token(config, dat_context, "eager", args.device) / macs_per_token(config, context, "llama")


# ---- workers (one measurement per process) -----------------------------------------------------------------------
def fused_sdpa_only(args) -> bool:
    """`--sdpa-math forbid`, or no `--sdpa-math` on CUDA."""
    return (args.sdpa_math or ("forbid" if args.device.startswith("cuda") else "allow")) == "forbid"


class Device:
    """Where a worker runs: `sync()` before reading a clock; peak memory = max RSS on CPU, the allocator's peak on
    CUDA; `autocast()` for `--dtype bf16` (fp32 weights, bf16 matmuls); `attention()` around the model's calls, which
    with `--sdpa-math forbid` (the default on CUDA) lets SDPA choose only fused kernels (flash, memory-efficient,
    cuDNN): a call that only the math fallback (n x n scores in memory) could serve fails the worker and says so."""

    def __init__(self, args):
        import torch

        self.torch, self.name, self.bf16 = torch, args.device, args.dtype == "bf16"
        self.cuda = torch.device(args.device).type == "cuda"
        self.fused_sdpa_only = fused_sdpa_only(args)

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

    @contextlib.contextmanager
    def attention(self):
        if not self.fused_sdpa_only:
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        try:
            with sdpa_kernel(fused):
                yield
        except RuntimeError as error:
            if "No available kernel" not in str(error):
                raise
            raise RuntimeError("scaled_dot_product_attention found no fused kernel for a call, and its math fallback "
                               f"is forbidden (--sdpa-math forbid): {error}") from error

    def record(self):
        """What a worker reports about its device."""
        return {"sdpa_math": "forbidden" if self.fused_sdpa_only else "allowed"}


def _logits(impl, model, x):
    return model(x)[0] if impl == "reference" else model(x).logits


def worker_train(args):
    import torch

    torch.set_num_threads(args.threads)
    device = Device(args)
    model = build(args.impl, args, max(args.seq, args.max_len)).train().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.compile:  # the first (warm-up) step compiles; dat_hf and Llama compile as one graph
        if args.impl in ("dat_hf", "baseline", "dat_hf_causal"):  # compiled graphs call the CPU kernel when loaded
            import dat_hf

            dat_hf.load_cpu_kernel()
        model = torch.compile(model, fullgraph=args.impl != "reference")
    x = torch.randint(0, dat_config(args, args.seq).vocab_size, (args.batch, args.seq), device=args.device)
    base = device.memory_gib()  # interpreter, libraries and the model (CPU); the model (CUDA)
    times = []
    for step in range(args.steps + 1):
        device.sync()
        start = time.perf_counter()
        with device.attention(), device.autocast():
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
    print(json.dumps({"time_s": statistics.median(times), "peak_gib": peak, "net_gib": peak - base,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "relational_backend": relational_backend(model), **device.record(),
                      "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}))


def _step_clock(device):
    """A logits processor that notes the time of every decoding step (after a device sync): step times without
    subtracting separately timed runs."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            device.sync()
            self.times.append(time.perf_counter())
            return scores

    return StepClock()


def _forward_clock(model, device):
    """Times the model forward of every decoding step inside `generate` (the compiled call, or `__call__` when eager):
    `times` gets the seconds of each call, after a device sync. What a step takes beyond it is `generate`'s own loop
    (inputs, masks, logits processors, stopping criteria). -> (times, {"inputs": the last call's (args, kwargs)})."""
    times, last = [], {}

    def timed(call):
        def forward(*args, **kwargs):
            device.sync()
            start = time.perf_counter()
            out = call(*args, **kwargs)
            device.sync()
            times.append(time.perf_counter() - start)
            last["inputs"] = args, kwargs
            return out

        return forward

    if hasattr(model, "_compiled_call"):  # made by the warm-up; `generate` takes it while the CompileConfig is the same
        model._compiled_call = timed(model._compiled_call)
    else:  # `generate` decodes through `self.__call__` (the prefill calls the model directly)
        model.__call__ = timed(model.__call__)
    return times, last


def _guard_check(model, inputs, calls=2000):
    """Dynamo's guard check before each compiled decoding step, timed on its own: the guards of the step's cached graph
    (on `forward`'s code, which `generate`'s compiled `__call__` enters) checked against the last step's inputs, `calls`
    times -> {"guard_check_us": microseconds per check, "guards": how many it evaluates}; None values where no cached
    graph accepts the inputs or Dynamo's internals differ (a diagnostic: it never fails the measurement)."""
    import torch

    none = {"guard_check_us": None, "guards": None}
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        forward = type(model).forward
        code = forward.__code__
        cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in forward.__closure__ or ())))
        names = code.co_varnames  # (self, then the wrapper's *args and **kwargs)
        if code.co_argcount == 0:  # a wrapper of (*args, **kwargs) alone, self among the args (`deprecate_kwarg`)
            f_locals = {names[0]: (model, *inputs[0]), names[1]: inputs[1], **cells}
        else:
            f_locals = {names[0]: model, names[code.co_argcount]: inputs[0], names[code.co_argcount + 1]: inputs[1],
                        **cells}
        with torch.no_grad():  # (grad mode is guarded; generate decodes without gradients)
            guards = [entry.guard_manager for entry in _debug_get_cache_entry_list(code)
                      if entry.guard_manager.check(f_locals)]
            if not guards:
                return none
            start = time.perf_counter()
            for _ in range(calls):
                guards[0].check(f_locals)
            seconds = (time.perf_counter() - start) / calls
            return {"guard_check_us": seconds * 1e6, "guards": guards[0].check_verbose(f_locals).num_guards_executed}
    except (ImportError, AttributeError, IndexError, TypeError) as error:
        return none | {"guard_check_error": repr(error)}


def _cache_bytes(cache) -> int:
    """Bytes a generation's cache holds: every layer's keys and values (the buffers behind them, where a layer keeps
    spare room)."""
    tensors = []
    for layer in cache.layers:
        tensors += getattr(layer, "_buffers", None) or (layer.keys, layer.values)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cache_tokens(last_step) -> dict:
    """{"cache_tokens": the tokens the cache held after the last decoding step} (prompt + new tokens - 1 when the
    model used the cache `generate` gave it), or {} without a recorded step. A model that ignores the cache it is
    given (e.g. one reading another argument name than the one `generate` passes) still decodes, wrongly and fast."""
    if not last_step:
        return {}
    kwargs = last_step["inputs"][1]
    cache = next((kwargs[name] for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None)
    return {"cache_tokens": None if cache is None else int(cache.get_seq_length())}  # (a static cache: a tensor)


def _compile_counts():
    """Graphs Dynamo compiled and graphs inductor ran without CUDA graphs (on CUDA: an op or input they cannot hold;
    every graph on CPU), so far in this process."""
    from torch._dynamo.utils import counters

    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def compile_options(pairs):
    """`KEY=VALUE` strings -> inductor options (`cpp_wrapper=True`: VALUE read as a Python literal, else a string)."""
    import ast

    options = {}
    for pair in pairs or []:
        key, _, value = pair.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def worker_generate(args):
    import torch

    torch.set_num_threads(args.threads)
    device = Device(args)
    max_len = max(args.max_len, args.prompt + args.new_tokens)
    model = build(args.impl, args, max_len).eval().to(args.device)
    if device.bf16:
        model = model.to(torch.bfloat16)
    x = torch.randint(0, dat_config(args, max_len).vocab_size, (1, args.prompt), device=args.device)
    kwargs = {}
    if args.cache == "static":
        kwargs["cache_implementation"] = "static"
    if args.compile:
        from transformers import CompileConfig

        options = compile_options(args.compile_options)
        # (torch.compile takes a mode or options, not both)
        compile_config = CompileConfig(fullgraph=True, dynamic=False, **({"mode": None, "options": options}
                                                                          if options else {}))
        compile_config._compile_all_devices = True  # (Transformers compiles on accelerators only by default)
        kwargs.update(cache_implementation="static", compile_config=compile_config)

    def generate(new_tokens):
        if args.impl == "reference":
            device.sync()
            start = time.perf_counter()
            model.generate(x, new_tokens, top_k=1)
            device.sync()
            return start, [time.perf_counter()]
        clock = _step_clock(device)
        device.sync()
        start = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             logits_processor=[clock], return_dict_in_generate=True, **kwargs)
        # (the cache's field: `cache` from Transformers 5.24, `past_key_values` before; a baseline checkout may
        # predate dat_hf.transformers_compat)
        cache = next(getattr(out, name) for name in ("cache", "past_key_values") if hasattr(out, name))
        cache_bytes[0] = _cache_bytes(cache)
        return start, clock.times

    cache_bytes = [None]
    skip_guards = args.skip_guards and args.compile
    with torch.no_grad(), device.attention():
        # warm-up: one-time costs (kernels, compilation, first allocations) are not per-token costs; without guards,
        # the warm-up compiles for the timed run's cache (its length is the generation's)
        generate(args.new_tokens if skip_guards else 4)
        compile_counts = _compile_counts()
        forward_times, last_step = _forward_clock(model, device) if args.impl != "reference" else ([], {})
        # (set_stance takes effect when called: only after the warm-up) Dynamo runs the compiled step unguarded
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip_guards else (
                contextlib.nullcontext()):
            start, times = generate(args.new_tokens)
    forward = None
    if len(times) > 1:  # Transformers models: every step timed
        steps = [b - a for a, b in zip(times, times[1:])]
        decode, prefill = statistics.median(steps), times[0] - start
        forward = statistics.median(forward_times[-len(steps):]) if len(forward_times) >= len(steps) else None
    else:  # the reference: its whole run, less a prefill timed on its own
        first_start, first = generate(1)
        prefill = first[0] - first_start
        decode = max(times[0] - start - prefill, 0) / max(1, args.new_tokens - 1) or None
    compiled = {}
    if args.compile and last_step:  # the timed run's: one graph for all its steps, held by CUDA graphs on CUDA
        compiled = {key: count - compile_counts[key] for key, count in _compile_counts().items()}
        compiled.update(_guard_check(model, last_step["inputs"]))
    print(json.dumps({"decode_ms_per_token": None if decode is None else 1000 * decode,
                      "forward_ms_per_token": None if forward is None else 1000 * forward,
                      "ms_per_token": 1000 * (times[-1] - start) / args.new_tokens, "prefill_s": prefill,
                      "cache_mib": None if cache_bytes[0] is None else cache_bytes[0] / 2**20,
                      "relational_backend": relational_backend(model), **compiled, **_cache_tokens(last_step),
                      **device.record()}))


def run_worker(mode, impl, args, **extra):
    cmd = [sys.executable, __file__, f"_{mode}", "--impl", "baseline" if impl in baselines(args) else impl]
    for key, value in {**vars(args), **extra}.items():
        if key in ("mode", "impl", "seq", "prompt", "out", "impls", "repeats", "baseline") or value is None:
            continue
        if isinstance(value, bool):
            cmd += [f"--{key.replace('_', '-')}"] if value else []
            continue
        if isinstance(value, list):
            cmd += [f"--{key.replace('_', '-')}", *map(str, value)] if value else []
            continue
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key in ("seq", "prompt"):
        if key in extra:
            cmd += [f"--{key}", str(extra[key])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.mmap_threshold:  # glibc then maps every larger block on its own and unmaps it when freed
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if args.malloc == "heap":
        env.update(HEAP_ONLY_MALLOC)
    # dat_hf imported from a baseline's checkout, else from this one
    checkout = baselines(args).get(impl, CHECKOUT)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(checkout), env.get("PYTHONPATH")]))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def baselines(args) -> dict:
    """{name: checkout} of the `--baseline [NAME=]DIR` arguments (NAME defaults to `baseline`)."""
    given = [args.baseline] if isinstance(args.baseline, str) else args.baseline or []
    named = [value.partition("=") if "=" in value else ("baseline", "=", value) for value in given]
    return {name: directory for name, _, directory in named}


def sdpa_note(args):
    return ", SDPA fused kernels only (math fallback forbidden)" if fused_sdpa_only(args) else ""


def progress(message):
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


# ---- summaries -----------------------------------------------------------------------------------------------------
def summarize(results, metric):
    values = [r[metric] for r in results if r.get(metric) is not None]
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


def measure(mode, args, sizes, key, metrics, skip=lambda impl, size: False):
    """Every implementation at every size, alternating within each repetition -> {size: {impl: row}}."""
    table = {}
    for size in sizes:
        runs = {impl: [] for impl in args.impls}
        for rep in range(args.repeats):
            for impl in args.impls:
                if skip(impl, size):
                    runs[impl].append({})
                    continue
                result = run_worker(mode, impl, args, **{key: size})
                runs[impl].append(result)
                shown = result.get("error") or ", ".join(
                    f"{m} {result[m]:.4g}" for m in metrics if result.get(m) is not None)
                progress(f"{mode} {key} {size} repetition {rep + 1}/{args.repeats} {impl}: {shown}")
        table[size] = {impl: {m: summarize(r, m) for m in metrics} | {
            "runs": r, "errors": [x["error"] for x in r if "error" in x],
            "relational_backend": next((x["relational_backend"] for x in r if x.get("relational_backend")), None),
        } for impl, r in runs.items()}
        for impl, row in table[size].items():
            row["ratios"] = {f"{metric}/{other}": pair_ratios(runs, impl, other, metric)
                             for metric in metrics for other in args.impls if other != impl}
    return table


def main_train(args):
    def skip(impl, seq):
        return impl == "reference" and seq > args.reference_max_seq

    table = measure("train", args, args.seq, "seq", ("time_s", "peak_gib", "net_gib"), skip)
    for seq, row in table.items():
        if "dat_hf" in row and "llama" in row and row["dat_hf"]["time_s"] is not None:  # (not for a failed run)
            row["dat_hf"]["flop_ratio/llama"] = flop_ratio(args, seq, row["dat_hf"]["relational_backend"],
                                                           args.window if args.relational_bias != "causal" else None)
    config = dat_config(args, max(args.seq))
    print(f"\ntrain step (fwd+bwd+AdamW), batch {args.batch}, d={config.hidden_size}, {config.num_hidden_layers} "
          f"layers, {config.num_sensory_heads}+{config.num_relational_heads} heads, ffn {config.intermediate_size}, "
          f"{args.threads} threads, {args.device} {args.dtype}" + (", torch.compile" if args.compile else "")
          + (f", preset {args.preset}" if args.preset else "") + f", relational bias {args.relational_bias}"
          + (f" {args.window}" if args.relational_bias != "causal" else "") + sdpa_note(args)
          + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "")
          + (", heap-only malloc (" + " ".join(f"{k}={v}" for k, v in HEAP_ONLY_MALLOC.items()) + ")"
             if args.malloc == "heap" else ""))
    print("times and memory: medians over repetitions; ratios: median [min-max] of the per-repetition ratios; "
          "flops: the FLOP model's dat_hf / llama for the relational backend that ran")
    others = [o for o in ("reference", "llama", *baselines(args), "dat_hf_causal") if o in args.impls]
    header = f"{'seq':>6} {'impl':>13} {'backend':>8} {'time s':>8} {'peak GiB':>9} {'net GiB':>8}"
    header += "".join(f" {'t/' + o:>17}" for o in others) + "".join(f" {'m/' + o:>10}" for o in others)
    print(header + f" {'flops/llama':>11}")
    for seq, row in table.items():
        for impl, r in row.items():
            def cell(value, fmt):
                return format(value, fmt) if value else "-"
            line = (f"{seq:>6} {impl:>13} {r['relational_backend'] or '-':>8} {cell(r['time_s'], '.3f'):>8} "
                    f"{cell(r['peak_gib'], '.2f'):>9} {cell(r['net_gib'], '.2f'):>8}")
            line += "".join(f" {ratio_cell(r['ratios'].get(f'time_s/{o}'), True):>17}" for o in others)
            line += "".join(f" {ratio_cell(r['ratios'].get(f'peak_gib/{o}')):>10}" for o in others)
            flops = r.get("flop_ratio/llama")
            print(line + f" {format(flops, '.2f') if flops else '-':>11}")
    return table


def main_generate(args):
    table = measure("generate", args, args.prompt, "prompt",
                    ("decode_ms_per_token", "forward_ms_per_token", "ms_per_token", "prefill_s", "cache_mib"))
    for prompt, row in table.items():
        if "dat_hf" in row and "llama" in row and row["dat_hf"]["decode_ms_per_token"] is not None:
            row["dat_hf"]["flop_ratio/llama"] = decode_flop_ratio(args, prompt)
    compiled = ""
    if args.compile:
        compiled = "compiled" + (f" with {' '.join(args.compile_options)}" if args.compile_options else "") + (
            ", guards skipped" if args.skip_guards else "") + ", "
    print(f"\ngeneration, {args.new_tokens} new tokens (greedy, batch 1, {args.threads} threads, {args.device} "
          f"{args.dtype}, {compiled}{args.cache if not args.compile else 'static'} cache{sdpa_note(args)}); decode = "
          "median ms per step after the prompt, forward = median ms of the model forward alone in those steps (the "
          "rest of a step is generate's loop), with prompt = total time / new tokens, cache = the memory its cache "
          "holds")
    print("times: medians over repetitions; ratios: median [min-max] of the per-repetition ratios; flops: the FLOP "
          "model's dat_hf / llama for a decoding step (decoding reads more than it computes: a lower bound of the "
          "work, not of the time)")
    others = [o for o in ("llama", "reference", *baselines(args), "dat_hf_causal") if o in args.impls]
    print(f"{'prompt':>7} {'impl':>10} {'decode ms':>10} {'forward ms':>11} {'with prompt':>12} {'prefill s':>10}"
          f" {'cache MiB':>10}"
          + "".join(f" {'decode/' + o:>19}" for o in others) + "".join(f" {'forward/' + o:>19}" for o in others)
          + f" {'flops/llama':>11}")
    for prompt, row in table.items():
        for impl, r in row.items():
            def cell(value, fmt):
                return format(value, fmt) if value else "-"
            print(f"{prompt:>7} {impl:>10} {cell(r['decode_ms_per_token'], '.2f'):>10} "
                  f"{cell(r['forward_ms_per_token'], '.2f'):>11} "
                  f"{cell(r['ms_per_token'], '.2f'):>12} {cell(r['prefill_s'], '.3f'):>10}"
                  f" {cell(r['cache_mib'], '.1f'):>10}"
                  + "".join(f" {ratio_cell(r['ratios'].get(f'decode_ms_per_token/{o}'), True):>19}" for o in others)
                  + "".join(f" {ratio_cell(r['ratios'].get(f'forward_ms_per_token/{o}'), True):>19}" for o in others)
                  + f" {cell(r.get('flop_ratio/llama'), '.2f'):>11}")
    if args.compile:
        for prompt, row in table.items():
            counts = {impl: next((x for x in r["runs"] if "compiled_graphs" in x), None) for impl, r in row.items()}
            print(f"prompt {prompt}, the timed run: graphs compiled / run without CUDA graphs: " + ", ".join(
                f"{impl} {c['compiled_graphs']} / {c['cudagraph_skips']}" for impl, c in counts.items() if c)
                  + "; Dynamo's guard check per step: " + ", ".join(
                f"{impl} {c['guard_check_us']:.0f} us ({c['guards']} guards)" for impl, c in counts.items()
                if c and c["guard_check_us"]))
    for prompt, row in table.items():  # a model that ignores the cache `generate` gives it decodes, wrongly and fast
        for impl, r in row.items():
            held = {x["cache_tokens"] for x in r["runs"] if x.get("cache_tokens") is not None}
            if held - {prompt + args.new_tokens - 1}:
                print(f"warning: prompt {prompt}, {impl}: the cache held {', '.join(map(str, sorted(held)))} tokens "
                      f"after the last step, not {prompt + args.new_tokens - 1}: it decoded without the cache generate "
                      "gave it (e.g. a checkout older than the Transformers installed); its times are not comparable")
    return table


def main_parts(args):
    """Where a train step's time goes: one layer's parts, forward and backward (sum of outputs as the loss), dat_hf
    beside Llama in one process, parts alternating within each repetition; medians over `--repeats` (after one
    warm-up repetition)."""
    import torch

    from dat_hf.attention_plan import AttentionPlan
    from dat_hf.kernels.cpu import load_cpu_kernel, relational_attention_op
    from dat_hf.masking_dat import AttentionMask

    torch.set_num_threads(args.threads)
    max_len = max(args.max_len, *args.seq)
    dat, llama = build("dat_hf", args, max_len).train(), build("llama", args, max_len).train()
    config = dat.config
    dat_layer, llama_layer = dat.model.layers[0], llama.model.layers[0]
    heads = config.num_sensory_heads + config.num_relational_heads
    head_dim = config.hidden_size // heads
    relations, relation_dim = config.relations, config.relation_head_dim
    kernel = load_cpu_kernel()
    table = {}
    for seq in args.seq:
        b, positions = args.batch, torch.arange(seq)[None]
        x0 = torch.randn(b, seq, config.hidden_size)
        dat_rope, llama_rope = dat.model.rotary_emb(x0, positions), llama.model.rotary_emb(x0, positions)
        with torch.no_grad():
            symbols = dat.model.symbol_retrievers(0, x0, positions)

        # the plan a training forward of the model builds (one causal graph for both head types)
        plan = AttentionPlan.build({"causal": AttentionMask(None, None, True)}, config, x0, requires_grad=True,
                                   training=True)

        def dat_layer_fn(x):
            return dat_layer(x, dat.model.symbol_retrievers(0, x, positions), dat_rope, plan.sensory["causal"],
                             plan.relational["causal"])

        def leaves(*shapes):  # random inputs made once; each call gets fresh leaves of them (no copy)
            tensors = [torch.randn(*shape) for shape in shapes]
            return lambda: [t.detach().requires_grad_() for t in tensors]

        def heads_fn(num_heads):
            inputs = leaves(*[(b, num_heads, seq, head_dim)] * 3)
            # x only carries a gradient so that every part is timed alike
            return lambda x: torch.nn.functional.scaled_dot_product_attention(*inputs(), is_causal=True) + 0 * x.sum()

        kernel_inputs = leaves(*[(b, config.num_relational_heads, seq, head_dim)] * 3,
                               *[(b, seq, relations, relation_dim)] * 2)

        def relational_kernel_fn(x):
            out, rel = relational_attention_op(*kernel_inputs(), True, head_dim**-0.5, relation_dim**-0.5, None)
            return out.sum() + rel.sum() + 0 * x.sum()

        h_s = config.num_sensory_heads
        parts = {
            "dat_hf layer": dat_layer_fn,
            "llama layer": lambda x: llama_layer(x, attention_mask=None, position_ids=positions,
                                                 position_embeddings=llama_rope),
            "dat_hf symbol retrieval": lambda x: dat.model.symbol_retrievers(0, x, positions),
            "dat_hf attention": lambda x: dat_layer.dual_attn(dat_layer.input_layernorm(x), symbols, dat_rope,
                                                              plan.sensory["causal"], plan.relational["causal"])[0],
            "llama attention": lambda x: llama_layer.self_attn(llama_layer.input_layernorm(x), attention_mask=None,
                                                               position_embeddings=llama_rope)[0],
            "dat_hf mlp": lambda x: dat_layer.mlp(dat_layer.post_attention_layernorm(x)),
            "llama mlp": lambda x: llama_layer.mlp(llama_layer.post_attention_layernorm(x)),
            f"sdpa {h_s} heads": heads_fn(h_s),
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
            progress(f"parts seq {seq}: repetition {rep}/{args.repeats}" + (" (warm-up)" if not rep else ""))
        table[seq] = {name: {"fwd_ms": 1000 * statistics.median(f for f, _ in t),
                             "bwd_ms": 1000 * statistics.median(bw for _, bw in t),
                             "total_ms": 1000 * statistics.median(f + bw for f, bw in t)} for name, t in times.items()}
    print(f"\none layer's parts, fwd + bwd, batch {args.batch}, d={config.hidden_size}, {h_s}+"
          f"{config.num_relational_heads} heads, ffn {config.intermediate_size}, {args.threads} threads; medians of "
          f"{args.repeats}")
    for seq, row in table.items():
        print(f"seq {seq}")
        for name, r in row.items():
            print(f"  {name:>26} fwd {r['fwd_ms']:8.1f} ms  bwd {r['bwd_ms']:8.1f} ms  total {r['total_ms']:8.1f} ms")
        pairs = [("dat_hf layer", "llama layer"), ("dat_hf attention", "llama attention"), ("dat_hf mlp", "llama mlp"),
                 ("relational kernel", f"sdpa {h_s} heads")]
        for a, other in pairs:
            if a in row and other in row:
                print(f"  {a} / {other}: {row[a]['total_ms'] / row[other]['total_ms']:.2f}")
        if "relational kernel" in row:
            both = row["relational kernel"]["total_ms"] + row[f"sdpa {h_s} heads"]["total_ms"]
            print(f"  (relational kernel + sdpa {h_s} heads) / sdpa {heads} heads: "
                  f"{both / row[f'sdpa {heads} heads']['total_ms']:.2f}")
    return table


def plot(table, path, impls=IMPLS):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    seqs = sorted(table)
    for impl in impls:
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
                   metavar="{train,generate,parts}", help="train: one training step per sequence length; generate: greedy decoding after a prompt; "
                        "parts: one layer's components (attention, symbol retrieval, MLP, kernels) beside Llama's")
    models = p.add_argument_group("models")
    models.add_argument("--impls", nargs="+", default=["dat_hf", "reference", "llama"], metavar="IMPL",
                        help=f"implementations to compare, of {', '.join(IMPLS)} and the --baseline names (dat_hf: "
                             "this checkout; dat_hf_causal: dat_hf with the causal bias, beside a --relational-bias); "
                             "every --baseline not listed runs after them")
    models.add_argument("--baseline", metavar="[NAME=]DIR", action="append",
                        help="a checkout of dat_hf (e.g. `git worktree add --detach /tmp/old <commit>`) measured as "
                             "NAME (default: baseline); repeat it for several checkouts, each with its own ratios")
    models.add_argument("--preset", help="the shapes of a model preset (e.g. dat-343m; Llama matched), at --layers")
    models.add_argument("--layers", type=int, help="depth (default 4, or the preset's)")
    models.add_argument("--vocab", type=int, default=1024, help="vocabulary of the small benchmark model")
    models.add_argument("--hidden", type=int, default=256, help="width of the small benchmark model")
    models.add_argument("--sensory-heads", type=int, default=4, help="sensory heads of the small benchmark model")
    models.add_argument("--relational-heads", type=int, default=4, help="relational heads of the small model")
    models.add_argument("--ffn", type=int, default=1024, help="feed-forward width of the small benchmark model")
    models.add_argument("--max-len", type=int, default=1024, help="at least this many positions")
    models.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flex_attention"],
                        help="attn_implementation of dat_hf and Llama")
    models.add_argument("--relational-backend", help="dat_hf's relational_attn_implementation (default: automatic)")
    models.add_argument("--relational-bias", default="causal", choices=["causal", "sliding_window"],
                        help="dat_hf's relational bias (every head)")
    models.add_argument("--window", type=int, default=256, help="sliding window of --relational-bias sliding_window")
    run = p.add_argument_group("runs")
    run.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024], help="train/parts: sequence lengths")
    run.add_argument("--prompt", type=int, nargs="+", default=[16, 1024], help="generate: prompt lengths")
    run.add_argument("--new-tokens", type=int, default=512, help="generate: tokens generated after the prompt")
    run.add_argument("--cache", default="dynamic", choices=["dynamic", "static"], help="generate: cache type")
    run.add_argument("--compile", action="store_true",
                     help="train: torch.compile every model (fullgraph for dat_hf and Llama); generate: compiled "
                          "decoding steps over a static cache")
    run.add_argument("--compile-options", nargs="+", metavar="KEY=VALUE",
                     help="generate --compile: inductor options of the CompileConfig of every model (instead of its "
                          "mode), e.g. cpp_wrapper=True")
    run.add_argument("--skip-guards", action="store_true",
                     help="generate --compile: time the decoding under torch.compiler.set_stance('default', "
                          "skip_guard_eval_unsafe=True), after a warm-up generation of the same length")
    run.add_argument("--batch", type=int, default=4, help="train/parts: batch size")
    run.add_argument("--steps", type=int, default=2, help="train: timed steps after one warm-up step")
    run.add_argument("--repeats", type=int, default=1, help="repetitions; ratios are taken per repetition")
    run.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS) of every worker")
    run.add_argument("--device", default="cpu", help="cpu or cuda[:i]; on CUDA peak memory is the allocator's peak")
    run.add_argument("--sdpa-math", choices=["allow", "forbid"],
                     help="forbid: scaled_dot_product_attention may use fused kernels only (flash, memory-efficient, "
                          "cuDNN), and a call that needs its math fallback fails the run (default: forbid on CUDA, "
                          "allow on CPU)")
    run.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                     help="bf16: train under autocast (fp32 weights), generate with bf16 weights")
    run.add_argument("--reference-max-seq", type=int, default=2048,
                     help="train: the reference runs up to this length (its n x n tensors grow fast)")
    run.add_argument("--mmap-threshold", type=int, default=0,
                     help="fixed glibc mmap threshold in bytes for every worker (e.g. 131072): peak RSS then follows the "
                          "live tensors instead of the allocator's heap, which by default keeps freed blocks mapped")
    run.add_argument("--malloc", choices=["default", "heap"], default="default",
                     help="heap: glibc keeps freed blocks for reuse, as a caching allocator (jemalloc, tcmalloc) "
                          "does, so large activations are not mapped and page-faulted again every step")
    p.add_argument("--out", default=None, help="folder for the JSON (and the PNG of `train`)")
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)  # (workers)
    p.add_argument("--from-reference", action="store_true", help=argparse.SUPPRESS)  # (workers: dat_hf converted)
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    named = baselines(args)
    for name, directory in named.items():
        if name in IMPLS and name != "baseline" or not name:
            p.error(f"--baseline {name}={directory}: NAME must differ from {', '.join(set(IMPLS) - {'baseline'})}")
        if not os.path.isdir(os.path.join(directory, "dat_hf")):
            p.error(f"--baseline {name}={directory}: no dat_hf package there (a checkout of dat_hf?)")
        if args.mode in ("train", "generate") and name not in args.impls:
            args.impls.append(name)
    if len(named) != len(args.baseline or []):
        p.error("--baseline: every NAME once")
    unknown = [impl for impl in args.impls if impl not in IMPLS and impl not in named]
    if unknown or "baseline" in args.impls and "baseline" not in named:
        p.error(f"--impls {' '.join(unknown or ['baseline'])}: not one of {', '.join(IMPLS)} or a --baseline NAME "
                "(--impls baseline needs --baseline DIR)")
    if not args.mode.startswith("_"):  # (workers: their PYTHONPATH's dat_hf) this checkout's for the FLOP model, parts
        sys.path.insert(0, CHECKOUT)
    if args.mode in ("train", "generate"):  # a preset's dat_hf gets the reference's weights when both are measured
        args.from_reference = "reference" in args.impls
    if args.mode == "_train":  # one measurement (`run_worker` starts these)
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
            plot(table, os.path.join(args.out, "train_scaling.png"), args.impls)


if __name__ == "__main__":
    main()
