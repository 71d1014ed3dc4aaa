"""`cache_implementation="static"` and compiled decoding.

- greedy generation with a `StaticCache` gives the tokens of the default (dynamic) cache, for the causal LM over
  relational biases, GQA, left padding, non-identity relations and position-relative symbols (the reference
  backend), and for the seq2seq model with dual cross-attention;
- `generate(..., cache_implementation="static", compile_config=CompileConfig(fullgraph=True))` traces the decoding
  step as one graph (no graph break) that serves every step (no recompilation), same tokens; the graph is one that
  CUDA graphs can hold (what generate's compiled decoding uses on a GPU): no op they refuse, and every input it writes
  (the cache's buffers) at a fixed address;
- a `StaticCache` passed by the user gets DAT's layers; one filled by another model is refused with a clear error;
- a chunked prefill (`prefill_chunk_size`) gives the generation of one prefill, into dynamic and static caches, also
  compiled;
- a model whose layers use the `sliding_window` graph on both head types gets sliding-window cache layers
  (`DATConfig.layer_types`): static ones of `window + 1` slots, whatever the length, which give the logits of
  generation without a cache (as do the dynamic ones) whether the prompt or the decoding fills the window, with left
  padding, GQA, position-relative symbols and layers of both kinds, and beam search's scores; one compiled graph
  serves every step, also across the step that fills the window; the seq2seq decoder's self-attention likewise, its
  cross-attention caches keeping the whole source. (The static ones are the ring `import dat_hf` installs; each kind of
  update is also checked on the remote code's own layers, which roll the window.)
"""

import pytest
import torch
from conftest import set_torch_config, tiny_config, use_transformers_cache_layers
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import get_first_incompatible_cudagraph_node
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticLayer

from dat_hf import DATForCausalLM, DATForSeq2SeqLM, DATSeq2SeqConfig
from dat_hf.cache_dat import DATStaticLayer, DATStaticSlidingWindowLayer, RingSlidingWindowLayer
from dat_hf.transformers_compat import output_cache

LM_CASES = {
    "default": (dict(), False),
    "gqa-left-padded": (dict(num_relational_key_value_heads=1, num_sensory_key_value_heads=1), True),
    "sliding-window": (dict(relational_bias="sliding_window", sliding_window_size=3), True),
    "sparse-relational": (dict(relational_heads_bias="sparse", sparse_block_size=4, sparse_global_tokens=1), True),
    "relu-relations": (dict(relation_activation="relu"), False),
    "position-relative-symbols": (dict(symbol_retrieval="position_relative"), False),
}


def prompt_and_mask(padded, batch=2, n=7):
    torch.manual_seed(1)
    prompt = torch.randint(1, 97, (batch, n))
    mask = torch.ones_like(prompt)
    if padded:
        mask[0, :3] = 0
    return prompt, mask


def tiny_model_and_prompt(overrides, padded):
    """(the tiny LM with `overrides`, prompt, padding mask)."""
    torch.manual_seed(0)
    return (DATForCausalLM(tiny_config(**overrides)).eval(), *prompt_and_mask(padded))


def greedy(model, prompt, mask, **kwargs):
    """(tokens, the logits of every step, the cache)."""
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits), output_cache(out)


def assert_same_generation(got, expected):
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)  # the logits, not only their argmax


@pytest.mark.parametrize("name", list(LM_CASES))
def test_static_cache_generation_equals_dynamic(name):
    model, prompt, mask = tiny_model_and_prompt(*LM_CASES[name])
    expected = greedy(model, prompt, mask)
    got = greedy(model, prompt, mask, cache_implementation="static")
    assert_same_generation(got, expected)


# the decoder's window on the relational heads only (full cache layers), or on both head types (sliding ones)
SEQ2SEQ_WINDOWS = {"relational-window": dict(relational_heads_bias="sliding_window"),
                   "window-on-both": dict(relational_bias="sliding_window")}


def seq2seq_model(window="relational-window"):
    torch.manual_seed(3)
    config = DATSeq2SeqConfig(vocab_size=40, hidden_size=32, encoder_layers=2, num_hidden_layers=2,
                              num_sensory_heads=2, num_relational_heads=2, cross_attention="dual",
                              intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
                              decoder_start_token_id=1, pad_token_id=0, sliding_window_size=3,
                              **SEQ2SEQ_WINDOWS[window])
    return DATForSeq2SeqLM(config).eval()


