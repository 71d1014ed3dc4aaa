# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""What `import dat_hf` adds to `save_pretrained` and `from_pretrained` of every DAT model class, through the hook
points of `modeling_dat.SAVE_LOAD_HOOKS`:

- saving is crash-safe (`atomic_save.save_atomically`);
- a model sharded with FSDP2 (`fully_shard`) is saved as the unsharded model is, under its own class, by calling
  `save_pretrained` on every rank (`save_fully_sharded`);
- loading a local folder first completes or undoes an interrupted save, checks the config against the checkpoint's
  tensor index before the model is built (`checkpoint_bounds`), and loads again if a save commits during the load
  (`atomic_save.load_consistently`).

The model files import none of this: `save_pretrained` copies them, and only them, as a folder's remote code, which
without dat_hf saves and loads as any Transformers model does.
"""

import contextvars
import copy
import os
import weakref

from transformers import PreTrainedConfig
from transformers.utils import logging

from .atomic_save import finish_interrupted_save, load_consistently, save_atomically
from .checkpoint_bounds import check_against_checkpoint, local_checkpoint_index
from .configuration_dat import DualAttentionConfig

logger = logging.get_logger(__name__)

# (checkpoint index, its file, whether shapes must match) of the local folder `from_pretrained` is loading
_PENDING_CHECKPOINT = contextvars.ContextVar("dat_hf_pending_checkpoint", default=None)


def fsdp2_original_class(model):
    """The model's own class if FSDP2's `fully_shard` has swapped it for its generated `FSDP<Class>`, else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    if not isinstance(model, FSDPModule):
        return None
    return type(model).__mro__[type(model)._orig_cls_mro_index]


def save_fully_sharded(model, own_class, save_directory, *args, **kwargs):
    """Save an FSDP2 model as the unsharded model is saved, under its own class (`fully_shard` swaps it for a
    generated `FSDP<Class>` defined in torch, whose name and file would go into `architectures`, `auto_map` and the
    copied code). Without a `state_dict` this is a collective that every rank calls: the full weights are gathered,
    rank 0 writes the folder (atomically) and every rank returns once it is complete, or raises if the write failed.
    With a `state_dict` (gathered by the caller, e.g. Trainer) only the writing ranks call it."""
    import torch.distributed as dist

    sharded_class = type(model)
    gather = (len(args) < 2 and kwargs.get("state_dict") is None
              and getattr(model.config, "distributed_config", None) is None)  # else Transformers gathers
    if gather:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # full CPU tensors on rank 0, {} elsewhere; the gathered copies of tied weights do not share storage: only
        # the source of each tied pair is kept, as without FSDP
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        kwargs["state_dict"] = {name: tensor for name, tensor in full.items() if name not in tied}
    failure = None
    model.__class__ = own_class
    try:
        if not gather or dist.get_rank() == 0:  # (the other ranks hold no weights after the gather)
            model.save_pretrained(save_directory, *args, **kwargs)
    except Exception as error:
        failure = error
    finally:
        model.__class__ = sharded_class
    if gather:
        status = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(status, src=0)  # the other ranks wait for rank 0's write
        if failure is None and status[0] is not None:
            raise RuntimeError(f"save_pretrained failed on rank 0: {status[0]}")
    if failure is not None:
        raise failure


def save(model, save_pretrained, save_directory, *args, **kwargs):
    """`save_pretrained(save_directory, ...)` (Transformers'), written into a staging folder and switched in
    atomically, except for what is not one whole model written here (uploads, adapters, the other ranks); an FSDP2
    model by `save_fully_sharded`."""
    own_class = fsdp2_original_class(model)
    if own_class is not None and not kwargs.get("distributed_checkpoint"):
        return save_fully_sharded(model, own_class, save_directory, *args, **kwargs)
    is_main_process = args[0] if args else kwargs.get("is_main_process", True)
    if (kwargs.get("push_to_hub") or kwargs.get("distributed_checkpoint")
            or getattr(model, "_hf_peft_config_loaded", False) or not model.should_save_on_this_rank(is_main_process)):
        return save_pretrained(save_directory, *args, **kwargs)
    save_atomically(save_directory, lambda staging: save_pretrained(staging, *args, **kwargs))


def load(cls, from_pretrained, pretrained_model_name_or_path, *args, **kwargs):
    """`from_pretrained(pretrained_model_name_or_path, ...)` (Transformers'), for a local folder repaired first,
    bounded by its checkpoint and consistent with concurrent saves."""
    folder = None
    if isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
        folder = os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        finish_interrupted_save(folder)
    if folder is None or not os.path.isdir(folder) or kwargs.get("gguf_file") or kwargs.get("state_dict"):
        return from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def load_once():
        call_kwargs = dict(kwargs)
        source = config_source(kwargs.get("config"))
        if source is not None and os.path.isfile(os.path.join(folder, "config.json")):
            # a config read (by AutoConfig) before a save committed would pair the old config with new weights
            now, _ = PreTrainedConfig.get_config_dict(folder)
            if now != source[0]:
                logger.warning("dat_hf: %s changed after it was read (a save committed in between); read it "
                               "again: this is the new model's config.", os.path.join(folder, "config.json"))
                config = type(kwargs["config"]).from_dict(now, **source[1])
                call_kwargs["config"] = config[0] if isinstance(config, tuple) else config
        index = local_checkpoint_index(folder, kwargs.get("variant"))
        token = _PENDING_CHECKPOINT.set(None if index is None else
                                        [*index, not kwargs.get("ignore_mismatched_sizes", False)])
        try:
            return from_pretrained(pretrained_model_name_or_path, *args, **call_kwargs)
        finally:
            _PENDING_CHECKPOINT.reset(token)

    return load_consistently(folder, load_once)


def build(cls, args):
    """In `from_pretrained` of a local folder: the config is checked against the checkpoint before the model (its
    __init__) is built (once, for the outermost model; the check builds the model on the meta device)."""
    pending = _PENDING_CHECKPOINT.get()
    if pending is not None and args and isinstance(args[0], PreTrainedConfig):
        _PENDING_CHECKPOINT.set(None)
        shapes, source, check_shapes = pending
        check_against_checkpoint(args[0], cls, shapes, source, check_shapes=check_shapes)


# config object id -> (the dict it was built from, the keyword arguments of `from_dict`): lets `load` see that a
# config read by AutoConfig is older than the folder's config.json (a save committed in between)
_SOURCES: dict[int, tuple[dict, dict]] = {}


def config_source(config):
    """(config dict, `from_dict` kwargs) a DAT config was built from by `from_dict` (AutoConfig, from_pretrained), or
    None."""
    return _SOURCES.get(id(config))


def _from_dict_remembering_sources(cls, config_dict, **kwargs):
    source = (copy.deepcopy(config_dict), dict(kwargs))
    result = PreTrainedConfig.from_dict.__func__(cls, config_dict, **kwargs)
    config = result[0] if isinstance(result, tuple) else result
    _SOURCES[id(config)] = source
    weakref.finalize(config, _SOURCES.pop, id(config), None)
    return result


def install(hooks):
    """Put crash-safe saving and the checks of local folders into `hooks` (`modeling_dat.SAVE_LOAD_HOOKS`), and have
    every DAT config remember what `from_dict` built it from (`config_source`)."""
    hooks.update(save=save, load=load, build=build)
    DualAttentionConfig.from_dict = classmethod(_from_dict_remembering_sources)


__all__ = ["build", "fsdp2_original_class", "install", "load", "save", "save_fully_sharded"]
