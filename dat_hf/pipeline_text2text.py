# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""A text-to-text generation pipeline for encoder-decoder models, task name `"dat-text2text"`.

Transformers v5 removed `text2text-generation` (and `summarization`, `translation`). This module registers a
replacement with `PIPELINE_REGISTRY` under the task **`dat-text2text`** (importing `dat_hf` registers it):

```python
>>> from transformers import pipeline
>>> pipe = pipeline("dat-text2text", model="path/to/saved_model")       # dat_hf imported
>>> pipe("What is 3 + 4?", max_new_tokens=8)
[{'generated_text': '7'}]
```

It works with any `AutoModelForSeq2SeqLM` (and its tokenizer). `pipe.save_pretrained(folder)` writes this file into
the folder and a `custom_pipelines` entry into its config, so that without dat_hf installed
`pipeline(model=folder, trust_remote_code=True)` (task inferred, or `task="dat-text2text"`) loads both the model's
remote code and this pipeline class from the folder.

Inputs: a string or a list of strings. Call parameters: any `generate()` parameter (`max_new_tokens`, `num_beams`,
`do_sample`, `num_return_sequences`, ...), `truncation` / `max_length` of the tokenizer via `tokenizer_kwargs`, and
`return_tensors=True` for token ids instead of text, `clean_up_tokenization_spaces`.
Output: one list of `{"generated_text": str}` (or `{"generated_token_ids": list}`) dicts per input
(a single dict list for a single string input).
"""

from transformers import AutoModelForSeq2SeqLM, Pipeline
from transformers.generation import GenerationConfig
from transformers.pipelines import PIPELINE_REGISTRY

TASK = "dat-text2text"


class DATText2TextPipeline(Pipeline):
    """Encoder-decoder generation: source text -> generated target text."""

    _pipeline_calls_generate = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True
    # used when neither the call nor the model's generation config sets them
    _default_generation_config = GenerationConfig(max_new_tokens=64)

    def _sanitize_parameters(self, tokenizer_kwargs=None, return_tensors=None, clean_up_tokenization_spaces=None,
                             **generate_kwargs):
        preprocess_params = {"tokenizer_kwargs": tokenizer_kwargs or {}}
        postprocess_params = {}
        if return_tensors is not None:
            postprocess_params["return_tensors"] = return_tensors
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        return preprocess_params, generate_kwargs, postprocess_params

    def __call__(self, inputs, **kwargs):
        if isinstance(inputs, str):
            return super().__call__(inputs, **kwargs)
        if isinstance(inputs, (list, tuple)) and all(isinstance(text, str) for text in inputs):
            return super().__call__(list(inputs), **kwargs)
        raise ValueError(f"`{TASK}` takes a string or a list of strings, got {type(inputs).__name__}.")

    def preprocess(self, text, tokenizer_kwargs=None):
        if not text:
            raise ValueError(f"`{TASK}` got an empty input string.")
        return self.tokenizer(text, return_tensors="pt", **(tokenizer_kwargs or {}))

    def _forward(self, model_inputs, **generate_kwargs):
        if hasattr(self, "_prepare_generate_kwargs"):
            generate_kwargs = self._prepare_generate_kwargs(generate_kwargs)
        elif "generation_config" not in generate_kwargs:
            # Transformers 5.17: the pipeline holds the init's parameters and its defaults in `self.generation_config`
            # (no `_prepare_generate_kwargs`); the call's parameters go on top of it in `generate`
            generate_kwargs["generation_config"] = self.generation_config
        sequences = self.model.generate(input_ids=model_inputs["input_ids"],
                                        attention_mask=model_inputs.get("attention_mask"), **generate_kwargs)
        if not hasattr(sequences, "shape"):
            sequences = sequences.sequences
        batch = model_inputs["input_ids"].shape[0]
        return {"output_ids": sequences.reshape(batch, sequences.shape[0] // batch, *sequences.shape[1:])}

    def postprocess(self, model_outputs, return_tensors=False, clean_up_tokenization_spaces=False):
        records = []
        for ids in model_outputs["output_ids"][0]:
            if return_tensors:
                records.append({"generated_token_ids": ids.tolist()})
            else:
                text = self.tokenizer.decode(ids, skip_special_tokens=True,
                                             clean_up_tokenization_spaces=clean_up_tokenization_spaces)
                records.append({"generated_text": text})
        return records


def register():
    """Register `dat-text2text` (idempotent)."""
    if TASK not in PIPELINE_REGISTRY.supported_tasks:
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=DATText2TextPipeline, pt_model=AutoModelForSeq2SeqLM,
                                            type="text")
    # `save_pretrained` writes `custom_pipelines` from this (also for a copy loaded as remote code)
    DATText2TextPipeline._registered_impl = {
        TASK: {"impl": DATText2TextPipeline, "pt": (AutoModelForSeq2SeqLM,), "type": "text"}
    }


register()

__all__ = ["DATText2TextPipeline", "TASK", "register"]
