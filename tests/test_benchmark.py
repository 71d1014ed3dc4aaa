"""The benchmark script runs end to end on a tiny model and reports every implementation (figures not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_benchmark_train_smoke(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "train", "--seq", "32", "--steps", "1",
           "--batch", "1", "--vocab", "64", "--hidden", "32", "--layers", "1", "--ffn", "64", "--max-len", "64",
           "--threads", "1", "--mmap-threshold", "131072", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "MALLOC_MMAP_THRESHOLD_=131072" in result.stdout
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["args"]["mmap_threshold"] == 131072
    results = report["results"]["32"]
    for impl in ("dat_hf", "reference", "llama"):
        assert results[impl]["errors"] == [], results[impl]
        assert results[impl]["time_s"] > 0 and results[impl]["peak_gib"] > 0
    assert (tmp_path / "train_scaling.png").stat().st_size > 0


def test_benchmark_generate_smoke(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "generate", "--prompt", "6", "--new-tokens", "3",
           "--vocab", "64", "--hidden", "32", "--layers", "1", "--ffn", "64", "--max-len", "64", "--threads", "1",
           "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "generate.json").read_text())["results"]["6"]
    for impl in ("dat_hf", "reference", "llama"):
        assert results[impl]["errors"] == [], results[impl]
        assert results[impl]["decode_ms_per_token"] > 0 and results[impl]["ms_per_token"] > 0, results[impl]
        assert results[impl]["prefill_s"] > 0
    assert "decode/llama" in result.stdout
