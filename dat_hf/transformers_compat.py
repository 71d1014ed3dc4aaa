# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""The seam between dat_hf and Transformers' internals (the server has its own: `dat_hf/serve.py`'s `SERVER_INTERNALS`).

Every name dat_hf reaches that is not Transformers' documented API (the tensor-parallel style classes and registry,
continuous batching's paged cache and attention names, private attributes, the private methods DAT's classes override)
is listed in `INTERNALS`: where it is, what dat_hf needs of it, the shape that need takes (leading parameters, members,
names its source must mention) and the releases it was checked on. The model files, the kernels and the training
helpers reach those names through this module (`parallel_styles`, `PagedAttentionCache`, `attention_implementation`);
the methods they override are checked here, not reached.

Where a release changes a name's shape, this module adapts by what the name offers (a style's `shard_param` takes the
keywords a release passes), never by version number. Where it cannot, the feature that needs it stops at its start
with `TransformersMoved` (`require`): the internal, what changed, the installed release, the newest tested one and
the command that installs it. `tests/test_transformers_internals.py` walks the table on the installed release, in each
CI leg (docs/installing_and_testing.md: what to do when a release moves a name).

The cache's argument: 5.24 renamed `past_key_values` -> `cache` (forwards, `generate()` inputs, mask builders,
outputs): DAT's forwards take `cache` and accept `past_key_values`; what dat_hf hands Transformers uses `CACHE_NAME`.
"""

import dataclasses
import functools
import inspect
import pkgutil
import textwrap
import warnings

import torch
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPast

# the oldest and newest releases tested (constraints/floor.txt, constraints/tested.txt)
TESTED_TRANSFORMERS = ("5.17.0", "5.25.0")
# the releases `INTERNALS` was walked on (the floor and the newest in CI, each release between by hand)
CHECKED_RELEASES = ("5.17.0", "5.24.0", "5.25.0")


class TransformersMoved(RuntimeError):
    """The installed Transformers lacks, or has changed, an internal a dat_hf feature needs (`INTERNALS`)."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """A name of Transformers outside its documented API that dat_hf reaches, and what dat_hf needs of it."""

    name: str  # the module, then attributes: "transformers.distributed.tensor_parallel.TensorParallelLayer.shard_param"
    feature: str  # the dat_hf feature that needs it: stops at its start where it moved (`require`)
    need: str  # what dat_hf needs of it, in words
    used_by: str  # where dat_hf reaches it (a module, or the method that overrides it)
    parameters: tuple = ()  # a callable's leading parameters, as dat_hf calls or overrides it
    members: tuple = ()  # attributes it must have
    mentions: tuple = ()  # names its source must mention (attributes it sets or reads for dat_hf)
    since: str = TESTED_TRANSFORMERS[0]  # the first release whose form dat_hf uses (before: the feature is refused)
    optional: str = ""  # what dat_hf does where it is missing (empty: the feature needs it)


TP = "tensor parallelism"
CB = "continuous batching"
GENERATION = "generation"
TRAINING = "training"
EXPORT = "export"

INTERNALS = (
    # ---- tensor parallelism (`tp_plan="auto"`, `DistributedConfig`): dat_hf/tensor_parallel_dat.py -----------------
    Internal("transformers.distributed.tensor_parallel.TensorParallelLayer.shard_param", TP,
             "the base of DAT's `dat_heads` style; the loader calls `shard_param` per parameter a rule names (W_r "
             "sharded by head), with the keywords its release adds (5.25: `config`, `mesh_manager`), which DAT's "
             "style accepts", "tensor_parallel_dat.HeadShardedParameter",
             parameters=("self", "module", "param", "mesh")),
    Internal("transformers.distributed.tensor_parallel.ColwiseParallel", TP,
             "the base of DAT's `dat_gather` style: built with `input_layouts=`, `output_layouts=`; "
             "`transform_output_post_forward(module, output, mesh, ...)` overridden to gather the relations",
             "tensor_parallel_dat.GatheredColwiseParallel",
             members=("transform_output_post_forward", "transform_inputs_pre_forward")),
    Internal("transformers.distributed.tensor_parallel.ColwiseParallel.__init__", TP,
             "keywords `input_layouts` and `output_layouts`", "tensor_parallel_dat.GatheredColwiseParallel",
             mentions=("input_layouts", "output_layouts")),
    Internal("transformers.distributed.tensor_parallel.ColwiseParallel.transform_output_post_forward", TP,
             "called on each output of a colwise linear, which DAT's override gathers",
             "tensor_parallel_dat.GatheredColwiseParallel", parameters=("self", "module", "output", "mesh")),
    Internal("transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES", TP,
             "the style registry the plan's names resolve in: `register(name, style)`, `name in`",
             "tensor_parallel_dat", members=("register", "__contains__")),
    Internal("transformers.PreTrainedModel.init_parallel_plans", TP,
             "sets the model's plan in `self._tp_plan`, which DAT's override prunes to the modules the config builds",
             "DATPreTrainedModel.init_parallel_plans", parameters=("self",), mentions=("_tp_plan",)),
    Internal("transformers.PreTrainedModel.maybe_distribute_model", TP,
             "a classmethod `(model, distributed_config, mesh)` that shards the model before its weights load, "
             "after which DAT's override leaves each attention module its rank's heads; sets `model._tp_size`",
             "DATPreTrainedModel.maybe_distribute_model", parameters=("model", "distributed_config")),
    # ---- continuous batching (`generate_batch`, `init_continuous_batching`, the server): dat_hf/cache_dat.py -------
    Internal("transformers.generation.continuous_batching.PagedAttentionCache.update", CB,
             "`update(key_states, value_states, layer_idx, kwargs)`: DAT writes each layer's packed cache as the "
             "key and value halves of its pages and reads them back", "cache_dat.PagedCache.update_packed",
             parameters=("self", "key_states", "value_states", "layer_idx", "kwargs"), since="5.24.0"),
    Internal("transformers.generation.continuous_batching.PagedAttentionCache.__init__", CB,
             "sets `layer_to_allocator` (each with its `layer_type`): the positions a layer's keys hold",
             "cache_dat.PagedCache.relative_position_index", mentions=("layer_to_allocator",), since="5.24.0"),
    Internal("transformers.generation.continuous_batching.continuous_api", CB,
             "runs eager attention as `paged|eager` (`config._attn_implementation`), which DAT's heads read as "
             "eager over the paged cache", "attention_plan.sensory_function (`attention_implementation`)",
             mentions=('"paged|eager"',), since="5.24.0"),
    Internal("transformers.generation.continuous_batching.input_outputs", CB,
             "the forward's paged-cache arguments (`cache_dat.PAGED_ARGUMENTS`), which DAT's forward takes out of "
             "its keywords", "cache_dat.open_cache",
             mentions=("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "read_index", "write_index",
                       "block_table"), since="5.24.0"),
    Internal("transformers.GenerationMixin.init_continuous_batching", CB,
             "starts the batching manager; DAT's override first refuses, by name, what it cannot serve",
             "DATGenerationMixin.init_continuous_batching", parameters=("self",)),
    # ---- generation: dat_hf/modeling_dat.py ------------------------------------------------------------------------
    Internal("transformers.GenerationMixin._prepare_cache_for_generation", GENERATION,
             "builds `generate()`'s cache, marking the caller's `_is_user_defined`; DAT's override then gives the "
             "cache DAT's layers (keys, values, symbol values and relation keys of each layer)",
             "DATGenerationMixin._prepare_cache_for_generation",
             parameters=("self", "generation_config", "model_kwargs", "generation_mode", "batch_size",
                         "max_cache_length"), mentions=("_is_user_defined",)),
    Internal("transformers.GenerationMixin._get_static_cache_init_shape", GENERATION,
             "the shape a static cache is allocated with ahead of the first forward; DAT's override returns None "
             "(DAT's layers allocate at their first update, keys and values with their own heads)",
             "DATGenerationMixin._get_static_cache_init_shape", parameters=("self",)),
    Internal("transformers.PreTrainedModel._can_set_attn_implementation", GENERATION,
             "whether `set_attn_implementation` may change the model's attention; the seq2seq model's override says "
             "it may (its dual cross-attention reads the config)", "DATSeq2SeqPreTrainedModel"),
    Internal("transformers.PreTrainedConfig._attn_implementation", GENERATION,
             "the attention implementation in use, which the sensory heads' backend is chosen by",
             "attention_plan.sensory_function, masking_dat"),
    Internal("transformers.masking_utils.create_causal_mask", GENERATION,
             "Transformers' mask builders read the implementation from `config._attn_implementation` (DAT hands "
             "them a stand-in config: `masking_dat.MaskBuilderConfig`)", "masking_dat.MaskBuilderConfig",
             mentions=("_attn_implementation",)),
    Internal("transformers.modeling_utils.slice_logits_to_keep", GENERATION,
             "the hidden states whose logits `logits_to_keep` asks for", "modeling_dat, modeling_dat_seq2seq",
             parameters=("hidden_states", "logits_to_keep"), since="5.18.0",
             optional="dat_hf's own copy (`transformers_compat.slice_logits_to_keep`)"),
    # ---- training: dat_hf/training/trainer.py ----------------------------------------------------------------------
    Internal("transformers.Trainer._save_checkpoint", TRAINING,
             "writes one checkpoint under `_get_output_dir(trial)`; DAT's trainer stages it and renames it whole",
             "training.trainer.AtomicCheckpointMixin", parameters=("self", "model", "trial"),
             mentions=("_get_output_dir",)),
    Internal("transformers.Trainer._get_output_dir", TRAINING,
             "the run folder a checkpoint is written under (swapped for the staging folder while it is written)",
             "training.trainer.AtomicCheckpointMixin, training.preemption.PreemptionCallback",
             parameters=("self", "trial")),
    Internal("transformers.Trainer.__init__", TRAINING,
             "reads `enable_jit_checkpoint` here, and only here, to install its per-process JIT callback: DAT's "
             "trainer is built with the flag off and installs `PreemptionCallback` instead",
             "training.trainer.PreemptionMixin", mentions=("enable_jit_checkpoint",)),
    Internal("transformers.Trainer._build_accelerator_args", TRAINING,
             "reads `ddp_find_unused_parameters` (from `__init__`) for DDP's `find_unused_parameters`: DAT's trainer "
             "is built with it False when unset", "training.trainer.UsedParametersMixin",
             parameters=("self",), mentions=("ddp_find_unused_parameters",)),
    Internal("transformers.Trainer._save", TRAINING,
             "writes the model's files; DAT's override saves an FSDP-sharded model whole",
             "training.trainer.FSDPModelSaveMixin", parameters=("self", "output_dir", "state_dict")),
    Internal("transformers.Trainer._issue_warnings_after_load", TRAINING,
             "warns about the keys a resumed checkpoint lacks; DAT's override leaves out the tied ones restored",
             "training.trainer.ResumeMixin", parameters=("self", "load_result")),
    Internal("transformers.trainer_utils.rotate_checkpoints", TRAINING,
             "removes the checkpoints past `save_total_limit` (called after each atomic save)",
             "training.trainer.AtomicCheckpointMixin", parameters=("output_dir", "save_total_limit")),
    # ---- export: dat_hf/export.py ----------------------------------------------------------------------------------
    Internal("transformers.integrations.executorch.TorchExportableModuleWithStaticCache", EXPORT,
             "the exportable decoder with a static cache, whose forward DAT's exporter reuses over DAT's layers",
             "export.DATExportableModuleWithStaticCache"),
    Internal("transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM", EXPORT,
             "the ExecuTorch export entry, which DAT's exporter subclasses", "export.DATExportableModuleForDecoderOnlyLM"),
)


def resolve(name: str):
    """The object `name` (a module, then attributes) names in the installed Transformers; LookupError naming it."""
    try:
        return pkgutil.resolve_name(name)
    except (ImportError, AttributeError) as error:
        raise LookupError(f"there is no `{name}` ({error})") from None


def difference(internal: Internal) -> str | None:
    """What the installed Transformers' `internal.name` lacks of what dat_hf needs; None when it has it."""
    try:
        found = resolve(internal.name)
    except LookupError as missing:
        return f"{missing}"
    if internal.parameters:
        names = list(inspect.signature(found).parameters)
        if names[:len(internal.parameters)] != list(internal.parameters):
            return f"its parameters are ({', '.join(names)}), dat_hf's start ({', '.join(internal.parameters)})"
    lacking = [member for member in internal.members if not hasattr(found, member)]
    if lacking:
        return f"it has no {', '.join(f'`{member}`' for member in lacking)}"
    if internal.mentions:
        source = inspect.getsource(found)
        unmentioned = [word for word in internal.mentions if word not in source]
        if unmentioned:
            return f"its source does not mention {', '.join(f'`{word}`' for word in unmentioned)}"
    return None


