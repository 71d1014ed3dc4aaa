"""Training helpers shared by the scripts (never imported by the modeling files).

- Model presets: `presets/*.json` in this package (`load_preset_config("dat-tiny")`, or a path to a JSON file).
- `AtomicCheckpointTrainer`: a `Trainer` whose checkpoints appear atomically: each `checkpoint-N` is written in
  full under `<output_dir>/.staging/` and then renamed into place, so a run killed while saving never leaves a
  partial `checkpoint-N` for `resume_from_checkpoint` / `get_last_checkpoint` to pick up. Under FSDP with sharded
  checkpoints, the final `save_model` still gathers a full `model.safetensors` (`FSDPModelSaveMixin`). A resumed run
  says which checkpoint it resumed from, without Trainer's false missing-key warning for tied weights (`ResumeMixin`).
  An FSDP request that runs without FSDP (on the CPU) is named in one warning (`FSDPOnCPUWarningMixin`).
- Preemption (`--enable_jit_checkpoint`): a signal to any rank stops every rank at the same step with one complete
  checkpoint (`PreemptionMixin`, `dat_hf.training.preemption`).
- DDP without the search for unused parameters, for DAT models, which use every parameter (`UsedParametersMixin`).
- `start_deepspeed_comm_on_cpu`: what `torchrun ... --deepspeed ds.json --use_cpu` needs before the model is built.
- Offline `evaluate` metric modules shipped in this package: `load_metric("accuracy" | "exact_match")`.

What the libraries already do is left to them: parameter counts are `model.num_parameters()`, perplexity is
`exp(eval_loss)` of `Trainer.evaluate` (as in Transformers' `run_clm.py`), progress is Trainer's own progress bar /
`PrinterCallback`. The newest checkpoint is `dat_hf.training.preemption.last_complete_checkpoint`: Transformers'
`get_last_checkpoint`, skipping folders that are not whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from transformers import Trainer, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.utils import logging

from ..atomic_save import fsync_dir
from .preemption import DEFAULT_GRACE_SECONDS, DEFAULT_SIGNALS, PreemptionCallback, last_complete_checkpoint

logger = logging.get_logger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
PRESETS_DIR = PACKAGE_DIR / "presets"  # model presets (package data)
METRICS_DIR = PACKAGE_DIR / "metrics"  # offline `evaluate` modules, one folder each (package data)
STAGING_DIR_NAME = ".staging"


# ---- presets -------------------------------------------------------------------------------------------------------
def list_presets(config_dir: str | os.PathLike | None = None) -> list[str]:
    """Names of the model presets (`presets/<name>.json` in this package)."""
    config_dir = Path(config_dir or PRESETS_DIR)
    return sorted(p.stem for p in config_dir.glob("*.json"))


def preset_path(name_or_path: str, config_dir: str | os.PathLike | None = None) -> Path:
    """The JSON file of a preset name (`dat-tiny`) or an explicit path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = Path(config_dir or PRESETS_DIR) / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    raise FileNotFoundError(
        f"No model preset {name_or_path!r}: give a JSON file or one of {list_presets(config_dir)} "
        f"(in {config_dir or PRESETS_DIR})."
    )


def parse_config_overrides(overrides: str | None) -> dict:
    """`"hidden_size=64,num_hidden_layers=2,hidden_act=gelu"` -> a dict of JSON-parsed values (strings otherwise).

    Kept rather than `PretrainedConfig.update_from_string`: that sets attributes on a built config (after its
    validation), casts each value to the type of the current one, so it refuses fields whose default is None
    (`intermediate_size`, `sliding_window_size`, ...) and lists (`relational_heads_bias=[...]`); this gives the
    keyword arguments of the config's constructor, which validates them."""
    result = {}
    for item in re.split(r",(?![^\[]*\])", overrides or ""):  # commas inside [...] belong to a list value
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"Config overrides must look like `field=value`, got {item!r}.")
        key, value = (part.strip() for part in item.split("=", 1))
        try:
            result[key] = json.loads(value)
        except json.JSONDecodeError:
            result[key] = value
    return result


