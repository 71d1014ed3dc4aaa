"""Cached generation equals recomputation, compared by scores, on models whose next token depends on the whole prefix.

Comparing greedy *tokens* of an untrained model can pass with a broken cache: a decoding step that sees only its
new token (what a forward reading the cache under a name `generate()` no longer passes does, as on Transformers 5.24
before dat_hf followed its `cache` argument) often picks the same argmax. So every test here:

- checks that the model's logits depend on the prefix: the recomputed logits of each generated step differ from those
  of the step's token alone (at its position) by more than `DEPENDENCE` (the tests would otherwise prove nothing);
- compares the logits that generation produced at every step (`output_logits`; beam search: each sequence's summed
  log-probabilities) with one forward over the whole generated sequence without a cache, within `ATOL`.

Causal LM: dynamic, static and sliding-window ring caches, left padding, beam search, assisted decoding, and the
remote code's own cache layers (without the faster ones `import dat_hf` installs); the seq2seq decoder: dynamic and
static caches.
"""

import pytest
import torch
from conftest import tiny_config, use_transformers_cache_layers
from transformers.cache_utils import DynamicLayer

from dat_hf import DATForCausalLM, DATForSeq2SeqLM, DATSeq2SeqConfig
from dat_hf.cache_dat import DATStaticSlidingWindowLayer, InPlaceCacheLayer, RingSlidingWindowLayer
from dat_hf.transformers_compat import output_cache

NEW_TOKENS = 8
ATOL = 1e-4  # float32 logits of magnitude ~10: cached and recomputed sums differ by ~1e-6
DEPENDENCE = 0.5  # the least the prefix must move a step's logits (a one-token step would be off by that much)
INIT = 0.3  # spreads the logits (tokens vary, the prefix matters) while float32 stays precise


def causal_lm(**overrides):
    torch.manual_seed(0)
    return DATForCausalLM(tiny_config(initializer_range=INIT, **overrides)).eval()


def prompt_and_mask(left_padded: bool, batch: int = 2, length: int = 7):
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 97, (batch, length), generator=generator)
    mask = torch.ones_like(prompt)
    if left_padded:
        mask[0, :3] = 0
    return prompt, mask


