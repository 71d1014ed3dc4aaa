# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""A checkpoint's tensor index bounds the model a `config.json` asks for, before anything is allocated.

A folder's `config.json` is untrusted input: `num_hidden_layers: 1000000` or `hidden_size: 10**9` would make
`from_pretrained` hang building (and allocating) the model. The safetensors header (names, dtypes and shapes; each
tensor's byte range is checked against the file's size, so the shapes are bounded by the bytes on disk) is read
first, without reading a tensor, and

1. the layer counts of the config (`num_hidden_layers`, `encoder_layers`) must not exceed the layers the checkpoint
   holds (`...layers.<i>.` names);
2. the model is then built on the `meta` device (no memory), and every tensor both have must have the same shape;
3. what the checkpoint lacks (newly initialised weights, e.g. a classification head) must stay small next to it.

A failed check is a ValueError naming the file, the tensor, the config fields behind the differing sizes and the
checkpoint's values. Used by `from_pretrained` of every DAT class (installed by `import dat_hf` through
`safe_folders.py`; not part of a folder's remote code) and by the converter of the authors' checkpoints
(`conversion.py`).
"""

import contextlib
import json
import math
import os
import re
import struct
import sys

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # as the safetensors library
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
LAYER = re.compile(r"^(.*?)layers\.(\d+)\.")
# new tensors (absent from the checkpoint) may add this many elements beyond the checkpoint's own
MISSING_ALLOWANCE = 1 << 26
# a config may ask for this many layers beyond the checkpoint's (initialized on load, as Transformers does for any
# missing weight: a model grown in depth, a checkpoint missing its weights); more is not this checkpoint's model, and
# is refused before even the meta-device model is built
LAYER_SLACK = 64


class CheckpointMismatchError(ValueError, RuntimeError):
    """The config asks for shapes the checkpoint does not hold: a `ValueError` naming the field, and a `RuntimeError`
    as Transformers raises for mismatched sizes (`ignore_mismatched_sizes=True` loads them re-initialized)."""


def read_safetensors_header(path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, without reading any tensor. ValueError naming the file
    when the header is not a consistent safetensors header (its byte ranges must fit in the file)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file ({size} bytes).")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: its safetensors header claims {length} bytes (the file has {size}).")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: unreadable safetensors header ({error}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object.")
    data_bytes = size - 8 - length
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (dtype in DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in shape)
                     and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_bytes)
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid or (end - start) != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(f"{path}: tensor {name!r} has an inconsistent header entry {entry!r} (the file holds "
                             f"{data_bytes} data bytes).")
        shapes[name] = tuple(shape)
    return shapes


def local_checkpoint_index(folder, variant=None) -> tuple[dict[str, tuple[int, ...]], str] | None:
    """({tensor name: shape}, description) of a local folder's safetensors checkpoint (one file, or the shards of
    its index), or None when the folder holds none (e.g. a Hub id, or only `.bin` files)."""
    if folder is None or not os.path.isdir(folder):
        return None
    stem = f"model.{variant}" if variant else "model"
    single = os.path.join(folder, f"{stem}.safetensors")
    if os.path.isfile(single):
        return read_safetensors_header(single), single
    index_path = os.path.join(folder, f"{stem}.safetensors.index.json")
    if not os.path.isfile(index_path):
        return None
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index_path} is not a safetensors index ({type(error).__name__}: {error}).") from None
    shapes = {}
    for shard in shards:
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise ValueError(f"{index_path} names a shard outside the folder: {shard!r}.")
        shard_path = os.path.join(folder, shard)
        if os.path.isfile(shard_path):
            shapes.update(read_safetensors_header(shard_path))
    return shapes, index_path


def _layer_counts(names) -> dict[str, int]:
    """{stack prefix: number of layers} of `...layers.<i>.` names."""
    stacks: dict[str, set[int]] = {}
    for name in names:
        match = LAYER.match(name)
        if match:
            stacks.setdefault(match.group(1), set()).add(int(match.group(2)))
    return {prefix: len(indices) for prefix, indices in stacks.items()}


def check_layer_counts(config, shapes, source):
    """The config's layer counts must not exceed the checkpoint's by more than `LAYER_SLACK` (checked before the
    model, `num_hidden_layers` deep, is built at all)."""
    stacks = _layer_counts(shapes)
    if hasattr(config, "encoder_layers"):  # seq2seq: `...encoder.layers.<i>` and the decoder's
        fields = {"encoder_layers": lambda p: "encoder" in p, "num_hidden_layers": lambda p: "encoder" not in p}
    else:
        fields = {"num_hidden_layers": lambda p: True}
    for field, belongs in fields.items():
        value = getattr(config, field, None)
        held = sum(count for prefix, count in stacks.items() if belongs(prefix))
        if isinstance(value, int) and value > held + LAYER_SLACK:
            where = ", ".join(f"{prefix}layers.0-{count - 1}" for prefix, count in stacks.items() if belongs(prefix))
            raise ValueError(f"`{field}` is {value} in the config, but the checkpoint {source} holds {held} layers"
                             f"{f' ({where})' if where else ''}: the config does not match the checkpoint.")


def _int_fields(config, prefix=""):
    """{name: value} of a config's (or a dict's, nested dicts as `outer.inner`) integer fields."""
    items = config.items() if isinstance(config, dict) else config.to_dict().items()
    fields = {}
    for name, value in items:
        if isinstance(value, dict):
            fields.update(_int_fields(value, f"{prefix}{name}."))
        elif isinstance(value, int) and not isinstance(value, bool):
            fields[prefix + name] = value
    return fields


def _fields_of(config, pairs) -> str:
    """'`name`=value in the config, x in the checkpoint' for the config's integer fields behind differing sizes
    `pairs` ((config's size, checkpoint's size), ...)."""
    fields = _int_fields(config)
    found = []
    for ours, theirs in pairs:
        names = [name for name, value in sorted(fields.items()) if value == ours and value > 1]
        found += [f"`{name}`={ours} in the config, {theirs} in the checkpoint" if theirs is not None
                  else f"`{name}`={ours}" for name in names]
    return "; ".join(dict.fromkeys(found))


@contextlib.contextmanager
def outside_zero_init():
    """DeepSpeed ZeRO-3 loads a model inside `deepspeed.zero.Init`, whose patches build every module on the CPU and
    partition it (the meta device is ignored, shapes read `[0]`): they are lifted while the check model is built."""
    partitioning = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    context = getattr(partitioning, "top_level_context", None)
    if context is None or not getattr(context, "patched", False):
        yield
        return
    context.unpatch_init_and_builtins()
    try:
        yield
    finally:
        context.patch_init_and_builtins()


def check_against_checkpoint(config, build_model, shapes, source, check_shapes=True, layers_checked=False):
    """Check `config` (a config, or a dict of constructor kwargs) against a checkpoint's {name: shape} (see the
    module docstring); `build_model(config)` builds the model class (it is called on the meta device, after the
    layer counts are checked, unless `layers_checked`). ValueError naming the field and the checkpoint's value.
    Returns the model built on the meta device (nothing allocated), for further checks."""
    if not layers_checked:
        check_layer_counts(config, shapes, source)
    with outside_zero_init(), torch.device("meta"):
        model = build_model(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    # buffers outside the state dict (e.g. precomputed RoPE tables) are allocated too: bounded with what is missing
    extra = {name: tuple(buffer.shape) for name, buffer in model.named_buffers() if name not in expected}
    prefix = getattr(model, "base_model_prefix", "") or ""

    def counterpart(name):  # the checkpoint may be saved with or without the base model's prefix
        for candidate in (name, f"{prefix}.{name}", name[len(prefix) + 1:] if name.startswith(prefix + ".") else None):
            if candidate in expected:
                return candidate
        return None

    matched = set()
    for name, shape in shapes.items():
        ours = counterpart(name)
        if ours is None:
            continue
        matched.add(ours)
        if check_shapes and expected[ours] != shape:
            differing = [(a, b) for a, b in zip(expected[ours], shape) if a != b]
            fields = _fields_of(config, differing or [(a, None) for a in expected[ours]])
            raise CheckpointMismatchError(
                f"The config does not match the checkpoint {source}: tensor `{name}` is {list(shape)} in the checkpoint "
                f"but {list(expected[ours])} from the config"
                f"{f' ({fields})' if fields else ''}; fix config.json to the checkpoint's sizes.")
    checkpoint_elements = sum(math.prod(shape) for shape in shapes.values())
    missing = {name: shape for name, shape in expected.items() if name not in matched} | extra
    missing_elements = sum(math.prod(shape) for shape in missing.values())
    if missing_elements > checkpoint_elements + MISSING_ALLOWANCE:
        largest = sorted(missing.items(), key=lambda item: -math.prod(item[1]))[:3]
        fields = _fields_of(config, [(d, None) for _, shape in largest for d in shape])
        raise ValueError(
            f"The config asks for {missing_elements:,} parameters that the checkpoint {source} does not hold (it holds "
            f"{checkpoint_elements:,} in all), e.g. " + ", ".join(f"`{n}` {list(s)}" for n, s in largest)
            + f"{f' ({fields})' if fields else ''}: the config does not match the checkpoint.")
    return model


def check_layer_count(field, value, shapes, pattern, source):
    """`value` (the config's `field`) must not exceed the distinct indices `pattern` (a regex with one group, the
    index) finds in the checkpoint's names."""
    held = {int(m.group(1)) for m in map(re.compile(pattern).search, shapes) if m}
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"`{field}` must be a non-negative integer, got {value!r}.")
    if value > len(held):
        raise ValueError(f"`{field}` is {value} in the config, but the checkpoint {source} holds {len(held)} layers: "
                         "the config does not match the checkpoint.")


__all__ = ["CheckpointMismatchError", "read_safetensors_header", "local_checkpoint_index", "check_layer_counts",
           "check_layer_count", "check_against_checkpoint"]
