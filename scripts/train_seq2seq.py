#!/usr/bin/env python
"""Train an encoder-decoder DAT (`DATForSeq2SeqLM`) with `Seq2SeqTrainer` on text-to-text data.

    # default: problems generated offline with DeepMind's mathematics_dataset (arithmetic__add_or_sub and
    # algebra__linear_1d), character-level tokenizer, exact-match accuracy with generation
    OMP_NUM_THREADS=1 python scripts/train_seq2seq.py --output_dir runs/dat-math --max_steps 2000 --use_cpu

    # the Transformer baseline: 0 relational heads
    python scripts/train_seq2seq.py --output_dir runs/tf-math --num_relational_heads 0 --num_sensory_heads 4 ...

    # any `datasets` source with input/target text columns (json/csv/parquet files, a saved dataset, a builder)
    python scripts/train_seq2seq.py --dataset_name json --train_files train.jsonl --eval_files test.jsonl \\
        --input_column question --target_column answer --output_dir runs/mine

The arguments are `Seq2SeqTrainingArguments` plus `ModelArguments` and `DataArguments` below (`--help` lists them);
a single `.json` argument is read as a file of arguments. `--predict_with_generate` is on by default; exact match
comes from the `exact_match` evaluate module shipped in `dat_hf.training` (offline). The output folder gets the model
(with remote code), the tokenizer, the generation config, the `dat-text2text` pipeline code (`pipeline(model=folder,
trust_remote_code=True)` works without dat_hf) and `exact_match.json` (overall and per module).

`--do_eval` without `--do_train` only evaluates a saved model (`--model_name_or_path`): `exact_match.json` and
`predictions.jsonl` are written, nothing is trained or saved.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

import dat_hf  # noqa: F401  (registers the Auto classes and the dat-text2text pipeline)
from dat_hf import DATForSeq2SeqLM, DATSeq2SeqConfig
from dat_hf.pipeline_text2text import DATText2TextPipeline
from dat_hf.training import load_metric, parse_config_overrides
from dat_hf.training.math_data import DEFAULT_MODULES, build_char_tokenizer, math_dataset

logger = logging.getLogger("train_seq2seq")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A saved DATForSeq2SeqLM folder to continue from."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    encoder_layers: int = field(default=2, metadata={"help": "Encoder depth."})
    decoder_layers: int = field(default=2, metadata={"help": "Decoder depth."})
    num_sensory_heads: int = field(default=2, metadata={"help": "Sensory (self-attention) heads per layer."})
    num_relational_heads: int = field(default=2, metadata={"help": "Relational heads per layer (0 = Transformer)."})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP width (None = 8/3 d for swiglu)."})
    symbol_retrieval: str = field(default="symbolic_attention", metadata={"help": "symbolic_attention, positional, position_relative."})
    num_symbols: int = field(default=32, metadata={"help": "Symbol library size (symbolic attention)."})
    cross_attention: str = field(default="sensory", metadata={"help": "sensory (standard) or dual cross-attention."})
    position_embedding_type: str = field(default="rope", metadata={"help": "rope, learned or none (both stacks)."})
    max_position_embeddings: int = field(default=64, metadata={"help": "Longest target (and source unless set)."})
    encoder_max_position_embeddings: int | None = field(default=192, metadata={"help": "Longest source."})
    dropout: float = field(default=0.0, metadata={"help": "hidden/attention dropout."})
    config_overrides: str | None = field(default=None, metadata={"help": "More config fields: 'norm_type=layernorm,pre_norm=false'."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "A `datasets.load_dataset` source (builder name, 'json'/'csv'/'parquet' with "
                                        "--train_files, a local dataset folder). Default: generated math problems."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    train_files: list[str] | None = field(default=None, metadata={"help": "Training data files."})
    eval_files: list[str] | None = field(default=None, metadata={"help": "Held-out data files."})
    eval_split_name: str = field(default="test", metadata={"help": "Held-out split name of the dataset."})
    input_column: str = field(default="input", metadata={"help": "Source text column."})
    target_column: str = field(default="target", metadata={"help": "Target text column."})
    math_modules: str = field(default=",".join(DEFAULT_MODULES), metadata={"help": "mathematics_dataset modules, comma-separated."})
    n_train_per_module: int = field(default=10000, metadata={"help": "Generated training problems per module."})
    n_test_per_module: int = field(default=200, metadata={"help": "Generated held-out problems per module."})
    math_difficulty: str = field(default="easy", metadata={"help": "easy, medium, hard or all (train entropy range)."})
    math_test_split: str = field(default="train", metadata={"help": "train (held-out problems of the training distribution), interpolate or extrapolate."})
    problem_seed: int = field(default=0, metadata={"help": "Seed of problem generation."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "A tokenizer folder (default: the character tokenizer)."})
    max_source_length: int = field(default=192, metadata={"help": "Truncate sources to this many tokens."})
    max_target_length: int = field(default=48, metadata={"help": "Truncate targets; also the generation length."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many problems."})


def load_data(data_args: DataArguments):
    """A DatasetDict with 'train' and 'test' splits holding the input/target columns (and 'module' for math)."""
    from datasets import DatasetDict, load_dataset

    if data_args.dataset_name is None and not data_args.train_files:
        modules = [m.strip() for m in data_args.math_modules.split(",") if m.strip()]
        return math_dataset(modules, data_args.n_train_per_module, data_args.n_test_per_module, data_args.problem_seed,
                            data_args.math_difficulty, data_args.math_test_split)
    if data_args.train_files:
        files = {"train": data_args.train_files}
        if data_args.eval_files:
            files["test"] = data_args.eval_files
        raw = load_dataset(data_args.dataset_name or Path(data_args.train_files[0]).suffix.lstrip(".").replace("jsonl", "json"),
                           data_files=files)
    elif os.path.isdir(data_args.dataset_name) and os.path.exists(os.path.join(data_args.dataset_name, "dataset_dict.json")):
        from datasets import load_from_disk

        raw = load_from_disk(data_args.dataset_name)
    else:
        raw = load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    if "test" not in raw:
        if data_args.eval_split_name in raw:
            raw = DatasetDict(train=raw["train"], test=raw[data_args.eval_split_name])
        else:
            raw = raw["train"].train_test_split(test_size=0.05, seed=data_args.problem_seed)
    for column in (data_args.input_column, data_args.target_column):
        if column not in raw["train"].column_names:
            raise ValueError(f"Column {column!r} not in the dataset (columns: {raw['train'].column_names}); set "
                             "--input_column / --target_column.")
    return raw


def build_config(model_args: ModelArguments, tokenizer) -> DATSeq2SeqConfig:
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=model_args.hidden_size, encoder_layers=model_args.encoder_layers,
        decoder_layers=model_args.decoder_layers, num_sensory_heads=model_args.num_sensory_heads,
        num_relational_heads=model_args.num_relational_heads, intermediate_size=model_args.intermediate_size,
        symbol_retrieval=model_args.symbol_retrieval, num_symbols=model_args.num_symbols,
        symbolic_attention_heads=max(1, min(4, model_args.num_sensory_heads + model_args.num_relational_heads)),
        cross_attention=model_args.cross_attention, position_embedding_type=model_args.position_embedding_type,
        max_position_embeddings=model_args.max_position_embeddings,
        encoder_max_position_embeddings=model_args.encoder_max_position_embeddings,
        attention_dropout=model_args.dropout, hidden_dropout=model_args.dropout,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id,
    )
    kwargs.update(parse_config_overrides(model_args.config_overrides))
    return DATSeq2SeqConfig(**kwargs)


def tokenize(raw, tokenizer, data_args: DataArguments):
    def encode(batch):
        features = tokenizer(batch[data_args.input_column], truncation=True, max_length=data_args.max_source_length)
        features["labels"] = tokenizer(text_target=batch[data_args.target_column], truncation=True,
                                       max_length=data_args.max_target_length)["input_ids"]
        return features

    return raw.map(encode, batched=True, remove_columns=raw["train"].column_names, desc="tokenizing")


def make_compute_metrics(tokenizer):
    metric = load_metric("exact_match")

    def compute_metrics(eval_pred):
        predictions, labels = eval_pred
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        predictions = np.where(predictions < 0, tokenizer.pad_token_id, predictions)
        labels = np.where(labels < 0, tokenizer.pad_token_id, labels)
        decoded_predictions = tokenizer.batch_decode(predictions, skip_special_tokens=True)
        decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
        return metric.compute(predictions=decoded_predictions, references=decoded_labels)

    return compute_metrics


@torch.no_grad()
def exact_match_by_module(model, tokenizer, dataset, input_column="input", target_column="target", batch_size=64,
                          max_new_tokens=48, num_beams=1):
    """Greedy (or beam) generation on `dataset`; exact-match accuracy overall and per `module` column."""
    metric = load_metric("exact_match")
    model.eval()
    predictions = []
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start:start + batch_size]
        inputs = tokenizer(rows[input_column], return_tensors="pt", padding=True)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False)
        predictions += tokenizer.batch_decode(output, skip_special_tokens=True)
    references = list(dataset[target_column])
    result = {"exact_match": metric.compute(predictions=predictions, references=references)["exact_match"], "n": len(references)}
    if "module" in dataset.column_names:
        modules = list(dataset["module"])
        for name in dict.fromkeys(modules):
            idx = [i for i, m in enumerate(modules) if m == name]
            result[name] = metric.compute(predictions=[predictions[i] for i in idx],
                                          references=[references[i] for i in idx])["exact_match"]
    return result, predictions


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, Seq2SeqTrainingArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    else:
        if "--predict_with_generate" not in " ".join(argv):
            argv = [*argv, "--predict_with_generate", "true"]
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(training_args.seed)

    raw = load_data(data_args)
    if data_args.max_eval_samples is not None:
        raw["test"] = raw["test"].select(range(min(data_args.max_eval_samples, len(raw["test"]))))
    if model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(data_args.tokenizer_name or model_args.model_name_or_path)
        model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(data_args.tokenizer_name) if data_args.tokenizer_name else build_char_tokenizer()
        config = build_config(model_args, tokenizer)
        set_seed(training_args.seed)
        model = DATForSeq2SeqLM(config)
    # generation length for evaluation, the pipeline and `generate()` (`--generation_max_length` overrides it in eval)
    model.generation_config.max_new_tokens = data_args.max_target_length
    n_params = model.num_parameters()
    logger.info("model: %s parameters, config %s", f"{n_params:,}", model.config.to_diff_dict())

    tokenized = tokenize(raw, tokenizer, data_args)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    trainer = Seq2SeqTrainer(
        model=model, args=training_args, train_dataset=tokenized["train"], eval_dataset=tokenized["test"],
        processing_class=tokenizer, data_collator=collator, compute_metrics=make_compute_metrics(tokenizer),
    )
    train_only = {}
    # evaluation only: --do_eval without --do_train and without --eval_strategy (which turns do_eval on)
    strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)
    if training_args.do_train or not training_args.do_eval or strategy != "no":
        start = time.time()
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        train_only = dict(train_seconds=round(time.time() - start, 1), train_loss=train_result.training_loss)
        # Seq2SeqTrainer may write a default `max_length` into the generation config: keep `max_new_tokens` alone
        model.generation_config.max_length = None
        trainer.save_model()
        DATText2TextPipeline(model=model, tokenizer=tokenizer).save_pretrained(training_args.output_dir)
    elif not model_args.model_name_or_path:
        raise ValueError("`--do_eval` without `--do_train` evaluates a saved model: give `--model_name_or_path`.")
    result, predictions = exact_match_by_module(
        model, tokenizer, raw["test"], data_args.input_column, data_args.target_column,
        batch_size=training_args.per_device_eval_batch_size, max_new_tokens=data_args.max_target_length,
        num_beams=training_args.generation_num_beams or 1)
    result.update(**train_only, parameters=n_params, steps=trainer.state.global_step)
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "exact_match.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(training_args.output_dir, "predictions.jsonl"), "w") as f:
            for row, prediction in zip(raw["test"], predictions):
                f.write(json.dumps({"input": row[data_args.input_column], "target": row[data_args.target_column],
                                    "prediction": prediction}) + "\n")
    logger.info("held-out exact match: %s", result)
    return result


if __name__ == "__main__":
    main()
