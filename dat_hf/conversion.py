"""Conversion of the authors' `dual_attention` (0.0.7) models into dat_hf models with identical outputs.

`from_reference_model(module)` takes a live reference model and returns the matching dat_hf model (weights copied,
eval mode). Reads only module attributes and tensors; never unpickles anything. Not imported by the modeling files.

How the reference maps:
- Attention `wq, wk, wv, wo` -> `q_proj, k_proj, v_proj, o_proj`; RelationalAttention `wq_attn, wk_attn` ->
  `q_attn_proj, k_attn_proj`, `wq_rel, wk_rel` -> `q_rel_proj, k_rel_proj`, `wv` -> `symbol_proj` (W_s), `wr` ->
  `relation_proj` (W_r), `wo` -> `o_proj`.
- RoPE: the reference rotates interleaved pairs (x[2i], x[2i+1]); dat_hf uses Transformers' rotate-half pairs
  (x[i], x[i + d/2]). The rows of every RoPE'd query/key projection are permuted per head, which leaves every
  attention score unchanged.
- FeedForwardBlock `linear1, linear2, linear3` -> swiglu `gate_proj, down_proj, up_proj`; else `up_proj, down_proj`.
- activation 'gelu' (the reference's is tanh-approximated) -> `gelu_pytorch_tanh`.
- The LM's `bias` argument has no effect in the reference (its blocks always use FFN biases): `mlp_bias=True`.
"""

import importlib
import importlib.util
import inspect
import os
import tempfile
import warnings

import torch

REFERENCE_ACTIVATIONS = {"gelu": "gelu_pytorch_tanh", "relu": "relu", "swiglu": "swiglu", "silu": "silu",
                         "tanh": "tanh", "sigmoid": "sigmoid", "identity": "identity"}
REFERENCE_SYMBOLS = {"symbolic_attention": "symbolic_attention", "positional_symbols": "positional",
                     "position_relative": "position_relative"}


def _activation(name):
    if name not in REFERENCE_ACTIVATIONS:
        raise ValueError(f"Reference activation {name!r} has no dat_hf equivalent.")
    return REFERENCE_ACTIVATIONS[name]