@pytest.mark.parametrize("window", list(SEQ2SEQ_WINDOWS))
def test_seq2seq_static_cache_generation_equals_dynamic(window):
    """... and generation without a cache; with the window on both head types the decoder's self-attention caches
    keep 4 slots, while the cross-attention caches (made from the same config) keep the whole source."""
    model = seq2seq_model(window)
    source = torch.randint(2, 40, (2, 9))
    mask = torch.ones_like(source)
    mask[1, 6:] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = model.generate(source, use_cache=False, **kwargs)
    for implementation in ("dynamic", "static"):
        got = model.generate(source, cache_implementation=implementation, **kwargs)
        assert_same_generation((got.sequences, torch.stack(got.logits)),
                               (expected.sequences, torch.stack(expected.logits)))
        cache = output_cache(got)
        sliding = window == "window-on-both"
        for layer in cache.self_attention_cache.layers:
            assert layer.is_sliding == sliding, implementation
            assert not sliding or layer.keys.shape[-2] == 4 - (implementation == "dynamic"), implementation
        for layer in cache.cross_attention_cache.layers:
            assert not layer.is_sliding and layer.keys.shape[-2] == 9, implementation


def cuda_graph_check(graphs):
    """A torch.compile backend that runs the traced step as AOTAutograd's aten graph (no code generation) and appends
    to `graphs`, per graph, what would make inductor skip CUDA graphs on a GPU (generate's compiled decoding there uses
    them): an op they cannot hold (a host sync such as `.item()`, `_assert_scalar`, a data-dependent shape) and the
    inputs the step writes to that are not at a fixed address (`mark_static_address`, or parameters and buffers).
    (A function: `CompileConfig` deep-copies its fields, which would copy an object holding the list.)"""

    def backend(graph, example_inputs):
        fixed = {i for i, t in enumerate(example_inputs)
                 if isinstance(t, torch.nn.Parameter) or hasattr(t, "_dynamo_static_input_type")}

        def inspect(aten_graph, _):
            inputs = [node for node in aten_graph.graph.nodes if node.op == "placeholder"]
            written = {inputs.index(node.args[0]) for node in aten_graph.graph.nodes
                       if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder"}
            graphs.append(dict(unsafe_op=get_first_incompatible_cudagraph_node(aten_graph), written=written,
                               moving=written - fixed))
            return aten_graph.forward

        return aot_autograd(fw_compiler=inspect, keep_inference_input_mutations=True)(graph, example_inputs)

    return backend


def assert_cuda_graph_safe(graphs):
    (graph,) = graphs
    assert graph["written"], "the step writes no cache buffer: nothing was checked"
    assert graph["unsafe_op"] is None, f"CUDA graphs cannot hold {graph['unsafe_op'].format_node()}"
    assert not graph["moving"], f"inputs {graph['moving']} are written by the step but not at fixed addresses"


def compile_config(backend):
    """Compiled decoding on this CPU machine: Dynamo traces the whole step (`fullgraph`), `backend` runs it (what is
    checked here is the graph; inductor's code generation is what `scripts/benchmark.py` times)."""
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True
    return config


@pytest.fixture
def dynamo_counters():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["sliding-window", "relu-relations", "decoding-fills-window"])
def test_compiled_static_decoding_is_one_graph(name, dynamo_counters):
    model, prompt, mask = tiny_model_and_prompt(*{**LM_CASES, **SLIDING_CASES}[name])
    expected = greedy(model, prompt, mask)
    graphs = []
    got = greedy(model, prompt, mask, cache_implementation="static",
                 compile_config=compile_config(cuda_graph_check(graphs)))
    assert_same_generation(got, expected)
    assert dict(dynamo_counters["graph_break"]) == {}
    assert dynamo_counters["stats"]["unique_graphs"] == 1  # one trace served all nine decoding steps
    assert_cuda_graph_safe(graphs)