def moved_message(internal: Internal, what: str) -> str:
    """The one message for an internal that moved: the internal, what changed, the release installed, the newest
    tested and how to install it."""
    newest = TESTED_TRANSFORMERS[1]
    return (f"dat_hf's {internal.feature} needs `{internal.name}` of Transformers ({internal.need}); in the installed "
            f"transformers {transformers.__version__}, {what}. dat_hf is tested with Transformers "
            f"{TESTED_TRANSFORMERS[0]} to {newest}: pip install 'transformers=={newest}'")


@functools.cache
def moved(feature: str) -> tuple[str, ...]:
    """A message (`moved_message`) for each internal `feature` needs that the installed release moved."""
    return tuple(moved_message(internal, what) for internal in INTERNALS
                 if internal.feature == feature and not internal.optional
                 and (what := difference(internal)) is not None)


def require(feature: str) -> None:
    """Raise `TransformersMoved` if an internal `feature` needs moved (at the feature's start, never deep inside)."""
    messages = moved(feature)
    if messages:
        raise TransformersMoved("\n".join(messages))


# ---- what the modules reach through this seam ----------------------------------------------------------------------


def parallel_styles():
    """(`ALL_PARALLEL_STYLES`, `ColwiseParallel`, `TensorParallelLayer`) of the installed Transformers, or None where
    it has no tensor parallelism (or torch no distributed tensors) in the form DAT's styles build on (`moved(TP)`)."""
    if not torch.distributed.is_available() or moved(TP):
        return None
    from transformers.distributed import tensor_parallel

    return tensor_parallel.ALL_PARALLEL_STYLES, tensor_parallel.ColwiseParallel, tensor_parallel.TensorParallelLayer


