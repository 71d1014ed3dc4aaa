"""scripts/benchmark_serve.py: its `--quick` run reports every way for both models, with continuous batching's and
the padded batch's greedy tokens equal to `generate`'s one request at a time, and the bytes per token its caches
hold equal to what the configs imply (figures of speed not asserted: only that they exist and are consistent)."""

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from dat_hf import DATForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import benchmark_serve as serve  # noqa: E402


def cache_bytes(config, itemsize=4):
    """(paged, dynamic) bytes per token the config implies: the paged cache's pages hold `num_key_value_heads` heads
    of `head_dim` for keys and as many for values per layer; a `DynamicCache` holds DAT's packed layer as it is
    (`packed_cache_width` elements), Llama's keys and values."""
    layers = config.num_hidden_layers
    paged = 2 * config.num_key_value_heads * config.head_dim * itemsize * layers
    packed = getattr(config, "packed_cache_width", None)
    return paged, (paged if packed is None else packed * itemsize * layers)


def test_quick_run_reports_every_way_with_the_sequential_tokens(tmp_path):
    serve.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serve.json").read_text())
    args = argparse.Namespace(**report["args"])
    assert (args.concurrency, args.new_tokens, args.repeats) == ([1, 4], 6, 1)
    table, runs = report["results"], report["runs"]
    for c in args.concurrency:
        row = table["concurrency"][str(c)]
        for model in serve.MODELS:
            run = runs[model][0]
            assert row[model]["errors"] == [], row[model]
            for way in serve.WAYS:
                cell = run["concurrency"][str(c)][way]
                assert cell["tokens_per_s"] == pytest.approx(c * args.new_tokens / cell["seconds"]), cell
                assert row[model][way] == cell["tokens_per_s"]  # (the median of one repetition)
            # every request's greedy tokens, batched both ways, are those of `generate` alone; and they vary
            assert run["tokens_equal"][str(c)] == {"continuous": c, "padded": c}, run["tokens_equal"]
            assert run["distinct_tokens"][str(c)] > args.new_tokens / 2, run["distinct_tokens"]
            cells = run["concurrency"][str(c)]
            assert row[model]["speedup"]["pairs"] == [cells["continuous"]["tokens_per_s"]
                                                      / cells["sequential"]["tokens_per_s"]]
        ratios = row["dat_hf/llama"]
        for way in serve.WAYS:
            assert ratios["tokens_per_s"][way]["median"] == pytest.approx(row["dat_hf"][way] / row["llama"][way])
        assert 1 < ratios["decode_flop_ratio"] < 2  # (DAT's relational heads: more work per token, not twice)
    dat, llama = serve.model_configs(args)
    assert runs["dat_hf"][0]["backend"]["continuous"]  # (the relational backend the paged batches ran)
    for model, config in (("dat_hf", dat), ("llama", llama)):
        memory = table["memory"][model]
        assert (memory["paged_bytes_per_token"], memory["dynamic_bytes_per_token"]) == cache_bytes(config)
        assert memory["setup_s"] > 0
    assert table["acceptance"]["concurrency"] == 4 and table["acceptance"]["paged_bytes_ok"] is True


def test_a_preset_gives_its_shapes_at_the_depth_asked_for():
    """`--preset`: the preset's widths, heads and vocabulary at `--layers` depth, for DAT and its Llama alike (the
    shapes of the run in docs/performance.md)."""
    args = serve.parser().parse_args(["--preset", "dat-343m", "--layers", "2"])
    dat, llama = serve.model_configs(args)
    assert (dat.hidden_size, dat.num_hidden_layers, dat.num_sensory_heads, dat.num_relational_heads) == (1024, 2, 8, 8)
    assert (dat.sensory_kv_heads, dat.num_symbols, dat.vocab_size) == (4, 1024, 50304)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.vocab_size) == (1024, 2, 16, 50304)
    assert llama.intermediate_size == dat.intermediate_size
    full_depth = serve.parser().parse_args(["--preset", "dat-343m", "--layers", "24"])
    assert 1.15 < serve.decode_flop_ratio(full_depth, 16) < 1.3  # (the "about 1.2-1.3"; the LM head is shared)


