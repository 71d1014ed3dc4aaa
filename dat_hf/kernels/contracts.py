"""What each op that takes over a whole step computes, as data, and whether it may run a given module, decided once.

An op of `OPS` computes one fixed function of the module it takes over. Two tables say which:

- `FIELDS` classifies every field of every DAT config for every op: `COVERED` (the op computes any value: it reads
  the value from the modules' shapes or its inputs), `OUTSIDE` (the field never reaches the op's module: ids,
  embeddings, the head, initialization), `PER_CALL` (it reaches the op through each call's inputs, which the op checks
  there: the plan's masks and backends, dropout in train mode), or `Requires(takes, why)` (the op runs only for the
  values `takes` accepts). A field missing from the table fails `tests/test_contracts.py`, naming it.
- `MODULE_TYPES` lists, per op, the exact module types it may find inside the module it takes over (a subclass, PEFT's
  wrappers or a quantized linear are other types, which the op declines).

`spec(op, module)` decides once whether `op` may run `module` (`Spec.declines`: None, or why not): from `FIELDS` over
the config the module was built with (`module.config`, as Transformers' modules keep it), `MODULE_TYPES` over its
modules, their parameters (each one the op reads, `READS`: a bias or an adapter it does not read is a module it does
not compute; plain contiguous tensors, no tensor subclass) and hooks (none besides Transformers' output
recorders, which act only while outputs are recorded, when the ops decline per call). The decision is made again
after any module, parameter or buffer is registered anywhere (torch's global registration hooks: PEFT wrapping a
projection, a quantized or sharded weight, a replaced submodule) and when a hook or an instance `forward` comes or goes
on a module it reads (`Spec.current`, per call: the hooks' keys). Per call an op checks only dtype, device, shapes,
grad and train mode, and the plan and cache it is handed.

Writing a module's submodules straight into `_modules` (as some quantizers do while loading, before any forward)
bypasses torch's hooks: call `refresh()` after such a change made to a model that has already run.
"""

import itertools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.activations import SiLUActivation

from ..dual_attention import DualAttention, RelationalAttention, SensoryAttention
from ..modeling_dat import DATMLP, DATDecoderLayer, DATRMSNorm
from ..symbol_retrieval import SymbolicAttention

# the ops, each with the function that runs it (`dat_hf/kernels/cpu.py`)
OPS = {
    "layer_step": "a pre-norm decoder layer's decoding step: norms, dual attention, residuals, SwiGLU MLP "
                  "(`cpu.cpu_layer_step`)",
    "dual_attention_step": "a dual attention's decoding step: projections, RoPE, symbol values, the cache write, "
                           "both head types, output projections (`cpu.cpu_decoding_step`)",
    "symbolic_attention": "symbolic attention over a few rows (`cpu.cpu_symbolic_attention`)",
    "sensory_rows": "the sensory heads over a few receivers with a bool mask (`cpu.cpu_sdpa_rows`)",
    "cpu_relational": "the relational heads' `cpu` backend (`cpu.cpu_relational_attention`)",
}
STEPS = ("layer_step", "dual_attention_step")


class Requires(NamedTuple):
    """The op runs only where `takes(value)`; `why` says what it computes instead."""

    takes: Callable[[object], bool]
    why: str


COVERED, OUTSIDE, PER_CALL = "covered", "outside", "per call"


def _only(value, why: str) -> Requires:
    return Requires(lambda given: given == value, why)


def _for(ops, rule) -> dict:
    return dict.fromkeys(ops, rule)


_BOTH_HEAD_TYPES = Requires(lambda heads: heads > 0, "it computes sensory and relational heads together")
_IDENTITY = _only("identity", "it computes identity relations")
_SYMBOLS_PER_SENDER = Requires(lambda retrieval: retrieval != "position_relative",
                               "it reads one symbol per sender (not position-relative symbols)")
_BIAS_FREE_INPUTS = _only(False, "its input projections have no bias")

