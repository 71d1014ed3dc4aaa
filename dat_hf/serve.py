"""`transformers serve` for DAT: `python -m dat_hf.serve FOLDER [flags]` (console script `dat-hf-serve`), an
OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`, streaming; with `--continuous-batching` over the
paged cache). Needs the `serving` extra: `pip install "dat_hf[serving]"`.

This is Transformers' own `serve` command, run with the given arguments, with DAT registered and what a server facing
clients it does not trust needs (docs/serving.md):
- **Loading.** Transformers' loader loads a causal LM as `getattr(transformers, config.architectures[0])`, where no
  class of a model family outside Transformers is found. DAT's architecture names are set there to
  `AutoModelForCausalLM`, so the class loaded is the one Transformers itself picks for the folder: dat_hf's where it
  is installed, else the folder's remote code (`--trust-remote-code`).
- **Bodies.** A request body over `--max-request-bytes` (default 4 MiB) is refused with 413 from its `Content-Length`,
  before it is read (a body without one, as soon as it passes the limit); one not sent within `--body-timeout`
  seconds (default 30) gets 408.
- **Fields.** Every field of a completion or chat request is checked before anything runs: a wrong type or range, a
  string that is not Unicode, or a field the server does not implement (`n > 1`, `logprobs`, `echo`, ...) gets a 400
  naming it (`{"error": {"message", "type", "param", "code"}}`, as the OpenAI API answers), on a connection that
  stays open.
- **Context.** A prompt that leaves no room in `max_position_embeddings` is refused with 400 before anything is
  generated; it is measured on a worker thread, and a text too long to fit whatever its tokens is refused without
  being tokenized. A completion stops where the context is full (`finish_reason: "length"`).
- **Stop strings.** `stop` ends the text at its first occurrence, left out of the text (`finish_reason: "stop"`), the
  same with and without continuous batching, streamed or not.
- **Continuous batching.** A DAT configuration that continuous batching cannot serve (the model's
  `continuous_batching_limits`) is served by `generate`, one request at a time, with a warning naming the fields. A
  request asking sampling settings the batch cannot give it is refused by name.
- **`/v1/models/{id}`** answers the model the server holds.
- **Shutdown.** On SIGTERM / Ctrl+C the server stops admitting, finishes the requests in flight within
  `--shutdown-grace` seconds (default 10), answers the rest 503 (a stream is closed), and exits. A generation whose
  request was cancelled is not started, or its answer dropped.

Everything this file reaches in `transformers serve` goes through one seam (the section "The seam" below): a table of
the server's internals (`SERVER_INTERNALS`) and the two ways a release runs its model (`ENGINES`), the one installed
found by what it offers. A release that moved what the seam needs stops the server at its start, naming it.

The file imports nothing of dat_hf but, where installed, the package itself (its Auto registrations): where dat_hf is
not installed, the file alone serves a saved DAT folder from its remote code, run as a script:
`python serve.py FOLDER --trust-remote-code`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import dataclasses
import functools
import inspect
import json
import math
import os
import pkgutil
import re
import sys
import threading
import weakref
from dataclasses import dataclass

import transformers
from transformers.utils import logging

logger = logging.get_logger("transformers.cli.serving")  # (shown as the server's own messages are)

# the architectures of `config.architectures` the serve CLI may be asked to load: DAT's causal LM
ARCHITECTURES = ("DATForCausalLM",)
PROG_NAME = "python -m dat_hf.serve"
# the oldest and newest Transformers releases dat_hf is tested with (`dat_hf.transformers_compat.TESTED_TRANSFORMERS`:
# this file imports nothing of dat_hf)
TESTED_TRANSFORMERS = ("5.17.0", "5.25.0")
# the server's continuous-batching managers that were started in this process (each runs a generation thread)
STARTED_CB_MANAGERS = weakref.WeakSet()
# the uvicorn servers started in this process (`stop_servers`)
STARTED_SERVERS = weakref.WeakSet()
# where the server's settings reach the processes it spawns (its API servers)
SETTINGS_VARIABLE = "DAT_HF_SERVE_SETTINGS"


@dataclass
class Settings:
    """What `dat_hf.serve` adds to `transformers serve`'s flags."""

    max_request_bytes: int = 4 * 2**20  # --max-request-bytes
    shutdown_grace: float = 10.0  # --shutdown-grace, seconds
    body_timeout: float = 30.0  # --body-timeout, seconds

    def export(self) -> None:
        """Hand these settings to the processes this one spawns (`from_environment`)."""
        os.environ[SETTINGS_VARIABLE] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_environment(cls) -> Settings:
        """The settings the process that spawned this one exported (`export`), else the defaults."""
        return cls(**json.loads(os.environ.get(SETTINGS_VARIABLE, "{}")))


SETTINGS = Settings()


def parse_settings(argv: list[str]) -> tuple[Settings, list[str]]:
    """dat_hf.serve's own flags out of `argv`; the rest is `transformers serve`'s."""
    parser = argparse.ArgumentParser(prog=PROG_NAME, add_help=False)
    parser.add_argument("--max-request-bytes", type=int, default=Settings.max_request_bytes,
                        help="Largest request body, in bytes: a larger one gets 413 before it is read.")
    parser.add_argument("--shutdown-grace", type=float, default=Settings.shutdown_grace,
                        help="Seconds the requests in flight have to finish after SIGTERM / Ctrl+C.")
    parser.add_argument("--body-timeout", type=float, default=Settings.body_timeout,
                        help="Seconds a client has to send a request's body: a slower one gets 408.")
    if "--help" in argv:
        print(f"{PROG_NAME}'s own flags (the others are `transformers serve`'s, below):")
        lines = parser.format_help().splitlines()
        print("\n".join(lines[lines.index("options:") + 1:]), end="\n\n")  # (the flags, without the usage)
    known, rest = parser.parse_known_args(argv)
    if known.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be a positive number of bytes, got {known.max_request_bytes}")
    if not known.shutdown_grace >= 0:
        parser.error(f"--shutdown-grace must be a number of seconds >= 0, got {known.shutdown_grace}")
    if not known.body_timeout > 0:
        parser.error(f"--body-timeout must be a number of seconds > 0, got {known.body_timeout}")
    return Settings(known.max_request_bytes, known.shutdown_grace, known.body_timeout), rest


def import_dat_hf() -> bool:
    """`import dat_hf` where it is installed (its Auto registrations); -> whether it was."""
    try:
        import dat_hf  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "dat_hf":
            raise
        return False
    return True


def register_architectures():
    """Set DAT's architecture names on the `transformers` module the server's loader looks a causal LM's class up on,
    to `AutoModelForCausalLM` (which resolves the folder's class: installed or remote code). (That module object is
    the loader's own: importing some of Transformers' modules replaces `sys.modules["transformers"]` with a new one,
    so each process's is set, whichever came first.)"""
    from transformers.cli.serving import model_manager

    for module in {id(module): module for module in (transformers, sys.modules["transformers"],
                                                      model_manager.transformers)}.values():
        for name in ARCHITECTURES:
            if not hasattr(module, name):
                setattr(module, name, module.AutoModelForCausalLM)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: OpenAI's error body, the field named
# ---------------------------------------------------------------------------------------------------------------------


