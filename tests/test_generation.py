"""Generation and forward-output acceptance tests for DATForCausalLM / DATForSequenceClassification.

Cached generation must equal uncached generation (greedy, beam, incremental logits), left padding must not change a
prompt's continuation, and the output fields (loss, logits_to_keep, hidden states, attention weights, relations)
must have the documented meaning. Every model is tiny. Generation tests use `initializer_range=0.5`, which spreads
the logits so greedy decoding produces varied tokens (no degenerate repetition that would hide a cache bug); logit
comparisons use `initializer_range=0.1` (logits of magnitude ~3), where float32 rounding stays far below 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import enable_checkpointing, tiny_config
from transformers.cache_utils import DynamicCache, DynamicLayer

from dat_hf import DATForCausalLM, DATForSequenceClassification
from dat_hf.cache_dat import InPlaceCacheLayer
from dat_hf.transformers_compat import cache_kwargs, output_cache

ATOL = 1e-5

# a handful of tiny configs covering every symbol retriever, both position types, GQA, a non-identity relation
# activation (blocked path), shared attention parameters, symmetric relations, a sensory-only model and two
# relational biases other than causal
CONFIGS = {
    "symbolic_rope": dict(),
    "positional_learned": dict(symbol_retrieval="positional", position_embedding_type="learned"),
    "relative_rope": dict(symbol_retrieval="position_relative", max_relative_position=3),
    "gqa": dict(num_relational_key_value_heads=1, num_sensory_key_value_heads=1),
    "relu_relations": dict(relation_activation="relu", symbol_retrieval="positional"),
    "shared_params": dict(share_attention_params=True),
    "symmetric_relative_learned": dict(symmetric_relations=True, symbol_retrieval="position_relative",
                                       position_embedding_type="learned", max_relative_position=2),
    "sensory_only": dict(num_relational_heads=0, num_sensory_heads=4),
    # relational inductive biases: a sliding window for every head, a sparse graph for the relational heads only
    "sliding_window": dict(relational_bias="sliding_window", sliding_window_size=2),
    "sparse_relational": dict(relational_heads_bias="sparse", sparse_block_size=3, sparse_global_tokens=1),
}
CONFIG_IDS = list(CONFIGS)


GEN_INIT = 0.5  # varied greedy tokens
LOGIT_INIT = 0.1  # logits small enough for an absolute tolerance of 1e-5


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("initializer_range", LOGIT_INIT)
    return DATForCausalLM(tiny_config(**overrides)).eval()


def random_ids(batch, length, seed=1, low=1, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, length), generator=g)


@pytest.fixture(params=CONFIG_IDS)
def name(request):
    return request.param


@pytest.fixture
def gen_model(name):
    return make_model(initializer_range=GEN_INIT, **CONFIGS[name])


@pytest.fixture
def model(name):
    return make_model(**CONFIGS[name])


# ---- cache consistency ------------------------------------------------------------------------------------------


@torch.no_grad()
def test_greedy_cached_equals_uncached(gen_model):
    model = gen_model
    ids = random_ids(2, 5)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.sequences.shape == (2, 13)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)  # logits of magnitude ~10 here
    # the test is only meaningful if decoding is not degenerate
    assert len(set(cached.sequences[:, 5:].flatten().tolist())) > 3


@torch.no_grad()
def test_incremental_logits_match_full_forward(model):
    ids = random_ids(2, 10)
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :4], use_cache=True)
    torch.testing.assert_close(out.logits, full[:, :4], atol=ATOL, rtol=0)
    cache = output_cache(out)
    assert cache.get_seq_length() == 4
    for t in range(4, 7):  # one token at a time
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        torch.testing.assert_close(out.logits[:, -1], full[:, t], atol=ATOL, rtol=0)
        cache = output_cache(out)
    # then a chunk of several tokens at once on top of the cache (causal mask with an offset)
    out = model(ids[:, 7:10], cache=cache, use_cache=True)
    torch.testing.assert_close(out.logits, full[:, 7:10], atol=ATOL, rtol=0)
    assert output_cache(out).get_seq_length() == 10


@torch.no_grad()
def test_incremental_logits_with_attentions_match(model):
    """The explicit-weights path (`output_attentions=True`) with a cache gives the same logits."""
    ids = random_ids(1, 6)
    full = model(ids).logits
    out = model(ids[:, :3], use_cache=True, output_attentions=True)
    cache = output_cache(out)
    for t in range(3, 6):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True, output_attentions=True)
        torch.testing.assert_close(out.logits[:, -1], full[:, t], atol=ATOL, rtol=0)
        cache = output_cache(out)
        if out.attentions:  # over the cached tokens (a sliding-window layer keeps the window and the token)
            kept = t + 1 if model.config.layer_types[0] == "full_attention" else min(t + 1, model.config.sliding_window)
            assert out.attentions[0].shape[-2:] == (1, kept)


# Known bug, left open on purpose (see the report to the lead): the `sparse` graph (blocks, global tokens, explicit
# edges) is indexed by absolute positions in the padded row, so left padding moves the blocks and global tokens.
# The fix (map q_idx/kv_idx through `attention_mask.cumsum(-1) - 1` in `masking_dat._sparse_function`) contradicts
# tests/test_relational_biases.py::test_sparse_mask_matches_loop, which pins the absolute-index semantics; strict,
# so this xfail fails as soon as the behaviour is fixed and the marker must then be removed.
KNOWN_LEFT_PADDING_BUGS = {}  # name -> reason, for configs whose left-padded generation is known to differ


@torch.no_grad()
def test_left_padded_batch_matches_single_prompts(request, name, gen_model, model):
    if name in KNOWN_LEFT_PADDING_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_LEFT_PADDING_BUGS[name]))
    pad = 0
    prompts = [random_ids(1, n, seed=10 + n)[0] for n in (3, 6, 4)]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = p
        attention_mask[i, width - len(p) :] = 1
    assert (attention_mask[:, 0] == 0).any()  # really left-padded
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=pad)
    batched = gen_model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    for i, p in enumerate(prompts):
        alone = gen_model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i, width:], alone[0, len(p) :]), f"prompt {i} differs when left-padded"

    # the logits of the real tokens do not depend on the padding either
    logits = model(input_ids, attention_mask=attention_mask).logits
    for i, p in enumerate(prompts):
        alone = model(p[None]).logits[0]
        torch.testing.assert_close(logits[i, width - len(p) :], alone, atol=ATOL, rtol=0)


@torch.no_grad()
@torch.no_grad()
def test_self_speculative_decoding():
    """`assistant_early_exit=1`: Transformers drafts tokens with the model's first layer (it lowers
    `config.num_hidden_layers` for the draft's forwards) and checks them with every layer: the greedy tokens of plain
    decoding. A forward with `num_hidden_layers` lowered is the forward of the model cut to that depth."""
    model = make_model(initializer_range=GEN_INIT, num_hidden_layers=3)
    prompt = random_ids(1, 6)
    expected = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    got = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, assistant_early_exit=1)
    assert torch.equal(got, expected)
    assert model.config.num_hidden_layers == 3

    cut = make_model(initializer_range=GEN_INIT, num_hidden_layers=1)
    assert not cut.load_state_dict(model.state_dict(), strict=False).missing_keys  # (layer 0, embeddings, head)
    model.config.num_hidden_layers = 1
    try:
        early = model(prompt).logits
    finally:
        model.config.num_hidden_layers = 3
    torch.testing.assert_close(early, cut(prompt).logits, atol=ATOL, rtol=0)
    assert not torch.allclose(early, model(prompt).logits, atol=1e-3)


def test_beam_search_and_sampling(gen_model):
    model = gen_model
    ids = random_ids(2, 4)
    beams = model.generate(ids, num_beams=3, num_return_sequences=2, max_new_tokens=5, min_new_tokens=5,
                           do_sample=False, pad_token_id=0, use_cache=True)
    assert beams.shape == (4, 9)
    assert torch.equal(beams[::2, :4], ids) and torch.equal(beams[1::2, :4], ids)
    # beam search reorders the cache: it must give the same beams as recomputing everything
    beams_nocache = model.generate(ids, num_beams=3, num_return_sequences=2, max_new_tokens=5, min_new_tokens=5,
                                   do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(beams, beams_nocache)

    torch.manual_seed(0)
    sampled = model.generate(ids, do_sample=True, top_k=5, max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
    assert sampled.shape == (2, 9)
    assert torch.equal(sampled[:, :4], ids)
    assert sampled.min() >= 0 and sampled.max() < model.config.vocab_size
    # top-k: every sampled token is among the 5 most likely at its step (checked with a full forward)
    logits = model(sampled).logits[:, 3:-1]
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == sampled[:, 4:, None]).any(-1).all()


# ---- in-place cache layers ----------------------------------------------------------------------------------------
def test_in_place_cache_layer_behaves_like_dynamic_layer():
    """The same updates, crops, batch selections, repeats and beam reorderings on an `InPlaceCacheLayer` (capacity
    smaller than the final length, so it also grows) and a `DynamicLayer` give the same keys and values after every
    step, and views handed out earlier never change afterwards."""
    g = torch.Generator().manual_seed(0)

    def states(b, n):
        return torch.randn(b, 3, n, 4, generator=g), torch.randn(b, 1, n, 7, generator=g)

    ours, theirs = InPlaceCacheLayer(capacity=6), DynamicLayer()
    handed_out = []

    def step(op, *args):
        nonlocal theirs
        if op == "reset":  # a reset layer is a fresh one (Transformers 5.17's `DynamicLayer.reset` keeps zeroed keys)
            ours.reset()
            assert ours.keys is None and ours.values is None and not ours.is_initialized
            theirs = DynamicLayer()
            return None
        out = None
        for layer in (ours, theirs):
            out = getattr(layer, op)(*args) if op != "reorder" else layer.batch_select_indices(args[0])
        if op == "update":
            handed_out.append((ours.keys, ours.values, ours.keys.clone(), ours.values.clone()))
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), op
        assert ours.get_seq_length() == theirs.get_seq_length()
        return out

    step("update", *states(2, 5))
    step("update", *states(2, 1))
    step("update", *states(2, 1))  # 7 > capacity 6: grows
    step("crop", -2)
    step("update", *states(2, 1))  # overwrites a slot that an earlier view covered
    step("batch_repeat_interleave", 3)
    step("update", *states(6, 1))
    step("reorder", torch.tensor([5, 0, 0, 2, 1, 3]))
    step("update", *states(6, 2))
    step("batch_select_indices", torch.tensor([1, 4]))
    for _ in range(20):
        step("update", *states(2, 1))
    assert ours._buffers[0].shape[-2] < 2 * ours.get_seq_length() + 2  # grew by doubling, not per step
    step("reset")
    step("update", *states(2, 3))
    for keys, values, keys_then, values_then in handed_out:
        assert torch.equal(keys, keys_then) and torch.equal(values, values_then)
    assert ours._buffers[0].shape[-2] == 6  # reset: fresh buffers, sized by the capacity hint again


def test_packed_in_place_updates_give_the_packed_views():
    """A dual-attention layer's update written into an `InPlaceCacheLayer` part by part (`update_packed`) gives the
    views of packing, updating a `DynamicLayer` and unpacking, and the same keys and values, through growth, crops,
    batch selections and beam reorderings; views handed out earlier never change afterwards."""
    model = DATForCausalLM(tiny_config(num_relational_key_value_heads=1))
    packed = model.model.layers[0].dual_attn.packed  # keys: 1 relational + 2 sensory heads; values: 3 parts
    g = torch.Generator().manual_seed(0)

    def states(b, n):
        keys = torch.randn(b, sum(packed.key_heads), n, 8, generator=g)
        return keys, [torch.randn(b, n, width, generator=g) for width in packed.value_widths]

    ours, theirs, handed_out = InPlaceCacheLayer(capacity=4), DynamicLayer(), []

    def step(op, *args):
        if op == "update":
            got = ours.update_packed(packed, *args)
            expected = packed.unpack(*theirs.update(*packed.pack([args[0]], args[1])))
            for mine, reference in zip([*got[0], *got[1]], [*expected[0], *expected[1]]):
                assert mine.shape == reference.shape and torch.equal(mine, reference)
            handed_out.append([(view, view.clone()) for view in [*got[0], *got[1]]])
        else:
            for layer in (ours, theirs):
                getattr(layer, op)(*args)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), op
        assert ours.get_seq_length() == theirs.get_seq_length()

    step("update", *states(2, 3))
    for _ in range(3):
        step("update", *states(2, 1))  # 6 > capacity 4: grows
    step("crop", -2)
    step("update", *states(2, 1))  # overwrites a slot an earlier view covered
    step("batch_repeat_interleave", 2)
    step("update", *states(4, 1))
    step("batch_select_indices", torch.tensor([3, 0]))
    for _ in range(12):
        step("update", *states(2, 1))
    assert ours._buffers[0].shape[-2] < 2 * ours.get_seq_length() + 2
    for views in handed_out:
        assert all(torch.equal(view, then) for view, then in views)


@torch.no_grad()
def test_generate_appends_in_place():
    """generate's cache has in-place layers sized for the whole generation: no reallocation, nothing copied twice;
    a cache passed by the user keeps its own layers."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=GEN_INIT)).eval()
    ids = random_ids(2, 5)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    cache = output_cache(out)
    assert all(type(layer) is InPlaceCacheLayer for layer in cache.layers)
    for layer in cache.layers:
        assert layer._buffers[0].shape[-2] == 10  # max_length - 1 = 5 + 6 - 1 slots, allocated once
        assert layer.keys.data_ptr() == layer._buffers[0].data_ptr()
    mine = DynamicCache(config=model.config)
    model.generate(ids, max_new_tokens=3, do_sample=False, **cache_kwargs(mine))
    assert all(type(layer) is DynamicLayer for layer in mine.layers)
    # a plain forward with use_cache=True starts an in-place cache too
    assert all(type(layer) is InPlaceCacheLayer for layer in output_cache(model(ids, use_cache=True)).layers)


