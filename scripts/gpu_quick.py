#!/usr/bin/env python
"""The GPU quick stage (`bash scripts/gpu_checks.sh quick`): one command of at most 8 minutes on one H100/H200.

    python3 scripts/gpu_quick.py STEP --out DIR      STEP: env, kernel, train, decode, backends, serve, report

Each step adds its figures to DIR/quick.json as it goes (a step stopped at its time budget keeps what it measured);
`report` adds the ratios against the GPU targets and writes DIR/quick.md, the table for docs/performance.md.

- env: device, driver and package versions (the carried wheels apart), TF32 settings, the FLOP model's ratios for
  the runs below, and the backend each head type selects on the device for training, prefill and decoding;
- kernel: the Triton kernel on the device (`tests/triton_kernel_checks.py`'s `run_op`, one autotuning config):
  values and gradients in bfloat16, float32 and float16 against the float64 reference on the same rounded inputs,
  at DAT-343M's head shapes (causal; a decoding step whose senders are split among programs; a sliding window with
  left padding) and at odd dims (12 heads in two chunks, head dim 17, 5 relations of 20);
- train: `scripts/benchmark.py`'s train step, DAT-343M shapes at reduced depth vs Llama of equal width, bf16
  autocast, SDPA's math fallback forbidden (on CUDA), relational heads on the automatic backend;
- decode: `scripts/benchmark.py`'s greedy decoding after a 1k prompt, dynamic cache, DAT-343M vs Llama (bf16), and
  whether the cache held every token (a model that ignores its cache still decodes, wrongly and fast);
- backends: the train step with the relational heads on `flex_attention` (every head on FlexAttention) and on `sdpa`;
- serve: `scripts/benchmark_serve.py`'s serving throughput at 16 requests (bf16, one process for both models):
  continuous batching vs sequential and padded `generate`, DAT vs Llama, and the bytes per token of both caches.
  DAT's continuous batching needs Transformers 5.24's paged cache: on an older release (the lent image has 5.17) the
  step fails at once, saying which wheel to carry.

With `GPU_CHECKS_DRY_RUN=1` (CPU, Triton's interpreter, tiny shapes) every step runs the same code on CPU: the suite's
dry run (`tests/test_gpu_quick.py`). Progress lines go to stdout, prefixed `[quick STEP]`.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRY_RUN = os.environ.get("GPU_CHECKS_DRY_RUN", "0") == "1"
STEPS = ("env", "kernel", "train", "decode", "backends", "serve")
# the targets of the GPU issue: dat_hf / Llama of the same width at most these
TARGETS = {"train_time": 1.25, "train_peak_memory": 1.1, "decode_ms_per_token": 1.3}
PACKAGES = ("torch", "triton", "transformers", "accelerate", "tokenizers", "safetensors", "huggingface_hub", "numpy",
            "packaging", "datasets", "evaluate", "einops", "dual_attention", "pytest")

# DAT-343M's relational heads: 8 heads over 4 kv heads of 64, 8 relations of 64
HEADS_343M = dict(h=8, h_kv=4, d=64, R=8, d_r=64)
SETTINGS = {
    "gpu": dict(
        device="cuda", preset="dat-343m", threads=8,
        train=dict(layers=8, batch=4, seqs=[2048, 4096], steps=3),  # DAT-343M shapes, 8 of its 24 layers
        decode=dict(layers=None, prompt=1024, new_tokens=64),  # the whole 24 layers
        backends=dict(seqs=[2048, 4096]),
        # 16 requests of 8-96 tokens, 32 new tokens each, a model of DAT-343M's width at 4 layers
        serve=dict(concurrency=[16], new_tokens=32, shapes=["--hidden", "1024", "--layers", "4", "--sensory-heads",
                                                            "8", "--relational-heads", "8", "--ffn", "4096",
                                                            "--vocab", "32000"]),
        kernel=[  # (case, inputs of `make_inputs`, options of `run_op`, senders per split or None)
            ("343m-causal", dict(b=2, q_len=512, kv_len=512, **HEADS_343M), dict(causal=True), None),
            ("343m-decoding-split-senders", dict(b=1, q_len=1, kv_len=2048, **HEADS_343M), dict(causal=True), None),
            ("343m-window-128-left-padding", dict(b=2, q_len=384, kv_len=384, **HEADS_343M),
             dict(causal=True, window=128, padding=[384, 200]), None),
            ("odd-dims-head-chunks", dict(b=2, h=12, h_kv=4, q_len=80, kv_len=80, d=17, R=5, d_r=20),
             dict(causal=True), None),
        ],
    ),
    "dry_run": dict(
        device="cpu", preset="dat-tiny", threads=1,
        train=dict(layers=1, batch=1, seqs=[32], steps=1),
        decode=dict(layers=1, prompt=12, new_tokens=3),
        backends=dict(seqs=[32]),
        serve=dict(concurrency=[4], new_tokens=4, shapes=["--hidden", "64", "--layers", "1", "--sensory-heads", "2",
                                                          "--relational-heads", "2", "--ffn", "128", "--vocab", "256",
                                                          "--prompt-lengths", "4", "12", "--page-size", "16",
                                                          "--max-batch-tokens", "64"]),
        kernel=[
            ("343m-causal", dict(b=1, h=4, h_kv=2, q_len=20, kv_len=20, d=16, R=2, d_r=16), dict(causal=True), None),
            ("343m-decoding-split-senders", dict(b=1, h=4, h_kv=2, q_len=1, kv_len=70, d=16, R=2, d_r=16),
             dict(causal=True), 32),
            ("343m-window-128-left-padding", dict(b=2, h=4, h_kv=2, q_len=24, kv_len=24, d=16, R=2, d_r=16),
             dict(causal=True, window=5, padding=[24, 10]), None),
            ("odd-dims-head-chunks", dict(b=1, h=12, h_kv=4, q_len=9, kv_len=9, d=17, R=5, d_r=20),
             dict(causal=True), None),
        ],
    ),
}
# values and gradients within this fraction of the largest entry of the float64 reference (inputs rounded to the
# dtype first): float32 dots in IEEE precision, float16/bfloat16 with float32 accumulation
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
KERNEL_DTYPES = ("bfloat16", "float32", "float16")  # bfloat16 first: what training runs


def settings() -> dict:
    return SETTINGS["dry_run" if DRY_RUN else "gpu"]


def progress(step, message):
    print(f"[quick {step}] {message}", flush=True)


# ---- the JSON report ------------------------------------------------------------------------------------------------
def load(out: Path) -> dict:
    path = out / "quick.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "quick.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out / "quick.json")


def update(out: Path, step: str, section: dict) -> None:
    """Put `section` under `step` in DIR/quick.json (written after every measurement)."""
    report = load(out)
    report[step] = section
    save(out, report)


def error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 2000 else text[:2000] + " ..."


# ---- env -------------------------------------------------------------------------------------------------------------
def package_versions() -> dict:
    from importlib import metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def carried_wheels() -> dict:
    """Distributions installed from carried wheels (`GPU_CHECKS_SITE`, where gpu_checks.sh installs them)."""
    from importlib import metadata

    site = os.environ.get("GPU_CHECKS_SITE", "/tmp/site")
    if not os.path.isdir(site):
        return {}
    return {dist.metadata["Name"]: dist.version for dist in metadata.distributions(path=[site])}


def device_record(device: str) -> dict:
    import torch

    record = {"device": device, "python": platform.python_version(), "torch_cuda": torch.version.cuda}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        record.update(name=props.name, capability=f"{props.major}.{props.minor}",
                      multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
        try:
            query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
            record["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            record["nvidia_smi"] = error_text(error)
    else:
        record.update(name=f"CPU ({platform.machine()}, {os.cpu_count()} cores)", dry_run=DRY_RUN)
    return record


def tf32_record() -> dict:
    import torch

    from dat_hf.kernels import triton_relational as kernel

    x = torch.zeros(1, 1, 1, 16)
    r = torch.zeros(1, 1, 1, 16)
    _, _, constants = kernel._launch(x, x, x, r, r, None, True, 0, False)
    return {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "triton_kernel_float32_dots": constants["PRECISION"],
            "triton_kernel_half_dots": "float32 accumulation (tf32 flag ignored for 16-bit inputs)"}


def selections(device: str) -> dict:
    """The backend each head type selects on `device` (the selection function itself, nothing launched; the length
    only matters as 1 or more): training (float32, bf16 autocast), prefill and a decoding step in bf16, and with
    `attn_implementation="flex_attention"`, at DAT-343M's shapes."""
    import torch

    from dat_hf.attention_plan import AttentionPlan
    from dat_hf.masking_dat import AttentionMask
    from dat_hf.training import load_preset_config

    config = load_preset_config("dat-343m", num_hidden_layers=1)
    scenarios = {  # (attn_implementation, train, dtype of the queries, autocast, query length)
        "train fp32": ("sdpa", True, torch.float32, False, 256),
        "train bf16 autocast": ("sdpa", True, torch.float32, True, 256),
        "prefill bf16": ("sdpa", False, torch.bfloat16, False, 256),
        "decoding step bf16": ("sdpa", False, torch.bfloat16, False, 1),
        "train bf16 autocast, attn_implementation=flex_attention": ("flex_attention", True, torch.float32, True, 256),
    }
    chosen = {}
    for name, (attn, train, dtype, autocast, q_len) in scenarios.items():
        config._attn_implementation = attn
        inputs = torch.zeros(1, q_len, config.hidden_size, device=device, dtype=dtype, requires_grad=train)
        mask = AttentionMask(None, None, True)
        if attn == "flex_attention":  # (the masks of a flex model carry a BlockMask)
            from torch.nn.attention.flex_attention import create_block_mask

            block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, q_len, q_len, device=device)
            mask = AttentionMask(None, None, True, block_mask=block_mask)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(train):
            try:
                plan = AttentionPlan.build({"causal": mask}, config, inputs, requires_grad=train, training=train)
                relational = plan.relational["causal"].name
            except Exception as error:  # noqa: BLE001 (reported, not raised)
                relational = f"error: {error_text(error)}"
        chosen[name] = {"relational": relational, "sensory": attn}
    return chosen


