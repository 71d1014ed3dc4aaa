"""Export paths of the ecosystem: `torch.export` and ONNX (dynamo) with dynamic batch and length, and the
ExecuTorch-style export with a static cache (`dat_hf.export`, Transformers' recipe with DAT's cache layers).

While exporting, DAT takes its PyTorch backends (the compiled kernels registered by `import dat_hf` are not traced
into the program); the exported programs give the eager model's logits on shapes other than the example's."""

import importlib.util

import pytest
import torch
from conftest import tiny_config
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

from dat_hf import DATForCausalLM
from dat_hf.export import DATExportableModuleForDecoderOnlyLM

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


@pytest.mark.parametrize("overrides", [dict(), dict(num_relational_key_value_heads=1, relational_heads_bias="sliding_window",
                                                    sliding_window_size=3)], ids=["default", "gqa-window"])
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


def test_executorch_style_static_cache_export_generates_the_same_tokens():
    """One token per call at its cache position (the ExecuTorch runner's loop), prompt then greedy decoding: the
    exported program's logits and tokens are those of `generate` (dynamic cache, eager)."""
    model, _, _ = model_and_inputs()
    prompt = torch.tensor([[5, 9, 3, 7]])
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    program = DATExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32).export(
        input_ids=prompt[:, :1], cache_position=torch.tensor([0]))
    step = program.module()
    tokens, logits = prompt[0].tolist(), []
    with torch.no_grad():
        for position in range(prompt.shape[1] + 7):
            out = step(input_ids=torch.tensor([[tokens[position]]]), cache_position=torch.tensor([position]))
            if position >= prompt.shape[1] - 1:
                logits.append(out[:, -1])
                tokens.append(int(out[0, -1].argmax()))
    assert tokens == expected.sequences[0].tolist()
    torch.testing.assert_close(torch.stack(logits, 1), torch.stack(expected.logits, 1), atol=ATOL, rtol=0)


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
