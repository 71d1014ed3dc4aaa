"""`transformers serve` for DAT: `python -m dat_hf.serve FOLDER [flags]` (console script `dat-hf-serve`), an
OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`, streaming; with `--continuous-batching` over the
paged cache). Needs the `serving` extra: `pip install "dat_hf[serving]"`.

This is Transformers' own `serve` command, run with the given arguments, with DAT registered and what a server facing
clients it does not trust needs (docs/serving.md):
- **Loading.** Its model manager loads a causal LM as `getattr(transformers, config.architectures[0])`, where no class
  of a model family outside Transformers is found. DAT's architecture names are set there to `AutoModelForCausalLM`,
  so the class loaded is the one Transformers itself picks for the folder: dat_hf's where it is installed, else the
  folder's remote code (`--trust-remote-code`).
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
- **Continuous batching.** A DAT configuration that continuous batching cannot serve
  (the model's `continuous_batching_limits`) is served by `generate`, one request at a time, with a warning naming the
  fields. The batch samples every request as its first request asked: a request asking other sampling settings is
  refused by name.
- **`/v1/models/{id}`** answers the model the server holds.
- **Shutdown.** On SIGTERM / Ctrl+C the server stops admitting, finishes the requests in flight within
  `--shutdown-grace` seconds (default 10), answers the rest 503 (a stream is closed), and exits. A generation whose
  request was cancelled is not started, or its answer dropped.

The file imports nothing of dat_hf but, where installed, the package itself (its Auto registrations): where dat_hf is
not installed, the file alone serves a saved DAT folder from its remote code, run as a script:
`python serve.py FOLDER --trust-remote-code`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import functools
import json
import math
import os
import sys
import weakref
from dataclasses import dataclass

import transformers
from transformers.utils import logging

logger = logging.get_logger("transformers.cli.serving")  # (shown as the server's own messages are)

# the architectures of `config.architectures` the serve CLI may be asked to load: DAT's causal LM
ARCHITECTURES = ("DATForCausalLM",)
PROG_NAME = "python -m dat_hf.serve"
# the server's continuous-batching managers that were started (each runs a generation thread)
STARTED_CB_MANAGERS = weakref.WeakSet()


@dataclass
class Settings:
    """What `dat_hf.serve` adds to `transformers serve`'s flags."""

    max_request_bytes: int = 4 * 2**20  # --max-request-bytes
    shutdown_grace: float = 10.0  # --shutdown-grace, seconds
    body_timeout: float = 30.0  # --body-timeout, seconds


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


def register_architectures():
    """Set DAT's architecture names on the `transformers` module, where the serve CLI looks a causal LM's class up,
    to `AutoModelForCausalLM` (which resolves the folder's class: installed or remote code)."""
    for name in ARCHITECTURES:
        if not hasattr(transformers, name):
            setattr(transformers, name, transformers.AutoModelForCausalLM)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: OpenAI's error body, the field named
# ---------------------------------------------------------------------------------------------------------------------


