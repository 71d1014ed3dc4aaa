"""What the tensor-parallel workers (tp_check.py, fsdp_tp_train.py) share: one check per command-line spec on every
rank, each rank's results written as JSON."""

import json
import os
import sys

import torch.distributed as dist
from torch.distributed.tensor import DTensor


def full(tensor):
    """A sharded tensor gathered whole (a collective: every rank calls it), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run_specs(check):
    """`torchrun ... WORKER OUT SPEC [SPEC ...]`: `check(spec)` for each spec, in order, on every rank; the list of
    results to `OUT/rank<r>.json`."""
    out, specs = sys.argv[1], sys.argv[2:]
    results = [check(spec) for spec in specs]
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