def step_env(out: Path) -> None:
    s = settings()
    section = {"started": now(), "dry_run": DRY_RUN, "packages": package_versions(), "carried_wheels": carried_wheels()}
    progress("env", "packages: " + ", ".join(f"{k} {v}" for k, v in section["packages"].items()))
    progress("env", f"carried wheels: {section['carried_wheels'] or 'none'}")
    import torch

    if s["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("[quick env] no CUDA device visible to torch: the quick stage needs one "
                         "(GPU_CHECKS_DRY_RUN=1 runs it on CPU)")
    import dat_hf

    section.update(dat_hf=dat_hf.__version__, commit=git_commit(), **{"device": device_record(s["device"])})
    progress("env", f"device: {section['device']}")
    section["tf32"] = tf32_record()
    progress("env", f"TF32: {section['tf32']}")
    section["selection"] = selections(s["device"])
    for name, chosen in section["selection"].items():
        progress("env", f"{s['device']}, {name}: relational heads -> {chosen['relational']}, sensory heads -> "
                 f"{chosen['sensory']}")
    section["flop_model"] = flop_model()
    update(out, "env", section)


def flop_model() -> dict:
    """The FLOP model's dat_hf / Llama ratio of every run below (`scripts/benchmark.py`), per relational backend:
    `triton` (relations formed once per pair), `flex_attention`, `sdpa`."""
    benchmark = import_benchmark()
    s = settings()
    train = benchmark.parser().parse_args(train_argv(s))
    ratios = {f"train {seq}": {backend: benchmark.flop_ratio(train, seq, backend)
                               for backend in ("triton", "flex_attention", "sdpa")} for seq in s["train"]["seqs"]}
    decode = benchmark.parser().parse_args(decode_argv(s))
    ratios[f"decode {s['decode']['prompt']}"] = {"triton": benchmark.decode_flop_ratio(decode, s["decode"]["prompt"])}
    return ratios


