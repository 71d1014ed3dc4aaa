"""Training and data helpers for the scripts and examples (never imported by the modeling files, never copied to the
Hub as remote code).

- `dat_hf.training.trainer`: model presets, `AtomicCheckpointTrainer`, perplexity metrics (re-exported here).
- `dat_hf.training.text_data`: the bundled Shakespeare corpus, BPE tokenizers, packing for causal LM training.
- `dat_hf.training.math_data`: DeepMind's mathematics problems (offline) and a character tokenizer.
"""

from .trainer import *  # noqa: F401,F403
from .trainer import __all__
