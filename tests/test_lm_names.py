"""`import dat_hf` files the language models' model types in Transformers' causal-LM and seq2seq-LM name mappings,
which tools read to tell the two apart: lm-eval's `HFLM` (else it warns "neither marked as CausalLM or Seq2SeqLM" and
takes a seq2seq model for a causal one), the Trainer's label smoothing (it shifts the labels of a causal LM only) and
`transformers serve`. The Auto classes resolve DAT's classes and Transformers' own as before."""

import importlib.util
import json
import logging

import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, LlamaConfig, Trainer, TrainingArguments
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from dat_hf import DATConfig, DATForCausalLM, DATForSeq2SeqLM, DATSeq2SeqConfig


def seq2seq_config():
    return DATSeq2SeqConfig(vocab_size=40, hidden_size=32, encoder_layers=1, num_hidden_layers=1,
                            decoder_start_token_id=1, pad_token_id=0)


def lm_eval_backend(model_type: str) -> str | None:
    """lm-eval's `HFLM._get_backend` (0.4.13) with `backend="default"`: the seq2seq names first, then the causal
    names; None where it warns and falls back to causal."""
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    return "causal" if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else None


def test_lm_eval_tells_the_causal_and_the_seq2seq_model_apart(caplog):
    assert lm_eval_backend(LlamaConfig.model_type) == "causal"
    assert lm_eval_backend(DATConfig.model_type) == "causal"
    assert lm_eval_backend(DATSeq2SeqConfig.model_type) == "seq2seq"
    if importlib.util.find_spec("lm_eval"):  # (not a dependency of dat_hf: where installed, lm-eval's own check)
        from lm_eval.models.huggingface import HFLM

        for config, backend in ((tiny_config(), "causal"), (seq2seq_config(), "seq2seq")):
            lm = HFLM.__new__(HFLM)  # (HFLM's __init__ needs a tokenizer; the backend is decided from the config)
            lm.AUTO_MODEL_CLASS = None
            with caplog.at_level(logging.WARNING):
                lm._get_backend(config=config)
            assert lm.backend == backend and "neither marked" not in caplog.text


def test_trainer_label_smoothing_shifts_the_labels_of_dat(tmp_path):
    """With (almost no) label smoothing the Trainer's loss is the model's own, which predicts token t + 1 from t."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config())
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(str(tmp_path), label_smoothing_factor=1e-6, use_cpu=True, report_to=[])
    loss = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": ids})
    torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss, atol=1e-4, rtol=0)


def test_auto_classes_resolve_as_before():
    assert "dat" not in CONFIG_MAPPING_NAMES  # (so the Auto mappings never look `dat` up in transformers.models)
    assert MODEL_FOR_CAUSAL_LM_MAPPING[DATConfig] is DATForCausalLM
    assert type(AutoModelForCausalLM.from_config(tiny_config())) is DATForCausalLM
    assert type(AutoModelForSeq2SeqLM.from_config(seq2seq_config())) is DATForSeq2SeqLM
    llama = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    assert type(AutoModelForCausalLM.from_config(llama)).__name__ == "LlamaForCausalLM"


def test_one_registration_table_serves_auto_classes_and_remote_code(tmp_path, monkeypatch):
    """Each family's `auto_classes` is the one table: every entry resolves through its Auto class in this process, and
    a saved folder's `auto_map` (remote code) is that table; a head added to the table is registered like the rest."""
    import transformers

    import dat_hf

    for table in dat_hf.FAMILIES:
        config_class = getattr(importlib.import_module(f"dat_hf.{table['AutoConfig'].split('.')[0]}"),
                               table["AutoConfig"].split(".")[1])
        assert transformers.AutoConfig.for_model(config_class.model_type).__class__ is config_class
        for auto_name, target in table.items():
            if auto_name != "AutoConfig":
                mapping = getattr(transformers, auto_name)._model_mapping
                assert f"{mapping[config_class].__module__.split('.')[-1]}.{mapping[config_class].__name__}" == target
    model = DATForCausalLM(tiny_config())
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == DATForCausalLM.auto_classes

    class DATForTinyHead(DATForCausalLM):  # a new head: one entry in a table, then the same registration
        pass

    monkeypatch.setattr(dat_hf.modeling_dat, "DATForTinyHead", DATForTinyHead, raising=False)
    dat_hf.register_family({"AutoConfig": "configuration_dat.DATConfig",
                            "AutoModelForQuestionAnswering": "modeling_dat.DATForTinyHead"})
    try:
        assert transformers.AutoModelForQuestionAnswering._model_mapping[DATConfig] is DATForTinyHead
        assert DATForTinyHead._auto_class == "AutoModelForQuestionAnswering"
    finally:
        transformers.AutoModelForQuestionAnswering._model_mapping._extra_content.pop(DATConfig, None)
