"""FSDP2 applied by hand, then `save_pretrained` outside Trainer (run under torchrun; 2 processes, gloo, CPU, or with
`--device cuda`: NCCL when there is a GPU per process, else gloo over CUDA tensors of one GPU).

A tiny DATForCausalLM is sharded with `fully_shard` (each DAT block, then the root), trained one SGD step on a global
batch of 4 sequences (2 per rank), and saved with `model.save_pretrained(<out>/model)` on the ranks given by `--save_on`
(`all`: every rank, the supported usage; `0`: rank 0 only). Rank 0 also writes `<out>/reference.pt`: the full weights
gathered by hand (`DTensor.full_tensor()`, every rank taking part) and the logits on fixed tokens of an unsharded copy
of the model trained one step on the whole global batch (all saved on the CPU)."""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dat_hf import DATConfig, DATForCausalLM

PROBE_INPUT_IDS = torch.arange(2 * 16).reshape(2, 16) * 7 % 97  # fixed tokens for the logits check
LR = 0.1


def tiny_config():  # tests/conftest.py `tiny_config`
    return DATConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
                     intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64,
                     max_relative_position=8)


def train_step(model, input_ids):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--save_on", choices=["all", "0"], default="all")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.device == "cuda":
        world_size = int(os.environ["WORLD_SIZE"])
        one_gpu_each = torch.cuda.device_count() >= world_size
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) if one_gpu_each else 0)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if one_gpu_each else "gloo", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config()).to(device)  # same seed: the same initial weights on every rank
    reference = copy.deepcopy(model) if rank == 0 else None
    global_batch = torch.randint(0, 97, (2 * world_size, 16), generator=torch.Generator().manual_seed(1)).to(device)

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    train_step(model, global_batch[2 * rank:2 * rank + 2])  # FSDP averages the gradients over the ranks

    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()  # collective: every rank
            for name, p in model.state_dict().items()}
    if args.save_on == "all" or rank == 0:
        model.save_pretrained(args.out / "model")
    if rank == 0:
        train_step(reference, global_batch)
        with torch.no_grad():
            logits = reference.eval()(input_ids=PROBE_INPUT_IDS.to(device)).logits.cpu()
        torch.save({"weights": full, "input_ids": PROBE_INPUT_IDS, "logits": logits,
                    "reference_weights": {name: w.cpu() for name, w in reference.state_dict().items()}},
                   args.out / "reference.pt")
    (args.out / f"rank{rank}.json").write_text(json.dumps({
        "model_class": type(model).__name__, "device": str(device), "backend": dist.get_backend(),
        "relational_backend": model.model.layers[0].dual_attn.relational.relational_attention_backend}))
    dist.barrier()
    del model, reference  # (their sharded state released while the group is alive)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every file is written and the group closed: the process ends here, without the interpreter's finalization, where
    # gloo's threads can still end it with `terminate called without an active exception` (SIGABRT; seen once in CI
    # on a rank whose work was done)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
