"""Training and data helpers for the scripts and examples (never imported by the modeling files, never copied to the
Hub as remote code). Ships its data: the model presets (`presets/*.json`) and offline `evaluate` metric modules
(`metrics/<name>/`).

- `dat_hf.training.trainer`: model presets, `AtomicCheckpointTrainer`, metrics (re-exported here).
- `dat_hf.training.preemption`: every rank stops at one step on a preemption signal; the newest complete checkpoint.
- `dat_hf.training.progress`: the loss curve PNG (re-exported here).
- `dat_hf.training.text_data`: the bundled Shakespeare corpus, BPE tokenizers, packing for causal LM training.
- `dat_hf.training.math_data`: DeepMind's mathematics problems (offline) and a character tokenizer.
- `dat_hf.training.relational_games`: the relational games images (Shanahan et al., 2020), generated offline.
"""

from .preemption import Preemption, PreemptionCallback, checkpoint_problem, last_complete_checkpoint
from .progress import save_loss_curve
from .trainer import *  # noqa: F401,F403
from .trainer import __all__ as _trainer_all

__all__ = [*_trainer_all, "save_loss_curve", "Preemption", "PreemptionCallback", "checkpoint_problem",
           "last_complete_checkpoint"]
