"""Exact parity with the authors' `dual-attention` 0.0.7 language models after conversion (fp32, eval mode)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dat_hf
from dat_hf.conversion import convert_checkpoint_folder, rope_permutation
from dat_hf.transformers_compat import output_cache

dual_attention = pytest.importorskip("dual_attention")  # the reference is a dev dependency
from dual_attention.hf import DualAttnTransformerLM_HFHub  # noqa: E402
from dual_attention.language_models import DualAttnTransformerLM, TransformerLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB, D = 101, 64


def reference_lm(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, d_model=D, n_layers=2, n_heads_sa=2, n_heads_ra=2, dff=96, dropout_rate=0.0,
        activation="swiglu", norm_first=True, max_block_size=32, pos_enc_type="RoPE",
        symbol_retrieval="symbolic_attention", symbol_retrieval_kwargs=dict(d_model=D, n_heads=4, n_symbols=12),
    )
    kwargs.update(overrides)
    return kwargs


# each configuration covers one or more options; together: every symbol retrieval, RoPE and learned positions,
# GQA, n_relations != heads, symmetric relations, shared attention params, layernorm/rmsnorm, pre/post norm,
# swiglu/gelu/relu, non-identity relation activation, per-layer symbol retrievers, and 0 relational heads
CONFIGS = {
    "symbolic-rope-swiglu-layernorm-prenorm": reference_lm(),
    "learned-positions-gelu": reference_lm(pos_enc_type="pos_emb", activation="gelu"),
    "positional-symbols": reference_lm(
        symbol_retrieval="positional_symbols", symbol_retrieval_kwargs=dict(symbol_dim=D, max_length=32)),
    "position-relative-symbols": reference_lm(
        symbol_retrieval="position_relative", symbol_retrieval_kwargs=dict(symbol_dim=D, max_rel_pos=5),
        ra_kwargs=dict(use_relative_positional_symbols=True)),
    "gqa-nrel8-symmetric": reference_lm(
        n_heads_sa=2, n_heads_ra=2, sa_kwargs=dict(n_kv_heads=1),
        ra_kwargs=dict(n_kv_heads=1, n_relations=8, symmetric_rels=True)),
    "relu-relations-nrel4-reldim8": reference_lm(ra_kwargs=dict(n_relations=4, rel_proj_dim=8, rel_activation="relu")),
    "shared-attn-rmsnorm-postnorm": reference_lm(share_attn_params=True, norm_type="rmsnorm", norm_first=False),
    "unshared-tied-symbol-library-kv-bias": reference_lm(
        symbol_retriever_config=dict(shared_symbol_retriever=False, weight_tie_symbol_library=True),
        sa_kwargs=dict(add_bias_kv=True, add_bias_out=True), ra_kwargs=dict(add_bias_kv=True, add_bias_out=True)),
    "more-relational-heads-pos-relative-learned": reference_lm(
        n_heads_sa=1, n_heads_ra=3, d_model=48, pos_enc_type="pos_emb", symbol_retrieval="position_relative",
        symbol_retrieval_kwargs=dict(symbol_dim=48, max_rel_pos=3),
        ra_kwargs=dict(use_relative_positional_symbols=True, rel_activation="tanh")),
    "zero-relational-heads": reference_lm(n_heads_sa=4, n_heads_ra=0),
}


def _logits_close(reference, ours, seq_len=20, batch=2, seed=0):
    torch.manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, seq_len))
    with torch.no_grad():
        expected = reference(x)[0]
        got = ours(x).logits
    return (expected - got).abs().max().item()


@pytest.mark.parametrize("backend", [None, "eager"], ids=["automatic", "eager-reference"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_language_model_parity(name, backend):
    """With the automatic backend choice (the compiled CPU kernel where it applies) and with the package's reference
    (`eager`) for every relational head."""
    torch.manual_seed(hash(name) % 1000)
    reference = DualAttnTransformerLM(**CONFIGS[name]).eval()
    ours = dat_hf.from_reference_model(reference)
    ours.config.relational_attn_implementation = backend
    assert isinstance(ours, dat_hf.DATForCausalLM)
    assert _logits_close(reference, ours) < 1e-5
    # the full length of the reference's block size too
    assert _logits_close(reference, ours, seq_len=32, batch=1, seed=1) < 1e-5


@pytest.mark.parametrize("pos_enc_type", ["RoPE", "pos_emb"])
def test_transformer_baseline_parity(pos_enc_type):
    torch.manual_seed(0)
    reference = TransformerLM(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=4, dff=96, dropout_rate=0.0,
                              activation="relu", norm_first=True, max_block_size=32, pos_enc_type=pos_enc_type).eval()
    ours = dat_hf.from_reference_model(reference)
    assert ours.config.num_relational_heads == 0
    assert _logits_close(reference, ours) < 1e-5


def test_parity_survives_save_and_cached_generation(tmp_path):
    torch.manual_seed(3)
    reference = DualAttnTransformerLM(**CONFIGS["gqa-nrel8-symmetric"]).eval()
    dat_hf.from_reference_model(reference).save_pretrained(tmp_path)
    ours = dat_hf.DATForCausalLM.from_pretrained(tmp_path).eval()
    assert _logits_close(reference, ours) < 1e-5
    # incremental decoding of the converted model matches the reference's full forward
    x = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        expected = reference(x)[0]
        out = ours(x[:, :8], use_cache=True)
        steps = [out.logits]
        cache = output_cache(out)
        for t in range(8, 12):
            out = ours(x[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    assert (torch.cat(steps, 1) - expected).abs().max() < 1e-5


def test_rope_permutation_is_rotate_half_of_interleaved():
    """The row permutation turns the reference's interleaved-pair RoPE into rotate-half RoPE."""
    from dual_attention.attention_utils import apply_rotary_emb, precompute_freqs_cis

    from dat_hf.dual_attention import DATRotaryEmbedding, apply_rotary

    head_dim, n = 8, 5
    q, k = torch.randn(1, n, 1, head_dim), torch.randn(1, n, 1, head_dim)
    cos, sin = precompute_freqs_cis(head_dim, n)
    rq, rk = apply_rotary_emb(q, k, cos, sin)
    perm = rope_permutation(1, head_dim)
    config = dat_hf.DATConfig(hidden_size=head_dim, num_sensory_heads=1, num_relational_heads=0, vocab_size=4)
    rope_cos, rope_sin = DATRotaryEmbedding(config)(q, torch.arange(n)[None])
    oq, ok = apply_rotary(q[..., perm], rope_cos, rope_sin), apply_rotary(k[..., perm], rope_cos, rope_sin)
    assert torch.allclose(oq, rq[..., perm], atol=1e-6)
    assert torch.allclose(ok, rk[..., perm], atol=1e-6)


def test_convert_rejects_mismatched_checkpoint(tmp_path):
    reference = DualAttnTransformerLM_HFHub(**CONFIGS["symbolic-rope-swiglu-layernorm-prenorm"])
    reference.save_pretrained(tmp_path / "authors")
    config = json.loads((tmp_path / "authors" / "config.json").read_text())
    config["n_layers"] = 3  # the weights have 2 layers
    (tmp_path / "authors" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"`n_layers` is 3 in the config, but the checkpoint .* holds 2 layers"):
        convert_checkpoint_folder(tmp_path / "authors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_reference_is_a_clear_error():
    with pytest.raises(ValueError, match="No dat_hf conversion"):
        dat_hf.from_reference_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["symbolic-rope-swiglu-layernorm-prenorm", "gqa-nrel8-symmetric",
                                  "position-relative-symbols"])
def test_parity_with_eager_attention(name):
    torch.manual_seed(11)
    reference = DualAttnTransformerLM(**CONFIGS[name]).eval()
    ours = dat_hf.from_reference_model(reference)
    ours.set_attn_implementation("eager")
    assert ours.config._attn_implementation == "eager"
    assert _logits_close(reference, ours) < 1e-5