# field -> one classification for every op, or {op: rule} (the ops not named cover the field)
FIELDS: dict[str, object] = {
    # ---- DualAttentionConfig
    "hidden_size": COVERED,
    "num_hidden_layers": OUTSIDE,
    "num_sensory_heads": _for(STEPS, _BOTH_HEAD_TYPES),
    "num_relational_heads": _for(STEPS, _BOTH_HEAD_TYPES),
    "num_sensory_key_value_heads": COVERED,
    "num_relational_key_value_heads": COVERED,
    "num_relations": COVERED,
    "relation_dim": COVERED,
    "relation_activation": _for((*STEPS, "cpu_relational"), _IDENTITY),
    "symmetric_relations": COVERED,  # (the ops take the flag)
    "share_attention_params": _for(STEPS, _only(False, "it reads the sensory heads' own query and key projections")),
    "symbol_retrieval": _for((*STEPS, "cpu_relational"), _SYMBOLS_PER_SENDER),
    "num_symbols": COVERED,
    "symbolic_attention_heads": COVERED,
    "symbolic_attention_scale": COVERED,
    "trainable_symbols": COVERED,  # (gradients: the ops run without them, checked per call)
    "max_relative_position": OUTSIDE,  # (read by position-relative symbols only, which the ops decline)
    "max_symbol_positions": OUTSIDE,  # (positional symbols come to the ops as inputs)
    "shared_symbol_retriever": OUTSIDE,  # (the symbols come to the ops as inputs)
    "tie_symbol_library": COVERED,  # (symbolic attention takes the library it is handed)
    "intermediate_size": COVERED,
    "hidden_act": {"layer_step": _only("swiglu", "it computes a SwiGLU MLP")},
    "norm_type": {"layer_step": _only("rmsnorm", "it computes RMSNorms")},
    "norm_eps": COVERED,
    "pre_norm": {"layer_step": _only(True, "it computes a pre-norm layer")},
    "position_embedding_type": COVERED,  # (RoPE's cos and sin are inputs; learned positions are added before)
    "rope_theta": COVERED,
    "max_position_embeddings": OUTSIDE,
    "relational_bias": PER_CALL,  # (the plan's masks: implicit for the steps, bool for the rows and the backend)
    "relational_heads_bias": PER_CALL,
    "sliding_window_size": PER_CALL,
    "sparse_block_size": PER_CALL,
    "sparse_global_tokens": PER_CALL,
    "sparse_edges": PER_CALL,
    "attention_dropout": PER_CALL,  # (dropout: the ops decline it in train mode)
    "hidden_dropout": PER_CALL,
    "embedding_dropout": OUTSIDE,
    "symbol_dropout": PER_CALL,
    "attention_bias": _for(STEPS, _BIAS_FREE_INPUTS),
    "attention_out_bias": COVERED,
    "mlp_bias": {"layer_step": _only(False, "its MLP has no bias")},
    "initializer_range": OUTSIDE,
    "relational_attn_implementation": PER_CALL,  # (the plan's backends: `sdpa` and `cpu` for the steps)
    # ---- the families' configs
    "vocab_size": OUTSIDE,
    "tie_word_embeddings": OUTSIDE,
    "use_cache": OUTSIDE,
    "pad_token_id": OUTSIDE,
    "bos_token_id": OUTSIDE,
    "eos_token_id": OUTSIDE,
    "decoder_start_token_id": OUTSIDE,
    "num_node_features": OUTSIDE,
    "classifier_dropout": OUTSIDE,
    "image_size": OUTSIDE,
    "patch_size": OUTSIDE,
    "num_channels": OUTSIDE,
    "pooling": OUTSIDE,
    "patch_norm": OUTSIDE,
    "final_norm": OUTSIDE,
    "relative_symbols_2d": OUTSIDE,  # (position-relative symbols only, which the ops decline)
    "encoder_layers": OUTSIDE,
    "encoder_vocab_size": OUTSIDE,
    "share_embeddings": OUTSIDE,
    "encoder_relational_bias": PER_CALL,
    "encoder_position_embedding_type": COVERED,
    "encoder_max_position_embeddings": OUTSIDE,
    # (cross-attention: the seq2seq decoder layer's own module, which no op takes over)
    "cross_attention": OUTSIDE,
    "num_cross_attention_heads": OUTSIDE,
    "num_cross_relational_heads": OUTSIDE,
    "num_cross_attention_key_value_heads": OUTSIDE,
    "cross_attention_bias": OUTSIDE,
    "cross_attention_out_bias": OUTSIDE,
    "lm_head_bias": OUTSIDE,
    # ---- Transformers' `PreTrainedConfig`
    "transformers_version": OUTSIDE,
    "architectures": OUTSIDE,
    "output_hidden_states": PER_CALL,  # (recorded by hooks on the layers, which fire around the ops)
    "return_dict": OUTSIDE,
    "dtype": PER_CALL,  # (the ops run float32, checked per call)
    "chunk_size_feed_forward": OUTSIDE,  # (not read by DAT)
    "is_encoder_decoder": OUTSIDE,
    "id2label": OUTSIDE,
    "label2id": OUTSIDE,
    "problem_type": OUTSIDE,
}

# op -> the exact module types it may find in the module it takes over (None: it reads no module's state, only its
# inputs)
MODULE_TYPES: dict[str, tuple | None] = {
    "layer_step": (DATDecoderLayer, DualAttention, SensoryAttention, RelationalAttention, DATMLP, DATRMSNorm,
                   nn.Linear, nn.Dropout, SiLUActivation),
    "dual_attention_step": (DualAttention, SensoryAttention, RelationalAttention, nn.Linear),
    "symbolic_attention": (SymbolicAttention, nn.Linear),
    "sensory_rows": None,
    "cpu_relational": None,
}

# op -> `reads(module)`: the parameters the op reads of the module it takes over, registered with the op; a module
# holding a parameter or buffer the op does not read is one it does not compute
READS: dict[str, Callable[[nn.Module], list]] = {}

# the modules an op takes over, by type (what `spec` is asked about)
ROOTS = {"layer_step": DATDecoderLayer, "dual_attention_step": DualAttention, "symbolic_attention": SymbolicAttention}