def recomputed_logits(model, sequences, mask, prompt_length):
    """Logits of every generated step `[b, steps, vocab]` from one forward over the sequence without a cache, and the
    logits of each step's last token alone (same position), to show that the prefix matters."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - mask.shape[1])], dim=1)
    with torch.no_grad():
        logits = model(sequences[:, :-1], attention_mask=full_mask[:, :-1], use_cache=False).logits
        positions = full_mask[:, :-1].long().cumsum(-1) - 1
        alone = torch.stack([
            model(sequences[:, t:t + 1], position_ids=positions[:, t:t + 1].clamp(min=0), use_cache=False).logits[:, 0]
            for t in range(prompt_length - 1, sequences.shape[1] - 1)], dim=1)
    return logits[:, prompt_length - 1:], alone


def assert_generation_matches_recomputation(model, prompt, mask, **generate_kwargs):
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         **generate_kwargs)
    generated = torch.stack(out.logits, dim=1)
    expected, alone = recomputed_logits(model, out.sequences, mask, prompt.shape[1])
    rows = mask[:, -1].bool()  # (a row's steps are all real tokens)
    assert (expected - alone)[rows].abs().amax(dim=-1).min() > DEPENDENCE, "the prefix barely matters: no test"
    torch.testing.assert_close(generated, expected, atol=ATOL, rtol=0)


CAUSAL_CASES = {
    "dynamic": (dict(), False, dict()),
    "dynamic-left-padded": (dict(num_relational_key_value_heads=1), True, dict()),
    "static-left-padded": (dict(), True, dict(cache_implementation="static")),
    "position-relative-static": (dict(symbol_retrieval="position_relative"), True, dict(cache_implementation="static")),
    # every head on a window of 3 previous tokens: sliding cache layers (a ring of 4 slots when static)
    "sliding-window-ring": (dict(relational_bias="sliding_window", sliding_window_size=3), True,
                            dict(cache_implementation="static")),
    "sliding-window-dynamic": (dict(relational_bias="sliding_window", sliding_window_size=3), True, dict()),
    # a ring of 10 slots that the decoding fills, with position-relative symbols (their offsets modulo the ring)
    "decoding-fills-window": (dict(relational_bias="sliding_window", sliding_window_size=9,
                                   symbol_retrieval="position_relative"), True, dict(cache_implementation="static")),
}


@pytest.mark.parametrize("name", list(CAUSAL_CASES))
def test_causal_lm_cached_logits_equal_recomputation(name):
    overrides, left_padded, generate_kwargs = CAUSAL_CASES[name]
    assert_generation_matches_recomputation(causal_lm(**overrides), *prompt_and_mask(left_padded), **generate_kwargs)


# DAT's cache layer -> Transformers' own behaviour (`DynamicLayer`, the window rolled oldest first)
TRANSFORMERS_LAYER_CASES = {
    "dynamic-left-padded": (InPlaceCacheLayer, DynamicLayer),
    "sliding-window-ring": (RingSlidingWindowLayer, DATStaticSlidingWindowLayer),  # the prompt fills the window
    "decoding-fills-window": (RingSlidingWindowLayer, DATStaticSlidingWindowLayer),
}


@pytest.mark.parametrize("name", list(TRANSFORMERS_LAYER_CASES))
def test_transformers_cache_layers_give_the_scores_of_dats(name, monkeypatch):
    """DAT's in-place and ring cache layers give the tokens and logits of Transformers' own layers (`DynamicLayer`,
    the window rolled oldest first), which equal recomputation."""
    overrides, left_padded, generate_kwargs = CAUSAL_CASES[name]
    model, (prompt, mask) = causal_lm(**overrides), prompt_and_mask(left_padded)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  pad_token_id=0, output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    installed = model.generate(prompt, **kwargs)
    use_transformers_cache_layers(monkeypatch)
    remote = model.generate(prompt, **kwargs)
    for out, layer_class in zip((installed, remote), TRANSFORMERS_LAYER_CASES[name]):
        assert all(type(layer) is layer_class for layer in output_cache(out).layers), layer_class
    assert torch.equal(remote.sequences, installed.sequences)
    torch.testing.assert_close(torch.stack(remote.logits), torch.stack(installed.logits), atol=ATOL, rtol=0)
    assert_generation_matches_recomputation(model, prompt, mask, **generate_kwargs)


def test_assisted_decoding_logits_equal_recomputation():
    """The target model's logits in assisted decoding (a different draft model proposes tokens, the target verifies
    them over its cache, which is cropped when it rejects some)."""
    model = causal_lm()
    torch.manual_seed(5)
    assistant = DATForCausalLM(tiny_config(initializer_range=INIT, num_hidden_layers=1)).eval()
    prompt, mask = prompt_and_mask(False, batch=1)
    assert_generation_matches_recomputation(model, prompt, mask, assistant_model=assistant)


def test_beam_search_scores_equal_recomputation():
    """Beam search (cache reordered between beams): each returned sequence's score, with `length_penalty=0`, is the
    sum of its tokens' log-probabilities, recomputed without a cache."""
    model = causal_lm()
    prompt, mask = prompt_and_mask(True)
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         num_beams=3, num_return_sequences=3, length_penalty=0.0, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    beam_mask = mask.repeat_interleave(3, dim=0)
    expected, alone = recomputed_logits(model, out.sequences, beam_mask, prompt.shape[1])
    rows = beam_mask[:, -1].bool()
    assert (expected - alone)[rows].abs().amax(dim=-1).min() > DEPENDENCE
    tokens = out.sequences[:, prompt.shape[1]:]
    log_probs = expected.log_softmax(-1).gather(-1, tokens[..., None])[..., 0].sum(-1)
    torch.testing.assert_close(out.sequences_scores, log_probs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_seq2seq_decoder_cached_logits_equal_recomputation(cache_implementation):
    torch.manual_seed(3)
    model = DATForSeq2SeqLM(DATSeq2SeqConfig(
        vocab_size=40, hidden_size=32, encoder_layers=2, num_hidden_layers=2, num_sensory_heads=2,
        num_relational_heads=2, cross_attention="dual", intermediate_size=64, num_symbols=8, symbolic_attention_heads=2,
        decoder_start_token_id=1, pad_token_id=0, initializer_range=INIT)).eval()
    source = torch.randint(2, 40, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(source)
    mask[1, 6:] = 0
    out = model.generate(source, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, cache_implementation=cache_implementation, output_logits=True,
                         return_dict_in_generate=True)
    targets = out.sequences
    with torch.no_grad():
        expected = model(source, attention_mask=mask, decoder_input_ids=targets[:, :-1], use_cache=False).logits
        encoder_outputs = model.get_encoder()(source, attention_mask=mask)
        alone = torch.stack([model(attention_mask=mask, encoder_outputs=encoder_outputs,
                                   decoder_input_ids=targets[:, t:t + 1], decoder_position_ids=torch.full((2, 1), t),
                                   use_cache=False).logits[:, 0] for t in range(targets.shape[1] - 1)], dim=1)
    assert (expected - alone)[:, 1:].abs().amax(dim=-1).min() > DEPENDENCE
    torch.testing.assert_close(torch.stack(out.logits, dim=1), expected, atol=ATOL, rtol=0)
