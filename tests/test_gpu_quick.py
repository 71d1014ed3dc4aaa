"""The GPU quick stage (`bash scripts/gpu_checks.sh quick`, `scripts/gpu_quick.py`) on this CPU machine.

- the dry run: the whole command with `GPU_CHECKS_DRY_RUN=1` (CPU tensors, Triton's interpreter, tiny shapes) writes
  quick.json with every step's figures, quick.md with the table for docs/performance.md, and its log; it installs
  a carried wheel only for a package the machine lacks (a made-up one), not for one it has (pytest);
- the GPU settings: every benchmark command line the GPU run builds parses, the sizes are the issue's (2048 and 4096
  tokens, a 1k prompt, 16 requests served at once), the decoding case splits its senders on an H100, and the
  sub-steps' budgets fit 8 minutes.
"""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_quick  # noqa: E402
import wheels_to_install  # noqa: E402

from dat_hf.transformers_compat import paged_cache_limits  # noqa: E402

# DAT's continuous batching runs on Transformers 5.24's paged cache; on an older release (CI's floor leg, 5.17, the
# lent GPU image's) the serve step fails by name and the other steps still pass
PAGED = paged_cache_limits() is None


def make_wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of one empty module `name`."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", "")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.integration
def test_the_dry_run_writes_every_figure_and_the_table(tmp_path):
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "dat_hf_quick_probe", "1.0")
    (wheels / "pytest-1.0-py3-none-any.whl").write_bytes(b"never opened")  # older than the installed one
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(GPU_CHECKS_DRY_RUN="1", OUT=str(out), GPU_CHECKS_WHEELS=str(wheels), GPU_CHECKS_SITE=str(tmp_path / "site"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", "scripts/gpu_checks.sh", "quick"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    log = run.stdout + run.stderr
    rc = {step: 0 if step != "serve" or PAGED else 1 for step in gpu_quick.STEPS + ("report",)}
    assert run.returncode == max(rc.values()), log[-6000:]
    assert "[wheels] dat_hf_quick_probe 1.0: missing here, installing" in log
    assert re.search(r"\[wheels\] pytest 1\.0: here [\d.]+, not installed", log), log[:3000]
    for step in gpu_quick.STEPS + ("report",):
        assert re.search(rf"--- quick {step}: rc {rc[step]}, \d+ s", log), step
    assert (out / "quick.log").read_text().count("[quick kernel]") >= 12

    report = json.loads((out / "quick.json").read_text())
    s = gpu_quick.SETTINGS["dry_run"]
    assert set(report) >= {"env", "kernel", "train", "decode", "backends", "summary", "targets", "steps"}
    assert set(report["steps"]) == set(gpu_quick.STEPS) | {"report"}
    assert all(step["rc"] == rc[name] and step["budget_s"] > 0 for name, step in report["steps"].items())

    env_section = report["env"]
    assert env_section["dry_run"] is True and env_section["device"]["device"] == "cpu"
    assert env_section["carried_wheels"] == {"dat_hf_quick_probe": "1.0"}
    assert env_section["packages"]["torch"] and env_section["packages"]["transformers"]
    assert env_section["tf32"]["triton_kernel_float32_dots"] == "ieee"
    from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS

    assert len(env_section["selection"]) == 5
    for chosen in env_section["selection"].values():
        assert chosen["relational"] in RELATIONAL_ATTENTION_FUNCTIONS, chosen
    assert env_section["selection"]["decoding step bf16"]["relational"] == "eager"  # (CPU, no compiled kernel)
    assert set(env_section["flop_model"]) == {f"train {seq}" for seq in s["train"]["seqs"]} | {
        f"decode {s['decode']['prompt']}"}

    kernel = report["kernel"]
    assert kernel["interpreted"] is True
    cases = kernel["cases"]
    assert len(cases) == 3 * len(s["kernel"]) + 1  # every case in 3 dtypes, and each autotuning config (1 here)
    assert {c["dtype"] for c in cases} == set(gpu_quick.KERNEL_DTYPES)
    for c in cases:
        assert c["ok"], c
        assert len(c["errors"]) == 7 and max(c["errors"].values()) == c["worst"] <= gpu_quick.TOLERANCE[c["dtype"]]
    assert next(c for c in cases if c["case"] == "343m-decoding-split-senders")["sender_splits"] > 1

    for seq in s["train"]["seqs"]:
        row = report["train"]["results"][str(seq)]
        for impl in ("dat_hf", "llama"):
            assert row[impl]["time_s"] > 0 and row[impl]["peak_gib"] > 0 and "sdpa_math" in row[impl], row[impl]
        summary = report["summary"]["train"][str(seq)]
        assert summary["time_ratio"] == row["dat_hf"]["time_s"] / row["llama"]["time_s"]
        assert summary["flop_ratio"] > 0 and summary["errors"] == {}
    prompt = str(s["decode"]["prompt"])
    decode = report["decode"]["results"][prompt]
    for impl in ("dat_hf", "llama"):
        assert decode[impl]["decode_ms_per_token"] > 0 and "cache_tokens" in decode[impl], decode[impl]
    held = report["summary"]["decode"][prompt]["cache_held_every_token"]
    assert held["llama"] is True  # (the check itself: Llama's cache holds prompt + new tokens - 1)
    assert decode["llama"]["cache_tokens"] == s["decode"]["prompt"] + s["decode"]["new_tokens"] - 1
    backends = report["backends"]["results"]
    for seq in s["backends"]["seqs"]:
        assert backends[f"sdpa {seq}"]["dat_hf"]["relational_backend"] == "sdpa"
        assert backends[f"sdpa {seq}"]["dat_hf"]["time_s"] > 0
        assert "no backward on CPU" in backends[f"flex_attention {seq}"]["dat_hf"]["skipped"]
        assert "--relational-backend" in report["backends"]["argv"][f"flex_attention {seq}"]

    requests = s["serve"]["concurrency"][0]
    if PAGED:
        serve = report["serve"]["results"]
        for model in ("dat_hf", "llama"):
            row = serve["concurrency"][str(requests)][model]
            assert row["errors"] == [] and row["continuous"] > 0 and row["sequential"] > 0, row
            memory = serve["memory"][model]
            assert 0 < memory["paged_bytes_per_token"] <= memory["dynamic_bytes_per_token"], memory
        assert report["summary"]["serve"]["concurrency"] == requests
        assert report["summary"]["serve"]["paged_bytes_ok"] is True
    else:  # refused at once, naming the wheel to carry
        assert "results" not in report["serve"] and report["summary"]["serve"] is None
        assert "carry its wheel (`pip download --no-deps -d .whl transformers==5.25.0`)" in report["serve"]["dat_needs"]

    table = (out / "quick.md").read_text()
    assert table.startswith("### GPU quick stage: DRY RUN on CPU")
    assert "| measurement | dat_hf | Llama | dat_hf / Llama | target | FLOP model |" in table
    serving = ((f"| serving {requests} requests, continuous batching", "| cache bytes per token, paged / dynamic |")
               if PAGED else (f"Serving: {report['serve']['dat_needs']}.",))
    for row in (f"| train step, {s['train']['seqs'][0]} tokens (relational: sdpa) |",
                f"| peak memory, {s['train']['seqs'][0]} tokens |", f"| decoding after {prompt} tokens, ms/token",
                "relational heads on `sdpa` |", "| 343m-causal | ", "Each autotuning config",
                "Backends selected on cpu", *serving):
        assert row in table, row
    assert "None" not in table and "nan" not in table


# ---- the GPU run's settings, checked here ---------------------------------------------------------------------------
@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(gpu_quick, "DRY_RUN", False)
    return gpu_quick.settings()


def test_the_gpu_command_lines_parse_and_have_the_issues_sizes(gpu):
    benchmark = gpu_quick.import_benchmark()
    train = benchmark.parser().parse_args(gpu_quick.train_argv(gpu))
    assert (train.device, train.dtype, train.preset, train.impls) == ("cuda", "bf16", "dat-343m", ["dat_hf", "llama"])
    assert 1 < train.layers < 24 and train.sdpa_math is None  # (forbidden by default on CUDA)
    assert benchmark.fused_sdpa_only(train)
    assert gpu["train"]["seqs"] == gpu["backends"]["seqs"] == [2048, 4096]
    decode = benchmark.parser().parse_args(gpu_quick.decode_argv(gpu))
    assert (decode.device, decode.cache, decode.layers, gpu["decode"]["prompt"]) == ("cuda", "dynamic", None, 1024)
    assert decode.max_len >= gpu["decode"]["prompt"] + decode.new_tokens
    for backend in ("flex_attention", "sdpa"):
        args = benchmark.parser().parse_args(gpu_quick.train_argv(gpu, "--relational-backend", backend, "--attn",
                                                                  backend))
        assert args.relational_backend == backend and args.attn == backend
    import benchmark_serve

    serve = benchmark_serve.parser().parse_args(gpu_quick.serve_argv(gpu))
    assert (serve.device, serve.dtype, serve.concurrency, serve.in_process) == ("cuda", "bf16", [16], True)
    assert serve.hidden % (serve.sensory_heads + serve.relational_heads) == 0 and serve.repeats == 1


def test_the_gpu_kernel_cases(gpu, monkeypatch):
    """The cases are valid inputs at DAT-343M's head shapes; the decoding case splits its senders on an H100 (132
    multiprocessors); the padding leaves rows of different lengths."""
    import torch
    from relational_cases import make_inputs

    from dat_hf.kernels import triton_relational as kernel

    monkeypatch.setattr(kernel, "_processors", lambda device: 132)
    names = [case for case, _, _, _ in gpu["kernel"]]
    assert names == [case for case, _, _, _ in gpu_quick.SETTINGS["dry_run"]["kernel"]]
    for case, spec, options, split in gpu["kernel"]:
        query, key, values, q_rel, k_rel = make_inputs(**spec)
        assert query.shape[1] % key.shape[1] == 0 and split is None
        if case.startswith("343m"):
            assert (query.shape[1], key.shape[1], query.shape[3], q_rel.shape[2], q_rel.shape[3]) == (8, 4, 64, 8, 64)
        if "padding" in options:
            assert len(options["padding"]) == spec["b"] and max(options["padding"]) == spec["kv_len"] > min(
                options["padding"])
    decoding = dict((case, spec) for case, spec, _, _ in gpu["kernel"])["343m-decoding-split-senders"]
    splits, _ = kernel._sender_splits(1, decoding["kv_len"], decoding["b"], torch.device("cpu"))
    assert splits > 1


def test_the_sub_step_budgets_fit_eight_minutes():
    script = (REPO / "scripts" / "gpu_checks.sh").read_text()
    budgets = dict(item.split(":") for item in re.search(r"^QUICK_BUDGETS=\((.*)\)$", script, re.M).group(1).split())
    assert list(budgets) == [*gpu_quick.STEPS, "report"]
    assert sum(map(int, budgets.values())) <= 8 * 60 - 20  # (the marks and the wheel check take a few seconds)


def test_which_wheels_a_machine_needs(tmp_path):
    installed = {"torch": "2.11.0+cu130", "transformers": "5.17.0"}
    decide = wheels_to_install.decide
    assert decide(tmp_path / "transformers-5.24.0-py3-none-any.whl", installed)[0]  # older here
    assert not decide(tmp_path / "transformers-5.17.0-py3-none-any.whl", installed)[0]  # the same
    assert not decide(tmp_path / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", installed)[0]  # (+cu130)
    needed, why = decide(tmp_path / "dual_attention-0.0.7-py3-none-any.whl", installed)
    assert needed and "missing" in why
    needed, why = decide(tmp_path / "notawheel.whl", installed)
    assert not needed and "not a wheel file name" in why
