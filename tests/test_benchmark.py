"""The benchmark script runs end to end on a tiny model and reports every implementation (figures not asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = ("--vocab", "64", "--hidden", "32", "--layers", "1", "--ffn", "64", "--max-len", "64", "--threads", "1")


def run_benchmark(out, mode, *args, timeout=300, env=None):
    """`scripts/benchmark.py MODE ARGS --out OUT` in a child process -> (its stdout, its JSON report)."""
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), mode, *args, "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads((Path(out) / f"{mode}.json").read_text())


def benchmark_module():
    """scripts/benchmark.py imported as a module."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import benchmark
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return benchmark


@pytest.mark.parametrize("impl", ["dat_hf", "reference", "llama"])
def test_benchmark_workers_measure_in_process(impl, capsys):
    """One measurement of each worker (what `run_worker` starts in a child process per implementation) in this
    process: its JSON line has positive figures; the children and the report are the smokes' (integration)."""
    benchmark = benchmark_module()
    benchmark.main(["_train", "--impl", impl, "--seq", "16", "--steps", "1", "--batch", "1", *TINY])
    train = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert train["time_s"] > 0 and train["peak_gib"] > 0, train
    benchmark.main(["_generate", "--impl", impl, "--prompt", "6", "--new-tokens", "3", *TINY])
    generate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate["decode_ms_per_token"] > 0 and generate["prefill_s"] > 0, generate
    assert (generate["forward_ms_per_token"] is None) == (impl == "reference"), generate


@pytest.mark.integration
def test_benchmark_train_smoke(tmp_path):
    stdout, report = run_benchmark(tmp_path, "train", "--seq", "32", "--steps", "1", "--batch", "1", *TINY,
                                   "--mmap-threshold", "131072")
    assert "MALLOC_MMAP_THRESHOLD_=131072" in stdout
    assert report["args"]["mmap_threshold"] == 131072
    results = report["results"]["32"]
    for impl in ("dat_hf", "reference", "llama"):
        assert results[impl]["errors"] == [], results[impl]
        assert results[impl]["time_s"] > 0 and results[impl]["peak_gib"] > 0
    ratio = results["dat_hf"]["ratios"]["time_s/llama"]
    assert ratio["pairs"] == [results["dat_hf"]["runs"][0]["time_s"] / results["llama"]["runs"][0]["time_s"]]
    assert (tmp_path / "train_scaling.png").stat().st_size > 0