@pytest.mark.parametrize("name", ["default", "gqa-left-padded", "sliding-window"])
def test_compiled_static_decoding_with_flex_attention_is_one_graph(name, dynamo_counters):
    """Every head on FlexAttention: `create_masks_for_generate` hands the compiled step dense masks (Transformers
    passes tensors), which become BlockMasks inside its one graph; the tokens and logits are those of SDPA without a
    compiled step, and the graph is CUDA-graph safe."""
    model, prompt, mask = tiny_model_and_prompt(*LM_CASES[name])
    expected = greedy(model, prompt, mask)
    model.set_attn_implementation("flex_attention")
    model.config.relational_attn_implementation = "flex_attention"  # (decoding steps would pick `cpu`)
    graphs = []
    got = greedy(model, prompt, mask, cache_implementation="static",
                 compile_config=compile_config(cuda_graph_check(graphs)))
    assert_same_generation(got, expected)
    assert {layer.dual_attn.relational.relational_attention_backend for layer in model.model.layers} == {
        "flex_attention"}
    assert dict(dynamo_counters["graph_break"]) == {}
    assert_cuda_graph_safe(graphs)


def test_inductor_compiled_flex_attention_decoding_on_cpu(request):
    """The same step compiled by inductor on CPU, where its C++ FlexAttention template reads a view that starts past
    its buffer's beginning from the buffer's start (the sensory heads' slice of the cache would read the relational
    heads' keys; `sensory_attention.flex_inputs` hands it copies): the logits of SDPA without a compiled step.
    (Inductor cannot fuse the ops after that template, so this compiles with `epilogue_fusion` off.)"""
    set_torch_config(request, torch._inductor.config, "epilogue_fusion", False)
    model, prompt, mask = tiny_model_and_prompt(*LM_CASES["gqa-left-padded"])
    expected = greedy(model, prompt, mask)
    model.set_attn_implementation("flex_attention")
    model.config.relational_attn_implementation = "flex_attention"
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    assert_same_generation(greedy(model, prompt, mask, cache_implementation="static", compile_config=config),
                           expected)


# sliding-window cache layers: the tiny model's two layers, prompts of 7 tokens, 10 new ones
SLIDING_CASES = {
    "prompt-fills-window": (dict(relational_bias="sliding_window", sliding_window_size=3), True),  # 4 slots
    "decoding-fills-window": (dict(relational_bias="sliding_window", sliding_window_size=9,  # 10 slots
                                   num_relational_key_value_heads=1, num_sensory_key_value_heads=1), True),
    "position-relative-symbols": (dict(relational_bias="sliding_window", sliding_window_size=4,
                                       symbol_retrieval="position_relative"), True),
    "a-sliding-and-a-causal-layer": (dict(relational_bias=["causal", "sliding_window"], sliding_window_size=2), True),
}


def test_layer_types_follow_the_graphs_of_both_head_types():
    assert tiny_config(relational_bias="sliding_window", sliding_window_size=3).layer_types == ["sliding_attention"] * 2
    assert tiny_config(relational_bias="sliding_window", sliding_window_size=3).sliding_window == 4
    mixed = tiny_config(relational_bias=["causal", "sliding_window"], sliding_window_size=3)
    assert mixed.layer_types == ["full_attention", "sliding_attention"]
    # a window on one head type of some layer: its mask is shared with full layers, so no layer slides
    one_sided = tiny_config(relational_bias="sliding_window", relational_heads_bias=["sliding_window", "causal"],
                            sliding_window_size=3)
    assert one_sided.layer_types == ["full_attention"] * 2
    assert tiny_config().layer_types == ["full_attention"] * 2 and tiny_config().sliding_window is None
    config = tiny_config()
    config.sliding_window = 5  # Transformers' name, as its tests set it
    assert config.sliding_window_size == 4
    assert "layer_types" not in tiny_config().to_dict()  # derived, not saved


@pytest.mark.parametrize("name", list(SLIDING_CASES))
def test_sliding_window_caches_give_the_logits_of_generation_without_a_cache(name):
    model, prompt, mask = tiny_model_and_prompt(*SLIDING_CASES[name])
    expected = greedy(model, prompt, mask, use_cache=False)
    window = model.config.sliding_window
    for implementation, sliding_layer in (("static", RingSlidingWindowLayer),
                                          ("dynamic", DynamicSlidingWindowLayer)):
        got = greedy(model, prompt, mask, cache_implementation=implementation)
        assert_same_generation(got, expected)
        for layer, layer_type in zip(got[2].layers, model.config.layer_types):
            assert isinstance(layer, sliding_layer) == (layer_type == "sliding_attention"), implementation
            if layer_type == "sliding_attention":  # the window and the token, of 17 tokens
                assert layer.keys.shape[-2] == window - (implementation == "dynamic"), implementation