class Refusal(Exception):
    """A request the server will not run: HTTP `status` with `message`, naming the request field `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


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


def context_refusal(length: int, limit: int, param: str) -> Refusal:
    return Refusal(f"The prompt has {length} tokens: this model reads at most `max_position_embeddings` = {limit} "
                   f"tokens, prompt and completion, so a prompt must be shorter than {limit} tokens.", param)


def most_characters(tokenizer, limit: int) -> int:
    """The most characters a prompt of fewer than `limit` tokens can have: no token covers more characters than the
    tokenizer's longest (byte-level tokens: bytes, at least the characters they cover), with room for a normalizer."""
    if tokenizer not in LONGEST_TOKEN:
        LONGEST_TOKEN[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return NORMALIZER_SLACK * limit * LONGEST_TOKEN[tokenizer]


def check_prompt(body: dict, endpoint: str, model, processor, messages=None, template_kwargs=None):
    """Refuse a prompt (completions) or conversation (`messages` as the processor takes them) that leaves no room in
    `model.config.max_position_embeddings`, or a conversation the chat template cannot write, or a `logit_bias`
    token outside the vocabulary. Runs on a worker thread; a text longer than `most_characters` is refused without
    being tokenized."""
    config = model.config
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


def fit_to_context(model, inputs, generation_config):
    """Refuse (HTTP 400) a prompt of `inputs["input_ids"]` (`[1, n]` tensor, or a list of n ids under continuous
    batching) with no room left in `model.config.max_position_embeddings`; else cap `generation_config.max_new_tokens`
    to the room left."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return
    ids = inputs["input_ids"]
    length = len(ids) if isinstance(ids, list) else ids.shape[-1]
    room = limit - length
    if room < 1:
        raise context_refusal(length, limit, None)
    if generation_config.max_new_tokens is None or generation_config.max_new_tokens > room:
        generation_config.max_new_tokens = room


def _guarded(handle_request, endpoint: str):
    """A handler's `handle_request`, its request checked first: fields (`check_fields`) on the event loop, then the
    prompt (`check_prompt`) on a worker thread (a `Refusal` is answered by the app's handler, `guard_app`)."""

    @functools.wraps(handle_request)
    async def wrapper(self, body: dict, request_id: str):
        from transformers.cli.serving.utils import Modality

        check_fields(body, endpoint)
        _, model, processor = self._resolve_model(dict(body))
        messages, template_kwargs = None, {}
        if endpoint == "chat":
            try:
                messages = self.get_processor_inputs_from_messages(body["messages"], Modality.LLM)
            except (KeyError, TypeError, ValueError) as error:  # (a tool call without its fields, ...)
                raise Refusal(f"`messages` cannot be read: {error!r}.", "messages") from None
            template_kwargs = {**self.chat_template_kwargs, **body.get("chat_template_kwargs", {})}
        await asyncio.to_thread(check_prompt, body, endpoint, model, processor, messages, template_kwargs)
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
    """The streamed text queue a handler reads (`get`, `get_nowait`), ended at the first stop string: the request is
    cancelled there (`streamer.cancel()`), and `generation_config.max_new_tokens` is cleared so that the handler
    reports `finish_reason: "stop"`."""

    def __init__(self, queue: asyncio.Queue, stop: StopText, streamer, generation_config, on_stop=None):
        self.queue, self.stop, self.streamer, self.generation_config = queue, stop, streamer, generation_config
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
                self.generation_config.max_new_tokens = None
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


def _forget(manager, request_id: str):
    """Drop a cancelled continuous-batching request's result handler (the manager drops it only at a last output,
    which a cancelled request never sends)."""
    router = getattr(getattr(manager, "_cb", None), "output_router", None)
    if router is not None:
        with router._lock:
            router.result_handlers.pop(request_id, None)


def _check_sampling(manager, generation_config):
    """Under continuous batching every request is sampled as the batch's first request asked (one shared generation
    config): refuse, by name, a request that asks otherwise."""
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


def _streamed(generate_streaming):
    @functools.wraps(generate_streaming)
    def wrapper(self, model, processor, inputs, generation_config, *args, **kwargs):
        fit_to_context(model, inputs, generation_config)
        _check_sampling(self, generation_config)
        queue, streamer = generate_streaming(self, model, processor, inputs, generation_config, *args, **kwargs)
        if generation_config.stop_strings:
            request_id = kwargs.get("request_id", args[0] if args else None)
            queue = StoppingQueue(queue, StopText(generation_config.stop_strings), streamer, generation_config,
                                  on_stop=lambda: _forget(self, request_id))
        return queue, streamer

    return wrapper


def _completed(generate_non_streaming):
    @functools.wraps(generate_non_streaming)
    async def wrapper(self, model, processor, inputs, generation_config, *args, **kwargs):
        fit_to_context(model, inputs, generation_config)
        _check_sampling(self, generation_config)
        stops = generation_config.stop_strings
        if not stops:
            return await generate_non_streaming(self, model, processor, inputs, generation_config, *args, **kwargs)
        if getattr(self, "_cb", None) is None:  # `generate` stops at the stop string itself: cut the text there
            text, input_len, generated = await generate_non_streaming(self, model, processor, inputs,
                                                                      generation_config, *args, **kwargs)
            stop = StopText(stops)
            text = stop.feed(text) + stop.flush()
        else:  # the batch knows no stop strings: read the request as a stream, cancelled at the stop
            queue, streamer = self.generate_streaming(model, processor, inputs, generation_config, *args, **kwargs)
            generated, put = [], streamer.put

            def recording_put(output):  # (the ids, for the usage)
                generated[:] = output.generated_tokens
                put(output)

            streamer.put = recording_put
            pieces = []
            while (item := await queue.get()) is not None:
                if not isinstance(item, str):  # a `_StreamError`
                    raise RuntimeError(f"Generation failed: {getattr(item, 'msg', item)}")
                pieces.append(item)
            text, stop = "".join(pieces), queue.stop
            input_len = len(inputs["input_ids"])
        if stop.stopped:
            generation_config.max_new_tokens = None  # (the handler then reports finish_reason "stop")
        return text, input_len, generated

    return wrapper


def _sampling_as_asked(build_generation_config):
    """A request asking `temperature` > 0 or `top_p` is sampled (OpenAI's meaning), whatever the model's generation
    config says of `do_sample` (Transformers' server leaves it, and `generate` is then greedy)."""

    @functools.wraps(build_generation_config)
    def wrapper(self, body, model_generation_config, *args, **kwargs):
        config = build_generation_config(self, body, model_generation_config, *args, **kwargs)
        if body.get("temperature") != 0 and (body.get("temperature") is not None or body.get("top_p") is not None):
            config.do_sample = True
        return config

    return wrapper


def _servable(use_continuous_batching):
    @functools.wraps(use_continuous_batching)
    def wrapper(self, model, modality):
        if not use_continuous_batching(self, model, modality):
            return False
        limits = getattr(model, "continuous_batching_limits", list)()
        if limits:
            logger.warning_once(f"Continuous batching cannot serve this DAT model ({'; '.join(limits)}): it is "
                                "served by `generate`, one request at a time.")
        return not limits

    return wrapper


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
    generation entries serve `/v1/responses` too) and Transformers' `HTTPException`s, and `/v1/models/{id}`."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse

    app.add_middleware(RequestGuard)

    @app.exception_handler(Refusal)
    async def refused(_request: Request, refusal: Refusal):
        return JSONResponse(error_body(refusal.message, refusal.param, refusal.status), status_code=refusal.status)

    @app.exception_handler(HTTPException)
    async def openai_error(_request: Request, error: HTTPException):
        message = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
        return JSONResponse(error_body(message, None, error.status_code), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.get("/v1/models/{model_id:path}")
    def retrieve_model(model_id: str):
        for entry in model_manager.list_models():
            if entry["id"] == model_id:
                return JSONResponse(entry)
        return JSONResponse(error_body(f"The model `{model_id}` does not exist on this server.", "model", 404),
                            status_code=404)

    return app


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

    GracefulConfig._dat_hf_graceful = True
    return GracefulConfig


def hook_server(settings: Settings | None = None):
    """Fit Transformers' server for clients it does not trust (the module's docstring): the handlers check requests
    first (`_guarded`); the generation entries fit the prompt to the context, refuse other sampling settings under
    continuous batching and honour `stop` (`_streamed`, `_completed`); continuous batching is chosen by DAT's
    limits and its managers recorded, to stop their threads when the server stops; the app is guarded
    (`guard_app`) and uvicorn's shutdown given its grace. `settings` (default: the defaults) apply from then on;
    the hooks are installed once per process."""
    global SETTINGS
    SETTINGS = settings or Settings()
    import uvicorn
    from transformers.cli.serving import chat_completion, completion, server, utils

    if getattr(utils.GenerationState, "_dat_hf_hooked", False):
        return
    utils.GenerationState._dat_hf_hooked = True

    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        manager.generate_streaming = _streamed(manager.generate_streaming)
        manager.generate_non_streaming = _completed(manager.generate_non_streaming)
    completion.CompletionHandler.handle_request = _guarded(completion.CompletionHandler.handle_request,
                                                           "completions")
    chat_completion.ChatCompletionHandler.handle_request = _guarded(
        chat_completion.ChatCompletionHandler.handle_request, "chat")
    utils.BaseHandler._build_generation_config = _sampling_as_asked(utils.BaseHandler._build_generation_config)
    utils.GenerationState.use_continuous_batching = _servable(utils.GenerationState.use_continuous_batching)
    utils.CBGenerateManager.init_cb = _recorded(utils.CBGenerateManager.init_cb)
    utils.InferenceThread.async_submit = _cancellable(utils.InferenceThread.async_submit)
    server.build_server = _guarded_build(server.build_server)
    if not getattr(uvicorn.Config, "_dat_hf_graceful", False):
        uvicorn.Config = _graceful(uvicorn.Config)


def main(argv: list[str] | None = None):
    """Run `transformers serve` with `argv` (default: the command line), DAT registered and the server hooked."""
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
    settings, argv = parse_settings(sys.argv[1:] if argv is None else list(argv))
    register_architectures()
    hook_server(settings)
    group = typer.main.get_command(app) if isinstance(app, typer.Typer) else app  # (a click group since hub 2)
    serve = group.get_command(click.Context(group), "serve")
    prog_name = PROG_NAME if __name__ == "__main__" and __package__ else os.path.basename(sys.argv[0])
    try:
        serve.main(args=argv, prog_name=prog_name)
    finally:
        for manager in list(STARTED_CB_MANAGERS):
            manager.stop()


if __name__ == "__main__":
    main()
