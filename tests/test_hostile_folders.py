"""Hostile model folders are refused before anything is allocated (`dat_hf/checkpoint_bounds.py`):

- `from_pretrained` of every family checks config.json against the safetensors header (names and shapes, no tensor
  read): absurd layer counts and sizes are ValueErrors naming the field and the checkpoint's value, each within a
  few seconds (they used to hang allocating); legitimate loads (a new head, `ignore_mismatched_sizes`) still work;
- a safetensors header that claims more bytes than its file, or a shard outside the folder, names the file;
- the converter of the authors' checkpoints bounds their config.json the same way before building anything;
- every float field of every DAT config is finite and in range (NaN / inf refused, in code and in config.json).
"""

import dataclasses
import json
import math
import os
import struct
import time

import pytest
import torch
from conftest import tiny_config
from test_seq2seq import seq2seq_config
from test_vision import vision_config
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSeq2SeqLM

from dat_hf import (DATConfig, DATEncoderConfig, DATForCausalLM, DATForImageClassification, DATForSeq2SeqLM,
                    DATForSequenceClassification, DATSeq2SeqConfig, DATVisionConfig)
from dat_hf.checkpoint_bounds import read_safetensors_header

BOUND_S = 10  # every refusal below comes within this (they hung before)


def saved(tmp_path, model_cls, config, shard="30KB"):
    torch.manual_seed(0)
    folder = tmp_path / "model"
    model_cls(config).save_pretrained(folder, max_shard_size=shard)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def refused(load, folder, match):
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        load(folder)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"refused after {elapsed:.1f} s"


LM_CASES = {  # field -> (value, what the error names)
    "num_hidden_layers": (5000, r"`num_hidden_layers` is 5000 in the config, but the checkpoint .* holds 2 layers"),
    "num_hidden_layers ": (10**6, r"`num_hidden_layers` must be at most 10000, got 1000000"),
    "hidden_size": (2**30, r"`hidden_size`=1073741824 in the config, 32 in the checkpoint"),
    "vocab_size": (10**7, r"`vocab_size`=10000000 in the config, 97 in the checkpoint"),
    "intermediate_size": (10**9, r"`intermediate_size`=1000000000 in the config, 64 in the checkpoint"),
    "num_symbols": (10**9, r"`num_symbols`=1000000000 in the config, 8 in the checkpoint"),
}


@pytest.mark.parametrize("field", list(LM_CASES))
@pytest.mark.parametrize("loader", ["class", "auto"])
def test_absurd_sizes_in_a_causal_lm_folder(tmp_path, field, loader):
    folder = saved(tmp_path, DATForCausalLM, tiny_config())
    value, match = LM_CASES[field]
    edit_config(folder, **{field.strip(): value})
    refused(DATForCausalLM.from_pretrained if loader == "class" else AutoModelForCausalLM.from_pretrained, folder,
            match)


def test_absurd_layers_in_seq2seq_and_vision_folders(tmp_path):
    folder = saved(tmp_path / "s2s", DATForSeq2SeqLM, seq2seq_config())
    edit_config(folder, encoder_layers=3000)
    refused(AutoModelForSeq2SeqLM.from_pretrained, folder, r"`encoder_layers` is 3000 .* holds 2 layers")
    edit_config(folder, encoder_layers=10**6)
    refused(AutoModelForSeq2SeqLM.from_pretrained, folder, r"`encoder_layers` must be at most 10000, got 1000000")
    folder = saved(tmp_path / "vit", DATForImageClassification, vision_config())
    edit_config(folder, num_hidden_layers=5000)
    refused(AutoModelForImageClassification.from_pretrained, folder, r"`num_hidden_layers` is 5000 .* holds 2")


def test_legitimate_loads_still_work(tmp_path):
    folder = saved(tmp_path, DATForCausalLM, tiny_config())
    reference = DATForCausalLM.from_pretrained(folder)
    # a new head the checkpoint lacks (initialised), and a resized one with ignore_mismatched_sizes
    classifier = DATForSequenceClassification.from_pretrained(folder, num_labels=3)
    assert torch.equal(classifier.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    edit_config(folder, vocab_size=101)
    with pytest.raises(ValueError, match=r"`vocab_size`=101 in the config, 97 in the checkpoint"):
        DATForCausalLM.from_pretrained(folder)
    resized = DATForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True)
    assert resized.model.embed_tokens.weight.shape == (101, 32)


def test_inconsistent_safetensors_headers_name_the_file(tmp_path):
    folder = saved(tmp_path, DATForCausalLM, tiny_config(), shard="10GB")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = "model.embed_tokens.weight"
    header[name]["shape"] = [10**9, 32]  # more than the file holds
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}' has an inconsistent header entry"):
        read_safetensors_header(weights)
    refused(AutoModelForCausalLM.from_pretrained, folder, "inconsistent header entry")
    weights.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    refused(AutoModelForCausalLM.from_pretrained, folder, r"header claims 1099511627776 bytes \(the file has 10\)")