def test_beam_search_with_sliding_window_caches():
    """Beams reorder the sliding-window layers (`reorder_cache`): the sequences of beam search without a cache."""
    model, prompt, mask = tiny_model_and_prompt(*SLIDING_CASES["prompt-fills-window"])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, num_beams=3, num_return_sequences=3,
                  do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    expected = model.generate(prompt, use_cache=False, **kwargs)
    for implementation in ("dynamic", "static"):
        got = model.generate(prompt, cache_implementation=implementation, **kwargs)
        assert torch.equal(got.sequences, expected.sequences), implementation
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("symbols", ["symbolic_attention", "position_relative"])
def test_chunks_into_a_sliding_window_static_cache(symbols, ring, monkeypatch):
    """Every kind of update of a sliding-window static layer (6 slots), DAT's ring or Transformers' window rolled
    oldest first: one token before and once the window is full, several tokens that fit, that fill it, and after it
    is full; each chunk's logits are the full forward's."""
    if not ring:
        use_transformers_cache_layers(monkeypatch)
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(relational_bias="sliding_window", sliding_window_size=5,
                                       symbol_retrieval=symbols)).eval()
    tokens = torch.randint(1, 97, (2, 15))
    cache = StaticCache(config=model.config, max_cache_len=32)
    logits, start = [], 0
    with torch.no_grad():
        expected = model(tokens).logits
        for size in (1, 1, 5, 1, 4, 1, 2):
            positions = torch.arange(start, start + size)[None].expand(2, -1)
            logits.append(model(tokens[:, start:start + size], cache=cache, position_ids=positions).logits)
            start += size
    layer_class = RingSlidingWindowLayer if ring else DATStaticSlidingWindowLayer
    assert all(type(layer) is layer_class and layer.keys.shape[-2] == 6 for layer in cache.layers)
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-5, rtol=0)
    cache.reset()  # and again from the start
    with torch.no_grad():
        again = model(tokens[:, :9], cache=cache).logits
    torch.testing.assert_close(again, expected[:, :9], atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["gqa-left-padded", "sliding-window", "position-relative-symbols"])
def test_chunked_prefill_gives_the_generation_of_one_prefill(name, cache):
    """`prefill_chunk_size=3`: the prompt goes in chunks (Transformers 5.23 initializes a static cache for them ahead,
    with one shape for keys and values, which DAT declines: its layers size themselves at the first update); the
    tokens and logits of a prefill in one piece."""
    model, prompt, mask = tiny_model_and_prompt(*{**LM_CASES, **SLIDING_CASES}[name])
    expected = greedy(model, prompt, mask)
    assert_same_generation(greedy(model, prompt, mask, cache_implementation=cache, prefill_chunk_size=3), expected)


def test_compiled_chunked_prefill(dynamo_counters):
    """With a compile config, Transformers 5.23 compiles the chunks of a chunked prefill as well as the decoding
    steps: the tokens and logits of eager generation."""
    model, prompt, mask = tiny_model_and_prompt(*LM_CASES["gqa-left-padded"])
    expected = greedy(model, prompt, mask)
    got = greedy(model, prompt, mask, cache_implementation="static", prefill_chunk_size=3,
                 compile_config=compile_config("eager"))
    assert_same_generation(got, expected)
    assert dict(dynamo_counters["graph_break"]) == {}


@pytest.mark.parametrize("window", list(SEQ2SEQ_WINDOWS))
def test_compiled_seq2seq_static_decoding_is_one_graph(window, dynamo_counters):
    model = seq2seq_model(window)
    source = torch.randint(2, 40, (2, 9))
    expected = model.generate(source, max_new_tokens=8, do_sample=False)
    graphs = []
    got = model.generate(source, max_new_tokens=8, do_sample=False, cache_implementation="static",
                         compile_config=compile_config(cuda_graph_check(graphs)))
    assert torch.equal(got, expected)
    assert dict(dynamo_counters["graph_break"]) == {}
    assert dynamo_counters["stats"]["unique_graphs"] == 1
    assert_cuda_graph_safe(graphs)


