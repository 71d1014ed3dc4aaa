"""Continuous batching (`generate_batch`: Transformers' manager, packed batches of many requests over its paged cache)
gives, request by request, what `generate` gives for each prompt alone.

The models are those of tests/test_cached_scores.py (spread logits, so that the next token depends on the whole
prefix: checked here too, else equal tokens would prove nothing). Prompts of 1 to 100 tokens in pages of 16 tokens and
batches of at most 48 tokens: long prompts are prefilled in chunks that read their own earlier chunks back from the
cache, beside other requests' decoding steps.
"""

import copy

import pytest
import torch
import transformers
from conftest import tiny_config
from packaging.version import Version
from test_cached_scores import DEPENDENCE, INIT, recomputed_logits
from test_relational_biases import registered
from transformers import ContinuousBatchingConfig, GenerationConfig

import dat_hf.dual_attention as da
import dat_hf.kernels.cpu as kernel
import dat_hf.kernels.projections as projections
from dat_hf import DATForCausalLM
from dat_hf.kernels import cpu_build
from dat_hf.cache_dat import PAGED_ARGUMENTS, paged_layout, paged_views
from dat_hf.relational_biases import RelationalBias
from dat_hf.transformers_compat import CB, INTERNALS, paged_cache_limits

PROMPT_LENGTHS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 77, 89, 100)
NEW_TOKENS = 5
ATOL = 1e-4  # float32 log-probabilities: packed and single-request sums differ by ~1e-6
PAGED_API = Version(transformers.__version__).release >= (5, 24)  # (`paged_cache_limits` is tested against it)


def model_of(**overrides):
    torch.manual_seed(0)
    return DATForCausalLM(tiny_config(initializer_range=INIT, max_position_embeddings=128, **overrides)).eval()


def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 97, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generation_config(**overrides):
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs.update(overrides)
    return GenerationConfig(**kwargs)


def generate_batch(model, inputs, config, **cb_overrides):
    """`generate_batch` with a small paged cache (sized, not inferred from the machine's memory) -> outputs in
    request order (request `req_i`, forks `req_i__1`, ...)."""
    cb_kwargs = dict(page_size=16, num_blocks=160, max_batch_tokens=48, return_logprobs=True)
    cb_kwargs.update(cb_overrides)
    outputs = model.generate_batch(inputs, generation_config=copy.deepcopy(config),
                                   continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs))
    for output in outputs.values():
        assert output.error is None, output.error
    return [outputs[key] for key in sorted(outputs, key=lambda key: (int(key.split("_")[1]), key))]


def greedy_alone(model, prompt):
    """`generate` on one prompt: (tokens, log-probabilities of the chosen tokens)."""
    out = model.generate(torch.tensor([prompt]),
                         generation_config=generation_config(output_logits=True, return_dict_in_generate=True))
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.stack(out.logits, dim=1)[0].log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs


def assert_prefix_matters(model, prompt, tokens):
    sequence = torch.tensor([prompt + tokens])
    expected, alone = recomputed_logits(model, sequence, torch.ones(1, len(prompt), dtype=torch.long), len(prompt))
    first = 1 if len(prompt) == 1 else 0  # (a one-token prompt's first step has no prefix)
    assert (expected - alone)[:, first:].abs().amax(dim=-1).min() > DEPENDENCE, "the prefix barely matters: no test"
    return expected[0]


GQA = dict(num_sensory_key_value_heads=1, num_relational_key_value_heads=1)
# a bias registered at run time: receivers attend to the senders of their position's parity
PARITY = RelationalBias("same_parity", relations="the tokens of the same parity", symmetry="even translations",
                        ordered=False, layer_type="full_attention",
                        mask_function=lambda config, device, **inputs: lambda b, h, q, kv: (q - kv) % 2 == 0)
