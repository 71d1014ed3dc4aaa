"""Each way to extend dat_hf, shown by adding a toy one in a few lines (docs/architecture.md, "Extending" names these
tests; a relational bias: `test_relational_biases.py::test_a_registered_bias_runs_in_a_model`):

- a relational backend, registered in the one registry and chosen by name (or automatically) per forward;
- a compiled kernel of a replaceable function (here RoPE), taken where its `accepts` says;
- a cache layout: a Transformers cache layer class of its own, which the forward's `ForwardCache` writes through;
- a model head on `DATModel`, with Transformers' save and load.
"""

import torch
from conftest import tiny_config
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from dat_hf import DATForCausalLM, DATModel, DATPreTrainedModel
from dat_hf.dual_attention import apply_rotary
from dat_hf.kernel_hooks import BACKENDS, register_kernel
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, eager_relational_attention


def model_and_ids(**overrides):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.2, **overrides)).eval()
    return model, torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))


def test_a_relational_backend(monkeypatch):
    """A backend is a function with `eager_relational_attention`'s signature, registered by name with what it cannot
    run (`supports(call)` -> None or why); here the reference in float64."""
    calls = []

    def float64_backend(query, key, symbol_values, relation_queries, relation_keys, relation_proj, mask, spec,
                        dropout=0.0, **kwargs):
        calls.append(query.shape)
        inputs = (t.double() for t in (query, key, symbol_values, relation_queries, relation_keys, relation_proj))
        messages, _, _ = eager_relational_attention(*inputs, mask, spec, dropout, **kwargs)
        return messages.to(query.dtype), None, None

    monkeypatch.setitem(RELATIONAL_ATTENTION_FUNCTIONS, "float64", RELATIONAL_ATTENTION_FUNCTIONS["eager"])  # (undo)
    RELATIONAL_ATTENTION_FUNCTIONS.register(
        "float64", float64_backend, lambda call: None if call.device == "cpu" else "CPU only", mask_format="reference")
    model, ids = model_and_ids(relational_attn_implementation="float64")
    with torch.no_grad():
        got = model(ids).logits
        assert calls and model.model.layers[0].dual_attn.relational.relational_attention_backend == "float64"
        model.config.relational_attn_implementation = "eager"
        expected = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_compiled_kernel_of_a_replaceable_function(monkeypatch):
    """A kernel of a `@replaceable` function (here `apply_rotary`) is registered with the inputs it takes; the
    dispatch tries it first and falls back to the reference where it declines."""
    taken = []

    def rotary_in_float64(x, cos, sin):
        taken.append(x.shape)
        return apply_rotary.reference(x.double(), cos.double(), sin.double()).to(x.dtype)

    table = BACKENDS.of("rotary")
    for name in list(table):  # (this test's kernel alone; the others are restored afterwards)
        monkeypatch.delitem(table, name)
    key = f"{rotary_in_float64.__module__}.{rotary_in_float64.__qualname__}"  # (the name `register_kernel` gives)
    monkeypatch.setitem(table, key, None)  # (so that undoing drops the registration)
    register_kernel("rotary", rotary_in_float64, lambda x, cos, sin: x.shape[1] > 1)  # (prompts, not steps)
    model, ids = model_and_ids()
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert taken and all(shape[1] > 1 for shape in taken)
    monkeypatch.undo()
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-5, rtol=0)


class ChunkedLayer(DynamicLayer):
    """A toy cache layout: each update kept as a chunk of its own, joined when read."""

    def __init__(self):
        super().__init__()
        self.chunks = []

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.chunks.append((key_states, value_states))
        self.keys, self.values = (torch.cat(parts, dim=-2) for parts in zip(*self.chunks))
        return self.keys, self.values


def test_a_cache_layout():
    """A cache of a layer class of its own: the forward writes DAT's packed keys and values through it (the model's
    `ForwardCache`), and prompt-then-steps gives the logits of one forward over every token."""
    model, ids = model_and_ids()
    cache = DynamicCache()
    cache.layer_class_to_replicate = ChunkedLayer
    with torch.no_grad():
        expected = model(ids).logits
        logits = [model(ids[:, :5], cache=cache, use_cache=True).logits]
        for i in range(5, ids.shape[1]):
            logits.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    assert all(type(layer) is ChunkedLayer and len(layer.chunks) == 5 for layer in cache.layers)
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-5, rtol=0)


class DATForTokenRegression(DATPreTrainedModel):
    """A toy head: one number per token from the DAT stack's last hidden state."""

    def __init__(self, config):
        super().__init__(config)
        self.model = DATModel(config)
        self.regressor = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels=None):
        prediction = self.regressor(self.model(input_ids, attention_mask=attention_mask).last_hidden_state)[..., 0]
        loss = None if labels is None else nn.functional.mse_loss(prediction, labels)
        return prediction, loss


def test_a_model_head(tmp_path):
    """A head on `DATModel` trains (gradients reach every parameter) and saves and loads with Transformers."""
    torch.manual_seed(0)
    model = DATForTokenRegression(tiny_config())
    ids = torch.randint(1, 97, (2, 9))
    prediction, loss = model(ids, labels=torch.randn(2, 9))
    loss.backward()
    assert prediction.shape == (2, 9)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.save_pretrained(tmp_path)
    loaded = DATForTokenRegression.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], model.eval()(ids)[0])