def git_commit():
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---- kernel ----------------------------------------------------------------------------------------------------------
def step_kernel(out: Path) -> None:
    """Values and gradients of the Triton op against the float64 reference (`triton_kernel_checks.run_op`), each case
    in each dtype with the kernels' first autotuning config, then the 343M causal case in bfloat16 with each of the
    autotuning configs (those a training step's autotuner chooses from; their compiled kernels stay in Triton's
    cache for the train step); a case that fails to compile or launch is recorded with its error and the next runs."""
    os.environ.setdefault("DAT_HF_TRITON_AUTOTUNE", "0")  # (read when dat_hf is imported: one config per kernel)
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    import triton_kernel_checks as checks
    from relational_cases import right_padding

    torch.set_num_threads(settings()["threads"])  # (conftest sets 1; the float64 reference runs on the CPU)
    kernel = checks.kernel
    section = {"device": checks.DEVICE, "interpreted": kernel.INTERPRETED, "tolerance": TOLERANCE,
               "autotune": os.environ.get("DAT_HF_TRITON_AUTOTUNE", "1"), "cases": []}
    default_split = kernel.SPLIT_SENDERS
    runs = [(dtype_name, case, None) for dtype_name in KERNEL_DTYPES for case in settings()["kernel"]]
    # every autotuning config (forward and dq, dkv), after the bfloat16 cases (one under the interpreter)
    receiver = kernel._configs(kernel.RECEIVER_SHAPES, every=True)
    sender = kernel._configs(kernel.SENDER_SHAPES, every=True)
    runs[len(settings()["kernel"]):len(settings()["kernel"])] = [
        ("bfloat16", settings()["kernel"][0], (receiver[i], sender[i % len(sender)])) for i in range(len(receiver))]
    for dtype_name, (case, spec, options, split), configs in runs:
        dtype = getattr(torch, dtype_name)
        options = dict(options)
        padding = options.pop("padding", None)
        mask = None if padding is None else right_padding(spec["b"], spec["kv_len"], padding).flip(-1)
        kernel.SPLIT_SENDERS = split or default_split
        splits = kernel._sender_splits(spec["q_len"], spec["kv_len"], spec["b"], torch.device(checks.DEVICE))[0]
        entry = {"case": case, "dtype": dtype_name, "shape": spec, "options": options, "left_padding": padding,
                 "sender_splits": splits}
        if configs is not None:
            entry.update(case=f"{case}, config {' / '.join(map(config_text, configs))}",
                         configs=[str(config) for config in configs])
        start = time.perf_counter()
        try:
            with fixed_configs(kernel, configs):
                got, expected, grads, grads64 = checks.run_op(spec, dtype=dtype, mask=mask, **options)
            if checks.DEVICE == "cuda":
                torch.cuda.synchronize()
            errors = {name: relative_error(g, e) for name, g, e in zip(
                ["attended symbols", "attended relations"] + [f"d {n}" for n in checks.NAMES],
                list(got) + list(grads), list(expected) + list(grads64))}
            worst = max(errors.values())
            entry.update(errors=errors, worst=worst, ok=bool(worst <= TOLERANCE[dtype_name]))
        except Exception as error:  # noqa: BLE001 (a case that cannot compile or launch is a result)
            # a config that needs more of the device than it has is one the autotuner skips: noted, not a failure
            unfit = configs is not None and type(error).__name__ == "OutOfResources"
            entry.update(error=error_text(error), ok=None if unfit else False)
        finally:
            kernel.SPLIT_SENDERS = default_split
        entry["seconds"] = round(time.perf_counter() - start, 2)  # (the first case of a variant compiles it)
        section["cases"].append(entry)
        update(out, "kernel", section)
        shown = entry.get("error") or f"worst error {entry['worst']:.2e} of the largest entry"
        verdict = {True: "ok", False: "FAILED", None: "does not fit the device (the autotuner skips it)"}[entry["ok"]]
        progress("kernel", f"{dtype_name} {entry['case']}: {verdict}, {shown} ({entry['seconds']} s)")
    return 1 if any(c["ok"] is False for c in section["cases"]) else 0


