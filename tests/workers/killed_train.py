"""scripts/train_causal_lm.py that kills itself (SIGKILL, no clean-up) at a chosen point, for the resume test.

    python killed_train.py --kill_at_step K [--kill_while_saving] TRAIN_ARGS...

`--kill_at_step K`: killed at the end of step K, before any checkpoint of that step. With `--kill_while_saving`:
killed in the middle of writing the checkpoint of step K (after the model and the optimizer, before the scheduler
and RNG states and the trainer state).
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import train_causal_lm  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dat_hf.training import AtomicCheckpointTrainer  # noqa: E402


def kill():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            kill()


def main():
    argv = sys.argv[1:]
    step = int(argv[argv.index("--kill_at_step") + 1])
    del argv[argv.index("--kill_at_step"):argv.index("--kill_at_step") + 2]
    callbacks = []
    if "--kill_while_saving" in argv:
        argv.remove("--kill_while_saving")
        save_scheduler = AtomicCheckpointTrainer._save_optimizer_and_scheduler

        def save_then_die(self, output_dir):
            save_scheduler(self, output_dir)
            if self.state.global_step == step:
                kill()

        AtomicCheckpointTrainer._save_optimizer_and_scheduler = save_then_die
    else:
        callbacks.append(KillAtStep(step))
    train_causal_lm.main(argv, callbacks=callbacks)


if __name__ == "__main__":
    main()
