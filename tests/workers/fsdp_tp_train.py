"""FSDP2 x tensor parallelism on a 2 x 2 mesh, run by `torchrun --nproc_per_node 4` (gloo, CPU): for each saved causal
LM folder given, `AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=2,
fsdp_size=2))` (Transformers applies the model's TP plan on the `tp` dimension, then FSDP2 on the `fsdp` dimension)
trains STEPS SGD steps against the same folder trained in one process on the full batch. Each data-parallel group
(an `fsdp` coordinate) takes its half of every batch, the two TP ranks of a group the same half. Writes
`<out>/rank<r>.json` with, per folder, the per-step losses of both runs and the measured differences (the test
asserts on them).

    torchrun --nproc_per_node 4 tests/workers/fsdp_tp_train.py OUT SPEC [SPEC ...]

SPEC: a folder (Transformers' own TP x FSDP2 load), or `FOLDER+`: the same `from_pretrained` call with Transformers'
FSDP2 step skipped (the model is TP-sharded on the `tp` dimension of the same 2 x 2 mesh and its weights loaded), then
`fully_shard` applied by hand on the mesh's `fsdp` dimension (each decoder layer, then the root), as Transformers'
default FSDP plan does. The fallback exists because Transformers 5.24's shard-on-read loader fails on a parameter whose
TP shard has fewer rows than `fsdp_size` (DAT's W_r `[relational heads, d_h, R]` with 2 relational heads over tp=2,
fsdp=2: `DtensorShardOperation._slice_and_cat` indexes the empty interval list of the rank that holds no row, an
IndexError; tests/test_scale_out.py checks that it still does).

Batches have no padding and equal lengths: the causal LM loss is a mean over equally many tokens in each half, so the
mean of the two halves' losses is the full batch's loss, and FSDP2's gradient average over the `fsdp` dimension is the
full batch's gradient.
"""

import contextlib
import os
import time

import torch
import torch.distributed as dist
import transformers.distributed.mixin
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import dat_hf  # noqa: F401  (registers the Auto classes)
from spec_runner import full, run_specs

STEPS, BATCH, SEQ_LEN, LR = 4, 4, 12, 0.5
TP_SIZE = FSDP_SIZE = 2


def batches(vocab_size):
    """STEPS batches `[BATCH, SEQ_LEN]`, the same on every rank, no padding: two fixed seeded batches in turn, so
    that each is seen again after a step on the other (its loss must have fallen)."""
    generator = torch.Generator().manual_seed(0)
    pair = [torch.randint(1, vocab_size, (BATCH, SEQ_LEN), generator=generator) for _ in range(2)]
    return [pair[step % 2] for step in range(STEPS)]


