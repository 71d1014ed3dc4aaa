"""Run scripts/train_causal_lm.py under torchrun and record, per rank, what the DDP test checks: the process group,
the wrapped model, the per-rank data shard, a digest of the trained parameters and the logged losses."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import torch.distributed as dist  # noqa: E402
import train_causal_lm  # noqa: E402

from dat_hf.training import parameters_digest  # noqa: E402


def main():
    results = train_causal_lm.main(sys.argv[1:])
    trainer = results["trainer"]
    record = {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "dist_initialized": dist.is_initialized(),
        "dist_world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "parallel_mode": str(trainer.args.parallel_mode),
        "wrapped": type(trainer.model_wrapped).__name__,
        "train_blocks": results["train_blocks"],
        "batches_per_rank": len(trainer.get_train_dataloader()),
        "digest": parameters_digest(trainer.model),
        "losses": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
        "eval_loss": results["eval"]["eval_loss"],
        "vocab": len(trainer.processing_class),
    }
    out = Path(trainer.args.output_dir) / f"rank{record['rank']}.json"
    out.write_text(json.dumps(record))
    train_causal_lm.end_process_group()


if __name__ == "__main__":
    main()