def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path):
    folder = saved(tmp_path, DATForCausalLM, tiny_config())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(DATForCausalLM.from_pretrained, folder, r"names a shard outside the folder: '../elsewhere.safetensors'")


def converter_folder(tmp_path):
    pytest.importorskip("dual_attention")
    from dual_attention.hf import DualAttnTransformerLM_HFHub
    from test_parity import CONFIGS

    torch.manual_seed(0)
    DualAttnTransformerLM_HFHub(**CONFIGS["symbolic-rope-swiglu-layernorm-prenorm"]).save_pretrained(tmp_path / "in")
    return tmp_path / "in"


@pytest.mark.parametrize("change,match", [
    ({"n_layers": 10**6}, r"`n_layers` is 1000000 in the config, but the checkpoint .* holds 2 layers"),
    ({"d_model": 2**20, "symbol_retrieval_kwargs": dict(d_model=2**20, n_heads=4, n_symbols=12)},
     r"`d_model`=1048576 in the config, 64 in the checkpoint"),
    ({"max_block_size": 10**9}, r"asks for [\d,]+ parameters that the checkpoint .* does not hold"),
    ({"n_layers": "2"}, r"`n_layers` must be a positive integer, got .2."),
])
def test_converter_bounds_the_authors_config_by_the_checkpoint(tmp_path, change, match):
    from dat_hf.conversion import convert_checkpoint_folder

    folder = converter_folder(tmp_path)
    edit_config(folder, **change)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        convert_checkpoint_folder(folder, tmp_path / "out")
    assert time.monotonic() - start < BOUND_S
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,match", [
    ("[" * 100_000 + "]" * 100_000, r"config.json is not readable JSON \(RecursionError"),
    ('{"d_model": 64, "n_heads_sa": 2, "pad": "' + "x" * (1 << 21) + '"}', r"config.json has 2,097,\d{3} bytes"),
    ("fifo", r"config.json is not a regular file"),
])
def test_converter_refuses_unreadable_authors_configs(tmp_path, content, match):
    from dat_hf.conversion import convert_checkpoint_folder

    folder = converter_folder(tmp_path)
    (folder / "config.json").unlink()
    if content == "fifo":
        os.mkfifo(folder / "config.json")  # reading it would block forever
    else:
        (folder / "config.json").write_text(content)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        convert_checkpoint_folder(folder, tmp_path / "out")
    assert time.monotonic() - start < BOUND_S


CONFIG_CLASSES = {DATConfig: tiny_config, DATEncoderConfig: None, DATSeq2SeqConfig: seq2seq_config,
                  DATVisionConfig: vision_config}
FLOAT_FIELDS = [(cls, field.name) for cls in CONFIG_CLASSES for field in dataclasses.fields(cls)
                if "float" in str(field.type)]


def make_config(cls, **overrides):
    factory = CONFIG_CLASSES[cls]
    if factory is None:
        base = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
                    intermediate_size=64, num_symbols=8, symbolic_attention_heads=2)
        return cls(**{**base, **overrides})
    return factory(**overrides)


def test_every_float_field_is_covered():
    names = {name for _, name in FLOAT_FIELDS}
    assert {"symbolic_attention_scale", "norm_eps", "rope_theta", "initializer_range", "attention_dropout",
            "classifier_dropout"} <= names


@pytest.mark.parametrize("cls,field", FLOAT_FIELDS, ids=[f"{c.__name__}.{f}" for c, f in FLOAT_FIELDS])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_float_fields_are_refused(cls, field, bad):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        make_config(cls, **{field: bad})


@pytest.mark.parametrize("field,bad", [("symbolic_attention_scale", 0.0), ("symbolic_attention_scale", -1.0),
                                       ("norm_eps", 0.0), ("norm_eps", 2.0), ("rope_theta", -5.0),
                                       ("initializer_range", -0.1), ("hidden_dropout", 1.0)])
def test_out_of_range_float_fields_are_refused(field, bad):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        tiny_config(**{field: bad})
    assert tiny_config(symbolic_attention_scale=0.125).symbolic_attention_scale == 0.125  # in range: kept


def test_nan_in_a_saved_config_is_refused_at_load(tmp_path):
    folder = saved(tmp_path, DATForCausalLM, tiny_config())
    text = (folder / "config.json").read_text()
    config = json.loads(text)
    config["symbolic_attention_scale"] = float("nan")  # json writes NaN, Python's json reads it
    (folder / "config.json").write_text(json.dumps(config))
    assert "NaN" in (folder / "config.json").read_text()
    refused(AutoModelForCausalLM.from_pretrained, folder, r"`symbolic_attention_scale` must be a finite number, got nan")
