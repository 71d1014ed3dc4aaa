"""Tensor parallelism check, run by `torchrun --nproc_per_node N` (gloo, CPU): for each saved model folder given,
`from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))` against the same folder loaded in one
process: logits, one training step (loss, every gradient, SGD), greedy `generate` with the cache, and `save_pretrained`
of the sharded model reloaded in one process; and the sharded model's logits, loss and gradients without the installed projection kernel (the path of
remote code without dat_hf) against those with it. Writes `<out>/rank<r>.json` with the measured differences (the
test asserts on them).

    torchrun --nproc_per_node 2 tests/workers/tp_check.py OUT SPEC [SPEC ...]

SPEC: a folder (the model's plan), `FOLDER@PLAN.json` (a `DistributedConfig` whose `tp_plan` overrides rules of
the model's plan), `FOLDER!` (loading with the model's plan must raise a ValueError: its message is recorded), or
`FOLDER|pp` (pipeline parallelism over the ranks instead: logits only), or `FOLDER|legacy` (the deprecated
`from_pretrained(folder, tp_plan="auto")`: logits and sharding only).
"""

import contextlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification,
                          AutoModelForSeq2SeqLM)
from transformers.distributed import DistributedConfig

import dat_hf  # noqa: F401  (registers the Auto classes)
from dat_hf.kernel_hooks import BACKENDS
from spec_runner import full, run_specs

AUTO = {"dat": AutoModelForCausalLM, "dat_seq2seq": AutoModelForSeq2SeqLM,
        "dat_vision": AutoModelForImageClassification}


def inputs_for(config, generator):
    if config.model_type == "dat_vision":
        return {"pixel_values": torch.randn(2, config.num_channels, config.image_size, config.image_size,
                                            generator=generator), "labels": torch.tensor([0, 1])}
    ids = torch.randint(1, config.vocab_size, (2, 10), generator=generator)
    if config.model_type == "dat_seq2seq":
        target = torch.randint(1, config.vocab_size, (2, 7), generator=generator)
        return {"input_ids": ids, "decoder_input_ids": target, "labels": target}
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def projection_weights(model):
    """The layers' projection weights (matrices of their linears, and W_r)."""
    return {name: p for name, p in model.named_parameters()
            if ".layers." in name and (name.endswith("proj.weight") or name.endswith("relation_proj"))}


@contextlib.contextmanager
def projection_kernel(installed: bool):
    """`project_fused`'s installed kernel (`dat_hf.kernels.tensor_parallel`: one local product for a layer's sharded
    projections) counting its calls into the list yielded, or set aside (`installed=False`: the path of remote code
    without dat_hf, each projection through its TP style's forward)."""
    table, calls = BACKENDS.of("project_fused"), []
    kernels = dict(table)
    table.clear()
    if installed:
        for name, backend in kernels.items():
            table[name] = backend._replace(function=lambda *args, run=backend.function: calls.append(1) or run(*args))
    try:
        yield calls
    finally:
        table.clear()
        table.update(kernels)