def reshard(model):
    """Free the full weights a forward without backward leaves gathered (the FSDP units that keep them after forward:
    the root, Transformers' `keep_full_weight` units), so that `model.parameters()` are the sharded ones again: an
    optimizer built while they are gathered would update the gathered copies, which the next all-gather overwrites."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def train(model, data, rows=slice(None)):
    """STEPS optimizer steps on `data[step][rows]`; -> the losses of this process."""
    if isinstance(model, FSDPModule):  # the optimizer must hold the sharded parameters (see `reshard`)
        unsharded = [n for n, p in model.named_parameters()
                     if not (isinstance(p, DTensor) and "fsdp" in p.device_mesh.mesh_dim_names)]
        assert not unsharded, unsharded
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses = []
    for ids in data:
        ids = ids[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


@contextlib.contextmanager
def without_transformers_fsdp():
    """`from_pretrained` builds the (fsdp, tp) mesh, applies TP and loads the weights, but skips its FSDP2 step."""
    apply = transformers.distributed.mixin.apply_fully_sharded_data_parallelism
    transformers.distributed.mixin.apply_fully_sharded_data_parallelism = lambda model, *args, **kwargs: model
    try:
        yield
    finally:
        transformers.distributed.mixin.apply_fully_sharded_data_parallelism = apply


def load(folder, by_hand):
    """The model TP x FSDP2-sharded over the 2 x 2 mesh: by Transformers, or (`by_hand`) TP by Transformers and FSDP2
    by `fully_shard` on the same mesh's `fsdp` dimension, one unit per decoder layer and the root (which holds the
    tied embeddings / LM head and the final norm)."""
    config = DistributedConfig(tp_size=TP_SIZE, fsdp_size=FSDP_SIZE)
    if not by_hand:
        return AutoModelForCausalLM.from_pretrained(folder, distributed_config=config)
    with without_transformers_fsdp():
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=config)
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
    fsdp_mesh = model._mesh_manager.get_mesh("fsdp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    model._is_fsdp_managed_module = True
    return model


def run(spec):
    folder, by_hand = spec.removesuffix("+"), spec.endswith("+")
    name = os.path.basename(folder) + ("+" if by_hand else "")
    reference = AutoModelForCausalLM.from_pretrained(folder)
    start = time.perf_counter()
    sharded = load(folder, by_hand)
    load_s = time.perf_counter() - start
    mesh = sharded._mesh_manager
    fsdp_mesh, tp_mesh = mesh.get_mesh("fsdp"), mesh.get_mesh("tp")
    dp_rank, tp_rank = fsdp_mesh.get_local_rank(), tp_mesh.get_local_rank()
    config = reference.config
    data = batches(config.vocab_size)
    half = BATCH // FSDP_SIZE

    result = {"folder": name, "model_class": type(sharded).__name__, "dp_rank": dp_rank, "tp_rank": tp_rank,
              "tp_size": sharded._tp_size, "fsdp_size": sharded._fsdp_size, "load_s": load_s,
              "mesh": [list(map(int, sharded._device_mesh.mesh.flatten().tolist())),
                       list(sharded._device_mesh.mesh_dim_names)]}
    # what sharded the parameters: both mesh dimensions (TP-sharded projections), or FSDP only (the rest)
    params = dict(sharded.named_parameters())
    result["num_parameters"] = len(params)
    result["dtensor_parameters"] = sum(isinstance(p, DTensor) for p in params.values())
    # sharded on both mesh dimensions (TP-sharded, then FSDP-sharded): no Replicate on either
    result["tp_and_fsdp_sharded"] = sorted(
        n for n, p in params.items() if isinstance(p, DTensor) and p.device_mesh.ndim == 2
        and not any(pl.is_replicate() for pl in p.placements))
    # the layers' projection weights (matrices of their linears, and W_r): the TP plan shards every one
    result["projection_weights"] = sorted(n for n in params if ".layers." in n
                                          and (n.endswith("proj.weight") or n.endswith("relation_proj")))
    result["fsdp_units"] = sorted(n for n, m in sharded.named_modules() if type(m).__name__.startswith("FSDP"))

    with torch.no_grad():
        probe = data[0]
        sharded.eval()
        result["initial_logits_diff"] = (reference.eval()(input_ids=probe).logits
                                         - sharded(input_ids=probe).logits).abs().max().item()
    reshard(sharded)

    start = time.perf_counter()
    local = torch.stack(train(sharded, data, slice(dp_rank * half, (dp_rank + 1) * half)))
    result["train_s"] = time.perf_counter() - start
    result["local_losses"] = local.tolist()  # this group's half
    dist.all_reduce(local, group=fsdp_mesh.get_group())  # the two halves' mean: the full batch's loss
    result["losses"] = (local / FSDP_SIZE).tolist()
    result["reference_losses"] = torch.stack(train(reference, data)).tolist()
    result["loss_rel_diff"] = max(abs(a / b - 1) for a, b in zip(result["losses"], result["reference_losses"]))

    # the trained weights and logits
    trained = dict(sharded.named_parameters())
    result["weight_diff"] = max((full(trained[n].detach()) - p.detach()).abs().max().item()
                                for n, p in reference.named_parameters())
    result["weight_moved"] = max((full(trained[n].detach()) - p.detach()).abs().max().item()
                                 for n, p in AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    with torch.no_grad():
        sharded.eval()
        reference.eval()
        logits = reference(input_ids=probe).logits
        result["trained_logits_diff"] = (logits - sharded(input_ids=probe).logits).abs().max().item()
        result["trained_logits_scale"] = logits.abs().max().item()
    dist.barrier()
    return result


def main():
    run_specs(run)


if __name__ == "__main__":
    main()