def config_text(config) -> str:
    """`BLOCK_M x BLOCK_N, warps, stages` of a Triton config."""
    return (f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} w{config.num_warps} s{config.num_stages}")


class fixed_configs:  # noqa: N801 (a context manager)
    """The kernels run `configs` = (forward and dq config, dkv config) instead of autotuning (None: unchanged)."""

    def __init__(self, kernel, configs):
        self.kernel, self.configs, self.saved = kernel, configs, {}

    def __enter__(self):
        if self.configs is not None:
            for name, config in (("_forward_kernel", self.configs[0]), ("_backward_dq_kernel", self.configs[0]),
                                 ("_backward_dkv_kernel", self.configs[1])):
                tuned = getattr(self.kernel, name)
                self.saved[name] = tuned.configs
                tuned.configs = [config]

    def __exit__(self, *exc):
        for name, configs in self.saved.items():
            getattr(self.kernel, name).configs = configs


def relative_error(got, expected) -> float:
    """max |got - expected| / max |expected| (0 where both are 0); inf for non-finite values or a shape mismatch."""
    import torch

    got = got.detach().double().cpu()
    if got.shape != expected.shape or not torch.isfinite(got).all():
        return float("inf")
    scale = expected.abs().max().item()
    diff = (got - expected.detach()).abs().max().item()
    return diff / scale if scale > 0 else diff


# ---- train, decode, backends (scripts/benchmark.py's workers) --------------------------------------------------------
def import_benchmark():
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark

    return benchmark


def common_argv(s) -> list:
    return ["--device", s["device"], "--dtype", "bf16", "--preset", s["preset"], "--threads", str(s["threads"])]


def train_argv(s, *extra) -> list:
    t = s["train"]
    return ["train", *common_argv(s), "--layers", str(t["layers"]), "--batch", str(t["batch"]), "--steps",
            str(t["steps"]), "--impls", "dat_hf", "llama", *extra]


def decode_argv(s) -> list:
    d = s["decode"]
    layers = ["--layers", str(d["layers"])] if d["layers"] else []
    return ["generate", *common_argv(s), *layers, "--impls", "dat_hf", "llama", "--cache", "dynamic",
            "--new-tokens", str(d["new_tokens"]), "--max-len", str(d["prompt"] + d["new_tokens"])]


