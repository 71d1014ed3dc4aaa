"""Scale-out training on CPU (integration: `bash scripts/test.sh -m integration tests/test_scale_out.py`): FSDP2 x
tensor parallelism on a 2 x 2 mesh (4 processes) and DeepSpeed ZeRO-3 through `Trainer` (2 processes), each against
the same saved model trained in one process.

FSDP2 x TP (`tests/workers/fsdp_tp_train.py`): `AutoModelForCausalLM.from_pretrained(folder,
distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))`, Transformers 5.24 applying the model's TP plan on the
`tp` dimension and FSDP2 on the `fsdp` dimension, for Llama (the baseline) and a DAT with 4 relational heads; DAT with
2 relational heads has its W_r `[heads, d_h, R]` split into 1 row per TP rank, which Transformers' shard-on-read
loader cannot split further over 2 FSDP ranks (an IndexError in `DtensorShardOperation._slice_and_cat`:
`test_transformers_loads_a_tp_shard_smaller_than_fsdp_size` records it), so that model is TP-sharded by the same call
and FSDP2-sharded by hand (`fully_shard` on the mesh's `fsdp` dimension). Each data-parallel group trains on its half
of every batch, the two TP ranks of a group on the same half: 4 SGD steps whose losses (the mean of the halves'),
weights and logits equal one process trained on the full batches.

ZeRO-3 (`tests/workers/zero3_trainer.py`): `Trainer` with `TrainingArguments(deepspeed="configs/deepspeed/zero3.json")`
on a model loaded from a saved folder (`zero.Init` partitions it as it is built, so a model built from a config would
start from another initialisation), 4 AdamW steps, `trainer.save_model`; the losses and gradient norms equal one
process's, the saved folder reloads in one process to the trained (gathered) model's logits, and the losses fall. In
bf16 the saved folder holds the gathered weights bit for bit, and reloads to the trained model's logits exactly when
it computes its linear layers as the ZeRO-3 process did (see `test_deepspeed_zero3_bf16_...`).
"""

import json
import sys
import time

import pytest
import torch
from lm_helpers import REPO_ROOT, run_group, subprocess_env
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dat_hf import DATConfig, DATForCausalLM

pytestmark = pytest.mark.integration  # (processes: CI runs them; `bash scripts/test.sh -m integration`)

WORKERS = REPO_ROOT / "tests" / "workers"
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_symbols=8, symbolic_attention_heads=2,
             intermediate_size=96)
MODELS = {
    "dat": lambda: DATForCausalLM(DATConfig(num_sensory_heads=2, num_relational_heads=2, **SMALL)),
    # W_r has 4 rows: 2 per TP rank, 1 per (TP, FSDP) rank, which Transformers' loader splits
    "dat4": lambda: DATForCausalLM(DATConfig(num_sensory_heads=4, num_relational_heads=4, **SMALL)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                                  max_position_embeddings=64, tie_word_embeddings=True)),
}


def save_model(name, folder):
    torch.manual_seed(0)
    MODELS[name]().save_pretrained(folder)
    return str(folder)


def torchrun(nproc, worker, *args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKERS / worker), *map(str, args)]
    start = time.perf_counter()
    proc = run_group(cmd, timeout=timeout, cwd=REPO_ROOT, env=subprocess_env())
    return proc, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 x TP, 2 x 2

# SGD (lr 0.5) in fp32 on both sides: the sharded run sums partial products in another order (TP all-reduces, FSDP's
# reduce-scatter of two half-batch gradients), so results differ by rounding only. Measured over 4 steps: losses within
# 2.3e-7 (relative), weights within 3.4e-7 (steps move them by up to 0.28), logits within 3.5e-6 of logits up to 4.
# (AdamW, measured as well: losses within 1.2e-7, weights within 1.5e-4, as AdamW divides near-zero gradient entries
# by their own RMS and so magnifies rounding; SGD keeps the weight and logit checks tight.)
LOSS_RTOL, WEIGHT_ATOL, LOGITS_RTOL = 1e-5, 1e-5, 1e-5


