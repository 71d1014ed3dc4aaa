"""`transformers serve` for DAT: `python -m dat_hf.serve FOLDER [any transformers serve flag]` (console script
`dat-hf-serve`), an OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`, streaming; with
`--continuous-batching` over the paged cache). Needs the `serving` extra: `pip install "dat_hf[serving]"`.

This is Transformers' own `serve` command, run with the given arguments, with DAT registered and four additions:
- Its model manager loads a causal LM as `getattr(transformers, config.architectures[0])`, where no class of a model
  family outside Transformers is found. DAT's architecture names are set there to `AutoModelForCausalLM`, so the class
  loaded is the one Transformers itself picks for the folder: dat_hf's where it is installed, else the folder's remote
  code (`--trust-remote-code`; without it the loader asks for it).
- A prompt that leaves no room in the model's context (`max_position_embeddings` tokens, prompt and completion) is
  refused with HTTP 400 naming both lengths, before anything is generated (streamed or not); a completion stops where
  the context is full (`finish_reason: "length"`).
- With `--continuous-batching`, a DAT configuration that continuous batching cannot serve
  (`DATConfig.continuous_batching_limits`) is served by `generate`, one request at a time, with a warning naming the
  fields: what the server does for a model without continuous batching.
- When the server stops (Ctrl+C, SIGTERM), the continuous-batching thread is stopped too (the server leaves it
  running: the process would never exit).

The file imports nothing of dat_hf but, where installed, the package itself (its Auto registrations): where dat_hf is
not installed, the file alone serves a saved DAT folder from its remote code, run as a script:
`python serve.py FOLDER --trust-remote-code`.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref

import transformers
from transformers.utils import logging

logger = logging.get_logger("transformers.cli.serving")  # (shown as the server's own messages are)

# the architectures of `config.architectures` the serve CLI may be asked to load: DAT's causal LM
ARCHITECTURES = ("DATForCausalLM",)
PROG_NAME = "python -m dat_hf.serve"
# the server's continuous-batching managers that were started (each runs a generation thread)
STARTED_CB_MANAGERS = weakref.WeakSet()


def register_architectures():
    """Set DAT's architecture names on the `transformers` module, where the serve CLI looks a causal LM's class up,
    to `AutoModelForCausalLM` (which resolves the folder's class: installed or remote code)."""
    for name in ARCHITECTURES:
        if not hasattr(transformers, name):
            setattr(transformers, name, transformers.AutoModelForCausalLM)


def fit_to_context(model, inputs, generation_config):
    """Refuse (HTTP 400) a prompt of `inputs["input_ids"]` (`[1, n]` tensor, or a list of n ids under continuous
    batching) with no room left in `model.config.max_position_embeddings`; else cap `generation_config.max_new_tokens`
    to the room left."""
    from fastapi import HTTPException

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return
    ids = inputs["input_ids"]
    length = len(ids) if isinstance(ids, list) else ids.shape[-1]
    room = limit - length
    if room < 1:
        raise HTTPException(
            status_code=400,
            detail=f"The prompt has {length} tokens: this model reads at most `max_position_embeddings` = {limit} "
                   f"tokens, prompt and completion, so a prompt must be shorter than {limit} tokens.",
        )
    if generation_config.max_new_tokens is None or generation_config.max_new_tokens > room:
        generation_config.max_new_tokens = room


def _fitting(generate):
    @functools.wraps(generate)
    def wrapper(self, model, processor, inputs, generation_config, *args, **kwargs):
        fit_to_context(model, inputs, generation_config)
        return generate(self, model, processor, inputs, generation_config, *args, **kwargs)

    return wrapper


def _servable(use_continuous_batching):
    @functools.wraps(use_continuous_batching)
    def wrapper(self, model, modality):
        if not use_continuous_batching(self, model, modality):
            return False
        limits = getattr(model.config, "continuous_batching_limits", list)()
        if limits:
            logger.warning_once(f"Continuous batching cannot serve this DAT model ({'; '.join(limits)}): it is "
                                "served by `generate`, one request at a time.")
        return not limits

    return wrapper


def _recorded(init_cb):
    @functools.wraps(init_cb)
    def wrapper(self, *args, **kwargs):
        init_cb(self, *args, **kwargs)
        STARTED_CB_MANAGERS.add(self)

    return wrapper


def hook_server():
    """Wrap the server's generation entries: `fit_to_context` first in each (sequential and continuous batching,
    streamed and not: the prompt is tokenized, nothing is sent yet); the continuous-batching choice by DAT's limits;
    a record of each continuous-batching manager started, to stop its thread when the server stops. Once per
    process (a second call does nothing)."""
    from transformers.cli.serving import utils

    if getattr(utils.GenerationState, "_dat_hf_hooked", False):
        return
    utils.GenerationState._dat_hf_hooked = True

    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        for name in ("generate_streaming", "generate_non_streaming"):
            setattr(manager, name, _fitting(getattr(manager, name)))
    utils.GenerationState.use_continuous_batching = _servable(utils.GenerationState.use_continuous_batching)
    utils.CBGenerateManager.init_cb = _recorded(utils.CBGenerateManager.init_cb)


def main(argv: list[str] | None = None):
    """Run `transformers serve` with `argv` (default: the command line) and DAT registered."""
    try:
        import dat_hf  # noqa: F401  (registers DAT with the Auto classes)
    except ModuleNotFoundError as error:
        if error.name != "dat_hf":
            raise
    import click
    import typer
    from transformers.cli.transformers import app
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        sys.exit('dat_hf.serve needs the serving dependencies: pip install "dat_hf[serving]" (or '
                 '"transformers[serving]")')
    register_architectures()
    hook_server()
    group = typer.main.get_command(app) if isinstance(app, typer.Typer) else app  # (a click group since hub 2)
    serve = group.get_command(click.Context(group), "serve")
    prog_name = PROG_NAME if __name__ == "__main__" and __package__ else os.path.basename(sys.argv[0])
    try:
        serve.main(args=sys.argv[1:] if argv is None else argv, prog_name=prog_name)
    finally:
        for manager in list(STARTED_CB_MANAGERS):
            manager.stop()


if __name__ == "__main__":
    main()