def run_measurements(out: Path, step: str, mode: str, runs: list) -> None:
    """`runs`: (key, impl, argv, size) -> every worker in turn, each result under section[key][impl] as it comes."""
    benchmark = import_benchmark()
    section = {"argv": {}, "results": {}}
    for key, impl, argv, size in runs:
        args = benchmark.parser().parse_args(argv)
        section["argv"][key] = argv
        start = time.perf_counter()
        result = benchmark.run_worker(mode, impl, args, **{"seq" if mode == "train" else "prompt": size})
        result["wall_s"] = round(time.perf_counter() - start, 1)
        section["results"].setdefault(key, {})[impl] = result
        update(out, step, section)
        shown = result.get("error") or ", ".join(f"{k} {v:.4g}" for k, v in result.items()
                                                 if isinstance(v, float) and v is not None)
        progress(step, f"{key} {impl}: {shown}")
    return 1 if any("error" in r for row in section["results"].values() for r in row.values()) else 0


def step_train(out: Path) -> None:
    s = settings()
    return run_measurements(out, "train", "train", [(str(seq), impl, train_argv(s), seq)
                                                   for seq in s["train"]["seqs"] for impl in ("dat_hf", "llama")])


def step_decode(out: Path) -> None:
    s = settings()
    prompt = s["decode"]["prompt"]
    return run_measurements(out, "decode", "generate", [(str(prompt), impl, decode_argv(s), prompt)
                                                        for impl in ("dat_hf", "llama")])


def step_backends(out: Path) -> None:
    """The train step of dat_hf with its relational heads on flex_attention (every head on FlexAttention: the
    relational flex backend needs the BlockMask of a flex model) and on sdpa; Llama's figures are the train step's."""
    s = settings()
    runs = []
    for seq in s["backends"]["seqs"]:
        for backend, attn in (("sdpa", "sdpa"), ("flex_attention", "flex_attention")):  # (flex compiles: last)
            runs.append((f"{backend} {seq}", "dat_hf", train_argv(s, "--relational-backend", backend, "--attn", attn),
                         seq))
    if s["device"] == "cpu":  # (the dry run) FlexAttention has no backward on CPU in PyTorch: nothing to train
        skipped = [run for run in runs if run[0].startswith("flex_attention")]
        runs = [run for run in runs if run not in skipped]
    status = run_measurements(out, "backends", "train", runs)
    if s["device"] == "cpu":
        report = load(out)
        for key, _, argv, _ in skipped:
            report["backends"]["results"][key] = {"dat_hf": {"skipped": "FlexAttention has no backward on CPU"}}
            report["backends"]["argv"][key] = argv
        save(out, report)
    return status


def serve_argv(s) -> list:
    v = s["serve"]
    return ["--device", s["device"], "--dtype", "bf16", "--threads", str(s["threads"]), "--in-process", "--repeats",
            "1", "--concurrency", *map(str, v["concurrency"]), "--new-tokens", str(v["new_tokens"]), *v["shapes"]]


def step_serve(out: Path) -> None:
    """`scripts/benchmark_serve.py` in this process, one model after the other (each one's figures saved as they
    come): the table of its summary under "serve"."""
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark_serve
    import transformers

    from dat_hf.transformers_compat import TESTED_TRANSFORMERS, paged_cache_limits

    s = settings()
    section, runs = {"argv": serve_argv(s)}, {}
    if paged_cache_limits() is not None:  # (benchmark_serve.py refuses such a release: nothing measured)
        section["dat_needs"] = (f"not run: DAT's continuous batching needs Transformers {TESTED_TRANSFORMERS[1]}'s "
                                f"paged cache, this machine has {transformers.__version__}: carry its "
                                f"wheel (`pip download --no-deps -d .whl transformers=={TESTED_TRANSFORMERS[1]}`)")
        progress("serve", section["dat_needs"])
        update(out, "serve", section)
        return 1
    args = benchmark_serve.parser().parse_args(serve_argv(s))
    for model in args.models:
        runs[model] = [benchmark_serve.measure_model(model, args)]
        section["results"] = benchmark_serve.summarize(runs, args)
        update(out, "serve", section)
        progress("serve", f"{model}: " + json.dumps(runs[model][0]["concurrency"]))
    errors = [e for row in section["results"]["concurrency"].values() for m in args.models for e in row[m]["errors"]]
    return 1 if errors else 0


# ---- report ----------------------------------------------------------------------------------------------------------
def ratio(a, b):
    return a / b if a and b else None


def fmt(value, spec=".3f", unit=""):
    return "—" if value is None else f"{format(value, spec)}{unit}"


