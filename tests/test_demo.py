"""scripts/demo.py at tiny settings (a few seconds of training): progress lines without a terminal, the "saved to"
line, the loss curve PNG beside the model, a model that reloads; and the progress helpers of `dat_hf.training`."""

import re
import types

import pytest
from lm_helpers import import_script

from dat_hf.training import ProgressLinesCallback, save_loss_curve, use_progress_lines
from dat_hf.training.progress import progress_line

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_shows_progress_saves_the_model_and_a_loss_curve(tmp_path, capsys):
    from PIL import Image
    from transformers import AutoModelForCausalLM

    out = tmp_path / "demo"
    import_script("demo").main(["--output_dir", str(out), "--train_seconds", "2", "--max_files", "2",
                                "--vocab_size", "300", "--block_size", "32", "--batch_size", "4",
                                "--max_new_tokens", "4"])
    stdout = capsys.readouterr().out
    # no terminal under pytest: one line per logging step (10 per run), not raw dicts or a progress bar
    steps = re.findall(r"^step (\d+)/(\d+) \(\d+%\) \| epoch [\d.]+ \| loss [\d.]+ \| lr ", stdout, re.M)
    assert len(steps) >= 5 and all(int(done) <= int(total) for done, total in steps)
    assert "{'loss'" not in stdout and "it/s]" not in stdout
    assert f"[demo] model, tokenizer, model card and metrics saved to {out}\n" in stdout
    assert f"[demo] loss curve saved to {out / 'loss_curve.png'}\n" in stdout
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG_MAGIC
    assert Image.open(out / "loss_curve.png").size == (600, 400)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "DATForCausalLM"


def test_progress_line_formats_training_eval_and_summary_logs():
    line = progress_line({"loss": 4.8123, "learning_rate": 2.9e-3, "epoch": 0.35}, step=40, max_steps=200,
                         elapsed=12.0)
    assert line == "step 40/200 (20%) | epoch 0.35 | loss 4.812 | lr 2.90e-03 | 12 s, ~48 s left"
    line = progress_line({"eval_loss": 3.5, "eval_perplexity": 33.1, "eval_runtime": 2.0}, 200, 200, 60.0)
    assert line == "step 200: eval loss 3.5, perplexity 33.1"
    assert progress_line({"train_runtime": 125.0, "train_loss": 4.0}, 200, 200, 125.0) == (
        "trained 200 steps in 2.1 min, mean training loss 4")
    assert progress_line({"total_flos": 1.0}, 200, 200, 1.0) is None


def test_use_progress_lines_replaces_the_raw_dict_printer(tmp_path, tiny):
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from dat_hf import DATForCausalLM

    def callbacks(trainer):
        return {type(c) for c in trainer.callback_handler.callbacks}

    for disable_tqdm in (True, False):
        args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=disable_tqdm, report_to="none", use_cpu=True)
        trainer = Trainer(model=DATForCausalLM(tiny()), args=args)
        use_progress_lines(trainer)
        if disable_tqdm:
            assert ProgressLinesCallback in callbacks(trainer) and PrinterCallback not in callbacks(trainer)
        else:
            assert ProgressCallback in callbacks(trainer) and ProgressLinesCallback not in callbacks(trainer)


def test_progress_lines_callback_prints_on_the_main_process_only(capsys):
    callback = ProgressLinesCallback(prefix="[run] ")
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=5, max_steps=10)
    callback.on_train_begin(None, state, None)
    callback.on_log(None, state, None, logs={"loss": 2.0})
    state.is_world_process_zero = False
    callback.on_log(None, state, None, logs={"loss": 1.0})
    assert capsys.readouterr().out.splitlines() == ["[run] step 5/10 (50%) | loss 2 | 0 s, ~0 s left"]


def test_save_loss_curve_writes_a_png_and_needs_a_logged_loss(tmp_path):
    history = [{"loss": 5.0 - 0.1 * i, "step": 10 * i} for i in range(1, 6)] + [{"eval_loss": 4.6, "step": 50}]
    path = save_loss_curve(history, tmp_path / "curve.png", title="t")
    assert open(path, "rb").read(8) == PNG_MAGIC
    with pytest.raises(ValueError, match="logging_steps"):
        save_loss_curve([{"train_runtime": 1.0, "step": 3}], tmp_path / "none.png")
