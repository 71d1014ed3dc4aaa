"""Property tests of the relational inductive biases (issue 5, the paper's Table 1 extended with DAT's symbols).

Every test runs on random weights and random inputs, over several seeds, at tolerance 1e-5 (fp32). Weights are drawn
with `initializer_range=0.2` (instead of 0.02) so that every path (symbols, relations, positions) moves the outputs
clearly: the "this breaks the symmetry" checks then show differences far above the tolerance.

Biases and the symmetry each keeps (see docs/relational_biases.md):
- full + symbolic-attention symbols, no positions: permutation equivariance; positional symbols break it.
- causal: prefix stability (appending tokens does not change earlier outputs); with relative positions,
  translation equivariance (also full, two-sided windows, and sparse blocks for shifts by the block size).
- sliding window p: locality (a one-layer output at i sees tokens i-p..i) and, with relative positions, shift
  invariance (prepending m tokens) for i >= L * p.
- sparse: exactly the configured graph (checked against a Python loop); equivariance under the graph's automorphisms.
- graph: relabelling equivariance; a non-neighbour does not reach a node in one layer.
- isolated receivers (no neighbour, fully padded rows): zero output, no NaN, in fp32, fp16 and bf16.
- sliding window with a KV cache: cached greedy generation and incremental logits equal the uncached ones past the
  window.
- every bias's masks move with a layer to its device (a model spread over devices by `device_map`).
- the registry (`relational_biases.py`): a toy bias added by one entry runs in a model (its weights zero exactly off
  its graph), the configs validate against the registry, and each entry's `ordered` flag agrees with its masks.
The encoder-decoder (bipartite) source-permutation property is tested with the seq2seq model.
"""

import contextlib
import warnings
from unittest import mock

import pytest
import torch
from conftest import set_torch_config
from torch._inductor.exc import CppCompileError, InductorError
from torch.nn.attention.flex_attention import create_mask

from dat_hf import DATConfig, DATEncoderConfig, DATEncoderModel, DATForCausalLM, DATModel, DATSeq2SeqConfig
from dat_hf import masking_dat
from dat_hf.relational_biases import (CROSS_ATTENTION_BIAS, RELATIONAL_BIASES, RelationalBias, is_ordered,
                                      register_relational_bias, unregister_relational_bias)
from dat_hf.dual_attention import DualAttention
from dat_hf.attention_plan import AttentionPlan
from dat_hf.modeling_dat import plan_layers
from dat_hf.transformers_compat import output_cache

SEEDS = [0, 1, 2]
ATOL = 1e-5
BREAK = 1e-2  # a broken symmetry must move the outputs by more than this
IMPLS = ["sdpa", "eager"]

BASE = dict(
    hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2, intermediate_size=64,
    num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64, max_relative_position=8,
    initializer_range=0.2,
)


def make_config(encoder=False, impl="sdpa", **overrides):
    kwargs = dict(BASE, vocab_size=97)
    kwargs.update(overrides)
    config = (DATEncoderConfig if encoder else DATConfig)(**kwargs)
    config._attn_implementation = impl
    return config


def make_model(encoder=False, impl="sdpa", seed=0, cls=None, **overrides):
    torch.manual_seed(seed)
    config = make_config(encoder=encoder, impl=impl, **overrides)
    cls = cls or (DATEncoderModel if encoder else DATModel)
    return cls(config).eval()


def embeds(seed, n, batch=2, d=32):
    return torch.randn(batch, n, d, generator=torch.Generator().manual_seed(1000 + seed))


def hidden(model, x, **kwargs):
    with torch.no_grad():
        return model(inputs_embeds=x, **kwargs).last_hidden_state


def random_adjacency(seed, batch, n, p=0.35, self_loops=True):
    g = torch.Generator().manual_seed(2000 + seed)
    adj = torch.rand(batch, n, n, generator=g) < p
    if self_loops:
        adj |= torch.eye(n, dtype=torch.bool)
    return adj


def max_diff(a, b):
    return (a - b).abs().max().item()


# ---- full bias: permutations --------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
def test_full_bias_permutation_equivariance(seed, impl):
    """full + symbolic-attention symbols + no position embedding: permuting the tokens permutes the outputs."""
    model = make_model(encoder=True, impl=impl, seed=seed, relational_bias="full", position_embedding_type="none",
                       symbol_retrieval="symbolic_attention")
    x = embeds(seed, 12)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed))
    out, out_perm = hidden(model, x), hidden(model, x[:, perm])
    assert max_diff(out_perm, out[:, perm]) < ATOL
    # with padding, permuting the tokens and the padding mask together also permutes the outputs
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    out = hidden(model, x, attention_mask=mask)
    out_perm = hidden(model, x[:, perm], attention_mask=mask[:, perm])
    assert max_diff(out_perm, out[:, perm]) < ATOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("retrieval, positions", [("positional", "none"), ("position_relative", "none"),
                                                  ("symbolic_attention", "rope"), ("symbolic_attention", "learned")])
def test_position_information_breaks_permutation_equivariance(seed, retrieval, positions):
    """Positional symbols (and position-relative symbols, RoPE, learned positions) break permutation symmetry."""
    model = make_model(encoder=True, seed=seed, relational_bias="full", position_embedding_type=positions,
                       symbol_retrieval=retrieval)
    x = embeds(seed, 12)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed))
    assert max_diff(hidden(model, x[:, perm]), hidden(model, x)[:, perm]) > BREAK


# ---- causal: prefixes and translations ----------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bias", ["causal", "sliding_window", "sparse", "graph"])
@pytest.mark.parametrize("retrieval", ["symbolic_attention", "positional", "position_relative"])
def test_causal_prefix_invariance(seed, impl, bias, retrieval):
    """In the causal stack, the outputs of a prefix do not change when tokens are appended (every causal bias)."""
    model = make_model(impl=impl, seed=seed, relational_bias=bias, symbol_retrieval=retrieval, sliding_window_size=3,
                       sparse_block_size=4, sparse_global_tokens=1)
    x = embeds(seed, 14)
    adj = random_adjacency(seed, 2, 14) if bias == "graph" else None
    full = hidden(model, x, graph_adjacency=adj)
    prefix = hidden(model, x[:, :9], graph_adjacency=None if adj is None else adj[:, :9, :9])
    assert max_diff(prefix, full[:, :9]) < ATOL