def summarize(report: dict) -> dict:
    """Ratios against the targets, from the steps' figures."""
    s = settings()
    env, summary = report.get("env", {}), {"train": {}, "decode": {}, "backends": {}}
    flops = env.get("flop_model", {})
    train = report.get("train", {}).get("results", {})
    for seq, row in train.items():
        dat, llama = row.get("dat_hf", {}), row.get("llama", {})
        backend = dat.get("relational_backend")
        time_ratio, peak_ratio = ratio(dat.get("time_s"), llama.get("time_s")), ratio(dat.get("peak_gib"),
                                                                                       llama.get("peak_gib"))
        summary["train"][seq] = {
            "backend": backend, "time_ratio": time_ratio, "peak_ratio": peak_ratio,
            "net_ratio": ratio(dat.get("net_gib"), llama.get("net_gib")),
            "flop_ratio": flops.get(f"train {seq}", {}).get(backend if backend in ("flex_attention", "sdpa")
                                                            else "triton"),
            "time_ok": None if time_ratio is None else time_ratio <= TARGETS["train_time"],
            "peak_ok": None if peak_ratio is None else peak_ratio <= TARGETS["train_peak_memory"],
            "errors": {impl: r["error"] for impl, r in row.items() if "error" in r},
        }
    expected_tokens = s["decode"]["prompt"] + s["decode"]["new_tokens"] - 1
    for prompt, row in report.get("decode", {}).get("results", {}).items():
        dat, llama = row.get("dat_hf", {}), row.get("llama", {})
        decode_ratio = ratio(dat.get("decode_ms_per_token"), llama.get("decode_ms_per_token"))
        summary["decode"][prompt] = {
            "backend": dat.get("relational_backend"), "decode_ratio": decode_ratio,
            "forward_ratio": ratio(dat.get("forward_ms_per_token"), llama.get("forward_ms_per_token")),
            "flop_ratio": flops.get(f"decode {prompt}", {}).get("triton"),
            "decode_ok": None if decode_ratio is None else decode_ratio <= TARGETS["decode_ms_per_token"],
            "cache_tokens_expected": expected_tokens,
            "cache_held_every_token": {impl: r.get("cache_tokens") == expected_tokens for impl, r in row.items()
                                       if "cache_tokens" in r},
            "errors": {impl: r["error"] for impl, r in row.items() if "error" in r},
        }
    for key, row in report.get("backends", {}).get("results", {}).items():
        backend, seq = key.split()
        dat, llama = row.get("dat_hf", {}), train.get(seq, {}).get("llama", {})
        summary["backends"][key] = {
            "backend_ran": dat.get("relational_backend"), "time_ratio": ratio(dat.get("time_s"), llama.get("time_s")),
            "peak_ratio": ratio(dat.get("peak_gib"), llama.get("peak_gib")),
            "flop_ratio": flops.get(f"train {seq}", {}).get(backend), "error": dat.get("error"),
            "skipped": dat.get("skipped"),
        }
    summary["serve"] = report.get("serve", {}).get("results", {}).get("acceptance")
    cases = report.get("kernel", {}).get("cases", [])
    summary["kernel"] = {"cases": len(cases), "ok": sum(c.get("ok") is True for c in cases),
                         "failed": [f"{c['dtype']} {c['case']}" for c in cases if c.get("ok") is False],
                         "configs_that_do_not_fit": [c["case"] for c in cases if c.get("ok") is None]}
    return summary


