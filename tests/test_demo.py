"""scripts/demo.py at tiny settings (a few seconds of training): Trainer's logged lines without a terminal, the
"saved to" line, the loss curve PNG beside the model, a model that reloads; and `dat_hf.training.save_loss_curve`."""

import re

import pytest
from lm_helpers import import_script

from dat_hf.training import save_loss_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_shows_progress_saves_the_model_and_a_loss_curve(tmp_path, capsys):
    from PIL import Image
    from transformers import AutoModelForCausalLM

    out = tmp_path / "demo"
    import_script("demo").main(["--output_dir", str(out), "--train_seconds", "2", "--max_files", "2",
                                "--vocab_size", "300", "--block_size", "32", "--batch_size", "4",
                                "--max_new_tokens", "4"])
    stdout = capsys.readouterr().out
    # no terminal under pytest: Trainer's PrinterCallback, one logged dict per logging step, no progress bar
    losses = re.findall(r"^\{'loss': '?[\d.]+'?, .*'learning_rate'", stdout, re.M)
    assert len(losses) >= 5, stdout[-2000:]
    assert "it/s]" not in stdout
    assert f"[demo] model, tokenizer, model card and metrics saved to {out}\n" in stdout
    assert f"[demo] loss curve saved to {out / 'loss_curve.png'}\n" in stdout
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG_MAGIC
    assert Image.open(out / "loss_curve.png").size == (600, 400)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "DATForCausalLM"


def test_save_loss_curve_writes_a_png_and_needs_a_logged_loss(tmp_path):
    history = [{"loss": 5.0 - 0.1 * i, "step": 10 * i} for i in range(1, 6)] + [{"eval_loss": 4.6, "step": 50}]
    path = save_loss_curve(history, tmp_path / "curve.png", title="t")
    assert open(path, "rb").read(8) == PNG_MAGIC
    with pytest.raises(ValueError, match="logging_steps"):
        save_loss_curve([{"train_runtime": 1.0, "step": 3}], tmp_path / "none.png")