CASES = {
    "default": dict(),
    "gqa": GQA,
    # every head on a window of 3 previous tokens: Transformers' sliding allocator (a ring of 4 tokens per request)
    "sliding-window": dict(relational_bias="sliding_window", sliding_window_size=3),
    # one full and one sliding layer: both allocators, a mask per layer type
    "full-and-sliding-layers": dict(relational_bias=["causal", "sliding_window"], sliding_window_size=3),
    "position-relative-symbols": dict(symbol_retrieval="position_relative"),
    "positional-symbols": dict(symbol_retrieval="positional"),
    "shared-attention-params": dict(share_attention_params=True),
    # every bias from its registry entry, for both head types, with GQA: the fixed sparse graph (global tokens), a bias
    # registered at run time (`PARITY`), and layers whose two head types have different graphs (a window on one:
    # full-attention layers, the window from the tokens' positions)
    "sparse": dict(relational_bias="sparse", sparse_block_size=4, sparse_global_tokens=1),
    "registered-relational-heads-gqa": dict(relational_heads_bias="same_parity", **GQA),
    "registered-both-head-types": dict(relational_bias="same_parity"),
    "registered-sensory-window-relational-gqa": dict(relational_bias="same_parity", **GQA,
                                                     relational_heads_bias="sliding_window", sliding_window_size=3),
    "window-relational-heads-gqa": dict(relational_heads_bias="sliding_window", sliding_window_size=3, **GQA),
    "window-sensory-heads": dict(relational_bias="sliding_window", relational_heads_bias="causal",
                                 sliding_window_size=3),
}


@pytest.mark.skipif(not PAGED_API, reason="the floor release's refusal is tested below")
@pytest.mark.parametrize("name", list(CASES))
def test_generate_batch_equals_generate_alone(name):
    with registered(PARITY):
        generate_batch_equals_generate_alone(model_of(**CASES[name]))


def generate_batch_equals_generate_alone(model):
    inputs = prompts()
    outputs = generate_batch(model, inputs, generation_config())
    assert [output.prompt_ids for output in outputs] == inputs
    for prompt, output in zip(inputs, outputs):
        tokens, logprobs = greedy_alone(model, prompt)
        assert output.generated_tokens == tokens, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(torch.tensor(output.logprobs), logprobs, atol=ATOL, rtol=0)
    for prompt in (inputs[4], inputs[-1]):
        assert_prefix_matters(model, prompt, greedy_alone(model, prompt)[0])