def markdown(report: dict) -> str:
    s = settings()
    env, summary, steps = report.get("env", {}), report.get("summary", {}), report.get("steps", {})
    device = env.get("device", {})
    packages = env.get("packages", {})
    train, decode, kernel = report.get("train", {}).get("results", {}), report.get("decode", {}).get("results", {}), \
        report.get("kernel", {})
    title = "DRY RUN on CPU (Triton's interpreter, tiny shapes): not a measurement" if env.get("dry_run") else (
        device.get("name", "?"))
    lines = [
        f"### GPU quick stage: {title}, {env.get('started', '?')}",
        "",
        f"`bash scripts/gpu_checks.sh quick` at dat_hf {env.get('dat_hf', '?')} (commit {env.get('commit') or '?'}); "
        f"{device.get('nvidia_smi') or device.get('name', '?')}; torch {packages.get('torch')}"
        + (f" (CUDA {device['torch_cuda']})" if device.get("torch_cuda") else "")
        + f", triton {packages.get('triton')}, transformers {packages.get('transformers')}"
        + (f"; carried wheels: {', '.join(f'{k} {v}' for k, v in env.get('carried_wheels', {}).items())}"
           if env.get("carried_wheels") else "") + ".",
        f"{s['preset']} shapes; train step: {s['train']['layers']} layers, batch {s['train']['batch']}, bf16 autocast, "
        f"fwd + bwd + AdamW, median of {s['train']['steps']} steps after a warm-up; decoding: "
        f"{s['decode']['layers'] or 'all'} layers, bf16 weights, greedy, dynamic cache, {s['decode']['new_tokens']} "
        f"new tokens; SDPA math fallback "
        f"{next((r.get('sdpa_math') for row in train.values() for r in row.values() if r.get('sdpa_math')), '?')}.",
        "",
        "| measurement | dat_hf | Llama | dat_hf / Llama | target | FLOP model |",
        "|---|---|---|---|---|---|",
    ]
    for seq, row in train.items():
        dat, llama, sm = row.get("dat_hf", {}), row.get("llama", {}), summary.get("train", {}).get(seq, {})
        backend = dat.get("relational_backend") or "error"
        lines.append(f"| train step, {seq} tokens (relational: {backend}) | {fmt(dat.get('time_s'), '.3f', ' s')} | "
                     f"{fmt(llama.get('time_s'), '.3f', ' s')} | {fmt(sm.get('time_ratio'), '.2f')} | "
                     f"<= {TARGETS['train_time']} | {fmt(sm.get('flop_ratio'), '.2f')} |")
        lines.append(f"| peak memory, {seq} tokens | {fmt(dat.get('peak_gib'), '.2f', ' GiB')} | "
                     f"{fmt(llama.get('peak_gib'), '.2f', ' GiB')} | {fmt(sm.get('peak_ratio'), '.2f')} | "
                     f"<= {TARGETS['train_peak_memory']} | |")
    for prompt, row in decode.items():
        dat, llama, sm = row.get("dat_hf", {}), row.get("llama", {}), summary.get("decode", {}).get(prompt, {})
        expected = sm.get("cache_tokens_expected")
        note = "".join(f"; {impl}'s cache held {r.get('cache_tokens')} of {expected} tokens: it decoded without it"
                       for impl, r in row.items() if "cache_tokens" in r and r["cache_tokens"] != expected)
        lines.append(f"| decoding after {prompt} tokens, ms/token (relational: {dat.get('relational_backend')})"
                     f"{note} | {fmt(dat.get('decode_ms_per_token'), '.2f')} | "
                     f"{fmt(llama.get('decode_ms_per_token'), '.2f')} | {fmt(sm.get('decode_ratio'), '.2f')} | "
                     f"<= {TARGETS['decode_ms_per_token']} | {fmt(sm.get('flop_ratio'), '.2f')} |")
    for key, row in report.get("backends", {}).get("results", {}).items():
        dat, sm = row.get("dat_hf", {}), summary.get("backends", {}).get(key, {})
        backend, seq = key.split()
        llama = train.get(seq, {}).get("llama", {})
        shown = fmt(dat.get("time_s"), ".3f", " s") if not (dat.get("error") or dat.get("skipped")) else (
            f"{'skipped' if dat.get('skipped') else 'failed'}: {(dat.get('error') or dat.get('skipped'))[:150]}")
        every = " (every head on FlexAttention; Llama on SDPA)" if backend == "flex_attention" else ""
        lines.append(f"| train step, {seq} tokens, relational heads on `{backend}`{every} | {shown} | "
                     f"{fmt(llama.get('time_s'), '.3f', ' s')} | {fmt(sm.get('time_ratio'), '.2f')} "
                     f"(memory {fmt(sm.get('peak_ratio'), '.2f')}) | | {fmt(sm.get('flop_ratio'), '.2f')} |")
    lines += serve_rows(report.get("serve", {}).get("results", {}))
    if report.get("serve", {}).get("dat_needs"):
        lines += ["", f"Serving: {report['serve']['dat_needs']}."]
    lines += ["", "Triton kernel vs the float64 reference (inputs rounded to the dtype; worst of the values and the "
              "five input gradients, as a fraction of the reference's largest entry; tolerance "
              + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()) + "; float32 dots: "
              f"{env.get('tf32', {}).get('triton_kernel_float32_dots', '?')}, torch matmul TF32 "
              f"{env.get('tf32', {}).get('torch.backends.cuda.matmul.allow_tf32', '?')}):", "",
              "| case | " + " | ".join(KERNEL_DTYPES) + " |", "|---|" + "---|" * len(KERNEL_DTYPES)]
    def cell(c):
        if "worst" in c:
            return f"{c['worst']:.1e} {'ok' if c['ok'] else 'FAILED'}"
        return f"{'does not fit' if c['ok'] is None else 'error'}: {c.get('error', '?')[:120]}"

    cases = kernel.get("cases", [])
    cells = {(c["case"], c["dtype"]): cell(c) for c in cases if "configs" not in c}
    for case in dict.fromkeys(c["case"] for c in cases if "configs" not in c):
        lines.append(f"| {case} | " + " | ".join(cells.get((case, d), "not run") for d in KERNEL_DTYPES) + " |")
    configs = [c for c in cases if "configs" in c]
    if configs:
        lines += ["", f"Each autotuning config (forward and dq / dkv), {configs[0]['case'].split(',')[0]}, bfloat16: "
                  + "; ".join(f"{c['case'].split(', config ')[1]}: {cell(c)}" for c in configs) + "."]
    lines += ["", "Backends selected on " + device.get("device", "?") + ": " + "; ".join(
        f"{name}: relational {c['relational']}, sensory {c['sensory']}" for name, c in env.get("selection", {}).items())
        + ".", "", "Sub-steps (budget, wall time, exit status): " + ", ".join(
        f"{name} {st.get('budget_s')} s / {st.get('seconds')} s / rc {st.get('rc')}"
        + (" (stopped at its budget)" if st.get("rc") == 124 else "") for name, st in steps.items()) + "."]
    return "\n".join(lines) + "\n"


