"""Train a saved DAT causal LM a few steps with `Trainer`, under DeepSpeed ZeRO-3 (`torchrun --nproc_per_node 2
tests/workers/zero3_trainer.py MODEL OUT --deepspeed configs/deepspeed/zero3.json`, gloo, CPU) or in one process
(`python tests/workers/zero3_trainer.py MODEL OUT`, the reference), then `trainer.save_model(OUT/model)`. Writes
`OUT/rank<r>.json` (per-step losses and what the run was) and, from rank 0, `OUT/probe.pt`: the trained model's
logits on fixed tokens (under ZeRO-3 every rank takes part in the forward, which gathers the partitioned weights), and
`OUT/gathered.safetensors`: its parameters as they are in memory after training (gathered from every rank under
ZeRO-3). `--bf16` trains in bf16 (DeepSpeed's `"bf16": "auto"`: the model's parameters in bf16, fp32 master weights).

The training set is one global batch: GLOBAL_BATCH sequences without padding, seen once per step (2 per process under
ZeRO-3, 4 in one process). Each step's loss is then the mean over the same tokens whatever the order the sampler
draws them in, so the two runs' per-step losses compare directly. The model is loaded with `from_pretrained` after
the `TrainingArguments` exist, so that under ZeRO-3 it is built partitioned (`zero.Init`) and its weights are the
saved folder's (a model built from a config there would draw another initialisation).

DeepSpeed on a CPU-only machine, as `torchrun ... scripts/train_causal_lm.py --deepspeed ds.json --use_cpu` runs it:
`use_cpu=True` has Accelerate start torch's process group with gloo, and `dat_hf.training.start_deepspeed_comm_on_cpu`
starts DeepSpeed's communication backend on it before the model is built (else `zero.Init` counts one process and
DeepSpeed refuses the batch sizes, `4 != 2 * 1 * 1`). Trainer, its DeepSpeed plugin and engine, ZeRO-3 and the save
are then the code a GPU run takes.
"""

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

import dat_hf  # noqa: F401  (registers the Auto classes)
from dat_hf.training import start_deepspeed_comm_on_cpu

STEPS, GLOBAL_BATCH, SEQ_LEN, LR = 4, 4, 16, 1e-2
PROBE_INPUT_IDS = torch.arange(2 * 10).reshape(2, 10) * 7 % 90 + 3  # fixed tokens for the logits check


def dataset(vocab_size):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=generator)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    training_args = TrainingArguments(
        output_dir=args.out,
        deepspeed=args.deepspeed,
        use_cpu=True,
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        max_steps=STEPS,
        learning_rate=LR,
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        bf16=args.bf16,
    )
    start_deepspeed_comm_on_cpu(training_args)
    # after TrainingArguments: under ZeRO-3, `from_pretrained` builds the model partitioned and loads the folder into it
    model = AutoModelForCausalLM.from_pretrained(args.model)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset(model.config.vocab_size),
                      data_collator=default_data_collator)
    trainer.train()
    trainer.save_model(os.path.join(args.out, "model"))

    model = trainer.model
    partitioned = {name: tuple(p.shape) for name, p in model.named_parameters() if p.numel() == 0}
    gather = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))  # (a no-op below ZeRO-3)
    with gather:
        gathered = {name: p.detach().clone().contiguous() for name, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE_INPUT_IDS).logits.float()
    rank = training_args.process_index
    if rank == 0:
        torch.save({"input_ids": PROBE_INPUT_IDS, "logits": logits}, os.path.join(args.out, "probe.pt"))
        save_file(gathered, os.path.join(args.out, "gathered.safetensors"))
    record = {
        "rank": rank,
        "world_size": training_args.world_size,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "zero_stage": (trainer.accelerator.state.deepspeed_plugin.zero_stage
                       if trainer.is_deepspeed_enabled else None),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": str(training_args.device),
        "dtypes": sorted({str(p.dtype) for p in gathered.values()}),
        "model_class": type(model).__name__,
        # under ZeRO-3 each rank holds a partition of every parameter, the module's own tensors are empty
        "empty_parameters": len(partitioned),
        "num_parameters": len(list(model.parameters())),
        "losses": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [(h["step"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