@pytest.mark.skipif(not PAGED_API, reason="the floor release's refusal is tested below")
@pytest.mark.parametrize("num_return_sequences", [1, 2])
def test_seeded_sampling_scores_equal_recomputation(num_return_sequences):
    """Sampled tokens (seeded: the same twice) with their log-probabilities, those of one forward over each whole
    sequence; with `num_return_sequences=2` each request is forked after its prefill (the forks share its cache)."""
    model = model_of(num_relational_key_value_heads=1)
    inputs = prompts()[::2] if num_return_sequences > 1 else prompts()
    config = generation_config(do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                               num_return_sequences=num_return_sequences)
    torch.manual_seed(3)
    outputs = generate_batch(model, inputs, config)
    torch.manual_seed(3)
    again = generate_batch(model, inputs, config)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in again]
    assert len(outputs) == num_return_sequences * len(inputs)
    for i, output in enumerate(outputs):
        prompt = inputs[i // num_return_sequences]
        assert output.prompt_ids == prompt
        logits = assert_prefix_matters(model, prompt, output.generated_tokens)
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(output.generated_tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=ATOL, rtol=0)
    if num_return_sequences > 1:  # (the forks sample apart)
        assert any(a.generated_tokens != b.generated_tokens for a, b in zip(outputs[::2], outputs[1::2]))


@pytest.mark.skipif(not PAGED_API, reason="the floor release's refusal is tested below")
@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
def test_relational_backends_over_paged_batches_equal_the_reference(backend):
    """Each fast relational backend over the packed batches and the paged mask (as bool, with receiver blocks)
    against the eager reference over the same batches (`relational_attn_implementation` pins one per run)."""
    if backend == "cpu":
        assert kernel.load_cpu_kernel(), f"the CPU kernel did not build: {cpu_build._STATE['error']}"
    inputs = prompts()
    reference, fast = (generate_batch(model_of(relational_attn_implementation=name, num_relational_key_value_heads=1),
                                      inputs, generation_config()) for name in ("eager", backend))
    for expected, output in zip(reference, fast):
        assert output.generated_tokens == expected.generated_tokens
        torch.testing.assert_close(torch.tensor(output.logprobs), torch.tensor(expected.logprobs), atol=ATOL, rtol=0)


@pytest.mark.skipif(not PAGED_API, reason="the floor release's refusal is tested below")
def test_prefix_sharing_reuses_the_pages_of_a_common_prefix(monkeypatch):
    """Prompts with a common 40-token prefix: the later requests take the first two 16-token pages of the earlier
    one's cache (the manager's prefix sharing) instead of recomputing them, and still give `generate`'s tokens."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    shared = []
    search = PagedAttentionCache.search_prefix_match
    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match",
                        lambda self, *args: shared.append(search(self, *args)) or shared[-1])
    model = model_of()
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(1, 97, (40,), generator=generator).tolist()
    inputs = [prefix + torch.randint(1, 97, (n,), generator=generator).tolist() for n in (1, 3, 7, 12, 20, 2)]
    outputs = generate_batch(model, inputs, generation_config())
    assert shared.count(32) >= 3 and max(shared) == 32  # (requests scheduled after the first one's pages filled)
    for prompt, output in zip(inputs, outputs):
        assert output.generated_tokens == greedy_alone(model, prompt)[0]


@pytest.mark.skipif(not PAGED_API, reason="the floor release's refusal is tested below")
def test_eager_heads_run_as_paged_eager_and_come_back():
    """A model on `eager` runs as Transformers' `paged|eager` during continuous batching (DAT's heads read the paged
    cache themselves) and is `eager` again after it."""
    model = model_of()
    model.set_attn_implementation("eager")
    inputs = prompts()[:6]
    outputs = generate_batch(model, inputs, generation_config())
    assert model.config._attn_implementation == "eager"
    for prompt, output in zip(inputs, outputs):
        assert output.generated_tokens == greedy_alone(model, prompt)[0]


@pytest.mark.skipif(not PAGED_API, reason="the floor release's refusal is tested below")
def test_decoding_steps_attend_one_receiver_per_request(monkeypatch):
    """A batch of decoding steps (one new token per request) runs both head types as one-receiver rows over the
    packed keys: the CPU kernel's decoding op, which reads each request's senders only (the sensory heads through it
    without relations, which also take steps of fewer than `FUSED_PROJECTION_MIN_ROWS` rows; prefills: the packed
    op)."""
    assert kernel.load_cpu_kernel(), f"the CPU kernel did not build: {cpu_build._STATE['error']}"
    calls = {"decode": 0, "decode without relations": 0, "packed": 0}

    def count(name, original):
        def counted(*args, **kwargs):
            if name == "decode" and args[3].shape[2] == 0:  # (relation queries [b, 1, R, d_r])
                name_ = "decode without relations"
            else:
                name_ = name
            calls[name_] += 1
            return original(*args, **kwargs)
        return counted

    for name, op in (("decode", "relational_decode_op"), ("packed", "relational_attention_op")):
        monkeypatch.setattr(kernel, op, count(name, getattr(kernel, op)))
    model = model_of()
    inputs = prompts()[:4]
    outputs = generate_batch(model, inputs, generation_config(), max_batch_tokens=256)
    layers = model.config.num_hidden_layers
    # one prefill step for all four, of 11 rows: the relational heads' packed op, the sensory heads' rows op
    assert sum(map(len, inputs)) < projections.FUSED_PROJECTION_MIN_ROWS
    assert calls == {"decode": layers * (NEW_TOKENS - 1), "decode without relations": layers * NEW_TOKENS,
                     "packed": layers}
    for prompt, output in zip(inputs, outputs):
        assert output.generated_tokens == greedy_alone(model, prompt)[0]


def test_packed_cache_fits_the_paged_pages():
    """`DATConfig.num_key_value_heads` heads of `head_dim` hold a layer's packed token in two halves, with less than
    one pair of heads of padding: the widths the layers cache (`PackedCache`)."""
    for overrides in [{}, *CASES.values(), dict(num_sensory_heads=0), dict(num_relational_heads=0),
                      dict(num_relations=3, relation_dim=5)]:
        with registered(PARITY):
            model = model_of(**overrides)
        config, packed = model.config, model.model.layers[0].dual_attn.packed
        width = sum(packed.key_heads) * config.head_dim + sum(packed.value_widths)
        assert config.packed_cache_width == width, overrides
        assert 0 <= 2 * config.num_key_value_heads * config.head_dim - width < 2 * config.head_dim, overrides
        # the layout `update_packed` stores (as the views without a copy read it): the config's heads, padding to
        # two halves, every part once, in order
        parts = (sum(packed.key_heads) * config.head_dim, *packed.value_widths)
        heads, padding, pieces = paged_layout(parts, config.head_dim)
        half = heads * config.head_dim
        assert (heads, padding) == (config.num_key_value_heads, 2 * half - width), overrides
        flat = [(0 if h == 0 else half) + a if h is not None else a for h, a, _ in pieces]
        assert flat == [sum(parts[:i]) for i in range(len(parts))], overrides
        for (h, start, end), part in zip(pieces, parts):
            assert (end - start if h is not None else half - start + end) == part, overrides


def joined_halves(packed, halves, widths):
    """The paged cache's halves read back by joining them (a copy): the obvious reading `paged_views` is held to."""
    n = halves[0].shape[2]
    tokens = torch.cat([half.transpose(1, 2).reshape(1, n, -1) for half in halves], dim=-1)
    keys, *values = tokens[..., :sum(widths)].split(widths, dim=-1)
    return packed.views(keys.view(1, n, -1, packed.head_dim).transpose(1, 2), values)