def rule(field: str, op: str):
    """`FIELDS`' classification of `field` for `op` (KeyError for a field the table does not classify)."""
    entry = FIELDS[field]
    return entry.get(op, COVERED) if isinstance(entry, dict) else entry


def declined_fields(op: str, config) -> str | None:
    """Why `op` cannot compute a module built with `config` (the first field whose value it declines), or None."""
    return declined_values(op, {field: getattr(config, field) for field in FIELDS if hasattr(config, field)})


def declined_values(op: str, values: dict) -> str | None:
    """As `declined_fields`, over `{field: value}` (the fields `values` holds)."""
    for field, value in values.items():
        entry = FIELDS[field]
        requires = entry.get(op) if isinstance(entry, dict) else None
        if isinstance(requires, Requires) and not requires.takes(value):
            return f"`{field}={value!r}`: {requires.why}"
    return None


# ---- a module's spec, decided once -------------------------------------------------------------------------------
_VERSION = [0]  # bumped whenever a module, parameter or buffer is registered anywhere


def _bump(*args):
    _VERSION[0] += 1


def refresh() -> None:
    """Decide every spec again at its next use (after a change torch's registration hooks do not see)."""
    _bump()


torch.nn.modules.module.register_module_module_registration_hook(_bump)
torch.nn.modules.module.register_module_parameter_registration_hook(_bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump)


class Spec(NamedTuple):
    """Whether an op may run one module. `declines`: None or why not; `probe`: a parameter whose dtype and device the
    op checks per call (its inputs'); `hook_dicts`, `instance_dicts`: where a hook or an instance `forward` of a module
    it reads would appear; `stamp`: what they held when it was decided."""

    declines: str | None
    probe: torch.Tensor | None
    hook_dicts: tuple
    instance_dicts: tuple
    stamp: tuple
    version: int

    def current(self) -> bool:
        """Whether nothing it was decided from changed (per call: a version and the hooks' keys)."""
        return self.version == _VERSION[0] and self.stamp == _stamp(self.hook_dicts, self.instance_dicts)


def _stamp(hook_dicts, instance_dicts) -> tuple:
    return (*itertools.chain.from_iterable(hook_dicts), *["forward" in d for d in instance_dicts])


def _is_output_recorder(hook) -> bool:
    """Transformers' output-capturing hook (`capture_outputs`): inactive unless outputs are recorded."""
    return getattr(hook, "__qualname__", "").endswith("output_capturing_hook")


_PLAIN = (nn.Parameter, torch.Tensor)


def _decide(op: str, module: nn.Module) -> Spec:
    modules = [m for m in module.modules() if m is not module]  # (the module's own hooks fire around the op)
    hook_dicts = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))
    instance_dicts = tuple(m.__dict__ for m in modules)
    declines, probe = _declines(op, module, modules), None
    if declines is None:
        probe = next(module.parameters(), None)
    return Spec(declines, probe, hook_dicts, instance_dicts, _stamp(hook_dicts, instance_dicts), _VERSION[0])


def _declines(op: str, module: nn.Module, modules: list) -> str | None:
    if type(module) is not ROOTS[op]:
        return f"it takes over a {ROOTS[op].__name__}, not a {type(module).__name__}"
    config = getattr(module, "config", None)
    if config is None:
        return "the module keeps no config"
    why = declined_fields(op, config)
    if why is not None:
        return why
    known = MODULE_TYPES[op]
    for m in (module, *modules):
        if type(m) not in known:
            return f"it does not compute a {type(m).__name__} ({', '.join(t.__name__ for t in known)} only)"
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()] if m is not module else []
        if any(not _is_output_recorder(hook) for hook in hooks) or (m is not module and "forward" in m.__dict__):
            return f"a {type(m).__name__} inside has a hook or its own `forward`"
    read = {id(tensor) for tensor in READS[op](module)}
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if id(tensor) not in read:
            return f"it does not read `{name}`"
        if type(tensor) not in _PLAIN or not tensor.is_contiguous():
            return f"`{name}` is not a plain contiguous tensor ({type(tensor).__name__})"
    return None


_SPECS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def spec(op: str, module: nn.Module) -> Spec:
    """`op`'s spec of `module`, decided when first asked and again after what it was decided from changed."""
    specs = _SPECS.get(module)
    if specs is None:
        specs = _SPECS[module] = {}
    found = specs.get(op)
    if found is None or not found.current():
        found = specs[op] = _decide(op, module)
    return found


def runs(op: str, module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `op` may run `module` on `x`: its spec takes the module, and `x` is float32 on CPU like the module's
    parameters."""
    found = spec(op, module)
    if found.declines is not None:
        return False
    probe = found.probe
    return x.dtype == torch.float32 and x.is_cpu and (probe is None or (probe.dtype == torch.float32 and probe.is_cpu))


__all__ = ["COVERED", "FIELDS", "MODULE_TYPES", "OPS", "OUTSIDE", "PER_CALL", "Requires", "Spec", "declined_fields",
           "declined_values", "READS", "refresh", "rule", "runs", "spec"]