TRANSLATION_CASES = [
    # (encoder, bias, symbol retrieval, position embedding, shift m, symmetry kept)
    (False, "causal", "symbolic_attention", "rope", 3, True),
    (False, "causal", "position_relative", "none", 3, True),
    (False, "sliding_window", "position_relative", "rope", 3, True),
    (True, "full", "symbolic_attention", "rope", 3, True),
    (True, "full", "position_relative", "none", 3, True),
    (True, "sliding_window_bidirectional", "symbolic_attention", "rope", 3, True),
    # the sparse graph is anchored on real-token positions: masked (padding) tokens in front never move it
    (True, "sparse", "symbolic_attention", "rope", 4, True),
    (True, "sparse", "symbolic_attention", "rope", 2, True),
    (True, "sparse", "position_relative", "none", 4, True),
    (False, "causal", "positional", "none", 3, False),
    (False, "causal", "symbolic_attention", "learned", 3, False),
    (True, "full", "positional", "none", 3, False),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("encoder, bias, retrieval, positions, m, kept", TRANSLATION_CASES)
def test_translation_equivariance(seed, encoder, bias, retrieval, positions, m, kept):
    """Translating the sequence by m (m masked tokens in front, positions counted from the first index) leaves the
    outputs of the real tokens unchanged with relative positions only (RoPE, position-relative symbols) and a
    translation-invariant graph (the sparse graph counts real tokens only, so padding in front does not move it);
    absolute positions (positional symbols, learned embeddings) break it."""
    n = 10
    model = make_model(encoder=encoder, seed=seed, relational_bias=bias, symbol_retrieval=retrieval,
                       position_embedding_type=positions, sliding_window_size=2, sparse_block_size=4)
    x = embeds(seed, n)
    shifted = torch.cat([torch.randn(2, m, 32, generator=torch.Generator().manual_seed(seed)), x], dim=1)
    mask = torch.ones(2, m + n, dtype=torch.long)
    mask[:, :m] = 0
    out = hidden(model, x, position_ids=torch.arange(n)[None].expand(2, -1))
    out_shifted = hidden(model, shifted, attention_mask=mask, position_ids=torch.arange(m + n)[None].expand(2, -1))
    diff = max_diff(out_shifted[:, m:], out)
    assert diff < ATOL if kept else diff > BREAK


# ---- sliding window: locality and shifts --------------------------------------------------------------------------
RELATIVE = [("symbolic_attention", "rope"), ("position_relative", "none"), ("position_relative", "rope")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("retrieval, positions", RELATIVE + [("positional", "none")])
@pytest.mark.parametrize("encoder, bias", [(False, "sliding_window"), (True, "sliding_window"),
                                           (True, "sliding_window_bidirectional")])
def test_sliding_window_locality_one_layer(seed, impl, retrieval, positions, encoder, bias):
    """One layer, window p: the output at i depends only on tokens i-p..i (i-p..i+p for the two-sided window; the
    one-sided window stays one-sided in the bidirectional stack): perturbing token i-p-1 leaves it unchanged,
    perturbing token i-p changes it."""
    p, n = 3, 12
    model = make_model(encoder=encoder, impl=impl, seed=seed, num_hidden_layers=1, relational_bias=bias,
                       sliding_window_size=p, symbol_retrieval=retrieval, position_embedding_type=positions)
    x = embeds(seed, n, batch=1)
    base = hidden(model, x)[0]
    noise = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    for j in range(n):
        x2 = x.clone()
        x2[0, j] += noise[j]
        changed = (hidden(model, x2)[0] - base).abs().amax(-1)  # [n]
        for i in range(n):
            inside = abs(i - j) <= p if bias == "sliding_window_bidirectional" else i - p <= j <= i
            if inside:
                assert changed[i] > 1e-4, (i, j)
            else:
                assert changed[i] < ATOL, (i, j, changed[i].item())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("retrieval, positions", RELATIVE)
@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_sliding_window_shift_invariance(seed, impl, retrieval, positions, num_layers):
    """Prepending m tokens leaves the outputs of the original tokens unchanged for an L-layer stack once
    i >= L * p (the receptive field stays inside the original sequence), and changes them below that."""
    p, n, m = 2, 9, 3
    model = make_model(impl=impl, seed=seed, num_hidden_layers=num_layers, relational_bias="sliding_window",
                       sliding_window_size=p, symbol_retrieval=retrieval, position_embedding_type=positions)
    x = embeds(seed, n)
    prefix = torch.randn(2, m, 32, generator=torch.Generator().manual_seed(99 + seed))
    out = hidden(model, x)
    shifted = hidden(model, torch.cat([prefix, x], dim=1))[:, m:]
    bound = num_layers * p
    assert max_diff(shifted[:, bound:], out[:, bound:]) < ATOL
    assert max_diff(shifted[:, bound - 1], out[:, bound - 1]) > 1e-4  # the bound is tight


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("retrieval, positions", [("positional", "none"), ("symbolic_attention", "learned")])
def test_sliding_window_absolute_positions_break_shift(seed, retrieval, positions):
    """With absolute positions (positional symbols, learned embeddings) a shift changes the outputs."""
    p, n, m = 2, 9, 3
    model = make_model(seed=seed, num_hidden_layers=1, relational_bias="sliding_window", sliding_window_size=p,
                       symbol_retrieval=retrieval, position_embedding_type=positions)
    x = embeds(seed, n)
    prefix = torch.randn(2, m, 32, generator=torch.Generator().manual_seed(99 + seed))
    shifted = hidden(model, torch.cat([prefix, x], dim=1))[:, m:]
    assert max_diff(shifted[:, p:], hidden(model, x)[:, p:]) > BREAK


# ---- sparse: exact graph, automorphisms ---------------------------------------------------------------------------
SPARSE_VARIANTS = {
    "blocks": dict(sparse_block_size=4),
    "blocks_global": dict(sparse_block_size=4, sparse_global_tokens=2),
    "edges": dict(sparse_edges=[[5, 0], [0, 5], [9, 3], [2, 11], [11, 2], [7, 7], [19, 1]]),  # [19, 1]: beyond n
    "blocks_global_edges": dict(sparse_block_size=3, sparse_global_tokens=1, sparse_edges=[[10, 4], [1, 8]]),
}


def expected_sparse(config, n, positions=None):
    """The sparse graph by a slow Python loop: self, same block, global tokens, explicit edges, over the tokens'
    positions (`positions[i]`, default i: with padding, the index among the real tokens)."""
    positions = list(range(n)) if positions is None else positions
    allowed = torch.zeros(n, n, dtype=torch.bool)
    block, n_global = config.sparse_block_size, config.sparse_global_tokens
    edges = {tuple(e) for e in (config.sparse_edges or [])}
    for a in range(n):
        for b in range(n):
            i, j = positions[a], positions[b]
            allowed[a, b] = (i == j or (block is not None and i // block == j // block)
                             or i < n_global or j < n_global or (i, j) in edges)
    return allowed


def expected_graph(bias, config, n, adjacency=None):
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if bias == "full":
                allowed[i, j] = True
            elif bias == "causal":
                allowed[i, j] = j <= i
            elif bias == "sliding_window":
                allowed[i, j] = i - config.sliding_window_size <= j <= i
            elif bias == "sliding_window_bidirectional":
                allowed[i, j] = abs(i - j) <= config.sliding_window_size
    return allowed


def as_allowed(mask, n):
    """AttentionMask -> bool [b, n, n] (True = attend), whatever the implementation's format."""
    m = mask.mask
    if m is None:
        base = torch.ones(n, n, dtype=torch.bool)
        return (base.tril() if mask.is_causal else base)[None]
    m = m if m.dtype == torch.bool else m == 0
    return m[:, 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", sorted(SPARSE_VARIANTS))
@pytest.mark.parametrize("padded", [False, True])
def test_sparse_mask_matches_loop(impl, causal, variant, padded):
    """The sparse bias builds exactly the configured graph (blocks + global tokens and/or explicit edges), intersected
    with the causal order in decoders and with the padding; rows left without senders are flagged in `row_valid`."""
    n = 12
    config = make_config(encoder=not causal, impl=impl, relational_bias="sparse", **SPARSE_VARIANTS[variant])
    x = torch.zeros(2, n, 32)
    attention_mask = None
    pad = torch.ones(2, n, dtype=torch.bool)
    if padded:
        pad[1, :5] = False  # left padding
        attention_mask = pad.long()
    mask = masking_dat.build_attention_mask("sparse", config, x, attention_mask, causal=causal)
    # the graph is over real-token positions: left padding does not shift it
    positions = [(row.long().cumsum(0) - 1).clamp(min=0).tolist() for row in pad]
    expected = torch.stack([expected_sparse(config, n, p) for p in positions]) & pad[:, None, :]
    if causal:
        expected &= torch.ones(n, n, dtype=torch.bool).tril()
    row_any = expected.any(-1)
    expected_kernel = expected | ~row_any[..., None]  # rows without senders are unmasked for the kernel
    got = as_allowed(mask, n).expand(2, n, n)
    assert torch.equal(got, expected_kernel)
    if bool(row_any.all()):
        assert mask.row_valid is None
    else:
        assert torch.equal(mask.row_valid[:, 0, :, 0], row_any)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("encoder, bias", [(False, "causal"), (False, "sliding_window"), (False, "graph")] + [
    (True, bias) for bias in ("full", "causal", "sliding_window", "sliding_window_bidirectional", "graph")])
def test_bias_masks_match_loop(impl, encoder, bias):
    """Every other bias builds exactly its graph too (decoders intersect with the causal order; `causal` and
    `sliding_window` stay ordered in encoders)."""
    n = 10
    config = make_config(encoder=encoder, impl=impl, relational_bias=bias, sliding_window_size=2)
    adj = random_adjacency(0, 2, n, self_loops=False)
    x = torch.zeros(2, n, 32)
    mask = masking_dat.build_attention_mask(bias, config, x, None, graph_adjacency=adj, causal=not encoder)
    expected = adj.clone() if bias == "graph" else expected_graph(bias, config, n)[None].expand(2, n, n)
    if not encoder:
        expected = expected & torch.ones(n, n, dtype=torch.bool).tril()
    row_any = expected.any(-1)
    assert torch.equal(as_allowed(mask, n).expand(2, n, n), expected | ~row_any[..., None])
    if not bool(row_any.all()):
        assert torch.equal(mask.row_valid[:, 0, :, 0], row_any)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_sparse_automorphism_equivariance(seed, impl):
    """Bidirectional sparse graph (blocks of 4, 2 global tokens), symbolic-attention symbols, no positions: permuting
    tokens by an automorphism of the graph (within the global tokens, within blocks, and swapping whole blocks)
    permutes the outputs; a permutation that is not an automorphism does not, nor do positional symbols."""
    n = 14  # tokens 0-1 global, blocks [0-3], [4-7], [8-11], [12-13]
    model = make_model(encoder=True, impl=impl, seed=seed, relational_bias="sparse", sparse_block_size=4,
                       sparse_global_tokens=2, position_embedding_type="none")
    x = embeds(seed, n)
    out = hidden(model, x)
    automorphism = torch.tensor([1, 0, 3, 2, 10, 8, 11, 9, 6, 4, 7, 5, 13, 12])
    assert max_diff(hidden(model, x[:, automorphism]), out[:, automorphism]) < ATOL
    not_automorphism = torch.tensor([0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # moves token 3 into block 1
    assert max_diff(hidden(model, x[:, not_automorphism]), out[:, not_automorphism]) > BREAK
    positional = make_model(encoder=True, impl=impl, seed=seed, relational_bias="sparse", sparse_block_size=4,
                            sparse_global_tokens=2, position_embedding_type="none", symbol_retrieval="positional")
    assert max_diff(hidden(positional, x[:, automorphism]), hidden(positional, x)[:, automorphism]) > BREAK


# ---- graph: relabelling, neighbourhoods ---------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("split_heads", [False, True])
def test_graph_relabelling_equivariance(seed, impl, split_heads):
    """graph bias, symbolic-attention symbols, no positions: relabelling the nodes (permuting the features and the
    adjacency together) permutes the outputs (also with sensory heads on the full graph and relational heads on the
    graph); positional and position-relative symbols break it."""
    n = 11
    heads = dict(relational_bias="graph")
    if split_heads:
        heads = dict(relational_bias="full", relational_heads_bias="graph")
    model = make_model(encoder=True, impl=impl, seed=seed, position_embedding_type="none", **heads)
    x, adj = embeds(seed, n), random_adjacency(seed, 2, n, self_loops=False)
    adj[0, 3] = False  # an isolated node
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    out = hidden(model, x, graph_adjacency=adj)
    out_perm = hidden(model, x[:, perm], graph_adjacency=adj[:, perm][:, :, perm])
    assert max_diff(out_perm, out[:, perm]) < ATOL

    for retrieval in ("positional", "position_relative"):
        positional = make_model(encoder=True, impl=impl, seed=seed, position_embedding_type="none",
                                symbol_retrieval=retrieval, **heads)
        out = hidden(positional, x, graph_adjacency=adj)
        out_perm = hidden(positional, x[:, perm], graph_adjacency=adj[:, perm][:, :, perm])
        assert max_diff(out_perm, out[:, perm]) > BREAK


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("encoder", [False, True])
@pytest.mark.parametrize("retrieval", ["symbolic_attention", "positional", "position_relative"])
def test_graph_non_neighbour_invariance(seed, impl, encoder, retrieval):
    """One layer, graph bias: changing a non-neighbour's features leaves a node's output unchanged; changing a
    neighbour's changes it (decoders use the graph intersected with the causal order)."""
    n = 10
    model = make_model(encoder=encoder, impl=impl, seed=seed, num_hidden_layers=1, relational_bias="graph",
                       symbol_retrieval=retrieval)
    x, adj = embeds(seed, n, batch=1), random_adjacency(seed, 1, n)
    effective = adj[0] if encoder else adj[0] & torch.ones(n, n, dtype=torch.bool).tril()
    base = hidden(model, x, graph_adjacency=adj)[0]
    noise = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    for j in range(n):
        x2 = x.clone()
        x2[0, j] += noise[j]
        changed = (hidden(model, x2, graph_adjacency=adj)[0] - base).abs().amax(-1)
        for i in range(n):
            if effective[i, j] or i == j:
                assert changed[i] > 1e-4, (i, j)
            else:
                assert changed[i] < ATOL, (i, j, changed[i].item())


# ---- isolated receivers -------------------------------------------------------------------------------------------
def record_dual_attention(model):
    outputs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: outputs.append(out[0]))
             for m in model.modules() if isinstance(m, DualAttention)]
    return outputs, hooks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("retrieval", ["symbolic_attention", "position_relative"])  # fused and blocked paths
def test_isolated_rows_zero_and_finite(dtype, impl, retrieval):
    """A node without neighbours, a fully padded sequence (encoder) and left-padded rows (decoder) get exactly zero
    attention output and no NaN, in fp32, fp16 and bf16 (also their reported attention weights are zero)."""
    n = 8
    # encoder, graph bias: node 2 of sequence 0 isolated; sequence 1 fully padded
    model = make_model(encoder=True, impl=impl, relational_bias="graph", symbol_retrieval=retrieval).to(dtype)
    adj = random_adjacency(0, 2, n)
    adj[0, 2] = False
    attention_mask = torch.ones(2, n, dtype=torch.long)
    attention_mask[1] = 0
    outputs, hooks = record_dual_attention(model)
    with torch.no_grad():
        out = model(inputs_embeds=embeds(0, n).to(dtype), attention_mask=attention_mask, graph_adjacency=adj,
                    output_attentions=True, output_hidden_states=True)
    for h in hooks:
        h.remove()
    assert len(outputs) == 2
    for o in outputs:
        assert torch.isfinite(o).all()
        assert torch.equal(o[0, 2], torch.zeros_like(o[0, 2]))
        assert torch.equal(o[1], torch.zeros_like(o[1]))
        assert o[0, 3].abs().max() > 0
    assert all(torch.isfinite(h).all() for h in out.hidden_states) and torch.isfinite(out.last_hidden_state).all()
    for weights in out.attentions:
        assert weights.shape[1] == 4  # every head: 2 sensory, then 2 relational
        assert torch.isfinite(weights).all()
        assert weights[0, :, 2].abs().max() == 0 and weights[1].abs().max() == 0

    # decoder, left padding: the padded rows have no sender
    model = make_model(impl=impl, relational_bias="causal", symbol_retrieval=retrieval).to(dtype)
    attention_mask = torch.ones(2, n, dtype=torch.long)
    attention_mask[1, :3] = 0
    outputs, hooks = record_dual_attention(model)
    with torch.no_grad():
        out = model(inputs_embeds=embeds(0, n).to(dtype), attention_mask=attention_mask)
    for h in hooks:
        h.remove()
    for o in outputs:
        assert torch.isfinite(o).all()
        assert torch.equal(o[1, :3], torch.zeros_like(o[1, :3]))
    assert torch.isfinite(out.last_hidden_state).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_isolated_rows_dual_attention_direct(dtype):
    """DualAttention called directly with a mask whose row 0 is empty: zero output for it, no NaN."""
    config = make_config(encoder=True, relational_bias="graph")
    torch.manual_seed(0)
    attn = DualAttention(config, 0, is_causal=False).to(dtype).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    n = 6
    adj = torch.ones(1, n, n, dtype=torch.bool)
    adj[0, 0] = False
    x = embeds(0, n, batch=1).to(dtype)
    mask = masking_dat.build_attention_mask("graph", config, x, None, graph_adjacency=adj, causal=False)
    symbols = torch.randn(1, n, 32).to(dtype)
    with torch.no_grad():
        plan = AttentionPlan.build({"graph": mask}, config, x)
        out, _, _ = attn(x, symbols, sensory_plan=plan.sensory["graph"], relational_plan=plan.relational["graph"])
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert out[0, 1:].abs().amax(-1).min() > 0


# ---- sliding window with a KV cache -------------------------------------------------------------------------------
CACHE_CASES = [
    dict(relational_bias="sliding_window"),
    dict(relational_bias="sliding_window", symbol_retrieval="position_relative"),
    dict(relational_bias="causal", relational_heads_bias="sliding_window"),
    dict(relational_bias=["sliding_window", "causal"], relational_heads_bias=["causal", "sliding_window"],
         symbol_retrieval="positional"),
    dict(relational_bias="sparse", sparse_block_size=3, sparse_global_tokens=1),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CACHE_CASES)))
def test_sliding_window_cached_generation(impl, case):
    """Greedy generation well past the window gives the same tokens with and without the cache, and incremental
    logits (one token at a time, then chunks) equal the full forward's logits (also with left padding)."""
    p = 3
    model = make_model(impl=impl, seed=case, cls=DATForCausalLM, sliding_window_size=p, **CACHE_CASES[case])
    prompt = torch.randint(1, 97, (2, 4), generator=torch.Generator().manual_seed(case))
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0  # left padding
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4 * p, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape[1] == 4 + 4 * p
    assert torch.equal(cached, uncached)

    ids = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(10 + case))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        for chunks in ([4] + [1] * 10, [5, 3, 1, 4, 1]):
            cache, start, parts = None, 0, []
            for size in chunks:
                out = model(ids[:, start:start + size], attention_mask=mask[:, :start + size], cache=cache,
                            use_cache=True)
                cache, start = output_cache(out), start + size
                parts.append(out.logits)
            incremental = torch.cat(parts, dim=1)
            assert max_diff(incremental[0], full[0]) < ATOL
            assert max_diff(incremental[1, 2:], full[1, 2:]) < ATOL  # padded positions carry no meaning


@pytest.mark.parametrize("encoder, bias", [(False, "sliding_window"), (True, "sliding_window_bidirectional")])
def test_long_sliding_window_without_the_dense_mask_matches_it(monkeypatch, encoder, bias):
    """A long sliding window attends block by block from index arithmetic, never forming the n x n mask:
    the same outputs as through Transformers' dense mask, left-padded, in decoders and encoders; and in a decoder, a
    long prompt run into an empty cache (that path) then continued token by token matches the full forward."""
    import dat_hf.masking_dat as masking_dat

    model = make_model(encoder=encoder, seed=3, relational_bias=bias, sliding_window_size=20,
                       max_position_embeddings=2048, symbol_retrieval="symbolic_attention")
    n = 1104
    x = embeds(7, n)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :5] = 0
    built, long_window_mask = [], masking_dat.long_window_mask
    monkeypatch.setattr(masking_dat, "long_window_mask",
                        lambda *args: built.append(long_window_mask(*args)) or built[-1])
    with torch.no_grad():
        blockwise = model(inputs_embeds=x, attention_mask=mask).last_hidden_state
        assert built and built[0].window is not None and built[0].receiver_blocks is not None
        with monkeypatch.context() as patch:
            patch.setattr(masking_dat, "long_window_mask", lambda *args: None)  # (Transformers' dense mask)
            dense = model(inputs_embeds=x, attention_mask=mask).last_hidden_state
        assert max_diff(blockwise[0], dense[0]) < ATOL and max_diff(blockwise[1, 5:], dense[1, 5:]) < ATOL
        if encoder:
            return
        out = model(inputs_embeds=x[:, :1100], attention_mask=mask[:, :1100], use_cache=True)
        assert built[-1].window is not None  # the prompt into the empty cache went block by block too
        cache, parts = output_cache(out), [out.last_hidden_state]
        for i in range(1100, n):
            out = model(inputs_embeds=x[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache,
                        use_cache=True)
            cache = output_cache(out)
            parts.append(out.last_hidden_state)
        incremental = torch.cat(parts, dim=1)
        assert max_diff(incremental[0], blockwise[0]) < ATOL and max_diff(incremental[1, 5:], blockwise[1, 5:]) < ATOL


def test_long_sliding_window_with_flex_attention_skips_blocks_without_the_dense_mask():
    """With FlexAttention heads, a long sliding window keeps its index arithmetic too: the heads get Transformers'
    sliding-window BlockMask (masked blocks skipped), no `n x n` mask is formed, and the outputs are those of the
    dense mask (left padding)."""
    import dat_hf.masking_dat as masking_dat

    kwargs = dict(seed=3, relational_bias="sliding_window", sliding_window_size=20, max_position_embeddings=2048)
    flex, sdpa = make_model(impl="flex_attention", **kwargs), make_model(**kwargs)
    n = 1100
    x, mask = embeds(7, n), torch.ones(2, n, dtype=torch.long)
    mask[1, :5] = 0
    built = []
    build = masking_dat.build_attention_mask
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking_dat, "build_attention_mask", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
        out = hidden(flex, x, attention_mask=mask)
    (window_mask,) = built
    assert window_mask.window is not None and window_mask.block_mask is not None
    assert window_mask._mask is None  # (the dense mask is built only on request)
    assert flex.layers[0].dual_attn.relational.relational_attention_backend == "flex_attention"
    dense = hidden(sdpa, x, attention_mask=mask)
    assert max_diff(out[0], dense[0]) < ATOL and max_diff(out[1, 5:], dense[1, 5:]) < ATOL


# ---- FlexAttention's BlockMask where Inductor cannot compile it (issue 55) ----------------------------------------
def _block_mask_warnings(caught):
    return [str(w.message) for w in caught if "FlexAttention's BlockMask" in str(w.message)]


@pytest.mark.integration  # (Inductor builds: 20 s cold; it resets Dynamo, making later tests recompile)
def test_block_mask_over_one_key_a_row_is_built(request):
    """Issue 55: the sparse graph over one token a row of 3 (its mask function reads the `[3, 1]` positions):
    PyTorch 2.13-2.14.1's Inductor generates C++ for Transformers' compiled `create_block_mask` that does not compile
    (`CppCompileError`, statically and after a recompile alike); the BlockMask is then built without compiling, after
    one RuntimeWarning naming the error, and holds the graph (each token sees itself)."""
    # compiled: Dynamo runs a function uncompiled from the first time it hits the recompile limit in the process on
    torch.compiler.reset()
    set_torch_config(request, torch._dynamo.config, "recompile_limit", 64)
    masking_dat._warn_block_mask_uncompiled.cache_clear()
    masking_dat._UNCOMPILABLE_BLOCK_MASKS.clear()
    request.addfinalizer(masking_dat._warn_block_mask_uncompiled.cache_clear)
    request.addfinalizer(masking_dat._UNCOMPILABLE_BLOCK_MASKS.clear)
    config = make_config(impl="flex_attention", relational_bias="sparse", sparse_block_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mask = masking_dat.build_attention_mask("sparse", config, torch.zeros(3, 1, 32),
                                                torch.ones(3, 1, dtype=torch.long))
    warned = _block_mask_warnings(caught)
    assert len(warned) <= 1 and all("CppCompileError" in message for message in warned), warned
    if torch.__version__.split("+")[0] in ("2.13.0", "2.14.1"):  # (the releases measured; a later one may compile it)
        assert warned, "the compiled BlockMask built: Inductor's C++ compiles this mask now (or Dynamo did not compile)"
    block = mask.block_mask
    assert block.seq_lengths == (1, 1) and block.kv_num_blocks.flatten().tolist() == [1, 1, 1]
    assert create_mask(block.mask_mod, 3, 1, 1, 1, device="cpu").all()


def test_block_mask_fallback_takes_only_a_cpp_compile_error():
    """The BlockMask falls back to the dense mask only for Inductor's `CppCompileError` with a dense mask at hand
    (warned once per process, and not compiled again for that shape); any other error, or the error without a dense
    mask, is raised."""
    config = make_config(impl="flex_attention")
    dense = torch.ones(2, 1, 3, 3, dtype=torch.bool).tril()
    cpp = InductorError(CppCompileError(["c++"], "error: operands to '?:' have different types"), None)
    compiles = []

    def builder(error, dense=dense):
        def create(config, **kwargs):
            if config._attn_implementation == "sdpa":
                return dense
            compiles.append(error)
            raise error
        return create

    masking_dat._warn_block_mask_uncompiled.cache_clear()
    masking_dat._UNCOMPILABLE_BLOCK_MASKS.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                got, block = masking_dat._both_formats(builder(cpp), config)
                assert got is dense and block is dense  # (converted by `with_row_validity`, uncompiled)
        assert len(_block_mask_warnings(caught)) == 1 and "CppCompileError" in _block_mask_warnings(caught)[0]
        assert compiles == [cpp]  # (the second call does not try again)
        masking_dat._UNCOMPILABLE_BLOCK_MASKS.clear()
        for error in (InductorError(RuntimeError("a lowering failed"), None), CppCompileError(["c++"], "error"),
                      RuntimeError("something else")):
            with pytest.raises(type(error)):
                masking_dat._both_formats(builder(error), config)
        with pytest.raises(InductorError):
            masking_dat._both_formats(builder(cpp, dense=None), config)
    finally:
        masking_dat._warn_block_mask_uncompiled.cache_clear()
        masking_dat._UNCOMPILABLE_BLOCK_MASKS.clear()
    masks = masking_dat.with_row_validity(dense, is_causal=True, block_mask=dense)
    assert create_mask(masks.block_mask.mask_mod, 2, 1, 3, 3, device="cpu").equal(dense.expand(2, 1, 3, 3))


# ---- masks built once per forward; per-head-type graphs -----------------------------------------------------------
def test_masks_built_once_per_forward():
    """Each distinct bias is built once per forward (not once per layer or head type), in training and generation."""
    model = make_model(seed=0, cls=DATForCausalLM, num_hidden_layers=3, sliding_window_size=2,
                       relational_bias=["causal", "sliding_window", "causal"], relational_heads_bias="sliding_window")
    ids = torch.randint(0, 97, (1, 6))
    with mock.patch.object(masking_dat, "build_attention_mask", wraps=masking_dat.build_attention_mask) as spy:
        with torch.no_grad():
            model(ids)
        assert spy.call_count == 2
        assert sorted(call.args[0] for call in spy.call_args_list) == ["causal", "sliding_window"]
        spy.reset_mock()
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert spy.call_count == 2 * 3  # one forward per new token

    model = make_model(seed=0, num_hidden_layers=2, relational_bias="graph")
    with mock.patch.object(masking_dat, "build_attention_mask", wraps=masking_dat.build_attention_mask) as spy:
        with torch.no_grad():
            model(ids, graph_adjacency=random_adjacency(0, 1, 6))
        assert spy.call_count == 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sensory, relational", [("causal", "sliding_window"), ("sliding_window", "causal")])
def test_relational_heads_bias_applies_to_relational_heads(seed, impl, sensory, relational):
    """`relational_heads_bias` gives the relational heads their own graph: with a window p on one head type only,
    that type's attention weights are zero outside the window while the other type's are not."""
    p, n = 2, 10
    model = make_model(impl=impl, seed=seed, relational_bias=sensory, relational_heads_bias=relational,
                       sliding_window_size=p)
    with torch.no_grad():
        out = model(inputs_embeds=embeds(seed, n), output_attentions=True)
    assert len(out.attentions) == len(out.relations) == 2
    h_s = model.config.num_sensory_heads  # attentions: every head, sensory heads first
    sensory_weights = [w[:, :h_s] for w in out.attentions]
    relational_weights = [w[:, h_s:] for w in out.attentions]
    outside = torch.ones(n, n, dtype=torch.bool).tril(-p - 1)  # j < i - p
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    windowed, causal = ((sensory_weights, relational_weights) if sensory == "sliding_window"
                        else (relational_weights, sensory_weights))
    for w_win, w_causal in zip(windowed, causal):
        assert w_win[..., outside].abs().max() == 0
        assert w_causal[..., outside].abs().min() > 0
        assert w_win[..., future].abs().max() == 0 and w_causal[..., future].abs().max() == 0
        for w in (w_win, w_causal):
            assert max_diff(w.sum(-1), torch.ones_like(w.sum(-1))) < ATOL
    # the relations r(x_i, x_j) are reported for every pair [b, R, n, n]
    assert out.relations[0].shape == (2, 2, n, n)


def test_graph_bias_validation():
    """The graph bias needs a bool [b, n, n] adjacency and no KV cache; causal LMs refuse bidirectional biases."""
    model = make_model(seed=0, relational_bias="graph")
    ids = torch.randint(0, 97, (2, 5))
    with pytest.raises(ValueError, match="graph_adjacency"):
        model(ids)
    with pytest.raises(ValueError, match="bool"):
        model(ids, graph_adjacency=torch.ones(2, 5, 5))
    with pytest.raises(ValueError, match="shape"):
        model(ids, graph_adjacency=torch.ones(2, 4, 4, dtype=torch.bool))
    for bias in ("full", "sliding_window_bidirectional"):
        with pytest.raises(ValueError, match="not allowed"):
            make_config(relational_bias=bias, sliding_window_size=2)
        make_config(encoder=True, relational_bias=bias, sliding_window_size=2)  # fine in encoders


# ---- scripts: node classification on a real graph, plots ----------------------------------------------------------
def load_script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_node_classification_karate_learns():
    """DATForTokenClassification with the graph bias on Zachary's karate club (networkx): supervised training
    accuracy rises from chance to above 0.8 within seconds; semi-supervised (8 of 34 members labelled), the graph
    carries the labels to the unlabelled members while the full bias stays near chance."""
    pytest.importorskip("networkx")
    karate = load_script("node_classification_karate")
    before = karate.main(["--labelled", "all", "--steps", "0", "--quiet"])
    after = karate.main(["--labelled", "all", "--steps", "60", "--max-seconds", "20", "--quiet"])
    assert before["train_accuracy"] < 0.8 < after["train_accuracy"]
    graph = karate.main(["--steps", "60", "--max-seconds", "20", "--quiet"])
    full = karate.main(["--steps", "60", "--max-seconds", "20", "--quiet", "--bias", "full"])
    assert graph["train_accuracy"] > 0.8 and graph["labelled"] == 8
    assert graph["test_accuracy"] > full["test_accuracy"] + 0.15


def test_token_classification_model_api(tmp_path):
    """DATForTokenClassification: node features, input ids or embeddings; HF token-classification loss (-100 ignored);
    relabelling equivariance end to end; save and Auto reload."""
    from transformers import AutoModelForTokenClassification

    from dat_hf import DATForTokenClassification

    config = make_config(encoder=True, relational_bias="graph", position_embedding_type="none", num_node_features=5,
                         num_labels=3)
    torch.manual_seed(0)
    model = DATForTokenClassification(config).eval()
    features, adj = torch.randn(2, 7, 5), random_adjacency(0, 2, 7)
    labels = torch.randint(0, 3, (2, 7))
    labels[0, :2] = -100
    out = model(node_features=features, graph_adjacency=adj, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 3), labels.reshape(-1), ignore_index=-100)
    assert out.logits.shape == (2, 7, 3) and torch.allclose(out.loss, expected)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    permuted = model(node_features=features[:, perm], graph_adjacency=adj[:, perm][:, :, perm]).logits
    assert max_diff(permuted, out.logits[:, perm]) < ATOL
    assert model(input_ids=torch.randint(0, 97, (2, 7)), graph_adjacency=adj).logits.shape == (2, 7, 3)
    with pytest.raises(ValueError, match="only one"):
        model(input_ids=torch.randint(0, 97, (2, 7)), node_features=features, graph_adjacency=adj)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert type(reloaded) is DATForTokenClassification
    assert max_diff(reloaded(node_features=features, graph_adjacency=adj).logits, out.logits) < ATOL


def test_plot_relational_biases_writes_pngs(tmp_path):
    """The plotting script writes one PNG per bias (mask matrix + graph drawing) and, for a model, the sensory
    attention, relational attention and relations of every layer: files exist, are non-empty PNGs, expected count."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("networkx")
    import json

    plot = load_script("plot_relational_biases")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(dict(BASE, vocab_size=97, num_hidden_layers=2, relational_bias="sliding_window",
                                           sliding_window_size=2, relational_heads_bias="causal")))
    out_dir = tmp_path / "plots"
    paths = plot.main(["--output-dir", str(out_dir), "--length", "10", "--sparse-edges", "8", "1",
                       "--config", str(config_file)])
    expected = [f"bias_{b}.png" for b in plot.BIASES] + [
        f"layer{layer}_{kind}.png" for layer in range(2) for kind in ("sensory", "relational", "relations")]
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == sorted(expected)
    assert sorted(f.name for f in out_dir.iterdir()) == sorted(expected)
    for name in expected:
        data = (out_dir / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    # the masks drawn are the ones the models use
    assert torch.equal(plot.bias_mask("sliding_window", 6, window=2),
                       expected_graph("sliding_window", make_config(sliding_window_size=2), 6))

    # a saved graph model (encoder), relational heads only, with the graph example
    config = make_config(encoder=True, relational_bias="graph", num_sensory_heads=0, num_relational_heads=2,
                         num_hidden_layers=1)
    DATEncoderModel(config).save_pretrained(tmp_path / "model")
    paths = plot.main(["--output-dir", str(tmp_path / "plots2"), "--length", "8", "--biases", "graph",
                       "--model", str(tmp_path / "model")])
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == ["bias_graph.png", "layer0_relational.png",
                                                           "layer0_relations.png"]


# ---- masks on other devices ----------------------------------------------------------------------------------------
DEVICE_CASES = {  # (config overrides, sequence length, padded)
    "causal-padded": (dict(), 12, True),
    "long-sliding-window-padded": (dict(relational_bias="sliding_window", sliding_window_size=8,
                                        max_position_embeddings=640), 600, True),
    "sparse": (dict(relational_heads_bias="sparse", sparse_block_size=3, sparse_global_tokens=1), 12, False),
}


@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_masks_follow_a_layer_to_its_device(case):
    """A model spread over devices (`device_map`): accelerate's hooks move a layer's inputs to its device with `.to`,
    the masks too (`AttentionMask.to`; a long sliding window's padding with it); a layer on another device (`meta`,
    for want of a second one) then runs with the masks built for the model's first device. `.to` the device a mask is
    on is the mask itself (its blocks stay shared by the layers)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    overrides, n, padded = DEVICE_CASES[case]
    model = DATForCausalLM(make_config(vocab_size=97, **overrides)).eval()
    ids = torch.randint(1, 97, (2, n))
    padding = torch.ones(2, n, dtype=torch.long)
    if padded:
        padding[0, : n // 3] = 0
    with torch.no_grad():
        embeds = model.model.embed_tokens(ids)
        positions = (padding.cumsum(-1) - 1).clamp(min=0)
        biases, plan = plan_layers(model.model, embeds, padding)
        entries = [*plan.sensory.values(), *plan.relational.values()]
        masks = {id(entry.source): entry.source for entry in entries}.values()
        symbols = model.model.symbol_retrievers(1, embeds, positions)
        rope = model.model.rotary_emb(embeds, positions)
        assert all(entry.to("cpu") is entry for entry in entries)
        assert any(mask.masked for mask in masks), "nothing to move: the case checks nothing"
        layer = model.model.layers[1].to("meta")
        add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("meta"), io_same_device=False))
        out = layer(embeds, symbols, position_embeddings=rope, sensory_plan=plan.sensory[biases[1][0]],
                    relational_plan=plan.relational[biases[1][1]])
    assert out.device.type == "meta" and out.shape == embeds.shape
    for mask in masks:
        moved = mask.to("meta")
        window = getattr(moved, "window", None)
        for tensor in (moved.mask, moved.row_valid, None if window is None else window.padding):
            assert tensor is None or tensor.device.type == "meta"