def rope_permutation(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns interleaved-pair RoPE projections into rotate-half ones: per head [0, 2, ..., 1, 3, ...]."""
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return torch.cat([h * head_dim + within for h in range(num_heads)])


def _copy_linear(ours, ref, rows=None):
    weight, bias = ref.weight.detach(), None if ref.bias is None else ref.bias.detach()
    if rows is not None:
        weight = weight[rows]
        bias = None if bias is None else bias[rows]
    if (bias is None) != (ours.bias is None):
        raise ValueError(f"Bias mismatch converting {ref}: reference bias={ref.bias is not None}.")
    ours.weight.copy_(weight)
    if bias is not None:
        ours.bias.copy_(bias)


def _copy_norm(ours, ref):
    ours.weight.copy_(ref.weight.detach())
    if getattr(ref, "bias", None) is not None:
        ours.bias.copy_(ref.bias.detach())
    name = "variance_epsilon" if hasattr(ours, "variance_epsilon") else "eps"  # (an RMSNorm's, a LayerNorm's)
    setattr(ours, name, getattr(ref, "eps", getattr(ours, name)))


# ---- config ------------------------------------------------------------------------------------------------------
def dual_attention_kwargs(ref_dual_attn, pos_enc_rope: bool) -> dict:
    """DualAttentionConfig fields describing a reference `DualAttention` module."""
    sa = getattr(ref_dual_attn, "self_attention", None) if ref_dual_attn.use_self_attn else None
    ra = getattr(ref_dual_attn, "relational_attention", None) if ref_dual_attn.use_rel_attn else None
    if ref_dual_attn.ra_type != "relational_attention":
        raise ValueError(f"ra_type={ref_dual_attn.ra_type!r} is not supported (only 'relational_attention').")
    kwargs = dict(
        num_sensory_heads=ref_dual_attn.n_heads_sa,
        num_relational_heads=ref_dual_attn.n_heads_ra,
        share_attention_params=ref_dual_attn.share_attn_params,
        attention_dropout=ref_dual_attn.dropout,
    )
    bias_kv, bias_out = set(), set()
    for module in (sa, ra):
        if module is None:
            continue
        if module.key_dim != module.head_dim:
            raise ValueError(f"key_dim={module.key_dim} != head_dim={module.head_dim} is not supported.")
        bias_kv.add(module.add_bias_kv)
        bias_out.add(module.add_bias_out)
    if len(bias_kv) > 1 or len(bias_out) > 1:
        raise ValueError("Sensory and relational heads with different bias settings are not supported.")
    kwargs.update(attention_bias=bias_kv.pop(), attention_out_bias=bias_out.pop())
    if sa is not None:
        kwargs["num_sensory_key_value_heads"] = sa.n_kv_heads
    if ra is not None:
        kwargs.update(
            num_relational_key_value_heads=ra.n_kv_heads,
            num_relations=ra.n_relations,
            relation_dim=ra.rel_proj_dim,
            relation_activation=_activation(ra.rel_activation),
            symmetric_relations=ra.symmetric_rels,
        )
    return kwargs


def symbol_retriever_kwargs(ref_retrievers, n_layers: int, symbol_retrieval: str, ref_config: dict) -> dict:
    """DualAttentionConfig symbol fields from the reference's list of (possibly repeated) retrievers."""
    first = ref_retrievers[0]
    shared = all(r is first for r in ref_retrievers)
    kwargs = dict(symbol_retrieval=REFERENCE_SYMBOLS[symbol_retrieval], shared_symbol_retriever=shared,
                  tie_symbol_library=bool(ref_config.get("weight_tie_symbol_library", False)) and not shared)
    name = type(first).__name__
    if name == "SymbolicAttention":
        kwargs.update(num_symbols=first.n_symbols, symbolic_attention_heads=first.n_heads,
                      symbolic_attention_scale=first.scale, trainable_symbols=first.trainable_symbols,
                      symbol_dropout=first.dropout)
    elif name == "PositionalSymbolRetriever":
        kwargs.update(max_symbol_positions=first.max_length)
    elif name == "PositionRelativeSymbolRetriever":
        kwargs.update(max_relative_position=first.max_rel_pos)
    else:
        raise ValueError(f"Unsupported reference symbol retriever {name}.")
    return kwargs


# ---- weights -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def load_symbol_retrievers(ours, ref_retrievers):
    """Copy reference retriever weights into a dat_hf `SymbolRetrievers`."""
    refs = [ref_retrievers[0]] if ours.shared else list(ref_retrievers)
    for i, (mine, ref) in enumerate(zip(ours.retrievers, refs)):
        name = type(ref).__name__
        if name == "SymbolicAttention":
            _copy_linear(mine.q_proj, ref.q_proj)
            mine.template_features.copy_(ref.template_features.detach())
            if hasattr(mine, "symbol_library"):
                mine.symbol_library.copy_(ref.symbol_library.detach())
        elif name == "PositionalSymbolRetriever":
            if hasattr(mine, "symbol_library"):
                mine.symbol_library.copy_(ref.symbol_library.weight.detach())
        else:
            mine.rel_pos_embeddings.copy_(ref.rel_pos_enc.rel_pos_embeddings.detach())


@torch.no_grad()
def load_dual_attention(ours, ref, rope: bool):
    """Copy a reference `DualAttention` into a dat_hf `DualAttention` (RoPE rows permuted when `rope`)."""
    hd = ours.head_dim
    if ours.relational is not None:
        mine, theirs = ours.relational, ref.relational_attention
        q_rows = rope_permutation(mine.num_heads, hd) if rope else None
        k_rows = rope_permutation(mine.num_kv_heads, hd) if rope else None
        _copy_linear(mine.q_attn_proj, theirs.wq_attn, q_rows)
        _copy_linear(mine.k_attn_proj, theirs.wk_attn, k_rows)
        _copy_linear(mine.q_rel_proj, theirs.wq_rel)
        if hasattr(mine, "k_rel_proj"):
            _copy_linear(mine.k_rel_proj, theirs.wk_rel)
        _copy_linear(mine.symbol_proj, theirs.wv)
        mine.relation_proj.copy_(theirs.wr.detach())
        _copy_linear(mine.o_proj, theirs.wo)
    if ours.sensory is not None:
        mine, theirs = ours.sensory, ref.self_attention
        if hasattr(mine, "q_proj"):
            _copy_linear(mine.q_proj, theirs.wq, rope_permutation(mine.num_heads, hd) if rope else None)
            _copy_linear(mine.k_proj, theirs.wk, rope_permutation(mine.num_kv_heads, hd) if rope else None)
        _copy_linear(mine.v_proj, theirs.wv)
        _copy_linear(mine.o_proj, theirs.wo)


@torch.no_grad()
def load_feed_forward(ours, ref):
    if ours.gated:
        _copy_linear(ours.gate_proj, ref.linear1)
        _copy_linear(ours.up_proj, ref.linear3)
    else:
        _copy_linear(ours.up_proj, ref.linear1)
    _copy_linear(ours.down_proj, ref.linear2)


@torch.no_grad()
def load_encoder_block(ours, ref, rope: bool):
    """Copy a reference `DualAttnEncoderBlock` into a dat_hf `DATDecoderLayer`."""
    _copy_norm(ours.input_layernorm, ref.norm1)
    _copy_norm(ours.post_attention_layernorm, ref.norm2)
    load_dual_attention(ours.dual_attn, ref.dual_attn, rope)
    load_feed_forward(ours.mlp, ref.ff_block)


@torch.no_grad()
def load_transformer_block(ours, ref, rope: bool):
    """Copy a reference (sensory-only) `EncoderBlock` into a dat_hf `DATDecoderLayer` with 0 relational heads."""
    _copy_norm(ours.input_layernorm, ref.norm1)
    _copy_norm(ours.post_attention_layernorm, ref.norm2)
    mine, theirs = ours.dual_attn.sensory, ref.self_attn
    hd = ours.dual_attn.head_dim
    _copy_linear(mine.q_proj, theirs.wq, rope_permutation(mine.num_heads, hd) if rope else None)
    _copy_linear(mine.k_proj, theirs.wk, rope_permutation(mine.num_kv_heads, hd) if rope else None)
    _copy_linear(mine.v_proj, theirs.wv)
    _copy_linear(mine.o_proj, theirs.wo)
    load_feed_forward(ours.mlp, ref.ff_block)


def _norm_kwargs(ref_norm) -> dict:
    is_rms = type(ref_norm).__name__ == "RMSNorm"
    return dict(norm_type="rmsnorm" if is_rms else "layernorm", norm_eps=float(ref_norm.eps))


# ---- language models ---------------------------------------------------------------------------------------------
def language_model_config(ref, **overrides):
    """DATConfig for a reference `DualAttnTransformerLM` or `TransformerLM`."""
    from .configuration_dat import DATConfig

    rope = ref.pos_enc_type == "RoPE"
    kwargs = dict(
        vocab_size=ref.vocab_size, hidden_size=ref.d_model, num_hidden_layers=ref.n_layers,
        intermediate_size=ref.layers.blocks[0].ff_block.dff, hidden_act=_activation(ref.activation),
        pre_norm=ref.norm_first, max_position_embeddings=ref.block_size,
        position_embedding_type="rope" if rope else "learned", hidden_dropout=ref.dropout_rate,
        mlp_bias=ref.layers.blocks[0].ff_block.use_bias, tie_word_embeddings=True,
        **_norm_kwargs(ref.layers.norm),
    )
    if type(ref).__name__.startswith("TransformerLM"):
        attn = ref.layers.blocks[0].self_attn
        if attn.key_dim != attn.head_dim:
            raise ValueError(f"key_dim={attn.key_dim} != head_dim={attn.head_dim} is not supported.")
        kwargs.update(num_sensory_heads=ref.n_heads, num_relational_heads=0, num_sensory_key_value_heads=attn.n_kv_heads,
                      attention_bias=attn.add_bias_kv, attention_out_bias=attn.add_bias_out,
                      attention_dropout=ref.dropout_rate)
    else:
        kwargs.update(dual_attention_kwargs(ref.layers.blocks[0].dual_attn, rope))
        if ref.n_heads_ra > 0:
            kwargs.update(symbol_retriever_kwargs(ref.layers.symbol_retrievers, ref.n_layers, ref.symbol_retriever,
                                                  ref.symbol_retriever_config))
    kwargs.update(overrides)
    return DATConfig(**kwargs)


@torch.no_grad()
def convert_language_model(ref, **overrides):
    """A dat_hf `DATForCausalLM` with the weights of a reference `DualAttnTransformerLM` / `TransformerLM`."""
    from .modeling_dat import DATForCausalLM

    config = language_model_config(ref, **overrides)
    model = DATForCausalLM(config)
    rope = config.position_embedding_type == "rope"
    model.model.embed_tokens.weight.copy_(ref.layers.token_embedder.weight.detach())
    model.lm_head.weight.copy_(ref.layers.final_out.weight.detach())
    if not rope:
        model.model.embed_positions.weight.copy_(ref.layers.positional_embedder.weight.detach())
    is_dat = not type(ref).__name__.startswith("TransformerLM")
    for ours, theirs in zip(model.model.layers, ref.layers.blocks):
        (load_encoder_block if is_dat else load_transformer_block)(ours, theirs, rope)
    if is_dat and config.num_relational_heads > 0:
        load_symbol_retrievers(model.model.symbol_retrievers, ref.layers.symbol_retrievers)
    _copy_norm(model.model.norm, ref.layers.norm)
    return model.eval()


# Reference class name -> converter. The vision and seq2seq families add theirs in their own modules.
CONVERTERS = {
    "DualAttnTransformerLM": convert_language_model,
    "DualAttnTransformerLM_HFHub": convert_language_model,
    "TransformerLM": convert_language_model,
    "TransformerLM_HFHub": convert_language_model,
}


def _lazy_converters():
    converters = dict(CONVERTERS)
    for name in ("conversion_vision", "conversion_seq2seq"):
        if importlib.util.find_spec(f"{__package__}.{name}") is not None:
            converters.update(importlib.import_module(f".{name}", __package__).CONVERTERS)
    return converters


def from_reference_model(module, **config_overrides):
    """Convert a live `dual_attention` model instance into the matching dat_hf model with identical outputs."""
    converters = _lazy_converters()
    for cls in type(module).__mro__:
        if cls.__name__ in converters:
            return converters[cls.__name__](module, **config_overrides)
    raise ValueError(
        f"No dat_hf conversion for {type(module).__name__}; supported: {sorted(converters)}."
    )


# ---- the authors' Hub format ----------------------------------------------------------------------------------------
# `dual_attention.hf.DualAttnTransformerLM_HFHub` / `TransformerLM_HFHub` (huggingface_hub's PyTorchModelHubMixin)
# write `config.json` = the constructor kwargs (no `model_type`) and `model.safetensors` (tied names dropped, each
# recorded in the metadata as `{dropped: kept}`). Only the language models have a Hub mixin in 0.0.7.
# the keys that tell the authors' config.json apart (any one of the DAT's, with `d_model`; all of the Transformer's);
# the others may be missing or wrong: `conversion_config` then names them
AUTHORS_LM_KEYS = {"DualAttnTransformerLM": ("n_heads_sa", "n_heads_ra", "symbol_retrieval_kwargs"),
                   "TransformerLM": ("n_heads", "max_block_size")}
AUTHORS_WEIGHTS_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class AuthorsCheckpointWarning(UserWarning):
    """Issued once per folder when a checkpoint in the authors' format is converted on load."""


def authors_lm_class_name(config_dict) -> str | None:
    """`"DualAttnTransformerLM"` or `"TransformerLM"` when `config_dict` holds the constructor kwargs of one of the
    authors' language models (their Hub `config.json`: no `model_type`, `d_model` and the keys of AUTHORS_LM_KEYS),
    else None."""
    if not isinstance(config_dict, dict) or "model_type" in config_dict or "d_model" not in config_dict:
        return None
    dat, transformer = AUTHORS_LM_KEYS.values()
    if any(key in config_dict for key in dat):
        return "DualAttnTransformerLM"
    return "TransformerLM" if all(key in config_dict for key in transformer) else None


def _reference_lm_class(name: str):
    try:
        module = importlib.import_module("dual_attention.language_models")
    except ImportError as error:
        raise ImportError(
            f"This checkpoint is in the authors' `dual-attention` format ({name}); converting it needs their package "
            "for the model definition: `pip install dual-attention==0.0.7 einops` (or `pip install 'dat_hf[authors]'`)."
        ) from error
    return getattr(module, name)


MAX_CONFIG_BYTES = 1 << 20  # the authors' config.json is a few hundred bytes


def read_authors_config(config_file):
    """The JSON of the authors' `config.json`; a ValueError naming the file when it is not a regular file, is larger
    than `MAX_CONFIG_BYTES` or is not JSON (nested too deeply included)."""
    import json

    if not os.path.isfile(config_file):  # a FIFO or a device would block or never end
        raise ValueError(f"{config_file} is not a regular file.")
    size = os.path.getsize(config_file)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{config_file} has {size:,} bytes; the authors' config.json is a few hundred.")
    try:
        with open(config_file, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{config_file} is not readable JSON ({type(error).__name__}: {error}).") from None


def authors_weights_file(folder) -> str:
    """`<folder>/model.safetensors`; a folder with only pickled weights is refused without opening them."""
    path = os.path.join(folder, AUTHORS_WEIGHTS_NAME)
    if os.path.isfile(path):
        return path
    pickles = sorted(f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES)) if os.path.isdir(folder) else []
    found = (f"; it has {pickles}, pickled weights, which are never loaded (unpickling can run arbitrary code)"
             if pickles else "")
    raise ValueError(f"{folder} has no {AUTHORS_WEIGHTS_NAME}{found}: only safetensors checkpoints are converted.")


def check_authors_weights(skeleton, weights_path: str) -> torch.dtype:
    """Compare the names and shapes in the safetensors header of `weights_path` with the state dict of `skeleton` (a
    reference model built on the meta device: nothing allocated); raise on any difference. Returns the stored
    floating dtype. Reads the header only (`safe_open` maps the file; no tensor is materialised)."""
    from safetensors import safe_open

    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    try:
        with safe_open(weights_path, framework="pt") as f:
            metadata = f.metadata() or {}
            stored = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
    except Exception as error:  # safetensors raises its own SafetensorError on a malformed header
        raise ValueError(f"{weights_path} is not a readable safetensors file: {error}") from error
    for dropped, kept in metadata.items():  # names safetensors dropped as copies of a tied tensor
        if kept in stored and dropped not in stored:
            stored[dropped] = stored[kept]
    missing = sorted(expected.keys() - stored.keys())
    unexpected = sorted(stored.keys() - expected.keys())
    wrong = [f"{name}: {stored[name][0]} stored, {expected[name]} expected"
             for name in sorted(expected.keys() & stored.keys()) if stored[name][0] != expected[name]]
    if missing or unexpected or wrong:
        problems = [f"missing {missing}" if missing else "", f"unexpected {unexpected}" if unexpected else "",
                    f"wrong shapes {wrong}" if wrong else ""]
        raise ValueError(f"{weights_path} does not match the {type(skeleton).__name__} its config.json describes: "
                         + "; ".join(p for p in problems if p) + ".")
    dtypes = {dtype for _, dtype in stored.values()}
    unknown = dtypes - SAFETENSORS_DTYPES.keys()
    if unknown:
        raise ValueError(f"{weights_path} stores tensors of dtype {sorted(unknown)}; expected floating point weights.")
    return SAFETENSORS_DTYPES["F32" if len(dtypes) != 1 else dtypes.pop()]


def load_authors_checkpoint(folder, weights_path: str | None = None, dtype=None, **config_overrides):
    """The dat_hf `DATForCausalLM` of a folder in the authors' Hub format, converted in memory with
    `from_reference_model` (identical outputs). Safetensors only; names and shapes are checked against the file's
    header before any weight is allocated. `dtype`: None/"auto" keeps the stored dtype."""
    from safetensors.torch import load_model

    from .checkpoint_bounds import check_against_checkpoint, check_layer_count, read_safetensors_header

    from .conversion_config import check_authors_config

    config_file = os.path.join(folder, "config.json")
    kwargs = read_authors_config(config_file)
    name = authors_lm_class_name(kwargs)
    if name is None:
        raise ValueError(f"{config_file} is not the authors' language-model format (constructor kwargs of "
                         "DualAttnTransformerLM or TransformerLM, with `d_model` and their heads).")
    check_authors_config(kwargs, name, config_file)  # every field, before anything (even on meta) is built
    weights_path = weights_path or authors_weights_file(folder)
    reference_cls = _reference_lm_class(name)
    # the untrusted config is bounded by the checkpoint's header (no tensor read): the layer count before even a meta
    # model is built, then each shape (naming the config field) and what the checkpoint lacks (buffers such as RoPE
    # tables), then the names, tied names and dtypes
    shapes = read_safetensors_header(weights_path)
    check_layer_count("n_layers", kwargs.get("n_layers"), shapes, r"(?:^|\.)blocks\.(\d+)\.", weights_path)
    try:
        skeleton = check_against_checkpoint(kwargs, lambda config: reference_cls(**config), shapes, weights_path,
                                            layers_checked=True)
    except TypeError as error:
        raise ValueError(f"{folder}/config.json does not build a {name}: {error}") from error
    stored_dtype = check_authors_weights(skeleton, weights_path)
    del skeleton
    reference = reference_cls(**kwargs)
    load_model(reference, weights_path, strict=True)  # resolves the tied names from the metadata
    model = from_reference_model(reference.eval(), **config_overrides)
    del reference
    dtype = stored_dtype if dtype in (None, "auto") else getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return model.to(dtype)


def convert_checkpoint_folder(input_dir, output_dir, dtype=None):
    """Convert a folder in the authors' Hub format into a dat_hf folder (`load_authors_checkpoint`, then
    `save_pretrained`)."""
    model = load_authors_checkpoint(input_dir, dtype=dtype)
    model.save_pretrained(output_dir)
    return model


# `from_pretrained` arguments that find the authors' files (then not passed on: the converted folder is local), and
# those that name files the authors' format does not have
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
_FILE_KWARGS = {"variant": "its one weights file is model.safetensors", "gguf_file": "its weights are safetensors"}


def _authors_files(name_or_path, hub_kwargs):
    """(folder, config_dict, weights_path or None) when `name_or_path` (folder or Hub id) holds the authors' format,
    else None. A Hub id that cannot be resolved is left to Transformers (its own error)."""
    if not isinstance(name_or_path, (str, os.PathLike)):  # e.g. None with a `state_dict`
        return None
    subfolder = hub_kwargs.get("subfolder") or ""
    if os.path.isdir(name_or_path):
        folder = os.path.join(name_or_path, subfolder)
        config_file = os.path.join(folder, "config.json")
        if not os.path.isfile(config_file):
            return None
    else:
        from transformers.utils import cached_file

        try:
            config_file = cached_file(str(name_or_path), "config.json", **hub_kwargs)
        except Exception:  # not resolvable here: Transformers raises its own error for it
            return None
        if config_file is None:
            return None
        folder = os.path.dirname(config_file)
    try:
        config_dict = read_authors_config(config_file)
    except (OSError, ValueError):
        return None
    if authors_lm_class_name(config_dict) is None:
        return None
    weights = None
    if not os.path.isdir(name_or_path):  # a Hub id: fetch the weights into the cache (safetensors only)
        from transformers.utils import cached_file

        weights = cached_file(str(name_or_path), AUTHORS_WEIGHTS_NAME, **hub_kwargs,
                              _raise_exceptions_for_missing_entries=False)
        if weights is None:
            raise ValueError(f"{name_or_path} is in the authors' format but has no {AUTHORS_WEIGHTS_NAME}: only "
                             "safetensors checkpoints are converted (pickled weights are never loaded).")
    return folder, config_dict, weights


def register_authors_format():
    """Make `AutoModelForCausalLM.from_pretrained` load the authors' Hub format (checked and converted in memory,
    with an `AuthorsCheckpointWarning`), then load the result as a dat_hf folder with the caller's arguments
    (`device_map`, `dtype`, `attn_implementation`, config fields, ...: each works, or is refused, as for a dat_hf
    folder); everything else goes to Transformers unchanged. Called by `import dat_hf`. Transformers has no hook for
    config files without `model_type`, so the Auto class's method is wrapped."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    original = AutoModelForCausalLM.from_pretrained.__func__
    if getattr(original, "_dat_hf_authors_format", False):
        return

    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        found = _authors_files(pretrained_model_name_or_path, {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
        if found is None:
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        for name, why in _FILE_KWARGS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{pretrained_model_name_or_path} is in the authors' dual-attention format, which "
                                 f"has no `{name}` ({name}={kwargs[name]!r}): {why}.")
        folder, _, weights = found
        model = load_authors_checkpoint(folder, weights_path=weights)  # checked, converted in memory, stored dtype
        # every other argument (device_map, dtype, attn_implementation, config fields, ...) is Transformers' own:
        # the converted model goes through a temporary dat_hf folder and Transformers' loading of it
        kwargs = {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS}
        if "disable_mmap" in inspect.signature(PreTrainedModel.from_pretrained).parameters:
            kwargs.setdefault("disable_mmap", True)  # read, not mapped: the weights outlive their deleted file
        with tempfile.TemporaryDirectory(prefix="dat_hf-converted-", ignore_cleanup_errors=True) as converted:
            model.save_pretrained(converted)
            del model
            try:
                result = original(cls, converted, *model_args, **kwargs)
            except Exception as error:
                error.add_note(f"(loading {pretrained_model_name_or_path}, in the authors' dual-attention format, "
                               "converted into a temporary dat_hf folder)")
                raise
        loaded = result[0] if isinstance(result, tuple) else result  # (model, loading info) with output_loading_info
        loaded.config.name_or_path = loaded.name_or_path = str(pretrained_model_name_or_path)
        warnings.warn(
            f"{pretrained_model_name_or_path}: converted on load from the authors' dual-attention format "
            f"({type(loaded).__name__}, identical outputs); `model.save_pretrained(folder)` writes dat_hf's format, "
            "which loads without converting.",
            AuthorsCheckpointWarning,
            stacklevel=2,
        )
        return result

    from_pretrained._dat_hf_authors_format = True
    from_pretrained.__doc__ = original.__doc__
    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)


__all__ = ["from_reference_model", "convert_checkpoint_folder", "convert_language_model", "language_model_config",
           "rope_permutation", "load_dual_attention", "load_encoder_block", "load_transformer_block",
           "load_feed_forward", "load_symbol_retrievers", "dual_attention_kwargs", "symbol_retriever_kwargs",
           "CONVERTERS", "AuthorsCheckpointWarning", "authors_lm_class_name", "check_authors_weights",
           "load_authors_checkpoint", "register_authors_format"]
