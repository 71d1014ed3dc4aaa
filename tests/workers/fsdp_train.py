"""Run scripts/train_causal_lm.py with FSDP2 (`--fsdp --fsdp_config ...`) under torchrun on CPU (gloo) and record, per
rank, what the FSDP test checks: the FSDP units, the shards, the tied embeddings, the steps this process ran, the
logged losses and gradient norms, and (rank 0) the trained sharded model's logits on fixed tokens."""

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import train_causal_lm  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

PROBE_INPUT_IDS = torch.arange(2 * 16).reshape(2, 16) * 7 % 300 + 3  # fixed tokens for the logits check


def enable_fsdp_on_cpu():
    """Accelerate takes its FSDP path only on accelerators: with `use_cpu` a multi-process run is `MULTI_CPU` (DDP)
    and the FSDP plugin is dropped without a word. Route that one decision to FSDP, in both of Accelerate's states as
    on GPUs; everything after it (Trainer's FSDP2 preparation, the wrap policy, sharded checkpoints, the full state
    dict on save) is the code a GPU run takes, and torch's `fully_shard` runs on CPU with gloo."""
    init = AcceleratorState.__init__

    @functools.wraps(init)
    def init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init_with_fsdp_on_cpu


class StepsRun(TrainerCallback):
    """The optimizer steps this process ran (a resumed run starts after its checkpoint)."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


@torch.no_grad()
def probe_logits(model):
    """Logits of the sharded model on `PROBE_INPUT_IDS` (every rank takes part in the all-gathers) `[2, 16, vocab]`."""
    model.eval()
    return model(input_ids=PROBE_INPUT_IDS).logits.float()


def main():
    enable_fsdp_on_cpu()
    steps_run = StepsRun()
    results = train_causal_lm.main(sys.argv[1:], callbacks=[steps_run])
    trainer = results["trainer"]
    model = trainer.model
    out = Path(trainer.args.output_dir)
    rank = trainer.args.process_index
    logits = probe_logits(model)
    if rank == 0:
        torch.save({"input_ids": PROBE_INPUT_IDS, "logits": logits}, out / "probe_logits.pt")
    for module in model.modules():  # units with `reshard_after_forward=False` (root, embeddings) stay gathered
        if isinstance(module, FSDPModule):
            module.reshard()
    record = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "backend": dist.get_backend(),
        "distributed_type": trainer.accelerator.distributed_type.value,
        "fsdp_version": trainer.accelerator.state.fsdp_plugin.fsdp_version,
        "model_class": type(model).__name__,
        "fsdp_units": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
        # per parameter: rows of this rank's shard, rows of the full tensor
        "shards": {name: [p.to_local().shape[0], p.shape[0]] for name, p in model.named_parameters()
                   if isinstance(p, DTensor)},
        "num_parameters": len(list(model.parameters())),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "steps_run": steps_run.steps,
        "losses": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [(h["step"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
        "eval_loss": results["eval"]["eval_loss"],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    train_causal_lm.end_process_group()


if __name__ == "__main__":
    main()
