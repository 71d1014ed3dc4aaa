"""FSDP2 training on CPU, 2 processes (gloo), with the settings of configs/accelerate/fsdp.yaml in fp32: the
documented launch (`accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_causal_lm.py`) and the
Trainer's own arguments (`torchrun ... --fsdp --fsdp_config <the file's fsdp_config>`). Checked: each DAT block is
one FSDP unit and every parameter is sharded over the 2 ranks, the embeddings stay tied, the losses and gradient norms
equal a 1-process run with the same global batch, the sharded checkpoint resumes to the same losses and weights as
the uninterrupted run, and the final model (full state dict, safetensors) loads with
`AutoModelForCausalLM.from_pretrained` and gives the sharded model's logits. Outside Trainer, a model sharded by hand
with `fully_shard` and saved with `save_pretrained` on every rank gives the folder the unsharded model writes.

Accelerate runs FSDP only on accelerators (on CPU it falls back to DDP without a word): the worker routes that one
decision to FSDP, see `tests/workers/fsdp_train.py`."""

import json
import os
import socket
import sys
import time

import pytest
import torch
import yaml
from lm_helpers import REPO_ROOT, import_script, losses_by_step, run_group, subprocess_env, train_args
from conftest import tiny_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dat_hf import DATForCausalLM

pytestmark = pytest.mark.xdist_group("fsdp")  # (one worker: the module-scoped fixtures built once)

WORKER = REPO_ROOT / "tests" / "workers" / "fsdp_train.py"
ACCELERATE_CONFIG = REPO_ROOT / "configs" / "accelerate" / "fsdp.yaml"
STEPS, SAVE_EVERY, PER_RANK_BATCH = 8, 4, 4
# fp32 on both sides; the 2-process run sums two half-batch gradients (reduce-scatter) where the 1-process run sums
# one batch, so the rounding differs by a few ulps per step. Measured: losses within 1e-6 (2 ulps), gradient norms
# within 2e-7 (relative), weights within 5e-6 after 8 AdamW steps (AdamW divides each gradient entry by its own running
# RMS, which magnifies rounding in entries near its epsilon). The loss changes by >= 1e-2 from step to step and each
# step moves weights by up to lr = 1e-2; a wrong gradient scale (sum instead of mean over ranks) doubles the norms.
RTOL, ATOL = 1e-5, 1e-5  # losses, gradient norms, logits
WEIGHT_ATOL = 1e-4  # 1% of one step


def run_args(out, *extra, batch_size=PER_RANK_BATCH):
    return train_args(out, "--save_steps", str(SAVE_EVERY), *extra, max_steps=STEPS, batch_size=batch_size, lr=1e-2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher, out, *extra):
    """Run the worker on 2 processes; -> the per-rank records."""
    cmd = [sys.executable, "-m", *launcher, str(WORKER), *run_args(out, *extra)]
    start = time.perf_counter()
    proc = run_group(cmd, timeout=300, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"2-process FSDP2 ({launcher[0]}, gloo, {STEPS} steps): {time.perf_counter() - start:.1f} s wall")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 2-process run through `accelerate launch` (checkpoints at steps 4 and 8), the same run resumed
    from its sharded checkpoint-4 through torchrun with `--fsdp_config`, and a 1-process run with the same global
    batch (2 x 4 = 8 blocks per step)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    accelerate = ["accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG), "--num_processes", "2",
                  "--mixed_precision", "no", "--main_process_port", str(free_port())]
    fsdp = launch(accelerate, tmp / "fsdp")

    fsdp_config = tmp / "fsdp_config.json"  # Trainer reads the Accelerate keys, `fsdp_` prefix and all
    fsdp_config.write_text(json.dumps(yaml.safe_load(ACCELERATE_CONFIG.read_text())["fsdp_config"]))
    torchrun = ["torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    resumed = launch(torchrun, tmp / "resumed", "--fsdp", "--fsdp_config", str(fsdp_config),
                     "--resume_from_checkpoint", str(tmp / "fsdp" / "checkpoint-4"))

    single = import_script("train_causal_lm").main(run_args(tmp / "single", batch_size=2 * PER_RANK_BATCH))
    return {"dir": tmp, "fsdp": fsdp, "resumed": resumed, "single": single}


