"""Export paths of the ecosystem: `torch.export` and ONNX (dynamo) with dynamic batch and length, and the
ExecuTorch-style export with a static cache (`dat_hf.export`, Transformers' recipe with DAT's cache layers), whose
`generate` gives `model.generate`'s tokens where Transformers' helpers feed wrong cache positions.

While exporting, DAT takes its PyTorch backends (the compiled kernels registered by `import dat_hf` are not traced
into the program); the exported programs give the eager model's logits on shapes other than the example's."""

import importlib.util
import sys
import types

import pytest
import torch
from conftest import tiny_config
from transformers.integrations.executorch import (
    TorchExportableModuleForDecoderOnlyLM,
    TorchExportableModuleWithStaticCache,
)

import dat_hf
from dat_hf import DATForCausalLM
from dat_hf.export import DATExportableModuleForDecoderOnlyLM

pytestmark = pytest.mark.xdist_group("export")  # (one worker: the module-scoped fixtures built once)

ATOL = 1e-4


class LogitsOnly(torch.nn.Module):
    """(input_ids, attention_mask) -> logits, no cache: what an inference server exports."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def model_and_inputs(**overrides):
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.3, **overrides)).eval()
    example = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    other = torch.randint(1, 97, (3, 13), generator=torch.Generator().manual_seed(2))
    other_mask = torch.ones_like(other)
    other_mask[0, :4] = 0  # left padding
    return model, (example, torch.ones_like(example)), (other, other_mask)


def dynamic_shapes():
    batch, length = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("length", min=2, max=48)
    return ({0: batch, 1: length}, {0: batch, 1: length})


@pytest.mark.parametrize("overrides", [dict(), dict(num_relational_key_value_heads=1,
                                                    relational_heads_bias="sliding_window", sliding_window_size=3)],
                         ids=["default", "gqa-window"])
def test_torch_export_keeps_batch_and_length_dynamic(overrides):
    model, example, other = model_and_inputs(**overrides)
    program = torch.export.export(LogitsOnly(model), example, dynamic_shapes=dynamic_shapes(), strict=False)
    assert not any("dat_hf::" in str(node.target) for node in program.graph.nodes)  # PyTorch backends only
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*other), LogitsOnly(model)(*other), atol=ATOL, rtol=0)


@pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ("onnx", "onnxscript", "onnxruntime")),
                    reason="the ONNX packages (onnx, onnxscript, onnxruntime: the dev extra) are not installed")
def test_onnx_export_runs_in_onnxruntime_with_dynamic_batch_and_length(tmp_path):
    import onnxruntime

    model, example, other = model_and_inputs()
    onnx_program = torch.onnx.export(LogitsOnly(model), example, dynamic_shapes=dynamic_shapes(), dynamo=True,
                                     verbose=False)
    onnx_program.save(str(tmp_path / "dat.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "dat.onnx"), providers=["CPUExecutionProvider"])
    names = [graph_input.name for graph_input in session.get_inputs()]
    got = session.run(None, {name: tensor.numpy() for name, tensor in zip(names, other)})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), LogitsOnly(model)(*other), atol=ATOL, rtol=0)


def length_bound(program, name: str = "input_ids") -> tuple[int, int]:
    """(min, max) the exported program takes for the length of its input `name` `[b, n]`."""
    node = next(node for node in program.graph.nodes if node.op == "placeholder" and node.name == name)
    bounds = program.range_constraints[node.meta["val"].shape[1].node.expr]
    return int(bounds.lower), int(bounds.upper)


def test_torch_export_caps_the_length_at_the_positional_symbols():
    """Positional symbols index a table of `max_symbol_positions` rows: a `Dim` that allows longer sequences is refused
    (torch.export names the largest the model takes), `dynamic_length` caps it at the table, and the program refuses a
    longer input, naming the bound (not an `IndexError` from the lookup); within it, the eager logits."""
    model, example, other = model_and_inputs(symbol_retrieval="positional", max_symbol_positions=16)
    assert dat_hf.export.max_sequence_length(model) == model.model.symbol_retrievers.retrievers[0].max_positions == 16
    with pytest.raises(torch._dynamo.exc.UserError, match=r"length <= 48 satisfy the generated guard(.|\n)*"
                                                          r"Dim\('length', max=16\)"):
        torch.export.export(LogitsOnly(model), example, dynamic_shapes=dynamic_shapes(), strict=False)
    batch, length = torch.export.Dim("batch", min=1, max=8), dat_hf.export.dynamic_length(model, max=48)
    program = torch.export.export(LogitsOnly(model), example, dynamic_shapes=({0: batch, 1: length},) * 2,
                                  strict=False)
    assert length_bound(program) == (1, 16)
    longest = torch.randint(1, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for inputs in (other, (longest, torch.ones_like(longest))):
            torch.testing.assert_close(program.module()(*inputs), LogitsOnly(model)(*inputs), atol=ATOL, rtol=0)
        too_long = torch.cat([longest, longest[:, :1]], 1)
        with pytest.raises((AssertionError, RuntimeError), match=r"input_ids.*<= 16\b") as error:
            program.module()(too_long, torch.ones_like(too_long))
        assert not isinstance(error.value, IndexError)


def test_torch_export_caps_the_length_at_learned_positions():
    """Learned positions cap an automatic `Dim` at `max_position_embeddings`; an example longer than the table is
    refused while exporting, naming the field; the static-cache export refuses a cache the table cannot cover."""
    model, example, _ = model_and_inputs(position_embedding_type="learned", max_position_embeddings=12)
    auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    program = torch.export.export(LogitsOnly(model), example, dynamic_shapes=(auto, auto), strict=False)
    assert length_bound(program)[1] == dat_hf.export.max_sequence_length(model) == 12
    long_example = torch.ones(1, 13, dtype=torch.long)
    with pytest.raises(ValueError, match="a sequence of 13 tokens is too long for the learned positions: an exported "
                                         "length must stay within `max_position_embeddings` = 12"):
        torch.export.export(LogitsOnly(model), (long_example, torch.ones_like(long_example)), strict=False)
    with pytest.raises(ValueError, match="max_cache_len=16 needs more positions than the learned positions hold: the "
                                         "cache must stay within `max_position_embeddings` = 12"):
        DATExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)


STATIC_CASES = {  # the exported programs' models: causal with RoPE, a sliding window on every head, GQA
    "causal-rope": dict(),
    "sliding-window": dict(relational_bias="sliding_window", sliding_window_size=3),
    "gqa": dict(num_sensory_key_value_heads=1, num_relational_key_value_heads=1),
}
PROMPT = torch.tensor([[5, 9, 3, 7]])
MAX_CACHE_LEN = 16


@pytest.fixture(scope="module")
def exported():
    """name -> (model, the program of `DATExportableModuleForDecoderOnlyLM`), each exported once (seconds each)."""
    programs = {}

    def get(name):
        if name not in programs:
            model = model_and_inputs(**STATIC_CASES[name])[0]
            programs[name] = model, DATExportableModuleForDecoderOnlyLM(
                model, batch_size=1, max_cache_len=MAX_CACHE_LEN).export(input_ids=PROMPT[:, :1],
                                                                           cache_position=torch.tensor([0]))
        return programs[name]

    return get


def fill_cache(program, scale: float):
    """Every cache slot `scale * N(0, 1)`: 0 as exported; garbage, which slots a generation has not written yet turn
    into, must not matter (the masks exclude those slots)."""
    for name, buffer in program.named_buffers():
        if "key_cache" in name or "value_cache" in name:
            buffer.copy_(scale * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(3)))


def test_executorch_style_static_cache_export_generates_the_same_tokens(exported):
    """One token per call at its cache position (the ExecuTorch runner's loop), prompt then greedy decoding: the
    exported program's logits and tokens are those of `generate` (dynamic cache, eager)."""
    model, program = exported("causal-rope")
    expected = model.generate(PROMPT, max_new_tokens=8, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    step = program.module()
    tokens, logits = PROMPT[0].tolist(), []
    with torch.no_grad():
        for position in range(PROMPT.shape[1] + 7):
            out = step(input_ids=torch.tensor([[tokens[position]]]), cache_position=torch.tensor([position]))
            if position >= PROMPT.shape[1] - 1:
                logits.append(out[:, -1])
                tokens.append(int(out[0, -1].argmax()))
    assert tokens == expected.sequences[0].tolist()
    torch.testing.assert_close(torch.stack(logits, 1), torch.stack(expected.logits, 1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(STATIC_CASES))
def test_generate_of_the_exported_program_gives_generates_tokens(name, exported):
    """`DATExportableModuleForDecoderOnlyLM.generate` (the documented path) over a cache full of garbage: the tokens
    of `model.generate(..., do_sample=False)`, up to the cache's last slot; with an EOS, both stop at it."""
    model, program = exported(name)
    fill_cache(program, 1e3)
    new = MAX_CACHE_LEN - PROMPT.shape[1] + 1  # (the last new token needs no slot)
    expected = model.generate(PROMPT, max_new_tokens=new, do_sample=False)
    assert torch.equal(DATExportableModuleForDecoderOnlyLM.generate(program, PROMPT, max_new_tokens=new), expected)
    eos = int(expected[0, PROMPT.shape[1] + 2])
    stopped = dat_hf.export.generate(program, PROMPT, max_new_tokens=new, eos_token_id=eos)
    assert torch.equal(stopped, model.generate(PROMPT, max_new_tokens=new, do_sample=False, eos_token_id=eos))
    assert stopped.shape[1] <= PROMPT.shape[1] + 3


class RecordingProgram:
    """An exported program whose step records `(token, cache position)` of every call (what a helper feeds)."""

    def __init__(self, program):
        self.program, self.step, self.fed = program, program.module(), []

    def named_buffers(self):
        return self.program.named_buffers()

    def module(self):
        return self

    def forward(self, input_ids, cache_position):
        self.fed.append((int(input_ids[0, -1]), int(cache_position[0])))
        return self.step(input_ids=input_ids, cache_position=cache_position)

    __call__ = forward


class OneTokenPerCharacter:
    """The tokenizer interface `TorchExportableModuleForDecoderOnlyLM.generate` uses (call, decode, eos_token_id)."""

    eos_token_id = None

    def __call__(self, text, return_tensors):
        return types.SimpleNamespace(input_ids=torch.tensor([[ord(char) - 96 for char in text]]))

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(int(i) + 96) for i in ids)


def test_transformers_generate_helpers_feed_wrong_cache_positions(exported):
    """Why dat_hf has its own `generate`: Transformers' `TorchExportableModuleWithStaticCache.generate` feeds the first
    new token at position n + 1 (slot n, right after the prompt, stays empty, and DAT's tokens change), and
    `TorchExportableModuleForDecoderOnlyLM.generate` feeds the prompt's last token twice. If this fails, Transformers
    fixed a helper: revise the docs of dat_hf.export and docs/inputs_and_saving.md."""
    model, program = exported("causal-rope")
    fill_cache(program, 0.0)
    n, new = PROMPT.shape[1], 6
    expected = model.generate(PROMPT, max_new_tokens=new, do_sample=False)[0].tolist()

    ours = RecordingProgram(program)
    assert DATExportableModuleForDecoderOnlyLM.generate(ours, PROMPT, max_new_tokens=new)[0].tolist() == expected
    assert ours.fed == list(zip(expected[:-1], range(n + new - 1)))  # each token at its own position

    upstream = RecordingProgram(program)
    tokens = TorchExportableModuleWithStaticCache.generate(upstream, PROMPT, max_new_tokens=new)[0].tolist()
    assert [position for _, position in upstream.fed] == [*range(n), *range(n + 1, n + new)]  # slot n skipped
    assert tokens[:n + 1] == expected[:n + 1] and tokens != expected

    upstream, tokenizer = RecordingProgram(program), OneTokenPerCharacter()
    TorchExportableModuleForDecoderOnlyLM.generate(upstream, tokenizer, tokenizer.decode(PROMPT[0], True), 3)
    assert upstream.fed[n - 1:n + 1] == [(PROMPT[0, -1].item(), n - 1), (PROMPT[0, -1].item(), n)]  # fed twice


def test_generate_names_bad_arguments(exported):
    _, program = exported("causal-rope")
    with pytest.raises(ValueError, match="`input_ids` must be a \\[batch, length\\] tensor of token ids.*got str"):
        dat_hf.export.generate(program, "a prompt", max_new_tokens=3)
    with pytest.raises(ValueError, match="exported with batch_size=1"):
        dat_hf.export.generate(program, PROMPT.expand(2, -1), max_new_tokens=3)
    with pytest.raises(ValueError, match="need 19 cache slots; the program has max_cache_len=16"):
        dat_hf.export.generate(program, PROMPT, max_new_tokens=16)
    with pytest.raises(ValueError, match="`max_new_tokens` must be a non-negative integer; got -1"):
        dat_hf.export.generate(program, PROMPT, max_new_tokens=-1)
    plain = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))  # (a program without a cache)
    with pytest.raises(ValueError, match="`exported_program` has no `key_cache` buffer: export it with"):
        dat_hf.export.generate(plain, PROMPT, max_new_tokens=3)


def test_import_dat_hf_reaches_dat_hf_export(monkeypatch):
    """`import dat_hf` is enough for `dat_hf.export` (imported on first use)."""
    monkeypatch.delitem(sys.modules, "dat_hf.export")
    monkeypatch.delattr(dat_hf, "export")
    assert dat_hf.export.DATExportableModuleForDecoderOnlyLM.generate is dat_hf.export.generate
    with pytest.raises(AttributeError, match="module 'dat_hf' has no attribute 'exports'"):
        dat_hf.exports


def test_transformers_executorch_wrapper_cache_initialized_ahead():
    """Transformers' own wrapper initializes its static cache ahead with one shape for keys and values: DAT sizes
    those layers again (eagerly, the wrapper's step gives the logits of a forward without a cache)."""
    model, _, _ = model_and_inputs()
    model.generation_config.cache_implementation = "static"
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)
    prompt = torch.tensor([[5, 9, 3, 7]])
    with torch.no_grad():
        steps = [wrapper.model(input_ids=prompt[:, i:i + 1], cache_position=torch.tensor([i])) for i in range(4)]
        torch.testing.assert_close(torch.cat(steps, 1), model(prompt).logits, atol=ATOL, rtol=0)