def test_training_forward_starts_no_cache():
    model = DATForCausalLM(tiny_config()).train()
    ids = random_ids(2, 5)
    assert output_cache(model(ids)) is None  # nothing would read it
    with torch.no_grad():
        assert output_cache(model(ids)) is not None
    assert output_cache(model.eval()(ids)) is not None


@pytest.mark.parametrize("name", ["symbolic_rope", "relative_rope", "positional_learned"])
def test_packed_sequences_attend_within_their_segment(name):
    """Two sequences packed in one row with restarting `position_ids` (no cache): each segment's logits equal those
    of the segment alone (the mask builder turns restarting positions into a block-diagonal causal mask)."""
    model = make_model(**CONFIGS[name]).train()  # training forward: no cache, as in packed training
    first, second = random_ids(1, 5, seed=3), random_ids(1, 4, seed=4)
    positions = torch.cat([torch.arange(5), torch.arange(4)])[None]
    packed = model(torch.cat([first, second], dim=1), position_ids=positions).logits
    torch.testing.assert_close(packed[:, :5], model(first).logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[:, 5:], model(second).logits, atol=ATOL, rtol=0)


# ---- forward outputs --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_logits_to_keep():
    model = make_model()
    ids = random_ids(2, 7)
    full = model(ids).logits
    assert full.shape == (2, 7, 97)
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 97)
    torch.testing.assert_close(last, full[:, -1:], atol=ATOL, rtol=0)
    last3 = model(ids, logits_to_keep=3).logits
    torch.testing.assert_close(last3, full[:, -3:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["symbolic_rope", "relu_relations"])
def test_labels_loss_is_shifted_cross_entropy(name):
    model = make_model(**CONFIGS[name])
    ids = random_ids(2, 7)
    labels = ids.clone()
    labels[0, :2] = -100  # ignored positions
    out = model(ids, labels=labels)
    manual = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, manual, atol=1e-6, rtol=1e-6)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