def test_paged_views_without_copy_equal_the_joined_halves():
    """The read of the paged cache (`cache_dat.paged_views`: strided views of the pages) gives the tensors of the
    halves joined, for every layout of the parts."""
    for overrides in [{}, *CASES.values(), dict(num_sensory_heads=0), dict(num_relational_heads=0),
                      dict(num_relations=3, relation_dim=5)]:
        with registered(PARITY):
            model = model_of(**overrides)
        config, packed = model.config, model.model.layers[0].dual_attn.packed
        widths = (sum(packed.key_heads) * config.head_dim, *packed.value_widths)
        halves = [torch.randn(1, config.num_key_value_heads, 11, config.head_dim) for _ in range(2)]
        expected, got = joined_halves(packed, halves, widths), paged_views(packed, halves, widths)
        for want, have in zip([*expected[0], *expected[1]], [*got[0], *got[1]], strict=True):
            assert want.shape == have.shape and torch.equal(want, have), overrides


@pytest.mark.parametrize("overrides, field", [
    (dict(relational_heads_bias="graph"), "`relational_heads_bias`='graph': its graph comes with each input "
                                          "(`graph_adjacency`)"),
    (dict(relational_attn_implementation="flex_attention"), "`relational_attn_implementation`='flex_attention'"),
])
def test_unservable_configurations_are_refused_by_name(overrides, field):
    model = model_of(**overrides)
    with pytest.raises(ValueError, match="Continuous batching cannot serve this DAT model") as error:
        model.init_continuous_batching(generation_config=generation_config())
    assert field in str(error.value)


def test_encoder_decoder_is_refused_by_name():
    from dat_hf import DATForSeq2SeqLM, DATSeq2SeqConfig

    model = DATForSeq2SeqLM(DATSeq2SeqConfig(vocab_size=50, hidden_size=32, encoder_layers=1, decoder_layers=1))
    with pytest.raises(ValueError, match="DATSeq2SeqConfig is an encoder-decoder"):
        model.generate_batch([[1, 2, 3]], generation_config=generation_config())


def test_paged_cache_api_of_the_installed_release():
    """DAT's layers use the paged cache of Transformers 5.24 on (`PagedCache`, the seam's continuous-batching
    internals): on a release whose paged cache differs, continuous batching is refused naming what moved; on the
    others the forward takes every argument the manager hands it."""
    import inspect

    paged = [internal for internal in INTERNALS if internal.feature == CB and internal.name.endswith(".update")]
    assert [internal.parameters for internal in paged] == [("self", "key_states", "value_states", "layer_idx",
                                                            "kwargs")]
    if PAGED_API:
        assert paged_cache_limits() is None
        from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

        # what the manager hands the forward: the model's own arguments, or the batch's, which the forward takes out
        forward = set(inspect.signature(DATForCausalLM.forward).parameters) | {"logits_to_keep"}
        assert set(PagedAttentionArgs.__annotations__) - forward == set(PAGED_ARGUMENTS)
    else:
        with pytest.raises(ValueError, match="PagedAttentionCache.update"):
            model_of().init_continuous_batching(generation_config=generation_config())