try:
    from transformers.generation.continuous_batching import PagedAttentionCache
except ImportError:  # pragma: no cover (a release without continuous batching: no cache is ever one)

    class PagedAttentionCache:
        """Stands in for continuous batching's paged cache, which the installed Transformers lacks."""


PAGED_PREFIX = "paged|"  # continuous batching's attention names: `paged|eager` (`INTERNALS`: continuous_api)


def attention_implementation(config) -> str | None:
    """The config's attention implementation, continuous batching's `paged|` prefix removed (DAT's heads read the
    paged cache themselves)."""
    implementation = config._attn_implementation
    return implementation.removeprefix(PAGED_PREFIX) if isinstance(implementation, str) else implementation


def paged_cache_limits() -> str | None:
    """Why the installed Transformers' continuous batching cannot hold DAT's layers (`moved(CB)`), or None when it
    can."""
    return "; ".join(moved(CB)) or None


# ---- the cache's name ----------------------------------------------------------------------------------------------

# the installed release's name of the cache argument and output field
CACHE_NAME = ("cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
              else "past_key_values")
LEGACY_CACHE_NAME = "past_key_values"
# the cache's names an output may carry (Trainer's `keys_to_ignore_at_inference`, accelerate's device placement)
CACHE_NAMES = ["cache", "past_key_values"]


