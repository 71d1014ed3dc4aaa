"""The attention plan (`dat_hf/attention_plan.py`): selection and mask conversion happen once per forward, not per
layer call; the layers hand their planned mask to the function without asking the mask object anything; every mask
format a backend may declare gives the same messages as the reference; decoding steps keep the last step's plan (and
symbolic attention its per-head views) while nothing they were made from changed."""

import pytest
import torch
from conftest import set_kernels_aside
from relational_cases import Heads, assert_close, call_backend, make_inputs, random_bool_mask

import dat_hf.attention_plan as attention_plan
import dat_hf.masking_dat as masking_dat
from dat_hf import DATConfig, DATForCausalLM
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS
from dat_hf.symbol_retrieval import SymbolicAttention


def tiny(**overrides):
    fields = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_sensory_heads=2, num_relational_heads=2,
                  intermediate_size=64, max_position_embeddings=128)
    return DATConfig(**{**fields, **overrides})


@pytest.mark.parametrize("biases", [dict(), dict(relational_bias="sliding_window", sliding_window_size=3),
                                    dict(relational_bias=["causal", "sliding_window"] * 2, sliding_window_size=3)])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_selection_and_mask_conversion_run_once_per_forward(monkeypatch, biases, attn):
    """A 4-layer forward selects one relational backend and converts each mask once per (bias, head type), however
    many layers use it; the layer calls ask the `AttentionMask` nothing (no `dense`, `to`)."""
    model = DATForCausalLM(tiny(attn_implementation=attn, **biases)).eval()
    selections, conversions, asked = [], [], []
    select, convert = attention_plan.select_relational_attention, attention_plan.mask_in_format
    monkeypatch.setattr(attention_plan, "select_relational_attention",
                        lambda *args: selections.append(args[0]) or select(*args))
    monkeypatch.setattr(attention_plan, "mask_in_format", lambda *args: conversions.append(args[1]) or convert(*args))
    layer_calls = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: layer_calls.append(module.layer_idx))

    def watch(name):
        original = getattr(masking_dat.AttentionMask, name)

        def watched(self, *args, **kwargs):
            if layer_calls:  # (once the layers run: the plan is built by then)
                asked.append(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(masking_dat.AttentionMask, name, watched)

    for name in ("dense", "to"):
        watch(name)
    distinct = len(set(model.config.layer_biases()[i][1] for i in range(4)))
    with torch.no_grad():
        model(torch.randint(1, 97, (2, 12)))
    assert layer_calls == [0, 1, 2, 3]
    assert len(selections) == distinct, selections
    # per entry at most its format (sensory eager forms its dense mask from the lengths of the call, once per shape)
    assert len([fmt for fmt in conversions if fmt != "dense"]) <= 2 * distinct
    assert len([fmt for fmt in conversions if fmt == "dense"]) <= 2 * distinct
    assert not [name for name in asked if name != "dense"], asked


def test_decoding_steps_reuse_the_plan_until_what_it_reads_changes(monkeypatch):
    """Decoding steps over implicit masks (causal order, no padding) plan once: the last step's plan serves the next,
    with the logits of planning every step. A step with padding, another requested backend, or a changed registry
    entry plans anew (and runs the new entry)."""
    from dat_hf.transformers_compat import output_cache

    model = DATForCausalLM(tiny(attn_implementation="sdpa")).eval()
    builds, build = [], attention_plan.AttentionPlan.of_reads.__func__

    def watch_builds():
        # (the decoding-step ops, which take the steps without the backends' functions, set aside)
        set_kernels_aside(monkeypatch, ("layer_step", "dual_attention_step"))
        monkeypatch.setattr(attention_plan.AttentionPlan, "of_reads",
                            classmethod(lambda cls, *args, **kwargs: builds.append(1) or build(cls, *args, **kwargs)))

    watch_builds()
    ids = torch.randint(1, 97, (2, 12))

    def decode(steps, **kwargs):
        """Greedy steps after the prompt -> (logits of each step, builds during the steps)."""
        with torch.no_grad():
            out = model(ids, use_cache=True, **kwargs)
            cache, token, logits = output_cache(out), out.logits[:, -1:].argmax(-1), []
            mask = kwargs.get("attention_mask")
            builds.clear()
            for _ in range(steps):
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                    kwargs["attention_mask"] = mask
                step = model(token, cache=cache, **kwargs).logits
                logits.append(step)
                token = step.argmax(-1)
        return torch.cat(logits, dim=1), len(builds)

    reused, planned = decode(5)
    assert planned == 1
    monkeypatch.setattr(attention_plan.AttentionPlan, "serves", lambda *args: False)  # (plan every step)
    every_step, planned = decode(5)
    assert planned == 5
    torch.testing.assert_close(reused, every_step, rtol=0, atol=0)
    monkeypatch.undo()
    watch_builds()

    padding = torch.ones(2, 12, dtype=torch.long)
    padding[0, :3] = 0
    assert decode(3, attention_mask=padding)[1] == 3  # explicit masks: planned per step
    decode(2)
    relational = model.model.layers[0].dual_attn.relational
    name, calls = relational.relational_attention_backend, []
    entry = RELATIONAL_ATTENTION_FUNCTIONS[name]
    monkeypatch.setitem(RELATIONAL_ATTENTION_FUNCTIONS, name, entry._replace(
        function=lambda *args, **kwargs: calls.append(1) or entry.function(*args, **kwargs)))
    assert decode(2)[1] == 1 and len(calls) == 2 * 4 + 4  # (the prompt, then each step's 4 layers)
    model.config.relational_attn_implementation = "eager"
    assert decode(2)[1] == 1 and relational.relational_attention_backend == "eager"


@pytest.mark.parametrize("backend", ["eager", "sdpa", "cpu"])
def test_each_mask_format_gives_the_reference(backend):
    """A backend gets the mask in the format it declares (`mask_in_format`); through `call_backend` (the plan's
    conversion) each equals the float64 reference on a random mask."""
    if backend not in RELATIONAL_ATTENTION_FUNCTIONS:
        pytest.skip(f"{backend} is not registered here (no C++ compiler)")
    module = Heads(h=4, h_kv=2, dtype=torch.float32)
    module64 = Heads(h=4, h_kv=2, relation_proj=module.relation_proj.detach().double())
    inputs = make_inputs(b=2, h=4, h_kv=2, q_len=9, kv_len=9, dtype=torch.float32)
    inputs64 = [t.detach().double() for t in inputs]
    mask = masking_dat.AttentionMask(random_bool_mask(2, 9, 9), None, False)
    expected = call_backend("eager", module64, *inputs64, mask)[0]
    with torch.no_grad():
        got = call_backend(backend, module, *inputs, mask)[0]
    assert_close(got, expected, atol=2e-5, what=f"{backend} ({RELATIONAL_ATTENTION_FUNCTIONS[backend].mask_format})")


def test_unknown_mask_format_is_named():
    with pytest.raises(ValueError, match="Unknown mask format 'csr'"):
        attention_plan.mask_in_format(masking_dat.AttentionMask(None, None, True), "csr")


def test_kept_symbol_views_follow_the_parameters():
    """What else a decoding step keeps from the last: symbolic attention's per-head views of its templates and library
    (`SymbolicAttention.heads_of`) equal the views formed anew, are kept between calls without gradients, follow
    in-place changes, and are formed anew when a parameter is replaced; with gradients or in another dtype they are
    formed at each call."""
    module = SymbolicAttention(tiny(num_symbols=8, symbolic_attention_heads=2)).eval()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter)
    library = module.symbol_library

    def formed(library, dtype=torch.float32):
        return module._heads(module.template_features, dtype), module._heads(library, dtype)

    with torch.no_grad():
        kept = module.heads_of(library, torch.float32)
        assert kept is module.heads_of(library, torch.float32)
        for got, expected in zip(kept, formed(library)):
            assert torch.equal(got, expected)
        library.mul_(2)  # in place: the kept views see it
        assert torch.equal(kept[1], formed(library)[1])
        module.symbol_library = torch.nn.Parameter(library.clone())
        assert module.heads_of(module.symbol_library, torch.float32) is not kept
        assert module.heads_of(library, torch.bfloat16) is not module.heads_of(library, torch.bfloat16)
    assert module.heads_of(library, torch.float32) is not module.heads_of(library, torch.float32)  # (gradients on)