def test_bytes_per_token_of_both_caches_follow_the_config():
    """A config whose packed layer does not fill its pages' heads (GQA, one relation of 4: 36 elements per layer in 3
    heads of 2 x 8): the paged cache holds more per token than the dynamic one, by the padding of its last head."""
    config = tiny_config(num_sensory_key_value_heads=1, num_relational_key_value_heads=1, num_relations=1,
                         relation_dim=4)
    paged, dynamic = cache_bytes(config)
    assert (config.packed_cache_width, config.num_key_value_heads, paged, dynamic) == (36, 3, 384, 288)
    torch.manual_seed(0)
    model = DATForCausalLM(config).eval()
    args = serve.parser().parse_args(["--new-tokens", "3"])
    with torch.no_grad():
        assert serve.dynamic_bytes_per_token(model, [5, 6, 7, 8], args) == dynamic
        from transformers import ContinuousBatchingConfig, GenerationConfig

        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=4, max_batch_tokens=32))
        manager.warmup()  # (builds the paged cache)
        try:
            assert serve.paged_bytes_per_token(manager.batch_processor.cache) == paged
        finally:
            manager.destroy()


def test_a_model_the_manager_refuses_keeps_its_other_ways(monkeypatch):
    """The manager's error is the continuous-batching cell's (and the summary's); the other ways still run."""
    def refuse(model, args):
        raise ValueError("Continuous batching cannot serve this DAT model: a reason")

    monkeypatch.setattr(serve, "start_manager", refuse)
    args = argparse.Namespace(**{**vars(serve.parser().parse_args([])), **serve.QUICK, "concurrency": [2]})
    result = serve.measure_model("dat_hf", args)
    error = "ValueError: Continuous batching cannot serve this DAT model: a reason"
    assert result["concurrency"]["2"]["continuous"] == {"error": error} and result["continuous_error"] == error
    assert result["concurrency"]["2"]["padded"]["tokens_per_s"] > 0 and result["tokens_equal"]["2"] == {"padded": 2}
    assert "paged_bytes_per_token" not in result and result["dynamic_bytes_per_token"] > 0
    table = serve.summarize({"dat_hf": [result]}, args)
    assert table["concurrency"][2]["dat_hf"]["errors"] == [error]
    assert table["concurrency"][2]["dat_hf"]["continuous"] is None and table["acceptance"]["speedup_ratio"] is None


@pytest.mark.slow
def test_a_worker_process_gives_what_the_run_in_process_gives():
    """The full run's path: a model measured in a worker process of its own (this checkout's dat_hf first)."""
    args = argparse.Namespace(**{**vars(serve.parser().parse_args([])), **serve.QUICK, "in_process": False})
    result = serve.run_worker("dat_hf", args, repetition=1)
    assert "error" not in result, result
    assert result["ways_order"] == ["sequential", "padded", "continuous"]  # (rotated by the repetition)
    assert result["tokens_equal"]["4"] == {"continuous": 4, "padded": 4}
    assert statistics.mean(r["tokens_per_s"] for r in result["concurrency"]["4"].values()) > 0
    assert (result["paged_bytes_per_token"], result["dynamic_bytes_per_token"]) == cache_bytes(
        serve.model_configs(args)[0])


def test_a_release_without_dats_paged_cache_is_refused_by_name(monkeypatch, capsys, tmp_path):
    """Before Transformers 5.24 the run stops at once, naming the release to install (the lent GPU image has 5.17)."""
    from dat_hf import transformers_compat

    monkeypatch.setattr(transformers_compat, "paged_cache_limits", lambda: "its paged cache differs; install X")
    monkeypatch.setattr(serve, "measure_model", lambda *a, **k: pytest.fail("measured on a refused release"))
    with pytest.raises(SystemExit) as stop:
        serve.main(["--quick", "--out", str(tmp_path)])
    assert stop.value.code == 2 and not (tmp_path / "serve.json").exists()
    assert "DAT's continuous batching needs another Transformers: its paged cache differs; install X" in \
        capsys.readouterr().err
