"""`AutoModelForCausalLM.from_pretrained` on folders written by the authors' own Hub mixin (`dual-attention` 0.0.7,
`DualAttnTransformerLM_HFHub` / `TransformerLM_HFHub.save_pretrained`): converted on load with identical logits;
wrong shapes, malformed files and pickles refused before anything is allocated or unpickled. Only the language
models have a Hub mixin in 0.0.7 (the vision and seq2seq models have none)."""

import json
import math
import os
import shutil
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import dat_hf
from dat_hf.conversion import AuthorsCheckpointWarning

pytest.importorskip("dual_attention")  # the reference is a dev dependency
import dual_attention.language_models as reference_models  # noqa: E402
from dual_attention.hf import DualAttnTransformerLM_HFHub, TransformerLM_HFHub  # noqa: E402

VOCAB, D = 101, 64
BASE = dict(vocab_size=VOCAB, d_model=D, n_layers=2, dff=96, dropout_rate=0.0, activation="swiglu", norm_first=True,
            max_block_size=32, pos_enc_type="RoPE")
DAT = dict(BASE, n_heads_sa=2, n_heads_ra=2, symbol_retrieval="symbolic_attention",
           symbol_retrieval_kwargs=dict(d_model=D, n_heads=4, n_symbols=12))
CASES = {
    "dat-symbolic-rope": (DualAttnTransformerLM_HFHub, DAT),
    "dat-position-relative-learned-gelu": (DualAttnTransformerLM_HFHub, dict(
        DAT, pos_enc_type="pos_emb", activation="gelu", symbol_retrieval="position_relative",
        symbol_retrieval_kwargs=dict(symbol_dim=D, max_rel_pos=5), ra_kwargs=dict(use_relative_positional_symbols=True),
        symbol_retriever_config=dict(shared_symbol_retriever=False, weight_tie_symbol_library=False))),
    "transformer-baseline": (TransformerLM_HFHub, dict(BASE, n_heads=4)),
}


def _authors_folder(path, case="dat-symbolic-rope", seed=0):
    cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    reference = cls(**kwargs).eval()
    reference.save_pretrained(path)  # the authors' own writer: config.json of kwargs + model.safetensors
    assert "model_type" not in json.loads((path / "config.json").read_text())
    return reference


def _max_logit_diff(reference, model):
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (reference(x)[0] - model(x).logits).abs().max().item()