@torch.no_grad()
def test_output_hidden_states():
    model = make_model()
    ids = random_ids(2, 5)
    out = model(ids, output_hidden_states=True)
    n_layers = model.config.num_hidden_layers
    assert len(out.hidden_states) == n_layers + 1
    for h in out.hidden_states:
        assert h.shape == (2, 5, 32)
    # the first is the embedding output (RoPE adds nothing to it), the last the final (normed) hidden state
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))
    torch.testing.assert_close(out.hidden_states[-1], model.model(ids).last_hidden_state)
    # and the intermediate states differ from each other (really one per layer)
    assert not torch.allclose(out.hidden_states[1], out.hidden_states[2])
    # without the flag, nothing is returned
    assert model(ids).hidden_states is None


def _check_attention_weights(weights, batch, heads, n):
    assert weights.shape == (batch, heads, n, n)
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch, heads, n), atol=1e-5, rtol=0)
    above = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    assert (weights[..., above] == 0).all(), "causal attention weights must be zero above the diagonal"
    assert (weights >= 0).all()


@torch.no_grad()
def test_output_attentions(name):
    model = make_model(**CONFIGS[name])
    cfg = model.config
    b, n = 2, 6
    ids = random_ids(b, n)
    out = model(ids, output_attentions=True)
    # the explicit-weights path gives the same logits as the default (fused / sdpa) path
    torch.testing.assert_close(out.logits, model(ids).logits, atol=ATOL, rtol=0)

    L, h_s, h_r = cfg.num_hidden_layers, cfg.num_sensory_heads, cfg.num_relational_heads
    # one tensor per layer covering every head that `num_attention_heads` counts, sensory heads first
    assert out.attentions is not None and len(out.attentions) == L
    for w in out.attentions:
        _check_attention_weights(w, b, cfg.num_attention_heads, n)
    if h_r == 0:
        assert not out.relations
        return
    assert len(out.relations) == L
    for r in out.relations:
        assert r.shape == (b, cfg.relations, n, n)
        assert torch.isfinite(r).all()
        assert r.abs().sum() > 0
        if cfg.relation_activation == "relu":
            assert (r >= 0).all()
        if cfg.symmetric_relations:
            torch.testing.assert_close(r, r.transpose(-1, -2), atol=1e-6, rtol=0)
    if not cfg.symmetric_relations:
        assert not torch.allclose(out.relations[0], out.relations[0].transpose(-1, -2))
    if h_s == 0:
        return
    # sensory and relational heads have their own attention projections unless shared
    sensory, relational = out.attentions[0][:, :h_s], out.attentions[0][:, h_s:]
    if cfg.share_attention_params:
        torch.testing.assert_close(sensory, relational)
    else:
        assert not torch.allclose(sensory, relational)