@pytest.mark.slow  # (50-80 s each on 2 cores: the default suite's budget)
def test_a_presets_shapes_with_the_reference(tmp_path):
    """`--preset` beside the reference: the authors' model gets the preset's shapes (GQA, symbols, FFN width) and
    dat_hf its converted weights, in process (equal logits) and in the workers (equal parameter counts)."""
    benchmark = benchmark_module()
    args = benchmark.parser().parse_args(["train", "--preset", "dat-tiny", "--layers", "2", "--impls", "dat_hf",
                                          "reference"])
    args.from_reference = True
    reference, ours = benchmark.build("reference", args, 64).eval(), benchmark.build("dat_hf", args, 64).eval()
    assert (ours.config.num_symbols, ours.config.intermediate_size, ours.config.num_hidden_layers) == (32, 341, 2)
    x = torch.randint(0, ours.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert (reference(x)[0] - ours(x).logits).abs().max() < 1e-5

    _, report = run_benchmark(tmp_path, "train", "--preset", "dat-tiny", "--layers", "1", "--impls", "dat_hf",
                              "reference", "llama", "--seq", "16", "--steps", "1", "--batch", "1", "--threads", "1")
    results = report["results"]["16"]
    for impl in ("dat_hf", "reference", "llama"):
        assert results[impl]["errors"] == [] and results[impl]["time_s"] > 0, results[impl]
    counts = {impl: results[impl]["runs"][0]["parameters"] for impl in results}
    assert counts["dat_hf"] == counts["reference"] != counts["llama"], counts


@pytest.mark.integration
def test_benchmark_heap_only_malloc_reaches_the_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    stdout, report = run_benchmark(tmp_path, "train", "--impls", "dat_hf", "--seq", "32", "--steps", "1", "--batch",
                                   "1", *TINY, "--malloc", "heap", env=env)
    assert "heap-only malloc (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736)" in stdout
    run = report["results"]["32"]["dat_hf"]["runs"][0]
    assert run["malloc_env"] == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


@pytest.mark.slow  # (50-80 s each on 2 cores: the default suite's budget)
def test_several_named_baselines_each_get_their_ratios(tmp_path):
    """`--baseline NAME=DIR`, repeated: each checkout runs as NAME after the listed implementations, with its own
    ratios to every other one; its workers import dat_hf from DIR, `dat_hf`'s from this checkout."""
    args = ("--impls", "llama", "--baseline", f"one={REPO}", "--baseline", f"two={REPO}")
    stdout, report = run_benchmark(tmp_path, "train", *args, "--seq", "32", "--steps", "1", "--batch", "1", *TINY)
    assert report["args"]["impls"] == ["llama", "one", "two"]
    results = report["results"]["32"]
    for impl in ("one", "two"):
        assert results[impl]["errors"] == [] and results[impl]["time_s"] > 0, results[impl]
        assert results[impl]["ratios"]["time_s/llama"]["pairs"], results[impl]
    assert "t/one" in stdout and "t/two" in stdout
    _, report = run_benchmark(tmp_path, "generate", *args, "--prompt", "6", "--new-tokens", "3", *TINY)
    results = report["results"]["6"]
    for impl in ("one", "two"):  # (the cache held the prompt and every new token but the last)
        assert results[impl]["errors"] == [] and results[impl]["runs"][0]["cache_tokens"] == 8, results[impl]
        assert results[impl]["ratios"]["decode_ms_per_token/llama"]["pairs"], results[impl]


def test_baseline_arguments_are_checked():
    import pytest

    benchmark = benchmark_module()
    args = benchmark.parser().parse_args(["train", "--baseline", "/tmp/old", "--baseline", "new=/tmp/x=y"])
    assert benchmark.baselines(args) == {"baseline": "/tmp/old", "new": "/tmp/x=y"}
    assert benchmark.baselines(benchmark.parser().parse_args(["train"])) == {}
    for argv in (["--impls", "baseline"], ["--impls", "dat_hf", "other"], ["--baseline", f"llama={REPO}"],
                 ["--baseline", f"a={REPO}", "--baseline", f"a={REPO}"], ["--baseline", "a=/nonexistent"]):
        with pytest.raises(SystemExit):
            benchmark.main(["train", *argv])


def test_pair_ratios_pair_repetitions_and_skip_missing_runs():
    benchmark = benchmark_module()
    pair_ratios, ratio_cell = benchmark.pair_ratios, benchmark.ratio_cell
    runs = {"dat_hf": [{"t": 3.0}, {"t": 2.0}, {"t": 5.0}, {"t": 4.0}],
            "llama": [{"t": 2.0}, {"t": 2.0}, {}, {"error": "failed"}]}
    ratio = pair_ratios(runs, "dat_hf", "llama", "t")
    assert ratio == {"median": 1.25, "min": 1.0, "max": 1.5, "pairs": [1.5, 1.0]}
    assert ratio_cell(ratio, spread=True) == "1.25 [1.00-1.50]" and ratio_cell(None) == "-"
    assert pair_ratios(runs, "dat_hf", "reference", "t") is None


@pytest.mark.integration
def test_benchmark_generate_smoke(tmp_path):
    stdout, report = run_benchmark(tmp_path, "generate", "--prompt", "6", "--new-tokens", "3", *TINY)
    results = report["results"]["6"]
    for impl in ("dat_hf", "reference", "llama"):
        assert results[impl]["errors"] == [], results[impl]
        assert results[impl]["decode_ms_per_token"] > 0 and results[impl]["ms_per_token"] > 0, results[impl]
        assert results[impl]["prefill_s"] > 0
    for impl in ("dat_hf", "llama"):  # the model forward alone, within the decoding step
        assert 0 < results[impl]["forward_ms_per_token"] < results[impl]["decode_ms_per_token"], results[impl]
        assert results[impl]["cache_mib"] > 0, results[impl]  # what the generation's cache holds
    assert results["reference"]["forward_ms_per_token"] is None and results["reference"]["cache_mib"] is None
    assert "decode/llama" in stdout and "forward/llama" in stdout and "flops/llama" in stdout
    # the FLOP model of a decoding step (6 + 2 senders on average): dat_hf's relational heads cost more per sender
    assert results["dat_hf"]["flop_ratio/llama"] > 1


def test_decode_flop_model_counts_the_senders_of_a_step():
    """A decoding step's FLOP model grows with the context (dat_hf's relational heads cost more per sender than
    Llama's heads) and, with a sliding window, stops at the window's senders."""
    benchmark = benchmark_module()
    args = benchmark.parser().parse_args(["generate", "--new-tokens", "64"])
    short, long = benchmark.decode_flop_ratio(args, 64), benchmark.decode_flop_ratio(args, 4096)
    assert 1 < short < long
    args.relational_bias = "sliding_window"
    assert benchmark.decode_flop_ratio(args, 4096) < 1 < short


@pytest.mark.slow  # (50-80 s each on 2 cores: the default suite's budget)
def test_benchmark_compiled_generate_options_smoke(tmp_path):
    """`generate --compile` with inductor options (the C++ wrapper) and unguarded compiled steps runs end to end for
    both models, also with SDPA restricted to fused kernels (as on CUDA: one graph under `sdpa_kernel`), and reports
    the forward alone beside the step, the graphs the timed run compiled and the guard check of its cached graph."""
    stdout, report = run_benchmark(tmp_path, "generate", "--impls", "dat_hf", "llama", "--prompt", "6",
                                   "--new-tokens", "4", *TINY, "--compile", "--compile-options", "cpp_wrapper=True",
                                   "--skip-guards", "--sdpa-math", "forbid", timeout=600)
    assert "compiled with cpp_wrapper=True, guards skipped" in stdout
    assert report["args"]["compile_options"] == ["cpp_wrapper=True"] and report["args"]["skip_guards"]
    results = report["results"]["6"]
    for impl in ("dat_hf", "llama"):
        assert results[impl]["errors"] == [] and results[impl]["runs"][0]["sdpa_math"] == "forbidden", results[impl]
        assert 0 < results[impl]["forward_ms_per_token"] < results[impl]["decode_ms_per_token"], results[impl]
        run = results[impl]["runs"][0]
        # without guards the warm-up decodes as far as the timed run: its graph serves every timed step
        assert run["compiled_graphs"] == 0, run
        assert run["guard_check_us"] > 0 and run["guards"] > 100, run  # the step's cached graph was found
    assert "the timed run: graphs compiled / run without CUDA graphs: dat_hf 0 / 0, llama 0 / 0" in stdout


def test_compile_options_parse_literals():
    compile_options = benchmark_module().compile_options
    assert compile_options(["cpp_wrapper=True", "cpp.threads=2", "cpp.simdlen=None", "mode=fast"]) == {
        "cpp_wrapper": True, "cpp.threads": 2, "cpp.simdlen": None, "mode": "fast"}
    assert compile_options(None) == {}


@pytest.mark.slow  # (50-80 s each on 2 cores: the default suite's budget)
def test_benchmark_bf16_options_smoke(tmp_path):
    """`--dtype bf16` (autocast in training, bf16 weights in generation) with SDPA's math fallback forbidden (the
    default on CUDA) runs end to end; on this CPU machine it stands in for the `--device cuda --dtype bf16` run made on
    a GPU machine (CPU's fused SDPA kernel is flash attention)."""
    common = [*TINY, "--impls", "dat_hf", "llama", "--device", "cpu", "--dtype", "bf16", "--sdpa-math", "forbid"]
    stdout, report = run_benchmark(tmp_path / "train", "train", "--seq", "32", "--steps", "1", "--batch", "1", *common)
    assert "cpu bf16" in stdout and "SDPA fused kernels only (math fallback forbidden)" in stdout
    results = report["results"]["32"]
    for impl in ("dat_hf", "llama"):
        assert results[impl]["errors"] == [] and results[impl]["time_s"] > 0, results[impl]
        assert results[impl]["runs"][0]["sdpa_math"] == "forbidden"
    _, report = run_benchmark(tmp_path / "gen", "generate", "--prompt", "6", "--new-tokens", "3", *common)
    results = report["results"]["6"]
    for impl in ("dat_hf", "llama"):
        assert results[impl]["errors"] == [] and results[impl]["decode_ms_per_token"] > 0, results[impl]
        assert results[impl]["runs"][0]["sdpa_math"] == "forbidden"


def test_a_call_only_sdpa_math_could_serve_fails_the_run_and_says_so():
    """Under `--sdpa-math forbid`, an SDPA call that no fused kernel takes (here: dropout, which CPU's flash kernel
    lacks) raises an error naming the math fallback, instead of running it."""
    import pytest

    benchmark = benchmark_module()
    Device, parser = benchmark.Device, benchmark.parser
    q = torch.randn(1, 2, 8, 16)
    forbid = Device(parser().parse_args(["train", "--sdpa-math", "forbid"]))
    with forbid.attention():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # flash serves it
    with pytest.raises(RuntimeError, match="no fused kernel .* math fallback is forbidden"):
        with forbid.attention():
            torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    allow = Device(parser().parse_args(["train"]))  # CPU: allowed by default
    assert allow.record() == {"sdpa_math": "allowed"}
    with allow.attention():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


@pytest.mark.integration
def test_benchmark_parts_smoke(tmp_path):
    stdout, report = run_benchmark(tmp_path, "parts", "--seq", "16", "--batch", "1", "--vocab", "64", "--hidden", "32",
                                   "--ffn", "64", "--max-len", "64", "--threads", "1")
    parts = report["results"]["16"]
    for name in ("dat_hf layer", "llama layer", "dat_hf attention", "llama attention", "dat_hf symbol retrieval",
                 "dat_hf mlp", "llama mlp", "sdpa 4 heads", "sdpa 8 heads"):
        assert parts[name]["fwd_ms"] > 0 and parts[name]["bwd_ms"] > 0, name
    assert "dat_hf layer / llama layer" in stdout


@pytest.mark.integration
def test_benchmark_validation_smoke():
    """scripts/benchmark_validation.py builds the benchmark model through benchmark.py and reports both ratios."""
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark_validation.py"), "--repeats", "1", "--steps", "1",
           "--batch", "1", "--seq", "16", "--prompt", "4", "--new-tokens", "2", "--vocab", "64", "--hidden", "32",
           "--layers", "1", "--heads", "1", "--ffn", "64"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "train step (s)     on" in result.stdout and "decode (ms/token)  on" in result.stdout
    assert "checks of one decode step" in result.stdout


@pytest.mark.integration
def test_decode_op_benchmark_counts_the_senders_of_each_mask():
    """`scripts/benchmark_decode_op.py` times the relational decoding op for masks allowing every slot, a causal
    step's and a sliding window's."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_decode_op.py"), "--slots", "96",
                             "--position", "80", "--window", "16", "--repeats", "2"], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])["results"]["cpu"]
    assert {name: r["senders"] for name, r in report.items()} == {"every slot": 96, "causal": 81, "window 16": 16}
    assert all(r["us"] > 0 for r in report.values())


@pytest.mark.integration
def test_decode_op_benchmark_of_the_triton_kernel():
    """`--backend triton` (on CUDA in scripts/gpu_checks.sh; here under Triton's interpreter): the kernel with its
    senders split and with one program per row, beside SDPA, for each mask."""
    script = str(REPO / "scripts" / "benchmark_decode_op.py")
    argv = [script, "--backend", "triton", "--slots", "300", "--position", "280", "--window", "16", "--repeats", "1",
            "--kv-heads", "2"]
    run_script = ("import runpy, sys, triton_interpreter; triton_interpreter.patch_runtime_loop_bounds(); "
                  f"sys.argv = {argv!r}; runpy.run_path({script!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", run_script], cwd=REPO / "tests", capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET="1",
                                                  DAT_HF_CPU_KERNEL="0"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])["results"]
    assert set(report) == {"triton", "triton-one-program", "sdpa-2h"}
    for rows in report.values():
        assert {name: r["senders"] for name, r in rows.items()} == {"every slot": 300, "causal": 281, "window 16": 16}
        assert all(r["us"] > 0 and r["GB/s"] > 0 for r in rows.values())