def serve_rows(serve: dict) -> list:
    """The serve step's rows: continuous batching's tokens/s and speed-up over sequential `generate` per model, DAT's
    time per token over Llama's; the bytes per token of the paged and the dynamic cache."""
    def throughput(r):
        if r.get("continuous") is None:
            return f"failed: {'; '.join(r.get('errors', []))[:150] or 'not run'}"
        return f"{r['continuous']:.0f} tokens/s ({fmt((r.get('speedup') or {}).get('median'), '.2f')}x sequential)"

    rows = []
    for c, row in serve.get("concurrency", {}).items():
        ratios = row.get("dat_hf/llama", {})
        tps, speedup = ratios.get("tokens_per_s", {}).get("continuous"), ratios.get("speedup")
        rows.append(f"| serving {c} requests, continuous batching (speed-up over sequential `generate`) | "
                    f"{throughput(row.get('dat_hf', {}))} | {throughput(row.get('llama', {}))} | time per token "
                    f"{fmt(tps and 1 / tps['median'], '.2f')} (speed-up {fmt(speedup and speedup['median'], '.2f')}) | "
                    f"speed-up >= 0.8x Llama's, time <= FLOP model | {fmt(ratios.get('decode_flop_ratio'), '.2f')} |")
    memory = serve.get("memory", {})
    if memory:
        dat, llama = memory.get("dat_hf", {}), memory.get("llama", {})
        cells = [f"{fmt(m.get('paged_bytes_per_token'), 'd')} / {fmt(m.get('dynamic_bytes_per_token'), 'd')}"
                 for m in (dat, llama)]
        rows.append(f"| cache bytes per token, paged / dynamic | {cells[0]} | {cells[1]} | "
                    f"{fmt(ratio(dat.get('paged_bytes_per_token'), llama.get('paged_bytes_per_token')), '.2f')} | "
                    "paged <= dynamic | |")
    return rows


def step_report(out: Path) -> None:
    report = load(out)
    report["summary"] = summarize(report)
    report["targets"] = TARGETS
    save(out, report)
    (out / "quick.md").write_text(markdown(report))
    progress("report", f"wrote {out / 'quick.json'} and {out / 'quick.md'}")
    print(markdown(report), flush=True)


def step_mark(out: Path, name: str, rc: int, seconds: int, budget: int) -> None:
    """Record a sub-step's exit status and wall time (gpu_checks.sh, after the step: 124 = stopped at its budget)."""
    report = load(out)
    report.setdefault("steps", {})[name] = {"rc": rc, "seconds": seconds, "budget_s": budget}
    save(out, report)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=[*STEPS, "report", "mark"])
    p.add_argument("--out", type=Path, required=True, help="folder of quick.json and quick.md")
    p.add_argument("--name", help="mark: the sub-step")
    p.add_argument("--rc", type=int, help="mark: its exit status")
    p.add_argument("--seconds", type=int, help="mark: its wall time")
    p.add_argument("--budget", type=int, help="mark: its time budget")
    args = p.parse_args(argv)
    if args.step == "mark":
        return step_mark(args.out, args.name, args.rc, args.seconds, args.budget)
    return {"env": step_env, "kernel": step_kernel, "train": step_train, "decode": step_decode,
            "backends": step_backends, "serve": step_serve, "report": step_report}[args.step](args.out)


if __name__ == "__main__":
    sys.exit(main())