def pipeline_check(folder, auto):
    """`DistributedConfig(pp_size=2)` (Transformers' naive pipeline: each rank runs its half of the layers): the
    logits against one process, and which layers each rank holds."""
    reference = auto.from_pretrained(folder)
    staged = auto.from_pretrained(folder, distributed_config=DistributedConfig(pp_size=2))
    ids = torch.randint(1, reference.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (reference(ids).logits - staged(ids).logits).abs().max().item()
    return {"folder": os.path.basename(folder) + "|pp", "logits_diff": diff,
            "layers": [type(layer).__name__ for layer in staged.base_model.layers]}


def legacy_check(folder, auto):
    """`from_pretrained(folder, tp_plan="auto")`, the form Transformers deprecates for `distributed_config` but still
    takes: the logits against one process, and whether the weights are sharded."""
    reference = auto.from_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        sharded = auto.from_pretrained(folder, tp_plan="auto")
    inputs = {k: v for k, v in inputs_for(reference.config, torch.Generator().manual_seed(0)).items() if k != "labels"}
    with torch.no_grad():
        diff = (reference(**inputs).logits - sharded(**inputs).logits).abs().max().item()
    sharded_weights = sum(isinstance(p, DTensor) for p in projection_weights(sharded).values())
    return {"folder": os.path.basename(folder) + "|legacy", "logits_diff": diff, "sharded_weights": sharded_weights}


def check(spec):
    folder, _, plan_file = spec.rstrip("!").removesuffix("|pp").removesuffix("|legacy").partition("@")
    config = AutoConfig.from_pretrained(folder)
    auto = AUTO[config.model_type]
    if spec.endswith("|pp"):
        return pipeline_check(folder, auto)
    if spec.endswith("|legacy"):
        return legacy_check(folder, auto)
    if spec.endswith("!"):
        try:
            auto.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
        except ValueError as error:
            return {"folder": os.path.basename(folder), "error": str(error)}
        return {"folder": os.path.basename(folder), "error": None}
    reference = auto.from_pretrained(folder)
    if plan_file:
        with open(plan_file) as f:
            sharded = auto.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan=json.load(f)))
    else:
        sharded = auto.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
    reference.to(sharded.device)  # (CPU with gloo; a rank's GPU with NCCL: scripts/gpu_checks.sh tp)
    name = os.path.basename(folder) + (f"@{os.path.basename(plan_file)}" if plan_file else "")
    result = {"folder": name, "tp_size": sharded._tp_size}
    weights = projection_weights(sharded)
    result["projection_weights"] = len(weights)
    result["sharded_weights"] = sum(isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
                                    for p in weights.values())
    inputs = {k: v.to(sharded.device) for k, v in inputs_for(config, torch.Generator().manual_seed(0)).items()}
    forward_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        logits_ref, logits_tp = reference(**forward_inputs).logits, sharded(**forward_inputs).logits
        with projection_kernel(installed=False):  # the remote code's path
            result["remote_logits_diff"] = (sharded(**forward_inputs).logits - logits_tp).abs().max().item()
    result["logits_diff"] = (logits_ref - logits_tp).abs().max().item()

    # one training step: loss, every gradient, an SGD step
    for model in (reference, sharded):
        model.train()
    loss_ref = reference(**inputs).loss
    loss_ref.backward()
    with projection_kernel(installed=True) as calls:
        loss_tp = sharded(**inputs).loss
        loss_tp.backward()
    result["kernel_calls"] = len(calls)
    result["loss_diff"] = abs(loss_ref.item() - loss_tp.item())
    grads_tp = dict(sharded.named_parameters())
    result["grad_diff"] = max((full(grads_tp[name].grad) - p.grad).abs().max().item()
                              for name, p in reference.named_parameters() if p.grad is not None)
    result["grads_missing"] = sorted(name for name, p in reference.named_parameters()
                                     if p.grad is not None and grads_tp[name].grad is None)

    # the remote code's path (the installed projection kernel set aside) against the kernel's: loss, every gradient
    kernel_grads = {name: full(p.grad) for name, p in sharded.named_parameters() if p.grad is not None}
    sharded.zero_grad(set_to_none=True)
    with projection_kernel(installed=False):
        loss_remote = sharded(**inputs).loss
        loss_remote.backward()
    result["remote_loss_diff"] = abs(loss_remote.item() - loss_tp.item())
    result["remote_grad_diff"] = max((full(grads_tp[name].grad) - grad).abs().max().item()
                                     for name, grad in kernel_grads.items())
    for model in (reference, sharded):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        model.eval()
    with torch.no_grad():
        stepped = reference(**forward_inputs).logits
        result["step_logits_diff"] = (stepped - sharded(**forward_inputs).logits).abs().max().item()
        result["step_logits_moved"] = (stepped - logits_ref).abs().max().item()

    if config.model_type != "dat_vision":  # greedy decoding with the cache
        gen = {k: v for k, v in forward_inputs.items() if k in ("input_ids", "attention_mask")}
        kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        result["generate_equal"] = torch.equal(reference.generate(**gen, **kwargs), sharded.generate(**gen, **kwargs))

    # the sharded model saved (every rank calls it) and reloaded in one process
    saved = os.path.join(os.environ["TP_CHECK_OUT"], f"saved-{name}")
    sharded.save_pretrained(saved)
    dist.barrier()
    reloaded = auto.from_pretrained(saved)
    with torch.no_grad():
        reloaded_logits = reloaded.to(sharded.device)(**forward_inputs).logits
        result["reload_diff"] = (reloaded_logits - sharded(**forward_inputs).logits).abs().max().item()
    return result


def main():
    os.environ["TP_CHECK_OUT"] = sys.argv[1]
    torch.manual_seed(0)
    run_specs(check)


if __name__ == "__main__":
    main()