@torch.no_grad()
def test_output_attentions_travel_in_kwargs():
    """`output_attentions` (the call's, else the config's) reaches every attention module through the kwargs: every
    head's weights and the relations come back whatever `attn_implementation` is, and `False` beats the config."""
    ids = random_ids(2, 6)
    seen, outputs = {}, {}
    for implementation in ("eager", "sdpa"):
        model = make_model()
        model.set_attn_implementation(implementation)
        calls = seen[implementation] = []
        model.model.layers[0].dual_attn.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(kwargs.get("output_attentions")), with_kwargs=True)
        out = outputs[implementation] = model(ids, output_attentions=True)
        assert len(out.attentions) == len(out.relations) == model.config.num_hidden_layers
        assert out.attentions[0].shape == (2, model.config.num_attention_heads, 6, 6)
        assert model(ids).attentions is None
    # the config's default (Transformers allows `config.output_attentions=True` with eager attention only)
    model.set_attn_implementation("eager")
    model.config.output_attentions = True
    from_config = model(ids)
    assert model(ids, output_attentions=False).relations is None
    assert seen == {"eager": [True, False], "sdpa": [True, False, True, False]}
    for a, b, c in zip(outputs["eager"].attentions + outputs["eager"].relations,
                       outputs["sdpa"].attentions + outputs["sdpa"].relations,
                       from_config.attentions + from_config.relations):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(b, c, atol=1e-6, rtol=0)