class Refusal(ValueError):
    """A request the server will not run: HTTP `status` with `message`, naming the request field `param`. (A
    `ValueError`, the request's fault: raised in the model's process, it reaches the server as a `ValueError` of its
    message, whose leading `` `field` `` names the field again: `refusal_of`.)"""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


FIELD_FIRST = re.compile(r"`([a-z_]+)`")  # a message that begins with the request field it refuses


def refusal_of(error: ValueError) -> Refusal:
    """`error` as a `Refusal`: itself, else its message, naming the field its message begins with, if any."""
    if isinstance(error, Refusal):
        return error
    message = str(error)
    field = FIELD_FIRST.match(message)
    return Refusal(message, field.group(1) if field else None)


def error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---------------------------------------------------------------------------------------------------------------------
# Request fields
# ---------------------------------------------------------------------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields the server does not implement, and the values that ask nothing of it (None always does)
UNSUPPORTED = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,),
    "presence_penalty": (0, 0.0), "suffix": (), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "function_call": (), "functions": (), "prediction": (), "web_search_options": (), "metadata": (),
    "store": (False,), "service_tier": ("auto", "default"), "reasoning_effort": (), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
}


def _same(value, default) -> bool:
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def _is_number(value, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return integer or math.isfinite(value)


def _number(body: dict, name: str, low=None, high=None, *, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return
    bounds = [f"> {low}" if low_open else f">= {low}"] if low is not None else []
    bounds += [f"<= {high}"] if high is not None else []
    wanted = f"{'an integer' if integer else 'a number'}{' ' + ' and '.join(bounds) if bounds else ''}"
    if (not _is_number(value, integer) or (low is not None and (value < low or (low_open and value == low)))
            or (high is not None and value > high)):
        raise Refusal(f"`{name}` must be {wanted}, got {json.dumps(value)}.", name)


def _type(body: dict, name: str, kind: type, what: str):
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise Refusal(f"`{name}` must be {what}, got {json.dumps(value)}.", name)


def _unicode(value, path: str):
    """Refuse a string (anywhere in `value`) that cannot be encoded as UTF-8: a lone surrogate (`"\\ud800"`)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise Refusal(f"`{path}` is not valid Unicode: {error.reason} at character {error.start}.", path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _unicode(key, path)
            _unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _unicode(item, f"{path}[{index}]")


def _stop(body: dict):
    stop = body.get("stop")
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s for s in stops):
        raise Refusal(f"`stop` must be a non-empty string or a list of 1 to 4 of them, got {json.dumps(stop)}.",
                      "stop")


def _messages(body: dict):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refusal(f"`messages` must be a non-empty list of messages, got {json.dumps(messages)[:200]}.",
                      "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise Refusal(f"`{where}` must be an object with `role` and `content`.", where)
        if message.get("role") not in ROLES:
            raise Refusal(f"`{where}.role` must be one of {', '.join(ROLES)}, got {json.dumps(message.get('role'))}.",
                          f"{where}.role")
        content = message.get("content")
        if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
            continue
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not all(isinstance(part, dict) for part in parts):
            raise Refusal(f"`{where}.content` must be a string or a list of text parts, got "
                          f"{json.dumps(content)[:200]}.", f"{where}.content")
        for number, part in enumerate(parts):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Refusal(f"`{where}.content[{number}]` must be a text part ({{\"type\": \"text\", \"text\": "
                              f"...}}): this model reads text only.", f"{where}.content[{number}]")


def _generation_config(body: dict):
    text = body.get("generation_config")
    if text is None:
        return
    try:
        settings = json.loads(text) if isinstance(text, str) else None
        if not isinstance(settings, dict):
            raise ValueError("it must be a JSON object, as a string")
        transformers.GenerationConfig(**settings).validate(strict=True)
    except Exception as error:  # noqa: BLE001  (whatever GenerationConfig says, named)
        raise Refusal(f"`generation_config` is not a generation config: {error}", "generation_config") from None


def check_fields(body: dict, endpoint: str):
    """Refuse (`Refusal`, 400 naming the field) a `/v1/completions` (`endpoint="completions"`) or
    `/v1/chat/completions` (`"chat"`) body with a field of the wrong type or range, a string that is not Unicode,
    or a field the server does not implement asked for something; before the model is touched."""
    _unicode(body, "")
    for name, defaults in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(_same(value, default) for default in defaults):
            raise Refusal(f"`{name}` = {json.dumps(value)[:100]} is not supported by this server"
                          f"{' (only ' + json.dumps(defaults[0]) + ')' if defaults else ''}.", name)
    options = body.get("stream_options")  # (the last streamed chunk carries the usage: include_usage is served)
    if options is not None and (not body.get("stream") or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise Refusal("`stream_options` takes `include_usage` only, with `stream: true`.", "stream_options")
    for name in ("model", "user"):
        _type(body, name, str, "a string")
    _type(body, "stream", bool, "true or false")
    _type(body, "seed", int, "an integer")
    _type(body, "stream_options", dict, "an object")
    _number(body, "max_tokens", 1, integer=True)
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1, low_open=True)
    _number(body, "frequency_penalty", -2, 2)
    _stop(body)
    _generation_config(body)
    if endpoint == "completions":
        if not isinstance(body.get("prompt"), str):
            raise Refusal(f"`prompt` must be a string, got {json.dumps(body.get('prompt'))[:200]}.", "prompt")
        return
    _messages(body)
    _number(body, "max_completion_tokens", 1, integer=True)
    _type(body, "tools", list, "a list of tools")
    _type(body, "chat_template_kwargs", dict, "an object")
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or not all(
            key.isdigit() and _is_number(value) and -100 <= value <= 100 for key, value in bias.items())):
        raise Refusal("`logit_bias` must map token ids to numbers from -100 to 100.", "logit_bias")


# ---------------------------------------------------------------------------------------------------------------------
# The prompt against the context: measured off the event loop, an oversized text never tokenized
# ---------------------------------------------------------------------------------------------------------------------

LONGEST_TOKEN = weakref.WeakKeyDictionary()  # tokenizer -> characters of its longest token
NORMALIZER_SLACK = 4  # a normalizer may shrink text (NFKC composes up to 3 characters into 1): room for it


LONGEST_TOKEN = weakref.WeakKeyDictionary()  # tokenizer -> characters of its longest token
NORMALIZER_SLACK = 4  # a normalizer may shrink text (NFKC composes up to 3 characters into 1): room for it


def context_refusal(length: int, limit: int, param: str) -> Refusal:
    return Refusal(f"The prompt has {length} tokens: this model reads at most `max_position_embeddings` = {limit} "
                   f"tokens, prompt and completion, so a prompt must be shorter than {limit} tokens.", param)


def most_characters(tokenizer, limit: int) -> int:
    """The most characters a prompt of fewer than `limit` tokens can have: no token covers more characters than the
    tokenizer's longest (byte-level tokens: bytes, at least the characters they cover), with room for a normalizer."""
    if tokenizer not in LONGEST_TOKEN:
        LONGEST_TOKEN[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return NORMALIZER_SLACK * limit * LONGEST_TOKEN[tokenizer]


def check_prompt(body: dict, endpoint: str, config, processor, messages=None, template_kwargs=None):
    """Refuse a prompt (completions) or conversation (`messages` as the processor takes them) that leaves no room in
    the model's `config.max_position_embeddings`, or a conversation the chat template cannot write, or a `logit_bias`
    token outside the vocabulary. Runs on a worker thread; a text longer than `most_characters` is refused without
    being tokenized."""
    for token in body.get("logit_bias") or {}:
        if int(token) >= config.vocab_size:
            raise Refusal(f"`logit_bias` names token {token}: the vocabulary has {config.vocab_size}.", "logit_bias")
    limit = getattr(config, "max_position_embeddings", None)
    tokenizer = getattr(processor, "tokenizer", processor)
    param = "prompt" if endpoint == "completions" else "messages"
    if endpoint == "chat" and getattr(processor, "chat_template", None) is None:
        raise Refusal("This model's tokenizer has no chat template: /v1/chat/completions needs one (save a "
                      "`chat_template` with the tokenizer, docs/serving.md); /v1/completions takes a plain prompt.",
                      "messages")
    if limit is None:
        return
    texts = [body["prompt"]] if endpoint == "completions" else [message["content"] for message in messages]
    characters, most = sum(map(len, texts)), most_characters(tokenizer, limit)
    if characters > most:
        raise Refusal(f"The prompt has {characters} characters: this model reads at most `max_position_embeddings` "
                      f"= {limit} tokens, and no token of its tokenizer covers more than "
                      f"{LONGEST_TOKEN[tokenizer]} characters; a prompt over {most} characters is refused without "
                      f"being tokenized.", param)
    if endpoint == "completions":
        length = len(tokenizer(body["prompt"])["input_ids"])
    else:
        try:
            length = len(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True, tools=body.get("tools"),
                                                       **template_kwargs)["input_ids"])
        except Exception as error:  # noqa: BLE001  (the template's own message: roles out of order, ...)
            raise Refusal(f"The chat template cannot write these messages: {error}", "messages") from None
    if length >= limit:
        raise context_refusal(length, limit, param)


def setting(settings, name: str):
    """A generation setting of a request: `settings` is a `GenerationConfig` (a model in the server's process) or
    the dict of `generate`'s keywords (a model in its own process)."""
    return settings.get(name) if isinstance(settings, dict) else getattr(settings, name, None)


def set_setting(settings, name: str, value) -> None:
    if isinstance(settings, dict):
        settings[name] = value
    else:
        setattr(settings, name, value)


def fit_to_context(config, inputs, settings):
    """Refuse (HTTP 400) a prompt of `inputs["input_ids"]` (`[1, n]` tensor, or a list of n ids under continuous
    batching) with no room left in the model's `config.max_position_embeddings`; else cap the request's
    `max_new_tokens` (`settings`: see `setting`) to the room left."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return
    ids = inputs["input_ids"]
    length = len(ids) if isinstance(ids, list) else ids.shape[-1]
    room = limit - length
    if room < 1:
        raise context_refusal(length, limit, None)
    asked = setting(settings, "max_new_tokens")
    if asked is None or asked > room:
        set_setting(settings, "max_new_tokens", room)


def _guarded(handle_request, endpoint: str, model_of):
    """A handler's `handle_request`, its request checked first: fields (`check_fields`) on the event loop, then the
    prompt (`check_prompt`) on a worker thread, against the model's config and processor (`model_of(handler, body)`,
    the engine's: `ENGINES`); a `Refusal` is answered by the app's handler, `guard_app`."""

    @functools.wraps(handle_request)
    async def wrapper(self, body: dict, request_id: str):
        from transformers.cli.serving.utils import Modality

        check_fields(body, endpoint)
        config, processor = model_of(self, body)
        messages, template_kwargs = None, {}
        if endpoint == "chat":
            try:
                messages = self.get_processor_inputs_from_messages(body["messages"], Modality.LLM)
            except (KeyError, TypeError, ValueError) as error:  # (a tool call without its fields, ...)
                raise Refusal(f"`messages` cannot be read: {error!r}.", "messages") from None
            template_kwargs = {**self.chat_template_kwargs, **body.get("chat_template_kwargs", {})}
        await asyncio.to_thread(check_prompt, body, endpoint, config, processor, messages, template_kwargs)
        return await handle_request(self, body, request_id)

    return wrapper


# ---------------------------------------------------------------------------------------------------------------------
# Stop strings: the text ends before the first one, in both modes, streamed or not
# ---------------------------------------------------------------------------------------------------------------------


class StopText:
    """Text let through up to the first occurrence of any of `stops`: `feed` returns what can be sent now, holding
    back an end that may begin a stop string; `stopped` once one was found (nothing after it is let through)."""

    def __init__(self, stops: str | list[str]):
        self.stops = [stops] if isinstance(stops, str) else list(stops)
        self.pending, self.stopped = "", False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [index for index in (self.pending.find(stop) for stop in self.stops) if index >= 0]
        if found:
            text, self.pending, self.stopped = self.pending[:min(found)], "", True
            return text
        held = max((size for stop in self.stops for size in range(1, len(stop)) if self.pending.endswith(stop[:size])),
                   default=0)
        text, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return text

    def flush(self) -> str:
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text


class StoppingQueue:
    """The streamed text queue a handler reads (`get`, `get_nowait`, `empty`), ended at the first stop string: the
    request is cancelled there (`streamer.cancel()`), and its `max_new_tokens` (`settings`: see `setting`) cleared
    so that the handler reports `finish_reason: "stop"`."""

    def __init__(self, queue: asyncio.Queue, stop: StopText, streamer, settings, on_stop=None):
        self.queue, self.stop, self.streamer, self.settings = queue, stop, streamer, settings
        self.on_stop = on_stop
        self.ready, self.ended = collections.deque(), False

    def _take(self, item):
        if type(item) is str:  # (text; the parser's typed items, `str` subclasses, pass as they are)
            text = self.stop.feed(item)
            if text:
                self.ready.append(text)
            if self.stop.stopped:
                self.streamer.cancel()
                if self.on_stop is not None:
                    self.on_stop()
                set_setting(self.settings, "max_new_tokens", None)
                self.ready.append(None)
                self.ended = True
            return
        if item is None:
            rest = self.stop.flush()
            if rest:
                self.ready.append(rest)
            self.ended = True
        self.ready.append(item)

    async def get(self):
        while not self.ready:
            self._take(await self.queue.get())
        return self.ready.popleft()

    def get_nowait(self):
        while not self.ready:
            if self.ended:
                raise asyncio.QueueEmpty
            self._take(self.queue.get_nowait())
        return self.ready.popleft()

    def empty(self) -> bool:
        """Whether `get_nowait` has nothing to give now (what the queue holds taken in, as far as it goes)."""
        while not self.ready and not self.ended and not self.queue.empty():
            self._take(self.queue.get_nowait())
        return not self.ready


# ---------------------------------------------------------------------------------------------------------------------
# Generation: the context, sampling as asked, stop strings (the engine's entries wrapped: `ENGINES`)
# ---------------------------------------------------------------------------------------------------------------------


def _streamed(generate_streaming, engine):
    """The engine's `generate_streaming`: the request fitted to the context, its sampling checked, its text queue
    ended at the first stop string (`StoppingQueue`)."""

    @functools.wraps(generate_streaming)
    def wrapper(self, *args, **kwargs):
        call = inspect.signature(generate_streaming).bind(self, *args, **kwargs).arguments
        config, inputs, settings = engine.request(self, call)
        fit_to_context(config, inputs, settings)
        engine.check_sampling(self, settings)
        queue, streamer = generate_streaming(self, *args, **kwargs)
        if setting(settings, "stop_strings"):
            queue = StoppingQueue(queue, StopText(setting(settings, "stop_strings")), streamer, settings,
                                  on_stop=engine.on_stop(self, call))
        return queue, streamer

    return wrapper


def _completed(generate_non_streaming, engine):
    """The engine's `generate_non_streaming`: as `_streamed`; with `stop`, the text cut before the stop string, read
    as a stream (and cancelled there) under continuous batching, whose batch knows no stop strings."""

    @functools.wraps(generate_non_streaming)
    async def wrapper(self, *args, **kwargs):
        call = inspect.signature(generate_non_streaming).bind(self, *args, **kwargs).arguments
        config, inputs, settings = engine.request(self, call)
        fit_to_context(config, inputs, settings)
        engine.check_sampling(self, settings)
        stops = setting(settings, "stop_strings")
        if not stops:
            return await generate_non_streaming(self, *args, **kwargs)
        if not engine.batched(self):  # `generate` stops at the stop string itself: cut the text there
            text, input_len, generated = await generate_non_streaming(self, *args, **kwargs)
            stop = StopText(stops)
            text = stop.feed(text) + stop.flush()
        else:
            queue, streamer = self.generate_streaming(*args, **kwargs)  # (wrapped: a `StoppingQueue`)
            generated, pieces = engine.record(streamer), []
            while (item := await queue.get()) is not None:
                if not isinstance(item, str):  # (the stream's error: a refusal from the model's process is one)
                    message = getattr(item, "msg", str(item))
                    raise refusal_of(ValueError(message)) if FIELD_FIRST.match(message) else RuntimeError(
                        f"Generation failed: {message}")
                pieces.append(item)
            text, stop, input_len = "".join(pieces), queue.stop, len(inputs["input_ids"])
        if stop.stopped:
            set_setting(settings, "max_new_tokens", None)  # (the handler then reports finish_reason "stop")
        return text, input_len, generated

    return wrapper


def _sampling_as_asked(build):
    """The handlers' generation settings of a request: one asking `temperature` > 0 or `top_p` is sampled (OpenAI's
    meaning), whatever the model's generation config says of `do_sample` (Transformers' server leaves it, and
    `generate` is then greedy)."""

    @functools.wraps(build)
    def wrapper(self, body, *args, **kwargs):
        settings = build(self, body, *args, **kwargs)
        if body.get("temperature") != 0 and (body.get("temperature") is not None or body.get("top_p") is not None):
            set_setting(settings, "do_sample", True)
        return settings

    return wrapper


def _check_sampling(manager, generation_config):
    """(A model in the server's process) under continuous batching every request is sampled as the batch's first
    request asked (one shared generation config): refuse, by name, a request that asks otherwise."""
    shared = getattr(getattr(manager, "_cb", None), "generation_config", None)
    if shared is None:
        return
    for name, field in (("do_sample", "temperature"), ("temperature", "temperature"), ("top_p", "top_p"),
                        ("top_k", "generation_config"), ("repetition_penalty", "frequency_penalty")):
        asked, served = getattr(generation_config, name, None), getattr(shared, name, None)
        if name != "do_sample" and not (generation_config.do_sample or shared.do_sample):
            continue  # (greedy: the sampling settings do nothing)
        if asked != served:
            raise Refusal(f"With continuous batching every request is sampled as the first one asked ({name}="
                          f"{served}); this one asks {name}={asked}. Ask the same, or serve without "
                          f"--continuous-batching.", field)


def check_batch_sampling(manager, generation_kwargs: dict):
    """(In a model's own process) refuse, by name, a request the continuous batch cannot sample as asked: the batch
    samples or not as the model's generation config says (`manager.generation_config`), and each request sets only
    the settings the batch's logits processors take per request (`manager.logit_processor.supported_keys`); the rest
    are the model's. The message begins with the field, which names it again in the server (`refusal_of`)."""
    shared, own = manager.generation_config, set(manager.logit_processor.supported_keys)
    sampled = bool(generation_kwargs.get("do_sample")) and generation_kwargs.get("temperature") != 0
    if sampled != bool(shared.do_sample) and (sampled or "top_k" not in own):  # (greedy per request: top_k=1)
        raise Refusal(f"`temperature`: with continuous batching this model's requests are "
                      f"{'sampled' if shared.do_sample else 'greedy'}, as its generation config says (do_sample="
                      f"{shared.do_sample}); this one asks {'sampling' if sampled else 'greedy text'}. Ask the same, "
                      f"or serve without --continuous-batching.", "temperature")
    checked = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "generation_config")) if sampled else ()
    for name, field in (*checked, ("repetition_penalty", "frequency_penalty")):
        asked, served = generation_kwargs.get(name), getattr(shared, name, None)
        if _effect(name, asked) != _effect(name, served) and name not in own:
            raise Refusal(f"`{field}`: with continuous batching this model's requests take {name}={served}, as its "
                          f"generation config says; this one asks {name}={asked}. Ask the same, or serve without "
                          f"--continuous-batching.", field)


