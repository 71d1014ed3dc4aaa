"""Every DAT family runs its layers through one loop (`modeling_dat.run_dat_layers`): the seq2seq encoder and decoder
included, the decoder's cross-attention taking the source from `CrossAttentionSource`."""

import torch
from test_seq2seq import model_for, padded_batch

import dat_hf.modeling_dat as modeling_dat
import dat_hf.modeling_dat_seq2seq as seq2seq


def test_seq2seq_encoder_and_decoder_run_the_shared_layer_loop(monkeypatch):
    shared_loop, stacks = seq2seq.run_dat_layers, []

    def recording_loop(layers, *args, **kwargs):
        stacks.append(type(layers[0]).__name__)
        return shared_loop(layers, *args, **kwargs)

    monkeypatch.setattr(seq2seq, "run_dat_layers", recording_loop)  # the encoder's call
    monkeypatch.setattr(modeling_dat, "run_dat_layers", recording_loop)  # the decoder's, through `run_text_stack`
    model = model_for("dual-cross")
    x, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask, decoder_input_ids=x[:, :5])
    assert stacks == ["DATDecoderLayer", "DATSeq2SeqDecoderLayer"]


def test_source_symbols_are_made_once_per_layer_in_a_cached_generation():
    """`dual` cross-attention: the source tokens' symbols go to the cross-attention cache at the first step; later steps
    read them from there and the retrievers no longer see the source."""
    model = model_for("dual-cross")
    x, mask = padded_batch(model.config.vocab_size)
    retrievers, seen = model.model.decoder.symbol_retrievers, []
    handle = retrievers.register_forward_hook(lambda module, args, output: seen.append((args[0], args[1].shape[1])))
    try:
        model.generate(x, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    source_calls = [layer for layer, length in seen if length == x.shape[1]]
    assert source_calls == list(range(model.config.num_hidden_layers))