@torch.no_grad()
def test_output_attentions_with_left_padding():
    """Padded senders get zero weight; real receivers' rows still sum to one."""
    model = make_model()
    ids = random_ids(2, 5)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = model(ids, attention_mask=mask, output_attentions=True)
    for w in out.attentions:
        assert w.shape[1] == model.config.num_attention_heads
        assert (w[0, :, 2:, :2] == 0).all()
        torch.testing.assert_close(w[0, :, 2:].sum(-1), torch.ones(w.shape[1], 3), atol=1e-5, rtol=0)
        assert torch.isfinite(w).all()


# ---- activation checkpointing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,extra", [("symbolic_rope", {}), ("relu_relations", {}),
                                        ("relative_rope", dict(hidden_dropout=0.1, attention_dropout=0.1))])
def test_activation_checkpointing_same_loss_and_grads(name, extra):
    ids = random_ids(2, 8)
    results = []
    for checkpointing in (False, True):
        model = make_model(**CONFIGS[name], **extra).train()
        if checkpointing:
            enable_checkpointing(model)
        calls = []
        hook = model.model.layers[0].dual_attn.register_forward_hook(lambda *a: calls.append(1))
        torch.manual_seed(123)  # same dropout masks (checkpointing must preserve the RNG state on recompute)
        loss = model(ids, labels=ids).loss
        loss.backward()
        hook.remove()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, len(calls)))
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results
    assert calls0 == 1
    assert calls1 == 2, "with checkpointing the layer must be recomputed in the backward pass"
    torch.testing.assert_close(loss1, loss0, atol=1e-6, rtol=0)
    assert grads0.keys() == grads1.keys() and len(grads0) > 0
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], atol=1e-5, rtol=1e-4, msg=f"gradient of {k}")


