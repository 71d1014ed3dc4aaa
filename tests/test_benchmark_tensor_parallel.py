"""scripts/benchmark_tensor_parallel.py: its `--quick` run (a torchrun of 2 processes, gloo, CPU) reports every leg
of both models with positive, finite times, the tensor-parallel step computing what one process computes (logits
and every step's loss), and where the time goes; the profile's categories split a one-process step (figures of
speed not asserted: only that they exist and are consistent)."""

import json
import math
import sys

import pytest
import torch
from conftest import tiny_config
from lm_helpers import REPO_ROOT, run_group, subprocess_env

from dat_hf import DATForCausalLM

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import benchmark_tensor_parallel as tp_bench  # noqa: E402


@pytest.mark.integration
def test_quick_run_reports_every_leg_and_equal_losses(tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "benchmark_tensor_parallel.py"), "--quick", "--out",
           str(tmp_path)]
    proc = run_group(cmd, timeout=240, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "where the time goes" in proc.stdout
    report = json.loads((tmp_path / "tensor_parallel.json").read_text())
    args, table = report["args"], report["results"]
    assert (args["tp"], args["threads"], args["steps"], args["repeats"], args["warmup"]) == (2, 2, 1, 1, 1)
    legs = ["tp", "one", "one_1t"]
    for name in tp_bench.MODELS:
        row = table["models"][name]
        assert row["tp_size"] == 2 and row["parameters"] > 0, row
        for leg in legs:
            assert len(row[leg]["time_s_per_rep"]) == 1
            assert math.isfinite(row[leg]["time_s"]) and row[leg]["time_s"] > 0, (name, leg, row[leg])
            times = report["runs"]["models"][name]["legs"][leg][0]["times"]
            assert len(times) == 1 and all(math.isfinite(t) and t > 0 for t in times)
        for leg in legs[1:]:
            ratio = row["ratios"][f"tp/{leg}"]
            assert ratio["pairs"] == [pytest.approx(row["tp"]["time_s"] / row[leg]["time_s"])]
        # the sharded model computes what one process computes: the first logits, and every step's loss (the same
        # steps from the same weights: warm-up, then per repetition warm-up + timed)
        check = row["check"]
        assert check["steps_compared"] == 3 and check["one_process_plain_tensors"] is True, check
        for leg in legs[1:]:
            assert check["legs"][leg]["logits_max_diff"] < 1e-4, check
            assert check["legs"][leg]["loss_diff"] < 1e-5, check
            assert check["loss_max_diff"][leg] < 1e-4, check
        losses = report["runs"]["models"][name]["losses"]
        assert all(len(losses[leg]) == 3 and all(math.isfinite(x) for x in losses[leg]) for leg in legs)
        assert losses["tp"][-1] < losses["tp"][0]  # (AdamW steps on one batch: the loss falls)
        # where the time goes: every rank of the TP leg, each one-process leg; the categories add up to the step
        profile = row["profile"]
        assert set(profile["tp"]) == {"rank0", "rank1"}
        for part in [*profile["tp"].values(), profile["one"], profile["one_1t"]]:
            assert set(part["ms"]) == set(tp_bench.CATEGORIES)
            assert part["profiled_step_s"] > 0 and sum(part["share"].values()) == pytest.approx(1, abs=0.02)
            assert part["share"]["linears"] > 0 and part["share"]["sensory attention"] > 0
            assert (part["share"]["relational attention"] > 0) == (name == "dat_hf"), (name, part["share"])
        tp_share = profile["tp"]["rank0"]["share"]
        assert tp_share["collectives"] > 0 and tp_share["dtensor dispatch"] > 0
        assert sum(profile["tp"]["rank0"]["collective_calls"].values()) > 0 and not profile["one"]["collective_calls"]
        assert profile["one"]["ms"]["collectives"] == profile["one"]["ms"]["dtensor dispatch"] == 0
    backends = table["models"]["dat_hf"]["relational_backend"]
    assert len(set(backends.values())) == 1 and None not in backends.values(), backends  # (one backend, every leg)
    ratios = table["dat_hf/llama"]
    assert ratios["tp/one"]["pairs"] == [pytest.approx(table["models"]["dat_hf"]["ratios"]["tp/one"]["median"]
                                                       / table["models"]["llama"]["ratios"]["tp/one"]["median"])]
    assert set(ratios["time_s"]) == set(legs)
    assert table["wall_s"] > 0 and table["shapes"]["hidden"] == 32


def test_profile_breakdown_puts_each_part_of_a_step_in_its_category():
    """`breakdown` of a one-process step: DAT's relational and sensory heads, its symbol retrieval, linears and
    AdamW each get time; no collectives or DTensor; the categories add up to the step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 97, (2, 12))
    handles = tp_bench.mark_modules(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with record_function(f"{tp_bench.STEP}{i}"):
                tp_bench.train_step(model, optimizer, batch)
    for handle in handles:
        handle.remove()
    part = tp_bench.breakdown(prof.events(), f"{tp_bench.STEP}1")
    for category in ("linears", "sensory attention", "relational attention", "symbol retrieval", "optimizer",
                     "other ops"):
        assert part["ms"][category] > 0, (category, part)
    assert part["ms"]["collectives"] == part["ms"]["dtensor dispatch"] == part["ms"]["dtensor copies"] == 0
    assert sum(part["ms"].values()) == pytest.approx(1000 * part["profiled_step_s"], rel=1e-3)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # (the marks are removed)