NEUTRAL_SETTINGS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}  # (as if unset)


def _effect(name: str, value):
    """A sampling setting as it acts: None for unset and for the values that change nothing."""
    return None if value is None or value == NEUTRAL_SETTINGS.get(name) else value


def _batch_sampling(build_batching_kwargs):
    """`CBGenerateRunner._build_continuous_batching_kwargs` (in the model's process): `check_batch_sampling` first."""

    @functools.wraps(build_batching_kwargs)
    def wrapper(self, generation_kwargs, *args, **kwargs):
        check_batch_sampling(self.manager, generation_kwargs)
        return build_batching_kwargs(self, generation_kwargs, *args, **kwargs)

    return wrapper


def _servable(use_continuous_batching, limits_of):
    """`GenerationState.use_continuous_batching`: a model continuous batching cannot serve (`limits_of(model or
    config)`, its `continuous_batching_limits`) is served by `generate`, with a warning naming what stops it."""

    @functools.wraps(use_continuous_batching)
    def wrapper(self, model, *args, **kwargs):
        if not use_continuous_batching(self, model, *args, **kwargs):
            return False
        limits = limits_of(model)
        if limits:
            logger.warning_once(f"Continuous batching cannot serve this DAT model ({'; '.join(limits)}): it is "
                                "served by `generate`, one request at a time.")
        return not limits

    return wrapper