def load_preset_config(name_or_path: str, config_dir: str | os.PathLike | None = None, **overrides):
    """A `DATConfig` from a preset name or JSON path; keys starting with `_` (comments, expected sizes) are dropped."""
    from ..configuration_dat import DATConfig

    with open(preset_path(name_or_path, config_dir), encoding="utf-8") as f:
        kwargs = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    kwargs.pop("model_type", None)
    kwargs.update(overrides)
    return DATConfig(**kwargs)


def preset_metadata(name_or_path: str, config_dir: str | os.PathLike | None = None) -> dict:
    """The `_`-prefixed fields of a preset (e.g. `_expected_parameters`, `_reference`), without the underscore."""
    with open(preset_path(name_or_path, config_dir), encoding="utf-8") as f:
        return {k[1:]: v for k, v in json.load(f).items() if k.startswith("_")}


def parameters_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), to compare replicas bit for bit."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


# ---- atomic checkpoints --------------------------------------------------------------------------------------------
class AtomicCheckpointMixin:
    """Kept because Trainer writes `checkpoint-N` in place (a killed save leaves a partial folder). Writes each `checkpoint-N` under `<run_dir>/.staging/checkpoint-N` (every process writes its part there),
    waits for all processes, then the saving process renames it to `<run_dir>/checkpoint-N` in one `os.replace`
    and rotates old checkpoints. The Trainer's own `_save_checkpoint` (model safetensors, optimizer, scheduler, RNG
    states, trainer state) is reused unchanged."""

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING_DIR_NAME)
        staging, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
            os.makedirs(staging_root, exist_ok=True)
        self.accelerator.wait_for_everyone()

        get_output_dir = self._get_output_dir
        self._get_output_dir = lambda trial=None: staging_root
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._get_output_dir = get_output_dir
        if self.state.best_model_checkpoint == staging:
            self.state.best_model_checkpoint = final
        self.accelerator.wait_for_everyone()  # every process has written its files (RNG states, shards)

        if self.args.should_save:
            # the trainer state written in staging must name the final folder
            self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
            if os.path.isdir(final):  # re-saving the same step: replace the old folder
                shutil.rmtree(final)
            fsync_dir(staging)
            os.replace(staging, final)
            fsync_dir(run_dir)
            shutil.rmtree(staging_root, ignore_errors=True)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )
        self.accelerator.wait_for_everyone()