def test_a_users_static_cache():
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config()).eval()
    prompt, mask = prompt_and_mask(False)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        logits = model(prompt, cache=cache).logits
        assert all(isinstance(layer, DATStaticLayer) for layer in cache.layers)
        step = model(prompt[:, :1], cache=cache, position_ids=torch.full((2, 1), 7)).logits
        expected = model(torch.cat([prompt, prompt[:, :1]], 1)).logits
    torch.testing.assert_close(logits, expected[:, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[:, 0], expected[:, 7], atol=1e-5, rtol=0)

    # initialized ahead with one shape for keys and values, still empty (Transformers' export wrapper, chunked
    # prefills): sized again for DAT
    ahead = StaticCache(config=model.config, max_cache_len=16)
    ahead.early_initialization(2, 4, 8, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt, cache=ahead).logits, logits, atol=1e-6, rtol=0)
    assert all(isinstance(layer, DATStaticLayer) for layer in ahead.layers)

    foreign = StaticCache(config=model.config, max_cache_len=16)
    layer = foreign.layers[0]
    assert type(layer) is StaticLayer
    layer.update(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))  # a token of another model
    with pytest.raises(ValueError, match="filled by another model"):
        model(prompt, cache=foreign)


def test_a_compiled_forward_over_a_sliding_window_static_cache(dynamo_counters):
    """A user's own `torch.compile(model.forward, fullgraph=True)` decoding step: with the masks built outside it
    (`create_masks_for_generate`, as `generate` does) it gives the eager logits; building them inside is refused with
    a message that says so (they depend on the tokens seen, which the cache counts in a tensor)."""
    model, prompt, _ = tiny_model_and_prompt(*SLIDING_CASES["prompt-fills-window"])
    cache = StaticCache(config=model.config, max_cache_len=16)
    step = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        model(prompt, cache=cache)
        token, padding = prompt[:, :1], torch.ones(2, 8, dtype=torch.long)
        masks = model.create_masks_for_generate(model.config, torch.empty(2, 1, 0), padding, cache)
        logits = step(token, attention_mask=masks, cache=cache, position_ids=torch.full((2, 1), 7)).logits
        expected = model(torch.cat([prompt, token], 1)).logits[:, -1:]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        with pytest.raises(Exception, match="built outside the compiled step"):
            step(token, cache=cache, position_ids=torch.full((2, 1), 8))
        # several tokens in one compiled step (a compiled chunk of a chunked prefill): refused, saying what to do
        chunk, padding = prompt[:, :2], torch.ones(2, 10, dtype=torch.long)
        masks = model.create_masks_for_generate(model.config, torch.empty(2, 2, 0), padding, cache)
        with pytest.raises(Exception, match="prefill_chunk_size"):
            step(chunk, attention_mask=masks, cache=cache, position_ids=torch.tensor([[8, 9]] * 2))


def test_a_ring_steps_block_mask_is_its_dense_mask():
    """FlexAttention heads of a one-token step over a ring cache get a `BlockMask` of the mask in slot order
    (`masking_dat._block_mask_of`): attention through it equals SDPA through the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from dat_hf.masking_dat import _block_mask_of

    torch.manual_seed(0)
    allowed = torch.rand(2, 1, 1, 300) < 0.5
    query, key, value = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    got = flex_attention(query, key, value, block_mask=_block_mask_of(allowed))
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
def test_a_graph_bias_without_its_graph_is_refused_by_name_with_every_cache(cache_implementation):
    """A `graph` bias's graph comes with each input (`graph_adjacency`): `generate` without it is a ValueError naming
    it, whether the masks are built in the forward (a dynamic cache) or ahead of it (a static one)."""
    model = DATForCausalLM(tiny_config(relational_bias="graph")).eval()
    with pytest.raises(ValueError, match="needs `graph_adjacency`"):
        model.generate(torch.randint(1, 90, (1, 5)), max_new_tokens=2, do_sample=False,
                       cache_implementation=cache_implementation)