def _load(path, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model, [w for w in caught if issubclass(w.category, AuthorsCheckpointWarning)]


@pytest.mark.parametrize("case", list(CASES))
def test_auto_class_loads_authors_folder_with_identical_logits(tmp_path, case):
    reference = _authors_folder(tmp_path / "authors", case)
    model, converted = _load(tmp_path / "authors")
    assert isinstance(model, dat_hf.DATForCausalLM) and not model.training
    assert len(converted) == 1 and "authors' dual-attention format" in str(converted[0].message)
    assert _max_logit_diff(reference, model) < 1e-5

    model.save_pretrained(tmp_path / "ours")  # dat_hf's format: loads without converting or warning
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "dat"
    assert not [f for f in os.listdir(tmp_path / "ours") if f.endswith((".bin", ".pt", ".pth"))]
    reloaded, converted = _load(tmp_path / "ours")
    assert converted == []
    assert _max_logit_diff(reference, reloaded) < 1e-5


def test_hub_id_resolves_from_the_cache_offline(tmp_path, monkeypatch):
    """A Hub id (here served from a cache folder laid out as huggingface_hub writes it) converts the same way."""
    reference = _authors_folder(tmp_path / "authors")
    commit = "0" * 39 + "1"
    repo = tmp_path / "hub" / "models--awni00--DAT-tiny"
    shutil.copytree(tmp_path / "authors", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, converted = _load("awni00/DAT-tiny", cache_dir=str(tmp_path / "hub"), local_files_only=True)
    assert len(converted) == 1 and model.config.name_or_path == "awni00/DAT-tiny"
    assert _max_logit_diff(reference, model) < 1e-5


@pytest.fixture
def constructions(monkeypatch):
    """Devices on which a reference model is built: wrong checkpoints must fail with only the meta skeleton built,
    wrong config fields with nothing built."""
    devices = []
    for name in ("DualAttnTransformerLM", "TransformerLM"):
        original = getattr(reference_models, name)

        class Spy(original):
            def __init__(self, *args, **kwargs):
                devices.append("started")  # before the reference's own constructor can fail
                super().__init__(*args, **kwargs)
                devices[-1] = next(self.parameters()).device.type

        monkeypatch.setattr(reference_models, name, Spy)
    return devices


@pytest.mark.parametrize("change, message", [
    (dict(dff=128), r"tensor `layers.blocks.0.ff_block.linear1.\w+` is \[96.*\] in the checkpoint but \[128.*`dff`"),
    (dict(n_layers=3), r"`n_layers` is 3 in the config, but the checkpoint .* holds 2 layers"),
    (dict(n_layers=1), r"unexpected \['layers.blocks.1."),
])
def test_wrong_shapes_are_refused_before_allocation(tmp_path, constructions, change, message):
    _authors_folder(tmp_path / "authors")
    config = json.loads((tmp_path / "authors" / "config.json").read_text())
    (tmp_path / "authors" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors")
    assert constructions in ([], ["meta"]), "only the meta-device skeleton may be built before the shapes are checked"


class _Detonator:
    """Unpickling this runs `open(marker, "w")`: proof that a file was unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_are_refused_unopened(tmp_path, constructions):
    _authors_folder(tmp_path / "authors")
    os.remove(tmp_path / "authors" / "model.safetensors")
    marker = tmp_path / "unpickled"
    torch.save({"weights": _Detonator(str(marker))}, tmp_path / "authors" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no model.safetensors; it has \['pytorch_model.bin'\], pickled weights"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors")
    assert not marker.exists(), "the pickle was unpickled"
    assert constructions == []


def test_malformed_safetensors_is_refused(tmp_path, constructions):
    _authors_folder(tmp_path / "authors")
    (tmp_path / "authors" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="is not a readable safetensors file|its safetensors header"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors")
    assert constructions == []  # (the header is read before anything is built)


class _Delete:
    """A table value: the field is removed."""

    def __repr__(self):  # (a stable test id: xdist's workers must collect the same names)
        return "<deleted>"


DELETE = _Delete()
BAD_FIELDS = [  # (class, {field (nested as a.b): bad value}, what the message says besides the file)
    ("dat", {"n_heads_sa": -2}, "`n_heads_sa` must be a non-negative integer, got -2"),
    ("dat", {"n_heads_sa": True}, "`n_heads_sa` must be a non-negative integer, got True"),
    ("dat", {"n_heads_ra": 1.5}, "`n_heads_ra` must be a non-negative integer, got 1.5"),
    ("dat", {"n_heads_ra": "2"}, "`n_heads_ra` must be a non-negative integer, got '2'"),
    ("dat", {"n_heads_sa": 0, "n_heads_ra": 0}, "`n_heads_sa` + `n_heads_ra` must be at least 1"),
    ("dat", {"n_heads_sa": 62}, "`pos_enc_type`='RoPE' needs an even head dimension; `d_model` / heads = 1"),
    ("dat", {"d_model": 0}, "`d_model` must be a positive integer, got 0"),
    ("dat", {"d_model": 62}, "`d_model` (62) must be divisible by the number of heads (`n_heads_sa` + `n_heads_ra` = "),
    ("dat", {"vocab_size": None}, "`vocab_size` must be a positive integer, got None"),
    ("dat", {"n_layers": False}, "`n_layers` must be a positive integer, got False"),
    ("dat", {"max_block_size": -32}, "`max_block_size` must be a positive integer, got -32"),
    ("dat", {"dff": 96.0}, "`dff` must be a positive integer, got 96.0"),
    ("dat", {"dff": DELETE}, "`dff` is missing"),
    ("dat", {"dropout_rate": math.nan}, "`dropout_rate` must be a probability in [0, 1), got nan"),
    ("dat", {"dropout_rate": math.inf}, "`dropout_rate` must be a probability in [0, 1), got inf"),
    ("dat", {"dropout_rate": -0.1}, "`dropout_rate` must be a probability in [0, 1), got -0.1"),
    ("dat", {"dropout_rate": 1.0}, "`dropout_rate` must be a probability in [0, 1), got 1.0"),
    ("dat", {"activation": "softmax"}, "`activation` must be one of ['swiglu', 'gelu', 'relu', 'silu', 'tanh'"),
    ("dat", {"norm_first": 1}, "`norm_first` must be true or false, got 1"),
    ("dat", {"norm_type": "none"}, "`norm_type` must be one of ['layernorm', 'rmsnorm'], got 'none'"),
    ("dat", {"pos_enc_type": "alibi"}, "`pos_enc_type` must be one of ['pos_emb', 'RoPE'], got 'alibi'"),
    ("dat", {"symbol_retrieval": "rel_sym_attn"}, "`symbol_retrieval` must be one of"),
    ("dat", {"ra_type": "rca"}, "`ra_type` must be one of ['relational_attention'], got 'rca'"),
    ("dat", {"share_attn_params": "yes"}, "`share_attn_params` must be true or false"),
    ("dat", {"share_attn_params": True, "sa_kwargs": {"n_kv_heads": 1}}, "`share_attn_params`=true needs"),
    ("dat", {"bias": None}, "`bias` must be true or false, got None"),
    ("dat", {"unknown": 1}, "unknown field ['unknown']"),
    ("dat", {"symbol_retrieval_kwargs": None}, "`symbol_retrieval_kwargs` must be an object (a dict), got None"),
    ("dat", {"symbol_retrieval_kwargs.n_symbols": -12}, "`symbol_retrieval_kwargs.n_symbols` must be a positive"),
    ("dat", {"symbol_retrieval_kwargs.n_symbols": DELETE}, "`symbol_retrieval_kwargs.n_symbols` is missing"),
    ("dat", {"symbol_retrieval_kwargs.n_heads": 5}, "must be divisible by `symbol_retrieval_kwargs.n_heads` (5)"),
    ("dat", {"symbol_retrieval_kwargs.d_model": 32}, "`symbol_retrieval_kwargs.d_model` (32) must be `d_model` (64)"),
    ("dat", {"symbol_retrieval_kwargs.scale": math.nan}, "`symbol_retrieval_kwargs.scale` must be null or a finite"),
    ("dat", {"symbol_retrieval_kwargs.scale": -1.0}, "`symbol_retrieval_kwargs.scale` must be null or a finite"),
    ("dat", {"symbol_retrieval_kwargs.dropout": 2.0}, "`symbol_retrieval_kwargs.dropout` must be a probability"),
    ("dat", {"symbol_retrieval_kwargs.trainable_symbols": "no"}, "`symbol_retrieval_kwargs.trainable_symbols` must be"),
    ("dat", {"symbol_retrieval_kwargs.max_rel_pos": 5}, "unknown field ['symbol_retrieval_kwargs.max_rel_pos']"),
    ("dat", {"sa_kwargs": [1]}, "`sa_kwargs` must be an object (a dict), got [1]"),
    ("dat", {"sa_kwargs": {"n_kv_heads": 3}}, "`sa_kwargs.n_kv_heads` (3) must divide the heads (2)"),
    ("dat", {"sa_kwargs": {"n_kv_heads": 0}}, "`sa_kwargs.n_kv_heads` must be a positive integer, got 0"),
    ("dat", {"sa_kwargs": {"key_dim": 8}}, "`sa_kwargs.key_dim` (8) must be null or the head dimension (16)"),
    ("dat", {"sa_kwargs": {"add_bias_kv": "true"}}, "`sa_kwargs.add_bias_kv` must be true or false"),
    ("dat", {"sa_kwargs": {"dropout": 0.1}}, "unknown field ['sa_kwargs.dropout']"),
    ("dat", {"ra_kwargs": {"n_kv_heads": -1}}, "`ra_kwargs.n_kv_heads` must be a positive integer, got -1"),
    ("dat", {"ra_kwargs": {"n_kv_heads": 3}}, "`ra_kwargs.n_kv_heads` (3) must divide `n_heads_ra` (2)"),
    ("dat", {"ra_kwargs": {"n_relations": 3}}, "`ra_kwargs.n_relations` (3) must divide `n_heads_ra` * head dimension"),
    ("dat", {"ra_kwargs": {"rel_proj_dim": 7}}, "`ra_kwargs.rel_proj_dim` (7) times `ra_kwargs.n_relations` (2)"),
    ("dat", {"ra_kwargs": {"rel_activation": "softmax"}}, "`ra_kwargs.rel_activation` must be one of"),
    ("dat", {"ra_kwargs": {"symmetric_rels": 0}}, "`ra_kwargs.symmetric_rels` must be true or false, got 0"),
    ("dat", {"ra_kwargs": {"use_relative_positional_symbols": True}},
     "`symbol_retrieval`='position_relative' and `ra_kwargs.use_relative_positional_symbols`=true go together"),
    ("dat", {"symbol_retriever_config": {"shared_symbol_retriever": "no"}},
     "`symbol_retriever_config.shared_symbol_retriever` must be true or false"),
    ("dat", {"symbol_retriever_config": {"foo": 1}}, "unknown field ['symbol_retriever_config.foo']"),
    ("transformer", {"n_heads": -4}, "`n_heads` must be a positive integer, got -4"),
    ("transformer", {"n_heads": True}, "`n_heads` must be a positive integer, got True"),
    ("transformer", {"n_heads": 3}, "`d_model` (64) must be divisible by the number of heads (`n_heads` = 3)"),
    ("transformer", {"use_flash_attention": "yes"}, "`use_flash_attention` must be true or false"),
    ("transformer", {"block_kwargs": {"attn_kwargs": {"n_kv_heads": 3}}},
     "`block_kwargs.attn_kwargs.n_kv_heads` (3) must divide the heads (4)"),
    ("transformer", {"block_kwargs": {"causal": False}}, "unknown field ['block_kwargs.causal']"),
    ("transformer", {"n_kv_heads": 2}, "unknown field ['n_kv_heads']"),
    ("transformer", {"vocab_size": DELETE}, "`vocab_size` is missing"),
]


def _edited(config, changes):
    config = json.loads(json.dumps(config))
    for path, value in changes.items():
        *outer, name = path.split(".")
        target = config
        for key in outer:
            target = target[key]
        if value is DELETE:
            del target[name]
        else:
            target[name] = value
    return config


@pytest.fixture(scope="module")
def authors_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("authors")
    return {case: (_authors_folder(root / case, name), root / case)
            for case, name in (("dat", "dat-symbolic-rope"), ("transformer", "transformer-baseline"))}


@pytest.mark.parametrize("case, changes, message", BAD_FIELDS,
                         ids=[f"{case}-{'+'.join(changes)}={list(changes.values())[0]!r}"[:60]
                              for case, changes, _ in BAD_FIELDS])
def test_every_bad_config_field_is_named_before_anything_is_built(tmp_path, authors_folders, constructions, case,
                                                                  changes, message):
    source = authors_folders[case][1]
    folder = tmp_path / "authors"
    shutil.copytree(source, folder)
    (folder / "config.json").write_text(json.dumps(_edited(json.loads((source / "config.json").read_text()),
                                                           changes)))
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(error.value).startswith(f"{folder / 'config.json'} (the authors' ")
    assert message in str(error.value)
    assert constructions == [], "the config must be checked before any reference class is built"


def test_every_field_of_the_authors_constructors_has_a_rule():
    """The tables cover exactly the parameters of the constructors the authors' format builds (nested kwargs: those
    of the module they reach, less what the caller passes itself)."""
    import inspect

    from dual_attention.attention import Attention
    from dual_attention.relational_attention import RelationalAttention
    from dual_attention.symbol_retrieval import (PositionalSymbolRetriever, PositionRelativeSymbolRetriever,
                                                 SymbolicAttention)

    from dat_hf.conversion_config import FIELDS, RA_KWARGS, SA_KWARGS, SYMBOL_KWARGS

    def params(cls, passed=()):
        return set(inspect.signature(cls).parameters) - set(passed)

    passed = ("d_model", "n_heads", "dropout", "total_n_heads")
    assert set(FIELDS["DualAttnTransformerLM"]) == params(reference_models.DualAttnTransformerLM)
    assert set(FIELDS["TransformerLM"]) == params(reference_models.TransformerLM)
    assert set(SA_KWARGS) == params(Attention, passed)
    assert set(RA_KWARGS) == params(RelationalAttention, passed)
    for name, cls in (("symbolic_attention", SymbolicAttention), ("positional_symbols", PositionalSymbolRetriever),
                      ("position_relative", PositionRelativeSymbolRetriever)):
        assert set(SYMBOL_KWARGS[name]) == params(cls)


def test_valid_configs_pass_the_checks():
    """Every configuration of the parity tests and the released models' shapes (null dff, n_relations) pass."""
    from test_parity import CONFIGS

    from dat_hf.conversion_config import check_authors_config

    released = dict(vocab_size=50304, d_model=1024, n_layers=24, n_heads_sa=8, n_heads_ra=8, dff=None,
                    dropout_rate=0.0, activation="swiglu", norm_first=True, max_block_size=1024, norm_type="rmsnorm",
                    pos_enc_type="RoPE", bias=False, symbol_retrieval_kwargs=dict(d_model=1024, n_heads=8,
                                                                                 n_symbols=1024),
                    sa_kwargs=dict(n_kv_heads=4), ra_kwargs=dict(n_kv_heads=4, n_relations=None,
                                                                 rel_activation="identity"))
    for kwargs in (*CONFIGS.values(), released, *(kwargs for _, kwargs in CASES.values())):
        check_authors_config(kwargs, "DualAttnTransformerLM" if "n_heads_sa" in kwargs else "TransformerLM", "x")


LOADING_ARGUMENTS = {  # as for a dat_hf folder
    "device_map=auto": dict(device_map="auto"),
    "device_map=cpu": dict(device_map="cpu"),
    "device_map=dict": dict(device_map={"": "cpu"}),
    "device_map=torch.device": dict(device_map=torch.device("cpu")),
    "low_cpu_mem_usage": dict(low_cpu_mem_usage=True),
    "attn_implementation=sdpa": dict(attn_implementation="sdpa"),
    "attn_implementation=eager": dict(attn_implementation="eager"),
    "hub-arguments": dict(trust_remote_code=True, revision="main", local_files_only=True),
    "dtype=bfloat16": dict(dtype=torch.bfloat16),
    "torch_dtype=bfloat16": dict(torch_dtype=torch.bfloat16),
    "config-field": dict(output_hidden_states=True),
}


@pytest.mark.parametrize("arguments", list(LOADING_ARGUMENTS))
def test_loading_arguments_work_as_on_a_dat_hf_folder(tmp_path, arguments):
    reference = _authors_folder(tmp_path / "authors")
    kwargs = LOADING_ARGUMENTS[arguments]
    model, converted = _load(tmp_path / "authors", **kwargs)
    assert len(converted) == 1 and model.name_or_path == str(tmp_path / "authors") and not model.training
    ours = AutoModelForCausalLM.from_pretrained(_converted_folder(tmp_path, reference), **kwargs)
    assert (model.dtype, model.device, model.config._attn_implementation) == (
        ours.dtype, ours.device, ours.config._attn_implementation)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)[0]
        logits = model(x.to(model.device)).logits.float().cpu()
    bf16 = model.dtype == torch.bfloat16
    assert (logits - expected).abs().max().item() < (0.05 if bf16 else 1e-5)
    if "device_map" in kwargs:
        assert getattr(model, "hf_device_map", None) == getattr(ours, "hf_device_map", None)
    if "output_hidden_states" in kwargs:
        assert model.config.output_hidden_states
    if os.path.exists("/proc/self/maps"):  # the weights are read, not mapped from the deleted temporary folder
        assert "dat_hf-converted" not in open("/proc/self/maps").read()


def test_a_given_config_is_used_as_for_a_dat_hf_folder(tmp_path):
    """`config=` replaces the converted config.json, checked against the weights as for a dat_hf folder."""
    reference = _authors_folder(tmp_path / "authors")
    model, _ = _load(tmp_path / "authors")
    config = model.config
    config.output_hidden_states = True
    given, converted = _load(tmp_path / "authors", config=config)
    assert len(converted) == 1 and given.config.output_hidden_states
    assert _max_logit_diff(reference, given) < 1e-5
    config.hidden_size = 32
    with pytest.raises(ValueError, match=r"`hidden_size`=32 in the config, 64 in the checkpoint"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors", config=config)


def _converted_folder(tmp_path, reference):
    """The same model, converted and saved as a dat_hf folder."""
    folder = tmp_path / "ours"
    dat_hf.from_reference_model(reference).save_pretrained(folder)
    return folder


def test_unsupported_loading_arguments_are_named(tmp_path):
    """As for a dat_hf folder (Transformers' own errors), with a note naming the authors' folder; arguments naming
    files the authors' format lacks are refused before converting."""
    _authors_folder(tmp_path / "authors")
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_argument'") as error:
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors", not_an_argument=1)
    assert f"loading {tmp_path / 'authors'}, in the authors' dual-attention format" in error.value.__notes__[0]
    with pytest.raises(ValueError, match=r"has no `variant` \(variant='fp16'\): its one weights file is model"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors", variant="fp16")