class FSDPModelSaveMixin:
    """Kept because `Trainer.save_model` (Transformers 5.24) saves nothing under FSDP's `SHARDED_STATE_DICT`; it only
    calls Accelerate's full-state-dict gathering (`accelerator.get_state_dict`) for `FULL_STATE_DICT`. Under FSDP, `save_model` writes the folder it writes without FSDP (full `model.safetensors`, config and
    `auto_map` of the model's own class, remote code, tokenizer), which `from_pretrained` loads:
    - with `SHARDED_STATE_DICT`, `Trainer.save_model` writes nothing (checkpoints hold `torch.distributed.checkpoint`
      shards instead): outside checkpoints, the full state dict is gathered;
    - the gathered copies of tied weights do not share storage, so `save_pretrained` would store both: only the
      source of each tied pair (`all_tied_weights_keys`) is kept, as without FSDP;
    - FSDP2's generated class `FSDP<Class>` is undone by the model's own `save_pretrained` (see
      `dat_hf.safe_folders.save_fully_sharded`)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None) if self.is_fsdp_enabled else None
        if _internal_call or plugin is None or "SHARDED_STATE_DICT" not in str(plugin.state_dict_type):
            return super().save_model(output_dir, _internal_call)
        sharded = plugin.state_dict_type
        plugin.state_dict_type = "FULL_STATE_DICT"  # read by `Trainer.save_model`; checkpoints stay sharded
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            plugin.state_dict_type = sharded

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self.is_fsdp_enabled:
            return super()._save(output_dir, state_dict)
        if state_dict:
            tied = getattr(self.model, "all_tied_weights_keys", {})  # {target: source}
            state_dict = {k: v for k, v in state_dict.items() if k not in tied}
        super()._save(output_dir, state_dict)


def cpu_ranks_resume_refusal(args, sharded: bool, version: str | None = None) -> str | None:
    """Why Transformers `version` (the installed one by default) cannot resume a multi-process run on the CPU (DDP
    over gloo), or None: 5.17 loads the optimizer state with `map_location=args.device` (`cpu:0`), which torch cannot
    restore (fixed in 5.18). FSDP and DeepSpeed load their own states."""
    import transformers
    from packaging.version import Version

    version = version or transformers.__version__
    if args.world_size > 1 and args.device.type == "cpu" and not sharded and Version(version) < Version("5.18.0"):
        return (f"Resuming a run of {args.world_size} processes on the CPU needs Transformers >= 5.18: {version} loads "
                "the optimizer state onto `cpu:0`, which torch cannot restore. `pip install -U 'transformers>=5.18'`.")
    return None


class ResumeMixin:
    """Kept because of three things `Trainer.train(resume_from_checkpoint=...)` does (Transformers 5.17 to 5.25):
    - with Transformers 5.17, several processes on the CPU fail to load the optimizer state deep in torch: refused
      before anything loads, naming the release that works (`cpu_ranks_resume_refusal`);
    - it names the checkpoint it resumes from only at info level (hidden by default): one line is printed, on the
      main process, with the checkpoint's path and step;
    - it warns "There were missing keys in the checkpoint model loaded: ['lm_head.weight']" for every model with tied
      embeddings (Llama's too), although the resumed weights are exact: `save_pretrained` leaves the tied copy out of
      the checkpoint, and `Trainer._issue_warnings_after_load` compares the missing keys with the model's
      `_keys_to_ignore_on_save`, not with its tied weights. A missing key that is the same parameter as a loaded one
      (`all_tied_weights_keys`, {target: source}) is left out of that warning; any other missing key is still named."""

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if resume_from_checkpoint is True:  # the newest complete checkpoint (Trainer raises its own error without)
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir) or True
        refusal = isinstance(resume_from_checkpoint, (str, os.PathLike)) and cpu_ranks_resume_refusal(
            self.args, sharded=self.is_fsdp_enabled or self.is_deepspeed_enabled)
        if refusal:
            raise RuntimeError(refusal)
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and self.is_world_process_zero():
            state_file = os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)
            if os.path.isfile(state_file):  # else Trainer raises, naming the file
                step = TrainerState.load_from_json(state_file).global_step
                print(f"Resuming from {os.path.abspath(resume_from_checkpoint)} (step {step})", flush=True)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _issue_warnings_after_load(self, load_result) -> None:
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        missing = set(load_result.missing_keys)
        restored = {key for key in missing if tied.get(key) in parameters and tied[key] not in missing
                    and parameters.get(key) is parameters[tied[key]]}
        if restored:
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in restored])
        super()._issue_warnings_after_load(load_result)


DAT_MODEL_TYPES = ("dat", "dat_encoder", "dat_seq2seq", "dat_vision")


def uses_every_parameter(model) -> bool:
    """Whether every trainable parameter of `model` takes part in each training forward, so that DDP needs no search
    for unused ones: true of every DAT model (each family, with or without either head type, every symbol retriever;
    `tests/test_preemption.py` checks it), through PEFT's wrapper too, except a node classifier
    (`num_node_features`: node features replace the token embeddings, which go unused); unknown (False) for other
    models."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in DAT_MODEL_TYPES and not getattr(config, "num_node_features", None)


@contextlib.contextmanager
def _arguments_during(args, **values):
    """Set fields of `args` for the duration of the block (Trainer's `__init__` reads them), then restore them."""
    previous = {name: getattr(args, name) for name in values}
    for name, value in values.items():
        setattr(args, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(args, name, value)


class PreemptionMixin:
    """Kept because `--enable_jit_checkpoint` has `Trainer.__init__` (Transformers 5.17 to 5.25) install its
    `JITCheckpointCallback`, which stops and saves in the signalled process alone (a hang when the signal reaches
    only some ranks) and writes its marker into `checkpoint-N/` around the atomic save. Here Trainer is built with the
    flag off and `PreemptionCallback` takes its place: every rank saves the same step through the atomic
    `_save_checkpoint` and stops (`dat_hf.training.preemption`); `preemption` then describes the stop.

    Args (keywords, beside Trainer's):
        preemption_signals: the signals that stop training (default SIGTERM; names or numbers).
        preemption_grace_seconds: how long a signalled process may take to stop and save before it exits anyway."""

    def __init__(self, *args, preemption_signals=DEFAULT_SIGNALS,
                 preemption_grace_seconds: float = DEFAULT_GRACE_SECONDS, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        jit = training_args is not None and training_args.enable_jit_checkpoint
        with _arguments_during(training_args, enable_jit_checkpoint=False) if jit else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        self.preemption_callback = None
        if jit:
            self.preemption_callback = PreemptionCallback(self, preemption_signals, preemption_grace_seconds)
            self.add_callback(self.preemption_callback)

    @property
    def preemption(self):
        """The `Preemption` that stopped the last `train()` (signal, ranks, step, checkpoint), or None."""
        return self.preemption_callback.preemption if self.preemption_callback is not None else None


class UsedParametersMixin:
    """Kept because, with `ddp_find_unused_parameters` unset, `Trainer.__init__` asks DDP to search every step for
    parameters the forward did not use (and DDP warns each run that it found none). A DAT model uses them all
    (`uses_every_parameter`): its Trainer is built with `ddp_find_unused_parameters=False`. An explicit
    `--ddp_find_unused_parameters` is kept."""

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        model = kwargs.get("model", args[0] if args else None)
        search = (training_args is not None and training_args.ddp_find_unused_parameters is None
                  and uses_every_parameter(model))
        with _arguments_during(training_args, ddp_find_unused_parameters=False) if search else contextlib.nullcontext():
            super().__init__(*args, **kwargs)

def fsdp_fallback_warning(args, accelerator) -> str | None:
    """The warning for an FSDP request that runs without FSDP on the CPU (see `FSDPOnCPUWarningMixin`), else None."""
    from accelerate.utils import DistributedType

    launched = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"  # (`accelerate launch`, `--fsdp`)
    if not (args.fsdp or launched) or accelerator.distributed_type == DistributedType.FSDP or args.device.type != "cpu":
        return None
    asked = "`--fsdp`" if args.fsdp else "`accelerate launch` with an FSDP config (`distributed_type: FSDP`)"
    launched_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        runs = f"its {accelerator.num_processes} processes train as plain DDP (MULTI_CPU, gloo)"
    elif launched_processes > 1:
        runs = (f"each of the {launched_processes} launched processes trains alone, on all the data, into the same "
                "output folder (no process group: add `--use_cpu` to train them together as DDP)")
    else:
        runs = f"it runs as {accelerator.distributed_type.value} in one process"
    warning = (f"FSDP was requested by {asked} but runs only on GPUs and other accelerators: on the CPU, Accelerate "
               f"runs without FSDP, and {runs}. Nothing is sharded: every process holds the whole model, its gradients "
               "and optimizer state, and checkpoints hold full weights. To shard, train on GPUs; to train on the CPU, "
               "launch DDP itself (`torchrun --nproc_per_node N scripts/train_causal_lm.py ... --use_cpu`; "
               "docs/training.md).")
    if accelerator.mixed_precision != "no" and not (args.bf16 or args.fp16):
        warning += (f" The launch config's `mixed_precision: {accelerator.mixed_precision}` also runs the forward "
                    "under autocast on the CPU: `accelerate launch --mixed_precision no ...` turns it off.")
    return warning


class FSDPOnCPUWarningMixin:
    """Kept because Accelerate (1.15) runs FSDP only on accelerators, without a word otherwise: on the CPU an FSDP
    request (`accelerate launch --config_file configs/accelerate/fsdp.yaml`, or `--fsdp --fsdp_config ...`) runs as
    plain DDP (`MULTI_CPU`) with `--use_cpu`, and as independent single processes without it. Building the Trainer
    logs one warning, on the launch's rank 0 (`RANK`; the independent processes are each rank 0 of their own),
    naming what runs instead and what to do (`fsdp_fallback_warning`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        warning = fsdp_fallback_warning(self.args, self.accelerator)
        if warning and int(os.environ.get("RANK", self.args.process_index)) == 0:
            logger.warning(warning)


def start_deepspeed_comm_on_cpu(training_args) -> None:
    """Kept because `torchrun ... --deepspeed ds.json --use_cpu` fails on a CPU-only machine (Transformers 5.24,
    Accelerate 1.15, DeepSpeed 0.19): `--use_cpu` has Accelerate start torch's process group (gloo) but not
    DeepSpeed's communication backend, which `deepspeed.initialize` starts only inside the Trainer, after the model is
    built. Under ZeRO-3 the model is built inside `deepspeed.zero.Init`, whose config then counts one process and
    refuses the batch sizes (`train_batch_size ... 8 != 4 * 1 * 1`). Called before the model is built, this starts
    DeepSpeed's backend on torch's process group; it does nothing without DeepSpeed, off the CPU or in one process.
    (`accelerate launch` with a DeepSpeed config and `--use_cpu` runs without it.)"""
    import torch.distributed as dist

    if training_args.deepspeed_plugin is None or training_args.device.type != "cpu" or not dist.is_initialized():
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


class AtomicCheckpointTrainer(AtomicCheckpointMixin, FSDPModelSaveMixin, ResumeMixin, PreemptionMixin,
                              UsedParametersMixin, FSDPOnCPUWarningMixin, Trainer):
    """`transformers.Trainer` with atomic checkpoints (see `AtomicCheckpointMixin`) that saves a full, loadable model
    under FSDP too (see `FSDPModelSaveMixin`), says what it resumes from (see `ResumeMixin`), stops every rank at one
    step on a preemption signal (see `PreemptionMixin`), runs DDP without the search for unused parameters (see
    `UsedParametersMixin`) and warns when an FSDP request runs without FSDP, on the CPU
    (see `FSDPOnCPUWarningMixin`)."""


def list_metrics() -> list[str]:
    """Names of the `evaluate` modules shipped in this package (`metrics/<name>/<name>.py`)."""
    return sorted(p.parent.name for p in METRICS_DIR.glob("*/*.py") if p.stem == p.parent.name)


def load_metric(name: str, **kwargs):
    """One of the package's `evaluate` modules (`accuracy`, `exact_match`), loaded offline from its folder (kept
    because `evaluate.load("accuracy")` needs the Hub), in memory by default (no cache files, so concurrent
    processes do not collide)."""
    import evaluate

    if name not in list_metrics():
        raise ValueError(f"`name` must be one of {list_metrics()}, got {name!r}.")
    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(METRICS_DIR / name), **kwargs)


__all__ = [
    "PRESETS_DIR",
    "METRICS_DIR",
    "list_presets",
    "preset_path",
    "load_preset_config",
    "preset_metadata",
    "parse_config_overrides",
    "parameters_digest",
    "AtomicCheckpointMixin",
    "AtomicCheckpointTrainer",
    "FSDPModelSaveMixin",
    "FSDPOnCPUWarningMixin",
    "fsdp_fallback_warning",
    "start_deepspeed_comm_on_cpu",
    "ResumeMixin",
    "cpu_ranks_resume_refusal",
    "PreemptionMixin",
    "UsedParametersMixin",
    "uses_every_parameter",
    "list_metrics",
    "load_metric",
]
