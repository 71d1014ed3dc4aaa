"""`AutoModelForCausalLM.from_pretrained` on folders written by the authors' own Hub mixin (`dual-attention` 0.0.7,
`DualAttnTransformerLM_HFHub` / `TransformerLM_HFHub.save_pretrained`): converted on load with identical logits;
wrong shapes, malformed files and pickles refused before anything is allocated or unpickled. Only the language
models have a Hub mixin in 0.0.7 (the vision and seq2seq models have none)."""

import json
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


def test_dtype_and_attention_arguments_are_honoured(tmp_path):
    reference = _authors_folder(tmp_path / "authors")
    model, _ = _load(tmp_path / "authors", dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    model, _ = _load(tmp_path / "authors", attn_implementation="eager")
    assert model.dtype == torch.float32 and _max_logit_diff(reference, model) < 1e-5


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
    """Devices on which the reference model is built: wrong checkpoints must fail with only the meta skeleton built."""
    devices = []
    original = reference_models.DualAttnTransformerLM

    class Spy(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            devices.append(next(self.parameters()).device.type)

    monkeypatch.setattr(reference_models, "DualAttnTransformerLM", Spy)
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


def test_unsupported_loading_arguments_are_named(tmp_path):
    _authors_folder(tmp_path / "authors")
    with pytest.raises(ValueError, match=r"got \['quantization_config'\].*Convert once"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "authors", quantization_config={"bits": 4})
