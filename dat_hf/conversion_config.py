"""The authors' `config.json` (constructor kwargs of `dual_attention`'s language models), checked field by field
before anything is built.

`check_authors_config(kwargs, class_name, source)` raises a ValueError naming the file and the field (nested ones as
`ra_kwargs.n_kv_heads`) for every value the authors' constructors or the conversion would choke on: a missing or
unknown field, a wrong type (`true` is not an integer), a sign, a choice outside what converts, a dropout outside
[0, 1), a NaN or infinite float, and the sizes that must divide each other. Without it, `n_heads_sa=-2` raised a
`ZeroDivisionError` and `n_heads_sa=true` a bare `AssertionError` from inside `dual_attention`.

Two tables: `FIELDS` (each field's own rule, per class; nested dicts have their own tables) and `CONSTRAINTS` (rules
across fields, checked in order once every field is valid). The rules raise the messages of dat_hf's own configs
(`configuration_dat`).
"""

import math
from types import SimpleNamespace

from .configuration_dat import _check_choice, _check_positive, _check_probability


# ---- field rules: rule(name, value) raises ValueError("`name` must be ..., got ...") -------------------------------
def _optional_positive(name, value):
    _check_positive(name, value, allow_none=True)


def _count(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")


def _boolean(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be true or false, got {value!r}.")


def _optional_scale(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ValueError(f"`{name}` must be null or a finite number > 0, got {value!r}.")


def _choice(*choices):
    return lambda name, value: _check_choice(name, value, choices)


def _object(name, value):
    if not isinstance(value, dict):
        raise ValueError(f"`{name}` must be an object (a dict), got {value!r}.")


def _nested(fields):
    """Null, or a dict checked with its own table of fields."""
    def rule(name, value):
        if value is not None:
            _object(name, value)
            _check_fields(value, fields, f"{name}.")
    return rule


REQUIRED = "required"  # a field's second column: it has no default in the authors' constructor

# what converts (dat_hf has no equivalent of the rest): the reference's FeedForwardBlock activations but softmax and
# identity, its relation activations but softmax (which leaks the future in a causal LM)
ACTIVATIONS = ("swiglu", "gelu", "relu", "silu", "tanh", "sigmoid")
RELATION_ACTIVATIONS = ("identity", "relu", "gelu", "silu", "tanh", "sigmoid")
SYMBOL_RETRIEVALS = ("symbolic_attention", "positional_symbols", "position_relative")

SA_KWARGS = {"n_kv_heads": (_optional_positive,), "key_dim": (_optional_positive,), "add_bias_kv": (_boolean,),
             "add_bias_out": (_boolean,)}
RA_KWARGS = {**SA_KWARGS, "n_relations": (_optional_positive,), "rel_proj_dim": (_optional_positive,),
             "rel_activation": (_choice(*RELATION_ACTIVATIONS),), "symmetric_rels": (_boolean,),
             "use_relative_positional_symbols": (_boolean,)}
SYMBOL_KWARGS = {  # symbol_retrieval -> the fields of its retriever's constructor
    "symbolic_attention": {"d_model": (_check_positive, REQUIRED), "n_heads": (_check_positive, REQUIRED),
                           "n_symbols": (_check_positive, REQUIRED), "dropout": (_check_probability,),
                           "scale": (_optional_scale,), "trainable_symbols": (_boolean,)},
    "positional_symbols": {"symbol_dim": (_check_positive, REQUIRED), "max_length": (_check_positive, REQUIRED),
                           "sinusoidal": (_boolean,)},
    "position_relative": {"symbol_dim": (_check_positive, REQUIRED), "max_rel_pos": (_check_positive, REQUIRED)},
}
COMMON = {
    "vocab_size": (_check_positive, REQUIRED), "d_model": (_check_positive, REQUIRED), "n_layers": (_check_positive, REQUIRED),
    "dff": (_optional_positive, REQUIRED), "dropout_rate": (_check_probability, REQUIRED),
    "activation": (_choice(*ACTIVATIONS), REQUIRED), "norm_first": (_boolean, REQUIRED),
    "max_block_size": (_check_positive, REQUIRED), "norm_type": (_choice("layernorm", "rmsnorm"),),
    "pos_enc_type": (_choice("pos_emb", "RoPE"),), "bias": (_boolean,),
}
FIELDS = {
    "DualAttnTransformerLM": {
        **COMMON, "n_heads_sa": (_count, REQUIRED), "n_heads_ra": (_count, REQUIRED),
        "symbol_retrieval": (_choice(*SYMBOL_RETRIEVALS),),
        # its fields depend on `symbol_retrieval`: checked with SYMBOL_KWARGS once that is known
        "symbol_retrieval_kwargs": (_object, REQUIRED),
        "symbol_retriever_config": (_nested({"shared_symbol_retriever": (_boolean,),
                                             "weight_tie_symbol_library": (_boolean,)}),),
        "sa_kwargs": (_nested(SA_KWARGS),), "ra_kwargs": (_nested(RA_KWARGS),),
        "ra_type": (_choice("relational_attention"),), "share_attn_params": (_boolean,),
    },
    "TransformerLM": {
        **COMMON, "n_heads": (_check_positive, REQUIRED), "use_flash_attention": (_boolean,),
        "block_kwargs": (_nested({"attn_kwargs": (_nested({k: SA_KWARGS[k] for k in ("n_kv_heads", "key_dim",
                                                                                     "add_bias_kv")}),)}),),
    },
}


def _check_fields(values: dict, fields: dict, prefix: str = ""):
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {[prefix + k for k in unknown]} "
                         f"(the known ones: {[prefix + k for k in fields]}).")
    for name, (rule, *required) in fields.items():
        if name not in values:
            if required:
                raise ValueError(f"`{prefix}{name}` is missing (it has no default).")
            continue
        rule(prefix + name, values[name])


# ---- rules across fields: (class names, what must hold of the resolved fields `c`, the message) --------------------
def _divides(small, big):
    """`small` (None: not set) divides `big` (0: no such heads)."""
    return small is None or big == 0 or big % small == 0


DAT, BOTH = ("DualAttnTransformerLM",), ("DualAttnTransformerLM", "TransformerLM")
CONSTRAINTS = [
    (DAT, lambda c: c.heads > 0, "`n_heads_sa` + `n_heads_ra` must be at least 1 (both are 0)"),
    (BOTH, lambda c: c.d_model % c.heads == 0,
     "`d_model` ({c.d_model}) must be divisible by the number of heads ({c.heads_fields} = {c.heads})"),
    (BOTH, lambda c: c.pos_enc_type != "RoPE" or c.head_dim % 2 == 0,
     "`pos_enc_type`='RoPE' needs an even head dimension; `d_model` / heads = {c.head_dim}"),
    (BOTH, lambda c: _divides(c.sa.get("n_kv_heads"), c.sa_heads),
     "`{c.sa_name}.n_kv_heads` ({c.sa[n_kv_heads]}) must divide the heads ({c.sa_heads})"),
    (DAT, lambda c: _divides(c.ra.get("n_kv_heads"), c.n_heads_ra),
     "`ra_kwargs.n_kv_heads` ({c.ra[n_kv_heads]}) must divide `n_heads_ra` ({c.n_heads_ra})"),
    (BOTH, lambda c: c.sa.get("key_dim") in (None, c.head_dim),
     "`{c.sa_name}.key_dim` ({c.sa[key_dim]}) must be null or the head dimension ({c.head_dim}): dat_hf has no "
     "separate key dimension"),
    (DAT, lambda c: c.ra.get("key_dim") in (None, c.head_dim),
     "`ra_kwargs.key_dim` ({c.ra[key_dim]}) must be null or the head dimension ({c.head_dim}): dat_hf has no "
     "separate key dimension"),
    (DAT, lambda c: c.n_heads_ra == 0 or c.ra.get("rel_proj_dim") is not None or c.ra_width % c.relations == 0,
     "`ra_kwargs.n_relations` ({c.relations}) must divide `n_heads_ra` * head dimension ({c.ra_width}) when "
     "`ra_kwargs.rel_proj_dim` is null"),
    (DAT, lambda c: c.n_heads_ra == 0 or c.ra.get("rel_proj_dim") in (None, c.ra_width // c.relations),
     "`ra_kwargs.rel_proj_dim` ({c.ra[rel_proj_dim]}) times `ra_kwargs.n_relations` ({c.relations}) must be "
     "`n_heads_ra` * head dimension ({c.ra_width})"),
    (DAT, lambda c: not c.share_attn_params or (c.n_heads_sa, c.sa["n_kv_heads"] or c.n_heads_sa)
     == (c.n_heads_ra, c.ra["n_kv_heads"] or c.n_heads_ra),
     "`share_attn_params`=true needs `n_heads_sa` == `n_heads_ra` and equal `sa_kwargs.n_kv_heads` and "
     "`ra_kwargs.n_kv_heads`"),
    (DAT, lambda c: c.symbol_dim == c.d_model,
     "`symbol_retrieval_kwargs.{c.symbol_dim_field}` ({c.symbol_dim}) must be `d_model` ({c.d_model})"),
    (DAT, lambda c: c.d_model % c.symbol_retrieval_kwargs.get("n_heads", 1) == 0,
     "`d_model` ({c.d_model}) must be divisible by `symbol_retrieval_kwargs.n_heads` "
     "({c.symbol_retrieval_kwargs[n_heads]})"),
    (DAT, lambda c: c.n_heads_ra == 0 or (c.symbol_retrieval == "position_relative")
     == c.ra.get("use_relative_positional_symbols", False),
     "`symbol_retrieval`='position_relative' and `ra_kwargs.use_relative_positional_symbols`=true go together "
     "(got {c.symbol_retrieval!r} and {c.ra[use_relative_positional_symbols]})"),
    (DAT, lambda c: not (c.symbol_retrieval == "position_relative" and c.tied_library and not c.shared_retriever),
     "`symbol_retriever_config.weight_tie_symbol_library`=true is not available with "
     "`symbol_retrieval`='position_relative'"),
]


def _resolved(kwargs: dict, class_name: str) -> SimpleNamespace:
    """The fields with the constructors' defaults filled in (absent keys of nested dicts read as None in messages),
    and the sizes they derive."""
    defaults = dict(pos_enc_type="pos_emb", symbol_retrieval="symbolic_attention", share_attn_params=False)
    c = SimpleNamespace(**{k: _Missing(v) if isinstance(v, dict) else v for k, v in {**defaults, **kwargs}.items()})
    if class_name == "TransformerLM":
        c.heads, c.heads_fields, c.sa_heads, c.sa_name = c.n_heads, "`n_heads`", c.n_heads, "block_kwargs.attn_kwargs"
        c.sa = _Missing((kwargs.get("block_kwargs") or {}).get("attn_kwargs") or {})
    else:
        c.heads, c.heads_fields = c.n_heads_sa + c.n_heads_ra, "`n_heads_sa` + `n_heads_ra`"
        c.sa_heads, c.sa_name = c.n_heads_sa, "sa_kwargs"
        c.sa, c.ra = _Missing(kwargs.get("sa_kwargs") or {}), _Missing(kwargs.get("ra_kwargs") or {})
        c.relations = c.ra.get("n_relations") or c.n_heads_ra
        retriever = kwargs.get("symbol_retriever_config") or {}
        c.shared_retriever = retriever.get("shared_symbol_retriever", True)
        c.tied_library = retriever.get("weight_tie_symbol_library", False)
        c.symbol_dim_field = "d_model" if c.symbol_retrieval == "symbolic_attention" else "symbol_dim"
        c.symbol_dim = c.symbol_retrieval_kwargs[c.symbol_dim_field]
    c.head_dim = c.d_model // c.heads if c.heads else 0
    c.ra_width = c.head_dim * c.n_heads_ra if class_name != "TransformerLM" else 0
    return c


class _Missing(dict):
    """A dict whose absent keys read as None (for the messages' `{c.ra[n_kv_heads]}`)."""

    def __missing__(self, key):
        return None


def check_authors_config(kwargs: dict, class_name: str, source) -> None:
    """Raise a ValueError naming `source` (the config file) and the field for any field of `kwargs`, the authors'
    `class_name` ("DualAttnTransformerLM" / "TransformerLM") constructor kwargs, that would not build the model or
    not convert. Nothing is built."""
    try:
        _check_fields(kwargs, FIELDS[class_name])
        if class_name == "DualAttnTransformerLM":  # the retriever's fields depend on which retriever
            retrieval = kwargs.get("symbol_retrieval", "symbolic_attention")
            _check_fields(kwargs["symbol_retrieval_kwargs"], SYMBOL_KWARGS[retrieval], "symbol_retrieval_kwargs.")
        c = _resolved(kwargs, class_name)
        for classes, holds, message in CONSTRAINTS:
            if class_name in classes and not holds(c):
                raise ValueError(message.format(c=c) + ".")
    except ValueError as error:
        raise ValueError(f"{source} (the authors' {class_name} format): {error}") from None


__all__ = ["check_authors_config", "FIELDS", "CONSTRAINTS", "SYMBOL_KWARGS"]