def check_fsdp_tp_run(name, records):
    """Assertions on the 4 ranks' records of one model (`fsdp_tp_train.py`)."""
    assert len(records) == 4
    assert {(rec["dp_rank"], rec["tp_rank"]) for rec in records} == {(0, 0), (0, 1), (1, 0), (1, 1)}, name
    first = records[0]
    for rec in records:
        assert rec["tp_size"] == rec["fsdp_size"] == 2, rec
        assert rec["mesh"] == [[0, 1, 2, 3], ["pp", "fsdp", "tp"]], rec
        assert rec["model_class"].startswith("FSDP"), rec  # fully_shard's class swap
        assert rec["dtensor_parameters"] == rec["num_parameters"], rec  # every parameter sharded
        assert {"", "model.layers.0", "model.layers.1"} <= set(rec["fsdp_units"]), rec
        assert rec["losses"] == first["losses"], (name, rec["losses"], first["losses"])  # the same global loss
    # every projection of every layer is sharded on both dimensions (TP, then FSDP)
    assert len(first["projection_weights"]) >= 7 * 2, first
    assert set(first["projection_weights"]) <= set(first["tp_and_fsdp_sharded"]), first
    # the two data-parallel groups trained on different halves: their own losses differ
    halves = {rec["dp_rank"]: rec["local_losses"] for rec in records}
    assert halves[0] != halves[1]
    for rec in records:
        assert rec["local_losses"] == halves[rec["dp_rank"]]  # the TP ranks of a group agree

    assert first["initial_logits_diff"] < 1e-5, first
    for step, (loss, reference) in enumerate(zip(first["losses"], first["reference_losses"]), 1):
        assert loss == pytest.approx(reference, rel=LOSS_RTOL), (name, step, first["losses"], first["reference_losses"])
    losses = first["reference_losses"]
    assert losses[2] < losses[0] - 0.1 and losses[3] < losses[1] - 0.1, losses  # each batch again after a step: lower
    assert first["weight_moved"] > 0.1 and first["weight_diff"] < WEIGHT_ATOL, first
    assert first["trained_logits_diff"] < LOGITS_RTOL * max(1.0, first["trained_logits_scale"]), first