# the `cache` argument for `auto_docstring` (releases before 5.24 do not document it)
CACHE_ARG_DOC = """cache (`~cache_utils.Cache`, *optional*):
    The cache of the tokens seen so far (keys, values, symbol values and relation keys of every layer), as returned
    by an earlier forward with `use_cache=True`; the model returns it updated. Also accepted as `past_key_values`
    (its name before Transformers 5.24, deprecated since)."""


def takes_cache(function):
    """Innermost decorator of a forward with `cache`: also accept `past_key_values=` (a `FutureWarning` from 5.24;
    ValueError if both are given), and document `cache`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if LEGACY_CACHE_NAME in kwargs:
            if CACHE_NAME == "cache":
                warnings.warn("`past_key_values` is deprecated since Transformers 5.24: pass the cache as `cache`.",
                              FutureWarning, stacklevel=2)
            legacy = kwargs.pop(LEGACY_CACHE_NAME)
            if kwargs.get("cache") is not None and legacy is not None:
                raise ValueError("Pass the cache once, as `cache` (`past_key_values` is its former name), not both.")
            if kwargs.get("cache") is None:
                kwargs["cache"] = legacy
        return function(*args, **kwargs)

    # (before the method's own arguments, indented as a method's docstring)
    wrapper.__doc__ = "\n" + textwrap.indent(CACHE_ARG_DOC, " " * 8) + "\n" + (function.__doc__ or "").lstrip("\n")
    return wrapper


def cache_kwargs(cache) -> dict:
    """`{CACHE_NAME: cache}`."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The cache a `ModelOutput` (or `model_kwargs` dict) carries."""
    if isinstance(outputs, dict):
        return outputs.get(CACHE_NAME)
    return getattr(outputs, CACHE_NAME, None)


try:  # (Transformers 5.18+; `INTERNALS`)
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # pragma: no cover (Transformers 5.17)

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """`hidden_states` `[b, n, d]` at the positions whose logits are wanted: an `int`, the last ones (0: all); a
        1D tensor, those positions; a 2D int `[b, k]`, per-sample; a 2D bool `[b, n]`, flattened `[true, d]`."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        if isinstance(logits_to_keep, int):
            logits_to_keep = slice(-logits_to_keep, None)
        return hidden_states[:, logits_to_keep, :]


__all__ = ["CACHE_NAME", "CACHE_NAMES", "CHECKED_RELEASES", "INTERNALS", "Internal", "PagedAttentionCache",
           "TESTED_TRANSFORMERS", "TransformersMoved", "attention_implementation", "cache_kwargs", "difference",
           "moved", "output_cache", "paged_cache_limits", "parallel_styles", "require", "resolve",
           "slice_logits_to_keep", "takes_cache"]