# ---- the registry of relational biases: adding a bias is one entry ------------------------------------------------
def every_other_token(config, device, attention_mask=None, graph_adjacency=None):
    """A toy graph's mask function: receiver i attends to the senders j of its parity (i - j even)."""
    return lambda batch_idx, head_idx, q_idx, kv_idx: (q_idx - kv_idx) % 2 == 0


TOY = RelationalBias("every_other_token", relations="the tokens of the same parity",
                     symmetry="translations by even offsets", ordered=False, mask_function=every_other_token)


@contextlib.contextmanager
def registered(*biases):
    """The registry with `biases` added, as it was afterwards."""
    for bias in biases:
        register_relational_bias(bias)
    try:
        yield
    finally:
        for bias in biases:
            unregister_relational_bias(bias.name)


def parity_graph(n):
    return (torch.arange(n)[:, None] - torch.arange(n)[None, :]) % 2 == 0


@pytest.mark.parametrize("encoder", [False, True])
def test_a_registered_bias_runs_in_a_model(encoder):
    """A bias added by one registry entry (its mask function) runs in a model: every head's attention weights are
    zero exactly off its graph (intersected with the causal order and the padding in the causal LM) and positive on
    it. In the causal LM only the relational heads take it (`relational_heads_bias`), the sensory heads stay causal."""
    n = 7
    with registered(TOY):
        if encoder:
            model = make_model(encoder=True, impl="eager", relational_bias=TOY.name)
            padding = torch.ones(2, n, dtype=torch.long)
        else:
            model = make_model(impl="eager", cls=DATForCausalLM, relational_heads_bias=TOY.name)
            padding = torch.ones(2, n, dtype=torch.long)
            padding[1, :2] = 0  # left padding: receivers 0 and 1 of row 1 see no sender of their parity
        assert model.config.layer_biases()[0] == (("causal", TOY.name) if not encoder else (TOY.name, TOY.name))
        ids = torch.randint(1, 97, (2, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = model(ids, attention_mask=padding, output_attentions=True)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    relational = parity_graph(n) if encoder else parity_graph(n) & causal
    sensory = relational if encoder else causal
    for weights in out.attentions:  # [b, heads, n, n]: 2 sensory heads, then 2 relational heads
        assert weights.shape == (2, 4, n, n)
        for heads, graph in ((slice(0, 2), sensory), (slice(2, 4), relational)):
            allowed = (graph[None] & padding.bool()[:, None, :])[:, None].expand(2, 2, n, n)
            w = weights[:, heads]
            assert (w[~allowed] == 0).all()
            assert (w[allowed] > 0).all()
            has_sender = allowed.any(-1)
            assert torch.allclose(w.sum(-1)[has_sender], torch.ones(()), atol=1e-5)
            assert (w.sum(-1)[~has_sender] == 0).all()  # (isolated receivers: zero output, zero weights)


def test_config_validation_reads_the_registry():
    """The configs accept a registered bias where its entry allows it (a causal LM needs `decoder`; its config fields
    must be set) and refuse unknown names, naming the field and the registered biases."""
    needs_block = RelationalBias("blocks_only", relations="local blocks", symmetry="block translations",
                                 ordered=False, decoder=False, config_fields=("sparse_block_size",),
                                 mask_function=every_other_token)
    seq2seq = dict(vocab_size=16, encoder_layers=1, **{k: v for k, v in BASE.items() if k != "num_hidden_layers"},
                   num_hidden_layers=1)
    with registered(TOY, needs_block):
        assert make_config(relational_bias=TOY.name).relational_bias == TOY.name
        assert make_config(encoder=True, relational_heads_bias=[TOY.name, "full"]).layer_bias(0, True) == TOY.name
        assert DATSeq2SeqConfig(encoder_relational_bias=TOY.name, **seq2seq).encoder_relational_bias == TOY.name
        assert make_config(encoder=True, relational_bias="blocks_only", sparse_block_size=2).sparse_block_size == 2
        with pytest.raises(ValueError, match=r"`relational_bias`='blocks_only' is not allowed for `dat` models "
                                             r"\(allowed: \[.*'every_other_token'\]\)"):
            make_config(relational_bias="blocks_only", sparse_block_size=2)
        with pytest.raises(ValueError, match=r"`relational_bias`='blocks_only' needs `sparse_block_size` to be set"):
            make_config(encoder=True, relational_bias="blocks_only")
        with pytest.raises(ValueError, match=r"`relational_heads_bias` entries must be in \[.*'every_other_token', "
                                             r"'blocks_only'\], got 'zigzag'"):
            make_config(relational_heads_bias="zigzag")
        with pytest.raises(ValueError, match=r"`encoder_relational_bias` entries must be in .*, got 'zigzag'"):
            DATSeq2SeqConfig(encoder_relational_bias="zigzag", **seq2seq)
        with pytest.raises(ValueError, match=r"`encoder_relational_bias`='graph' needs `graph_adjacency` with each "
                                             r"input, which `dat_seq2seq` models do not take"):
            DATSeq2SeqConfig(encoder_relational_bias="graph", **seq2seq)
        with pytest.raises(ValueError, match="already registered"):
            register_relational_bias(TOY)
        # the cross-attention graph is no self-attention bias
        with pytest.raises(ValueError, match=r"`relational_bias` entries must be in .*, got 'bipartite'"):
            make_config(encoder=True, relational_bias=CROSS_ATTENTION_BIAS)
    assert TOY.name not in RELATIONAL_BIASES and "blocks_only" not in RELATIONAL_BIASES
    with pytest.raises(ValueError, match=r"`relational_bias` entries must be in .*, got 'every_other_token'"):
        make_config(encoder=True, relational_bias=TOY.name)
    with pytest.raises(ValueError, match=r"Unknown relational bias 'every_other_token'; registered: \[.*'graph'"):
        masking_dat.build_attention_mask(TOY.name, make_config(encoder=True), torch.zeros(1, 3, 32), None)


def test_broken_entries_are_refused_by_name_at_registration():
    """An entry is checked when it is registered: a mask function that returns None (which would read as "every
    pair"), one that gives no bool per pair, a cache layer type that is not one or that the graph does not fit. One
    built from config fields is checked for each config that selects it. Nothing refused is registered."""
    def entry(name, mask_function=every_other_token, **fields):
        return RelationalBias(name, relations="r", symmetry="s", ordered=False, mask_function=mask_function, **fields)

    refused = {
        "returns_none": (entry("returns_none", lambda config, device, **inputs: None),
                         r"its `mask_function` returned None, not a mask function"),
        "gives_ints": (entry("gives_ints", lambda config, device, **inputs: lambda b, h, q, kv: q - kv),
                       r"its mask function gives torch.int64 of shape \(3, 3\) over 3 receivers and 3 senders, not one "
                       r"bool per pair"),
        "gives_none": (entry("gives_none", lambda config, device, **inputs: lambda *indices: None),
                       r"its mask function fails on index tensors"),
        "not_callable": (entry("not_callable", "causal"), r"`mask_function` must be None or a callable"),
        "unknown_layer": (entry("unknown_layer", layer_type="sliding"), r"`layer_type` must be None or one of"),
        "window_cache": (entry("window_cache", layer_type="sliding_attention"),
                         r"`layer_type`='sliding_attention' keeps only the last `sliding_window` tokens"),
    }
    for name, (bias, message) in refused.items():
        with pytest.raises(ValueError, match=rf"Relational bias '{name}': {message}"):
            register_relational_bias(bias)
        assert name not in RELATIONAL_BIASES
    from_field = entry("from_field", lambda config, device, **inputs: None if config.sparse_block_size > 2 else
                       every_other_token(config, device), config_fields=("sparse_block_size",), decoder=False)
    with registered(from_field):
        assert make_config(encoder=True, relational_bias="from_field", sparse_block_size=2).layer_biases()
        with pytest.raises(ValueError, match=r"Relational bias 'from_field': its `mask_function` returned None"):
            make_config(encoder=True, relational_bias="from_field", sparse_block_size=3)


@pytest.mark.parametrize("name", list(RELATIONAL_BIASES) + [TOY.name])
def test_ordered_flag_agrees_with_the_built_masks(name):
    """Each entry's `ordered` <=> the mask built in an encoder is causal (no sender after its receiver), as
    `AttentionMask.is_causal` says; in a causal model every bias's mask is causal; masks built ahead (compiled
    decoding) follow the same rule (`is_ordered`)."""
    n = 8
    config = make_config(encoder=True, sliding_window_size=2, sparse_block_size=4)
    x = torch.zeros(2, n, 32)
    with registered(TOY) if name == TOY.name else contextlib.nullcontext():
        bias = RELATIONAL_BIASES[name]
        if bias.cross:
            masks = {False: masking_dat.build_cross_attention_mask(config, x, torch.zeros(2, n + 1, 32), None)}
        else:
            adjacency = torch.ones(2, n, n, dtype=torch.bool) if bias.inputs else None
            masks = {causal: masking_dat.build_attention_mask(name, config, x, None, graph_adjacency=adjacency,
                                                              causal=causal) for causal in (False, True)}
        for causal, mask in masks.items():
            allowed = as_allowed(mask, n)
            ordered = not allowed[..., :n].triu(1).any()
            assert mask.is_causal == ordered == is_ordered(name, causal) == (bias.ordered or causal)
            if not bias.cross:
                ahead = masking_dat.prebuilt_masks({name: masking_dat.prebuildable(mask)}, [name], causal)[name]
                assert ahead.is_causal == mask.is_causal


def test_bias_names_are_literals_only_in_the_registry():
    """Outside `relational_biases.py`, a bias name is written only as a config field's default (class-level
    `relational_bias: ... = "full"`) or as a config value converted from the authors' checkpoints (conversion*.py):
    masks, plans, caches and validation read the registry."""
    import ast
    import pathlib

    package = pathlib.Path(masking_dat.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if "training" in path.parts or path.name == "relational_biases.py" or path.name.startswith("conversion"):
            continue
        tree = ast.parse(path.read_text())
        allowed = {id(node.body[0].value) for node in ast.walk(tree)  # docstrings
                   if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                   and isinstance(node.body[0], ast.Expr)}
        allowed |= {id(item.value) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)  # field defaults
                    for item in node.body if isinstance(item, ast.AnnAssign) and item.value is not None}
        found += [f"{path.name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in RELATIONAL_BIASES and id(node) not in allowed]
    assert not found, found