def test_fsdp2_x_tensor_parallel_on_a_2x2_mesh_matches_one_process(tmp_path):
    """4 processes, (fsdp=2, tp=2): Llama and the 4-relational-head DAT through Transformers' `from_pretrained`
    (TP, then FSDP2), the 2-relational-head DAT TP-sharded by the same call and FSDP2-sharded by hand (`dat+`)."""
    specs = [save_model("llama", tmp_path / "llama"), save_model("dat4", tmp_path / "dat4"),
             save_model("dat", tmp_path / "dat") + "+"]
    out = tmp_path / "out"
    out.mkdir()
    proc, wall = torchrun(4, "fsdp_tp_train.py", out, *specs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    print(f"\nFSDP2 x TP, 2 x 2 mesh (torchrun, 4 processes, gloo), {len(specs)} models x 4 steps: {wall:.1f} s wall")
    for i, name in enumerate(["llama", "dat4", "dat+"]):
        records = [rank[i] for rank in ranks]
        assert all(rec["folder"] == name for rec in records), [rec["folder"] for rec in records]
        first = records[0]
        print(f"{name:6s} losses 4 processes {[f'{x:.6f}' for x in first['losses']]}\n"
              f"{'':6s}        1 process   {[f'{x:.6f}' for x in first['reference_losses']]}\n"
              f"{'':6s} max relative loss difference {first['loss_rel_diff']:.1e}, weights {first['weight_diff']:.1e} "
              f"(moved {first['weight_moved']:.2f}), logits {first['trained_logits_diff']:.1e}; "
              f"FSDP units {first['fsdp_units']}")
        check_fsdp_tp_run(name, records)
    # Transformers' FSDP plan for the DAT is Llama's: the tied embeddings / LM head, the layers, the final norm
    assert ranks[0][1]["fsdp_units"] == ranks[0][0]["fsdp_units"] == ["", "model.embed_tokens", "model.layers.0",
                                                                      "model.layers.1", "model.norm"]


def test_transformers_loads_a_tp_shard_smaller_than_fsdp_size(tmp_path):
    """`from_pretrained(distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))` of the DAT with 2 relational
    heads: W_r `[2, d_h, R]` is TP-sharded by head (1 row per TP rank), FSDP2 then shards that row over 2 ranks, one of
    which holds none. Transformers 5.24's shard-on-read loader fails there: `DtensorShardOperation._slice_and_cat`
    (transformers/distributed/sharding_utils.py) reads `dim_intervals[0]` of the empty interval list of the rank that
    holds no row, an IndexError (its non-strided path takes such a list as an empty slice). Expected to fail while
    that holds; once Transformers loads it, the run must match one process as the others do."""
    out = tmp_path / "out"
    out.mkdir()
    proc, wall = torchrun(4, "fsdp_tp_train.py", out, save_model("dat", tmp_path / "dat"))
    print(f"\nDAT (2 relational heads) through Transformers' FSDP2 x TP load: {wall:.1f} s wall, rc {proc.returncode}")
    if proc.returncode != 0:
        known = "IndexError" in proc.stderr and "_slice_and_cat" in proc.stderr and "dim_intervals[0]" in proc.stderr
        assert known, proc.stdout[-3000:] + proc.stderr[-6000:]
        pytest.xfail("Transformers' shard-on-read loader cannot give a rank an empty FSDP shard of a TP shard "
                     "(IndexError in DtensorShardOperation._slice_and_cat): DAT's W_r with 2 relational heads over "
                     "tp=2, fsdp=2")
    check_fsdp_tp_run("dat", [json.loads((out / f"rank{r}.json").read_text())[0] for r in range(4)])


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 through Trainer, 2 processes

# AdamW (Trainer's) in fp32, lr 1e-2 decaying linearly over 4 steps, gradient clipping at 1: ZeRO-3 reduces the two
# processes' half-batch gradients where one process sums the whole batch, so results differ by rounding, which AdamW
# magnifies in gradient entries near zero (see above). Measured: losses within 1.2e-7 and gradient norms within 1e-7
# (relative), weights within 1.1e-5 of steps moving them by up to 0.025, reloaded logits within 3e-7 (ZeRO-3's own
# linear adds the bias after the product: see the bf16 test below).
Z3_RTOL, Z3_WEIGHT_ATOL, Z3_LOGITS_ATOL = 1e-5, 1e-4, 1e-5


def test_deepspeed_zero3_trainer_matches_one_process_and_saves_a_loadable_model(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install deepspeed")
    folder = save_model("dat", tmp_path / "dat")
    start = time.perf_counter()  # the reference: the same Trainer run in one process, without DeepSpeed
    proc = run_group([sys.executable, str(WORKERS / "zero3_trainer.py"), folder, tmp_path / "single"], timeout=300,
                     cwd=REPO_ROOT, env=subprocess_env())
    single_wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    proc, wall = torchrun(2, "zero3_trainer.py", folder, tmp_path / "zero3", "--deepspeed",
                          REPO_ROOT / "configs" / "deepspeed" / "zero3.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"\nDeepSpeed ZeRO-3 (torchrun, 2 processes, gloo), 4 steps + save: {wall:.1f} s wall; "
          f"1 process: {single_wall:.1f} s wall")

    single = json.loads((tmp_path / "single" / "rank0.json").read_text())
    ranks = [json.loads((tmp_path / "zero3" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rec in enumerate(ranks):
        assert rec["rank"] == r and rec["world_size"] == 2 and rec["backend"] == "gloo", rec
        assert rec["distributed_type"] == "DEEPSPEED" and rec["zero_stage"] == 3, rec
        assert rec["device"].startswith("cpu"), rec
        # partitioned: the module's own tensors of the larger parameters are empty (the small ones stay whole:
        # `stage3_param_persistence_threshold`)
        assert 0 < rec["empty_parameters"] < rec["num_parameters"], rec
        assert rec["losses"] == ranks[0]["losses"]  # logged losses are averaged over the processes
    assert single["world_size"] == 1 and single["distributed_type"] == "NO"

    losses, single_losses = dict(ranks[0]["losses"]), dict(single["losses"])
    norms, single_norms = dict(ranks[0]["grad_norms"]), dict(single["grad_norms"])
    print(f"losses ZeRO-3    {[f'{losses[s]:.6f}' for s in sorted(losses)]}\n"
          f"       1 process {[f'{single_losses[s]:.6f}' for s in sorted(single_losses)]}")
    assert sorted(losses) == sorted(single_losses) == [1, 2, 3, 4]
    for step in losses:  # step 1: the loss of the saved folder's weights, so ZeRO-3 loaded them (no fresh init)
        assert losses[step] == pytest.approx(single_losses[step], rel=Z3_RTOL), (step, losses, single_losses)
        assert norms[step] == pytest.approx(single_norms[step], rel=Z3_RTOL), (step, norms, single_norms)
    assert all(b < a for a, b in zip(list(losses.values()), list(losses.values())[1:])), losses  # falls every step
    assert losses[4] < losses[1] - 0.5, losses

    # the saved folder: the full (gathered) weights, the DAT's own files, tied embeddings stored once
    saved = tmp_path / "zero3" / "model"
    config = json.loads((saved / "config.json").read_text())
    assert config["architectures"] == ["DATForCausalLM"] and (saved / "modeling_dat.py").is_file()
    weights, initial = load_file(saved / "model.safetensors"), load_file(tmp_path / "dat" / "model.safetensors")
    single_weights = load_file(tmp_path / "single" / "model" / "model.safetensors")
    assert weights.keys() == initial.keys() == single_weights.keys() and "lm_head.weight" not in weights
    for name, weight in weights.items():
        assert weight.shape == initial[name].shape and weight.dtype == torch.float32, name
        torch.testing.assert_close(weight, single_weights[name], rtol=0, atol=Z3_WEIGHT_ATOL, msg=name)
    assert max((weights[n] - initial[n]).abs().max().item() for n in weights) > 1e-2  # it trained

    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    assert type(model) is DATForCausalLM and model.lm_head.weight is model.model.embed_tokens.weight
    probe = torch.load(tmp_path / "zero3" / "probe.pt", weights_only=True)  # the trained ZeRO-3 model's logits
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=0, atol=Z3_LOGITS_ATOL)
    print(f"reloaded vs trained ZeRO-3 logits: {(logits - probe['logits']).abs().max().item():.1e}; weights vs 1 "
          f"process: {max((w - single_weights[n]).abs().max().item() for n, w in weights.items()):.1e}")


# In bf16, a DAT reloaded from what ZeRO-3 saved differs from the trained model by one bf16 rounding of the logits
# (measured 0.0078 at logits ~1.8 with dat-tiny; Llama: 0.0). The weights are not the cause: the saved tensors are
# the gathered ones bit for bit. `deepspeed.zero.Init` replaces `torch.nn.functional.linear` for the whole process
# (`zero_optimization.memory_efficient_linear`, true by default) with `zero3_linear_wrap`, which for inputs of more
# than 2 dimensions computes `x @ W^T` and then adds the bias: two roundings in bf16 where torch's `F.linear` rounds
# once. DAT has biased linear layers (the symbolic attention's `q_proj`; `mlp_bias` in the large presets), Llama none.
# The reloaded model gives the trained logits exactly under `zero3_linear_wrap`, and under torch's `F.linear` when the
# ZeRO-3 run had `"memory_efficient_linear": false` (which keeps each gathered weight alive from forward to backward).
@pytest.mark.parametrize("memory_efficient_linear", [True, False], ids=["zero3.json", "memory_efficient_linear-false"])
def test_deepspeed_zero3_bf16_saves_the_trained_weights_exactly(tmp_path, monkeypatch, memory_efficient_linear):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install deepspeed")
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    ds_config = REPO_ROOT / "configs" / "deepspeed" / "zero3.json"
    if not memory_efficient_linear:
        config = json.loads(ds_config.read_text())
        config["zero_optimization"]["memory_efficient_linear"] = False
        ds_config = tmp_path / "zero3_plain_linear.json"
        ds_config.write_text(json.dumps(config))
    folder = save_model("dat", tmp_path / "dat")
    proc, wall = torchrun(2, "zero3_trainer.py", folder, tmp_path / "zero3", "--deepspeed", ds_config, "--bf16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / "zero3" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(rec["zero_stage"] == 3 and rec["dtypes"] == ["torch.bfloat16"] for rec in ranks), ranks
    losses = dict(ranks[0]["losses"])
    assert losses[4] < losses[1] - 0.5, losses  # it trained

    saved = tmp_path / "zero3" / "model"
    weights, gathered = load_file(saved / "model.safetensors"), load_file(tmp_path / "zero3" / "gathered.safetensors")
    assert weights.keys() == gathered.keys() and "lm_head.weight" not in weights
    for name, weight in weights.items():  # the in-memory parameters after training, bit for bit
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, gathered[name]), name

    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    assert model.dtype == torch.bfloat16 and model.model.symbol_retrievers.retrievers[0].q_proj.bias is not None
    probe = torch.load(tmp_path / "zero3" / "probe.pt", weights_only=True)
    with torch.no_grad():
        plain = model(input_ids=probe["input_ids"]).logits.float()
        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
            wrapped = model(input_ids=probe["input_ids"]).logits.float()
    difference = (plain - probe["logits"]).abs().max().item()
    print(f"\nDeepSpeed ZeRO-3 bf16 ({ds_config.name}, torchrun, 2 processes): {wall:.1f} s wall; reloaded vs trained "
          f"logits (up to {probe['logits'].abs().max().item():.2f}): torch's F.linear {difference:.2g}, "
          f"zero3_linear_wrap {(wrapped - probe['logits']).abs().max().item():.2g}")
    assert torch.equal(wrapped if memory_efficient_linear else plain, probe["logits"])
    torch.testing.assert_close(plain, probe["logits"], rtol=0, atol=0.05)  # a bf16 rounding of the logits at most