@pytest.mark.integration
def test_fsdp2_shards_every_dat_block(runs):
    ranks = runs["fsdp"]
    for r, rec in enumerate(ranks):
        assert rec["rank"] == r and rec["world_size"] == 2 and rec["backend"] == "gloo"
        assert rec["distributed_type"] == "FSDP" and rec["fsdp_version"] == 2
        assert rec["model_class"] == "FSDPDATForCausalLM"  # fully_shard's class swap
        # the wrap unit is the DAT block (`_no_split_modules`): one unit per block, none inside a block
        assert [u for u in rec["fsdp_units"] if u.startswith("model.layers")] == ["model.layers.0", "model.layers.1"]
        assert {"", "model.embed_tokens", "lm_head"} <= set(rec["fsdp_units"])
        assert rec["tied"]  # lm_head.weight is embed_tokens.weight after sharding and training
        assert len(rec["shards"]) == rec["num_parameters"]  # every parameter is a sharded DTensor
    # dim 0 is split over the ranks: the two shards together are the whole tensor, each at most half (rounded up)
    for name, (rows0, full) in ranks[0]["shards"].items():
        rows1, full1 = ranks[1]["shards"][name]
        assert full1 == full and rows0 + rows1 == full and max(rows0, rows1) == -(-full // 2), name
    assert "model.embed_tokens.weight" in ranks[0]["shards"]


@pytest.mark.integration
def test_fsdp2_losses_equal_one_process_with_the_same_global_batch(runs):
    fsdp, single = runs["fsdp"][0], runs["single"]
    assert single["trainer"].args.world_size == 1
    single_losses = losses_by_step(single["log_history"])
    single_norms = {h["step"]: h["grad_norm"] for h in single["log_history"] if "grad_norm" in h}
    fsdp_losses, fsdp_norms = dict(fsdp["losses"]), dict(fsdp["grad_norms"])
    assert sorted(fsdp_losses) == sorted(single_losses) == list(range(1, STEPS + 1))
    for step in fsdp_losses:
        assert fsdp_losses[step] == pytest.approx(single_losses[step], rel=RTOL), step
        assert fsdp_norms[step] == pytest.approx(single_norms[step], rel=RTOL), step
    assert fsdp_losses[STEPS] < fsdp_losses[1] - 0.2  # it trains
    assert fsdp["eval_loss"] == pytest.approx(single["eval"]["eval_loss"], rel=RTOL)
    assert runs["fsdp"][1]["losses"] == fsdp["losses"]  # logged losses are averaged over the ranks

    fsdp_weights = load_file(runs["dir"] / "fsdp" / "model.safetensors")
    single_weights = load_file(runs["dir"] / "single" / "model.safetensors")
    assert fsdp_weights.keys() == single_weights.keys()
    for name, weight in fsdp_weights.items():
        torch.testing.assert_close(weight, single_weights[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    print(f"FSDP2 vs 1 process, {STEPS} steps: losses within "
          f"{max(abs(fsdp_losses[s] - single_losses[s]) for s in fsdp_losses):.1e}, gradient norms within "
          f"{max(abs(fsdp_norms[s] / single_norms[s] - 1) for s in fsdp_norms):.1e} (relative), weights within "
          f"{max((w - single_weights[n]).abs().max().item() for n, w in fsdp_weights.items()):.1e}")


@pytest.mark.integration
def test_sharded_checkpoint_resumes_like_the_uninterrupted_run(runs):
    out = runs["dir"] / "fsdp"
    for step in (SAVE_EVERY, STEPS):
        ckpt = out / f"checkpoint-{step}"
        files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
        # torch.distributed.checkpoint shards, one file per rank, for the model and the optimizer; no gathered model
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert {f"{part}/.metadata", f"{part}/__0_0.distcp", f"{part}/__1_0.distcp"} <= files, files
        assert {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"} <= files
        assert not any(f.endswith((".safetensors", ".bin")) for f in files), files
    assert not (out / ".staging").exists()

    fsdp, resumed = runs["fsdp"][0], runs["resumed"][0]
    assert resumed["steps_run"] == list(range(SAVE_EVERY + 1, STEPS + 1))  # started after checkpoint-4
    # same operations in the same order from the restored weights, optimizer, scheduler, RNG and data position
    assert resumed["losses"] == fsdp["losses"] and resumed["grad_norms"] == fsdp["grad_norms"]
    resumed_weights = load_file(runs["dir"] / "resumed" / "model.safetensors")
    for name, weight in load_file(out / "model.safetensors").items():
        assert torch.equal(weight, resumed_weights[name]), name


@pytest.mark.integration
def test_final_model_is_a_full_loadable_dat_model(runs):
    out = runs["dir"] / "fsdp"
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_dat.py", "tokenizer.json", "README.md"} <= files
    assert not any(f.startswith("_fsdp") for f in files), files  # no torch FSDP files copied as remote code
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_dat.DATForCausalLM"
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights  # tied: stored once

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "DATForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    probe = torch.load(out / "probe_logits.pt", weights_only=True)  # the sharded model's logits, from the worker
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=RTOL, atol=ATOL)



SAVE_WORKER = REPO_ROOT / "tests" / "workers" / "fsdp_save.py"


def test_fsdp2_sharded_by_hand_in_one_process_saves_the_plain_folder(tmp_path):
    """The in-process check of the 2-process tests below: `fully_shard` on each DAT block and the root over a
    1-rank gloo group in this process (the model's parameters become DTensors, its class FSDP's), one SGD step, then
    `save_pretrained`: the folder is the one the unsharded model trained the same step writes (same files, same
    weights), and it loads back as a plain `DATForCausalLM`."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DATForCausalLM(tiny_config())
        plain = copy.deepcopy(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert type(model).__name__ == "FSDPDATForCausalLM"
        assert all(isinstance(p, DTensor) for p in model.parameters())
        batch = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        for trained in (model, plain):
            trained(input_ids=batch, labels=batch).loss.backward()
            torch.optim.SGD(trained.parameters(), lr=0.1).step()
        model.save_pretrained(tmp_path / "sharded")
    finally:
        dist.destroy_process_group()
    plain.save_pretrained(tmp_path / "plain")
    files = {name: sorted(p.name for p in (tmp_path / name).iterdir()) for name in ("sharded", "plain")}
    assert files["sharded"] == files["plain"]
    config = json.loads((tmp_path / "sharded" / "config.json").read_text())
    assert config["architectures"] == ["DATForCausalLM"]
    weights, expected = (load_file(tmp_path / name / "model.safetensors") for name in ("sharded", "plain"))
    assert weights.keys() == expected.keys()
    for name, weight in weights.items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-6, msg=name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    assert type(loaded) is DATForCausalLM and loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.integration
def test_save_pretrained_of_a_model_sharded_by_hand(tmp_path):
    """`fully_shard` applied by hand (each DAT block, then the root) outside Trainer, one SGD step, then
    `model.save_pretrained` called on every rank: the folder is the one the unsharded model writes (full weights, its
    own class in `architectures` and `auto_map`, dat_hf's code), written atomically by rank 0, and it loads to the
    gathered weights and to the logits of the unsharded model trained on the same global batch.

    `DAT_HF_FSDP_DEVICE=cuda` runs the two processes on CUDA (scripts/gpu_checks.sh: NCCL with a GPU each, else gloo
    sharing one GPU); the loaded model's logits are then computed on the CPU against the GPU's."""
    device = os.environ.get("DAT_HF_FSDP_DEVICE", "cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SAVE_WORKER),
           str(tmp_path), "--device", device]
    start = time.perf_counter()
    proc = run_group(cmd, timeout=300, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"2-process FSDP2 by hand on {device}, 1 step + save_pretrained: {time.perf_counter() - start:.1f} s wall")
    for r in (0, 1):  # the model keeps FSDP's class after the save
        record = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert record["model_class"] == "FSDPDATForCausalLM" and record["device"].startswith(device), record
        print(f"rank {r}: {record}")

    out = tmp_path / "model"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DATForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dat.DATForCausalLM"
    plain = tmp_path / "plain"  # the code files of the unsharded model's save: dat_hf's own sources, none of torch's
    DATForCausalLM(tiny_config()).save_pretrained(plain)
    code = sorted(p.name for p in out.glob("*.py"))
    assert code == sorted(p.name for p in plain.glob("*.py")) and "modeling_dat.py" in code
    for name in code:
        assert (out / name).read_text() == (REPO_ROOT / "dat_hf" / name).read_text(), name
    assert {p.name for p in out.iterdir()} == {p.name for p in plain.iterdir()}  # no staging leftovers, one file

    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    weights = load_file(out / "model.safetensors")
    gathered = {name: w for name, w in reference["weights"].items() if name != "lm_head.weight"}  # tied: stored once
    assert weights.keys() == gathered.keys()
    for name, weight in weights.items():
        assert torch.equal(weight, gathered[name]), name

    # the unsharded model, one step on the whole batch: the 2-process gradients (mean of two half-batch means) differ
    # by rounding only. Measured: weights within 4e-9, logits within 6e-8; the step itself moves weights by up to
    # 1.4e-2 and logits by 0.2
    for model in (DATForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)):
        assert type(model) is DATForCausalLM and model.lm_head.weight is model.model.embed_tokens.weight
        for name, weight in model.state_dict().items():
            torch.testing.assert_close(weight, reference["reference_weights"][name], rtol=0, atol=1e-6, msg=name)
        with torch.no_grad():
            logits = model.eval()(input_ids=reference["input_ids"]).logits
        torch.testing.assert_close(logits, reference["logits"], rtol=RTOL, atol=ATOL)