# ---- sequence classification ------------------------------------------------------------------------------------


def make_classifier(**overrides):
    torch.manual_seed(0)
    cfg = tiny_config(num_labels=3, pad_token_id=0, initializer_range=LOGIT_INIT, **overrides)
    return DATForSequenceClassification(cfg).eval()


@pytest.mark.parametrize("name", ["symbolic_rope", "positional_learned", "relative_rope"])
def test_sequence_classification_loss_and_padding(name):
    model = make_classifier(**CONFIGS[name])
    seqs = [random_ids(1, n, seed=20 + n)[0] for n in (4, 6, 3)]
    width = 6
    labels = torch.tensor([0, 2, 1])

    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits for s in seqs])
    assert alone.shape == (3, 3)

    # right padding, with attention_mask
    right = torch.zeros(3, width, dtype=torch.long)
    right_mask = torch.zeros_like(right)
    # left padding, with attention_mask
    left = torch.zeros(3, width, dtype=torch.long)
    left_mask = torch.zeros_like(left)
    for i, s in enumerate(seqs):
        right[i, : len(s)], right_mask[i, : len(s)] = s, 1
        left[i, width - len(s) :], left_mask[i, width - len(s) :] = s, 1

    out = model(right, attention_mask=right_mask, labels=labels)
    assert out.logits.shape == (3, 3)
    assert out.loss.shape == ()
    torch.testing.assert_close(out.logits, alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels), atol=1e-6, rtol=1e-6)

    with torch.no_grad():
        torch.testing.assert_close(model(left, attention_mask=left_mask).logits, alone, atol=ATOL, rtol=0)
        # right padding without a mask: the last non-pad token is found from pad_token_id
        torch.testing.assert_close(model(right).logits, alone, atol=ATOL, rtol=0)

    out.loss.backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0


def test_sequence_classification_regression():
    torch.manual_seed(0)
    cfg = tiny_config(num_labels=1, pad_token_id=0)
    model = DATForSequenceClassification(cfg)
    ids = random_ids(2, 5)
    target = torch.tensor([0.5, -1.0])
    out = model(ids, labels=target)
    assert out.logits.shape == (2, 1)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), target), atol=1e-6, rtol=1e-6)