def _forget(manager, request_id: str):
    """Drop a cancelled continuous-batching request's result handler (the manager drops it only at a last output,
    which a cancelled request never sends)."""
    router = getattr(getattr(manager, "_cb", None), "output_router", None)
    if router is not None:
        with router._lock:
            router.result_handlers.pop(request_id, None)


def _cancellable(async_submit):
    """In place of `InferenceThread.async_submit` (kept as `__wrapped__`), for requests that are cancelled (a client
    gone, the shutdown's grace period over): a call whose request was cancelled while queued is not run, and the answer
    of one cancelled while it ran is dropped. Transformers' own sets the result on the cancelled asyncio future from its
    thread (`InvalidStateError`, logged with a traceback) and runs every queued call. The call goes through the
    thread's `submit` (a `concurrent.futures.Future` nobody cancels), the answer is handed to the event loop, which
    sets it only on a future still waiting."""

    @functools.wraps(async_submit)
    def wrapper(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def call(*args, **kwargs):  # (on the inference thread)
            return None if answer.cancelled() else fn(*args, **kwargs)

        def settle(done):  # (on the event loop)
            if answer.done():
                return
            error = done.exception()
            answer.set_result(done.result()) if error is None else answer.set_exception(error)

        def hand_over(done):  # (on the inference thread)
            try:
                loop.call_soon_threadsafe(settle, done)
            except RuntimeError:  # (the event loop is closed: nobody waits for the answer)
                pass

        self.submit(call, *args, **kwargs).add_done_callback(hand_over)
        return answer

    return wrapper


def _recorded(init_cb):
    @functools.wraps(init_cb)
    def wrapper(self, model, generation_config, *args, **kwargs):
        # (a copy: the batch's shared config must not change with the request that happened to start it)
        init_cb(self, model, copy.deepcopy(generation_config), *args, **kwargs)
        STARTED_CB_MANAGERS.add(self)

    return wrapper


# ---------------------------------------------------------------------------------------------------------------------
# The app: body limit, errors as OpenAI answers them, /v1/models/{id}, 503 for what shutdown cut short
# ---------------------------------------------------------------------------------------------------------------------


async def _refuse(send, status: int, message: str):
    """Answer `status` with OpenAI's error body through ASGI's `send`, and close the connection (the request's body
    may be left unread)."""
    payload = json.dumps(error_body(message, None, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


class RequestGuard:
    """ASGI middleware: a body over `SETTINGS.max_request_bytes` gets 413 (from `Content-Length` before a byte is
    read; without one, once the limit is passed), a body not sent within `SETTINGS.body_timeout` 408, the connection
    then closed; a request cancelled before its answer started (the shutdown's grace period over) gets 503."""

    def __init__(self, app):
        self.app, self.in_flight = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, self._drained(receive), send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.in_flight += 1
        try:
            await self._guard(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _drained(self, receive, most: float = 2.0):
        """The lifespan's `receive`, its shutdown message held until the requests uvicorn cancelled have sent their
        503 (uvicorn does not wait for them: the process would end before they run), for at most `most` seconds."""

        async def drained():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                loop = asyncio.get_running_loop()
                deadline = loop.time() + most
                while self.in_flight and loop.time() < deadline:
                    await asyncio.sleep(0.02)
            return message

        return drained

    async def _guard(self, scope, receive, send):
        limit = SETTINGS.max_request_bytes
        too_large = f"The request body is over this server's limit of {limit} bytes (--max-request-bytes)."
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not length.isdigit():
            return await _refuse(send, 400, "`Content-Length` must be a number of bytes.")
        if length is not None and int(length) > limit:
            return await _refuse(send, 413, too_large)
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + SETTINGS.body_timeout
        while more:
            try:  # (a client that holds its connection open without sending the body it announced)
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await _refuse(send, 408, f"The request body did not arrive within {SETTINGS.body_timeout} s "
                                                f"(--body-timeout).")
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _refuse(send, 413, too_large)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except asyncio.CancelledError:  # (uvicorn cancels what is left when the shutdown's grace period is over)
            if not started:
                await _refuse(send, 503, f"The server is shutting down: the request did not finish within the grace "
                                         f"period ({SETTINGS.shutdown_grace} s).")
            # else a stream cut short: returning unfinished, its connection is closed


def guard_app(app, model_manager):
    """What `build_server`'s app gets: `RequestGuard`, OpenAI's error body for `Refusal`s (wherever raised: the
    generation entries serve `/v1/responses` too), Transformers' `ValueError`s and `HTTPException`s, and
    `/v1/models/{id}`."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse

    app.add_middleware(RequestGuard)

    @app.exception_handler(ValueError)  # (a `Refusal`; Transformers': a model it does not serve, a value it refuses)
    async def refused(_request: Request, error: ValueError):
        refusal = refusal_of(error)
        return JSONResponse(error_body(refusal.message, refusal.param, refusal.status), status_code=refusal.status)

    @app.exception_handler(HTTPException)
    async def openai_error(_request: Request, error: HTTPException):
        message = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
        return JSONResponse(error_body(message, None, error.status_code), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.get("/v1/models/{model_id:path}")
    def retrieve_model(model_id: str):
        for entry in served_models(model_manager):
            if entry["id"] == model_id:
                return JSONResponse(entry)
        return JSONResponse(error_body(f"The model `{model_id}` does not exist on this server.", "model", 404),
                            status_code=404)

    return app


def served_models(model_manager) -> list[dict]:
    """The models the server holds, as `/v1/models` lists them: its `list_models()`, else (a release without it) the
    model it is pinned to, then the generative models of the Hub cache."""
    from huggingface_hub import CacheNotFound

    if hasattr(model_manager, "list_models"):
        return model_manager.list_models()
    pinned = [{"id": model_manager.force_model, "object": "model", "created": 0, "owned_by": "local"}]
    try:
        cached = model_manager.get_gen_models()
    except CacheNotFound:  # (nothing downloaded yet)
        cached = []
    return pinned * (model_manager.force_model is not None) + cached


def _lists_models(manager_class) -> str | None:
    """(`SERVER_INTERNALS`) a model manager `served_models` can read."""
    if hasattr(manager_class, "list_models") or (hasattr(manager_class, "get_gen_models")
                                                 and "self.force_model" in inspect.getsource(manager_class.__init__)):
        return None
    return "it has neither `list_models` nor `get_gen_models` beside a pinned `force_model`"


def _guarded_build(build_server):
    @functools.wraps(build_server)
    def wrapper(model_manager, *args, **kwargs):
        return guard_app(build_server(model_manager, *args, **kwargs), model_manager)

    return wrapper


def _graceful(config_class):
    """uvicorn's `Config`, its `timeout_graceful_shutdown` (unset: wait for ever) defaulting to
    `SETTINGS.shutdown_grace`."""

    class GracefulConfig(config_class):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("timeout_graceful_shutdown", SETTINGS.shutdown_grace)
            super().__init__(*args, **kwargs)

    return GracefulConfig


def _recorded_server(server_class):
    """uvicorn's `Server`, each one started recorded (`stop_servers`)."""

    class RecordedServer(server_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            STARTED_SERVERS.add(self)

    return RecordedServer


def stop_servers():
    """Ask every server this process started to stop (its shutdown as on SIGTERM, the grace period included): a
    server run on a thread (`main` there) ends so."""
    for server in list(STARTED_SERVERS):
        server.should_exit = True


# ---------------------------------------------------------------------------------------------------------------------
# The seam: what dat_hf.serve reaches of `transformers serve`, and how it finds it
# ---------------------------------------------------------------------------------------------------------------------
#
# `SERVER_INTERNALS` lists every name of Transformers' server (and uvicorn's) this file wraps, replaces or reads, with
# what it needs of it and the shape that need takes. A release runs its model one of two ways (`ENGINES`), found by
# what the release offers, never by its version: in the server's own process on an inference thread (Transformers
# 5.17 to 5.24), or in a process of its own that the server spawns (5.25). `hook_server` checks the table on the
# installed release before it hooks anything: a name that moved stops the server at its start (`ServerMoved`: the
# name, what changed, the release installed and the newest tested). `tests/test_transformers_internals.py` walks the
# table in CI; docs/installing_and_testing.md says what to do when a release moves a name.

# the releases the table was checked on
SERVER_CHECKED_RELEASES = ("5.17.0", "5.24.0", "5.25.0")


class ServerMoved(RuntimeError):
    """The installed Transformers' server lacks, or has changed, what dat_hf.serve needs of it (`SERVER_INTERNALS`)."""


def _parameters(*names):
    """A callable whose parameters start with `names` (the ones the seam passes, binds or overrides)."""

    def shape(found):
        have = list(inspect.signature(found).parameters)
        if have[:len(names)] != list(names):
            return f"its parameters are ({', '.join(have)}), where the seam needs ({', '.join(names)}, ...)"

    return shape


def _mentioning(*words):
    """Source that mentions `words` (what it sets, reads or calls for the seam)."""

    def shape(found):
        missing = [word for word in words if word not in inspect.getsource(found)]
        if missing:
            return f"its source does not mention {', '.join(f'`{word}`' for word in missing)}"

    return shape


class ServerInternal(collections.namedtuple("ServerInternal", "name engine need shape", defaults=(None,))):
    """A name of Transformers' server (module, then attributes) the seam reaches: for `engine` ("both", or the
    `ENGINES` entry's name that uses it), what it `need`s of it, and its `shape` (the found object -> what differs,
    or None)."""

    def difference(self) -> str | None:
        """What the installed release's name lacks of what the seam needs; None when it has it. (Transformers' own,
        where the seam already hooked it: `unhooked`.)"""
        owner, _, attribute = self.name.rpartition(".")
        try:
            found = getattr(unhooked(pkgutil.resolve_name(owner)), attribute)
        except (ImportError, AttributeError) as error:
            return f"there is no `{self.name}` ({error})"
        return None if self.shape is None else self.shape(unhooked(found))


def unhooked(found):
    """What the seam's hook replaced (`_hook`): a wrapper's `__wrapped__`, a subclass's base; else `found`."""
    if not getattr(found, "dat_hf_hook", False):
        return found
    return found.__bases__[0] if isinstance(found, type) else inspect.unwrap(found)


SERVING = "transformers.cli.serving"
SERVER_INTERNALS = (
    # ---- both engines ----
    ServerInternal("transformers.cli.serve.Serve", "both",
                   "the `serve` command, whose options are the server's flags (`DATServe` subclasses it)"),
    ServerInternal(f"{SERVING}.server.build_server", "both",
                   "builds the app, looked up as the server starts: wrapped (`guard_app`)", _parameters("model_manager")),
    *(ServerInternal(f"{SERVING}.{module}.handle_request", "both",
                     f"answers {path}: wrapped, the request checked first (`_guarded`)",
                     _parameters("self", "body", "request_id"))
      for module, path in (("completion.CompletionHandler", "/v1/completions"),
                           ("chat_completion.ChatCompletionHandler", "/v1/chat/completions"))),
    ServerInternal(f"{SERVING}.utils.BaseHandler.get_processor_inputs_from_messages", "both",
                   "a chat's messages as the chat template takes them (measured against the context)",
                   _parameters("messages", "modality")),
    ServerInternal(f"{SERVING}.utils.Modality.LLM", "both", "a text model's modality"),
    ServerInternal(f"{SERVING}.model_manager.transformers", "both",
                   "the module the loader looks a causal LM's class up on (`register_architectures`)"),
    ServerInternal(f"{SERVING}.model_manager.ModelManager", "both",
                   "the models the server holds (`/v1/models/{id}`): `list_models()`, or the pinned `force_model` "
                   "and `get_gen_models()` (`served_models`)", _lists_models),
    ServerInternal(f"{SERVING}.utils.GenerationState.use_continuous_batching", "both",
                   "chooses continuous batching for a model: wrapped (`_servable`)", _parameters("self")),
    ServerInternal("uvicorn.Config.__init__", "both",
                   "`uvicorn.Config`, looked up as the server starts: replaced by a subclass whose "
                   "`timeout_graceful_shutdown` is --shutdown-grace", _mentioning("timeout_graceful_shutdown")),
    ServerInternal("uvicorn.Server.__init__", "both",
                   "`uvicorn.Server`, looked up as the server starts: replaced by a subclass that records it "
                   "(`stop_servers` sets its `should_exit`)", _mentioning("should_exit")),
    # ---- the model in the server's process, generating on an inference thread ----
    *(ServerInternal(f"{SERVING}.utils.{manager}.{entry}", "thread",
                     f"generates a request's text: wrapped (`_{'streamed' if 'non' not in entry else 'completed'}`)",
                     _parameters("self", "model", "processor", "inputs", "gen_config", "request_id"))
      for manager in ("GenerateManager", "CBGenerateManager")
      for entry in ("generate_streaming", "generate_non_streaming")),
    ServerInternal(f"{SERVING}.utils.CBGenerateManager.init_cb", "thread",
                   "starts the batch as the first request asks (its `_cb`): wrapped (`_recorded`)",
                   _parameters("self", "model", "gen_config")),
    ServerInternal(f"{SERVING}.utils.CBGenerateManager.generate_streaming", "thread",
                   "the batching manager in `self._cb`, whose `generation_config` the batch samples with",
                   _mentioning("self._cb")),
    ServerInternal("transformers.generation.continuous_batching.continuous_api.ContinuousBatchingManager."
                   "register_result_handler", "thread",
                   "a request's handler in `output_router.result_handlers` (`_forget` drops a stopped one's)",
                   _mentioning("result_handlers")),
    ServerInternal(f"{SERVING}.utils.InferenceThread.async_submit", "thread",
                   "runs a generation on the inference thread: replaced (`_cancellable`)", _parameters("self", "fn")),
    ServerInternal(f"{SERVING}.utils.InferenceThread.submit", "thread", "what `_cancellable` submits through",
                   _parameters("self", "fn")),
    ServerInternal(f"{SERVING}.utils.BaseHandler._build_generation_config", "thread",
                   "a request's generation config: wrapped (`_sampling_as_asked`)",
                   _parameters("self", "body", "model_generation_config")),
    ServerInternal(f"{SERVING}.utils.BaseHandler._resolve_model", "thread", "a request's model and processor",
                   _parameters("self", "body")),
    ServerInternal(f"{SERVING}.model_manager.ModelManager._load_model", "thread",
                   "loads a causal LM as `getattr(transformers, config.architectures[0])` (`register_architectures`)",
                   _mentioning("getattr(transformers, config.architectures[0])")),
    # ---- the model in a process of its own, spawned by the server ----
    ServerInternal(f"{SERVING}.model_manager.EngineClient.start_process", "process",
                   "spawns the model's process with the loader's `load_model_and_processor`: the loader (pickled) is "
                   "how the seam's hooks reach that process (`DATModelLoader`)",
                   _mentioning("loader.load_model_and_processor")),
    ServerInternal("transformers.cli.serve.Serve.__init__", "process",
                   "builds its loader from `model_manager.ModelLoader`, looked up as it runs (`DATModelLoader` put "
                   "there)", _mentioning("import ModelLoader", "ModelLoader(")),
    ServerInternal("transformers.cli.serve.Serve.run_api_servers", "process",
                   "spawns its API servers with the command's `run` (pickled: `DATServe.run` hooks them)",
                   _mentioning("self.run")),
    ServerInternal(f"{SERVING}.model_manager.ModelLoader.load_model_and_processor", "process",
                   "loads the model in its process: subclassed (`DATModelLoader`), the hooks installed first",
                   _parameters("self", "model_id")),
    ServerInternal(f"{SERVING}.model_manager.ModelLoader._load_model", "process",
                   "loads a causal LM as `getattr(transformers, config.architectures[0])` (`register_architectures`)",
                   _mentioning("getattr(transformers, config.architectures[0])")),
    *(ServerInternal(f"{SERVING}.model_manager.EngineClient.{entry}", "process",
                     f"generates a request's text: wrapped (`_{'streamed' if 'non' not in entry else 'completed'}`)",
                     _parameters("self", "inputs", "generation_kwargs"))
      for entry in ("generate_streaming", "generate_non_streaming")),
    ServerInternal(f"{SERVING}.model_manager.EngineClient.__init__", "process",
                   "the model's config and processor, in the server's process", _mentioning(
                       "self.model_config", "self.processor")),
    ServerInternal(f"{SERVING}.model_manager.EngineClient.use_cb", "process",
                   "whether the model generates with continuous batching"),
    ServerInternal(f"{SERVING}.model_manager.ModelManager.get_engine", "process", "a request's model",
                   _parameters("self", "model")),
    ServerInternal(f"{SERVING}.utils.Detokenizer.put_token", "process",
                   "a streamed token (recorded for the usage when `stop` is read as a stream)",
                   _parameters("self", "token_id")),
    ServerInternal(f"{SERVING}.utils.BaseHandler._build_generation_kwargs", "process",
                   "a request's `generate` keywords: wrapped (`_sampling_as_asked`)",
                   _parameters("self", "body", "model_generation_config")),
    ServerInternal(f"{SERVING}.utils.CBGenerateRunner._build_continuous_batching_kwargs", "process",
                   "a request's batch settings, in the model's process: wrapped (`check_batch_sampling`)",
                   _parameters("self", "generation_kwargs")),
    ServerInternal(f"{SERVING}.utils.CBGenerateRunner.__init__", "process", "its batching manager (`self.manager`)",
                   _mentioning("self.manager")),
    ServerInternal("transformers.generation.continuous_batching.continuous_api.ContinuousBatchingManager.__init__",
                   "process", "the batch's `generation_config` and `logit_processor` (its `supported_keys`: what a "
                   "request sets for itself)", _mentioning("self.generation_config", "self.logit_processor")),
    ServerInternal("transformers.generation.continuous_batching.cb_logits_processors."
                   "ContinuousBatchingLogitsProcessorList._retrieve_processors_kwargs", "process",
                   "`supported_keys`: the sampling settings each request of the batch sets", _mentioning(
                       "self.supported_keys")),
)


class Engine:
    """How a release runs its model, as the seam meets it: where a request's config, inputs and generation settings
    are found in a call of its generation entries, whether it batches continuously, the stream it hands tokens to,
    and what it hooks."""

    name = found_by = summary = ""
    settings_argument = ""  # the generation entries' argument holding the request's settings
    stream_entry = ""  # the streamer's method handed each output

    @classmethod
    def request(cls, owner, call: dict):
        """(the model's config, the inputs, the request's settings: see `setting`) of a generation entry's call
        (its arguments by name)."""
        return cls.config_of(owner, call), call["inputs"], call[cls.settings_argument]

    @classmethod
    def record(cls, streamer) -> list:
        """The ids `streamer` is handed, as it is handed them (for the usage, when `stop` reads a request as a
        stream)."""
        generated, hand = [], getattr(streamer, cls.stream_entry)

        def recording(output):
            cls.take(generated, output)
            hand(output)

        setattr(streamer, cls.stream_entry, recording)
        return generated


class ThreadEngine(Engine):
    """The model in the server's own process, generating on its inference thread (`GenerateManager`,
    `CBGenerateManager`, `InferenceThread`: Transformers 5.17 to 5.24)."""

    name = "thread"
    found_by = f"{SERVING}.utils.InferenceThread"
    summary = "the model in the server's process, Transformers 5.17 to 5.24"
    settings_argument, stream_entry = "gen_config", "put"
    check_sampling = staticmethod(_check_sampling)

    @staticmethod
    def config_of(manager, call):
        return call["model"].config

    @staticmethod
    def take(generated: list, output):
        generated[:] = output.generated_tokens  # (each output holds every token so far)

    @staticmethod
    def on_stop(manager, call):
        return lambda: _forget(manager, call.get("request_id"))

    @staticmethod
    def batched(manager) -> bool:
        return getattr(manager, "_cb", None) is not None

    @staticmethod
    def model_of(handler, body):
        _, model, processor = handler._resolve_model(dict(body))
        return model.config, processor

    @staticmethod
    def limits_of(model) -> list[str]:
        return getattr(model, "continuous_batching_limits", list)()

    @staticmethod
    def hook():
        from transformers.cli.serving import utils

        for manager in (utils.GenerateManager, utils.CBGenerateManager):
            _hook(manager, "generate_streaming", _streamed, ThreadEngine)
            _hook(manager, "generate_non_streaming", _completed, ThreadEngine)
        _hook(utils.BaseHandler, "_build_generation_config", _sampling_as_asked)
        _hook(utils.GenerationState, "use_continuous_batching", _servable, ThreadEngine.limits_of)
        _hook(utils.CBGenerateManager, "init_cb", _recorded)
        _hook(utils.InferenceThread, "async_submit", _cancellable)


class ProcessEngine(Engine):
    """The model in a process of its own, which the server spawns (`EngineClient`, `GenerateRunner`,
    `CBGenerateRunner`: Transformers 5.25). The server's process holds the model's config and processor; what runs
    beside generation is installed in the model's process by the loader it is handed (`DATModelLoader`)."""

    name = "process"
    found_by = f"{SERVING}.model_manager.EngineClient.start_process"
    summary = "the model in a process of its own, Transformers 5.25"
    settings_argument, stream_entry = "generation_kwargs", "put_token"

    @staticmethod
    def config_of(client, call):
        return client.model_config

    @staticmethod
    def take(generated: list, token_id: int):
        generated.append(token_id)

    @staticmethod
    def on_stop(client, call):
        return None  # (the stream's cancel ends the request in the model's process)

    @staticmethod
    def check_sampling(client, settings):
        pass  # (in the model's process, where the batch is: `check_batch_sampling`)

    @staticmethod
    def batched(client) -> bool:
        return client.use_cb

    @staticmethod
    def model_of(handler, body):
        engine = handler.model_manager.get_engine(body.get("model"))
        return engine.model_config, engine.processor

    @staticmethod
    def limits_of(config) -> list[str]:
        """What stops continuous batching from serving the model of `config`: a DAT model's
        `continuous_batching_limits`, asked of one built on the meta device (no weights); none for other models."""
        if not set(getattr(config, "architectures", None) or ()) & set(ARCHITECTURES):
            return []
        import torch

        remote = type(config).__module__.startswith("transformers_modules")  # (its code trusted already)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
        return getattr(model, "continuous_batching_limits", list)()

    @staticmethod
    def hook():
        from transformers.cli.serving import model_manager, utils

        _hook(model_manager.EngineClient, "generate_streaming", _streamed, ProcessEngine)
        _hook(model_manager.EngineClient, "generate_non_streaming", _completed, ProcessEngine)
        _hook(utils.BaseHandler, "_build_generation_kwargs", _sampling_as_asked)
        _hook(utils.GenerationState, "use_continuous_batching", _servable, ProcessEngine.limits_of)
        _hook(model_manager, "ModelLoader", lambda loader: DATModelLoader)


ENGINES = (ProcessEngine, ThreadEngine)  # (the first one the installed release offers is the one it runs)


def _hook(owner, name: str, hook, *args):
    """`owner.name` replaced by `hook(owner.name, *args)`, once (what a wrapper wraps stays its `__wrapped__`)."""
    current = getattr(owner, name)
    if getattr(current, "dat_hf_hook", False):
        return
    replacement = hook(current, *args)
    replacement.dat_hf_hook = True
    setattr(owner, name, replacement)


def moved_message(internal: ServerInternal, what: str) -> str:
    newest = TESTED_TRANSFORMERS[1]
    return (f"dat_hf.serve needs `{internal.name}` ({internal.need}); in the installed transformers "
            f"{transformers.__version__}, {what}. dat_hf is tested with Transformers {TESTED_TRANSFORMERS[0]} to "
            f"{newest}: pip install 'transformers=={newest}'")


def find_engine():
    """The way the installed release runs its model (`ENGINES`), found by what it offers; `ServerMoved` if neither."""
    for engine in ENGINES:
        try:
            pkgutil.resolve_name(engine.found_by)
            return engine
        except (ImportError, AttributeError):
            continue
    newest = TESTED_TRANSFORMERS[1]
    raise ServerMoved(f"dat_hf.serve cannot tell how the installed transformers {transformers.__version__}'s server "
                      f"runs its model: it has neither "
                      f"{' nor '.join(f'`{engine.found_by}` ({engine.summary})' for engine in ENGINES)}. "
                      f"dat_hf is tested with Transformers {TESTED_TRANSFORMERS[0]} to {newest}: pip install "
                      f"'transformers=={newest}'")


def server_moved(engine) -> list[str]:
    """A message (`moved_message`) for each internal `engine` needs that the installed release moved."""
    return [moved_message(internal, what) for internal in SERVER_INTERNALS
            if internal.engine in ("both", engine.name) and (what := internal.difference()) is not None]


def hook_server(settings: Settings | None = None):
    """Fit Transformers' server for clients it does not trust (the module's docstring): the handlers check requests
    first (`_guarded`); the generation entries fit the prompt to the context, refuse sampling the batch cannot give
    and honour `stop` (`_streamed`, `_completed`); continuous batching is chosen by DAT's limits; the app is guarded
    (`guard_app`) and uvicorn's shutdown given its grace. `settings` (default: the defaults) apply from then on; the
    hooks are installed once per process, after the seam's table is checked (`ServerMoved` naming what moved)."""
    global SETTINGS
    SETTINGS = settings or Settings()
    engine = find_engine()
    messages = server_moved(engine)
    if messages:
        raise ServerMoved("\n".join(messages))
    import uvicorn
    from transformers.cli.serving import chat_completion, completion, server

    _hook(completion.CompletionHandler, "handle_request", _guarded, "completions", engine.model_of)
    _hook(chat_completion.ChatCompletionHandler, "handle_request", _guarded, "chat", engine.model_of)
    _hook(server, "build_server", _guarded_build)
    _hook(uvicorn, "Config", _graceful)
    _hook(uvicorn, "Server", _recorded_server)
    engine.hook()


def hook_model_process():
    """In the model's own process (`ProcessEngine`): DAT registered (`import_dat_hf`, `register_architectures`),
    continuous batching chosen by DAT's limits, and sampling the batch cannot give refused (`check_batch_sampling`)."""
    from transformers.cli.serving import utils

    import_dat_hf()
    register_architectures()
    _hook(utils.GenerationState, "use_continuous_batching", _servable, ProcessEngine.limits_of)
    _hook(utils.CBGenerateRunner, "_build_continuous_batching_kwargs", _batch_sampling)


# What Transformers hands the processes it spawns, which carry the hooks there (module level: they are pickled)
try:
    from transformers.cli.serving.model_manager import ModelLoader as _TransformersModelLoader
except ImportError:  # (a release whose model runs in the server's process: nothing is handed over)
    _TransformersModelLoader = None
try:
    from transformers.cli.serve import Serve as _TransformersServe
except ImportError:  # (the command's packages are missing: `main` names them)
    _TransformersServe = None

if _TransformersModelLoader is not None:

    class DATModelLoader(_TransformersModelLoader):
        """Transformers' loader, which the server hands to its model's process: there, the hooks of that process
        first (`hook_model_process`)."""

        def load_model_and_processor(self, *args, **kwargs):
            hook_model_process()
            return super().load_model_and_processor(*args, **kwargs)

if _TransformersServe is not None:

    class DATServe(_TransformersServe):
        """Transformers' `serve` command, each API server it spawns hooked as this process is (`hook_server`, with
        the settings exported to the environment)."""

        def run(self, *args, **kwargs):
            hook_server(Settings.from_environment())
            return super().run(*args, **kwargs)

    DATServe.__doc__ = _TransformersServe.__doc__  # (the command's help)


def serve_command():
    """The `serve` command (click), run by `DATServe`: Transformers' options."""
    import typer

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(DATServe)
    return typer.main.get_command(app)


def main(argv: list[str] | None = None):
    """Run `transformers serve` with `argv` (default: the command line), DAT registered and the server hooked. Runs
    on a thread too (a notebook, the tests): `stop_servers` ends it there."""
    import_dat_hf()
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available() or _TransformersServe is None:
        sys.exit('dat_hf.serve needs the serving dependencies: pip install "dat_hf[serving]" (or '
                 '"transformers[serving]")')
    settings, argv = parse_settings(sys.argv[1:] if argv is None else list(argv))
    register_architectures()
    try:
        hook_server(settings)
    except ServerMoved as moved:  # (at start, before anything is loaded: no traceback from deep inside)
        sys.exit(f"{PROG_NAME}: {moved}")
    settings.export()
    prog_name = PROG_NAME if __name__ == "__main__" and __package__ else os.path.basename(sys.argv[0])
    on_a_thread = threading.current_thread() is not threading.main_thread()  # (returns, where a command exits)
    try:
        serve_command().main(args=argv, prog_name=prog_name, standalone_mode=not on_a_thread)
    finally:
        for manager in list(STARTED_CB_MANAGERS):
            manager.stop()


if __name__ == "__main__":
    main()
