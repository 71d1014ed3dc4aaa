"""`python -m dat_hf.serve FOLDER` (dat_hf/serve.py): Transformers' OpenAI-compatible server on a saved DAT folder,
on 127.0.0.1 (a free port), with and without `--continuous-batching`: in this process on a thread (the default suite),
and (integration) in a subprocess, with dat_hf installed and from the folder's remote code (`--trust-remote-code`, the
file run alone in a process where `import dat_hf` fails).

Each server answers six concurrent completions and a streamed one, and chat completions (streamed and not), with the
local greedy text (`generate(do_sample=False)`, decoded as the server decodes: special tokens skipped); refuses a
prompt that fills the context and an unknown model with HTTP 400 and a message, and serves on after them; stops on
SIGINT / SIGTERM within seconds, its shutdown complete and no traceback.
"""

import asyncio
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
import transformers
from conftest import tiny_config
from lm_helpers import corpus_file
from snippets import offline_env

from dat_hf import DATForCausalLM
from dat_hf.serve import ProcessEngine, ThreadEngine, _servable

pytestmark = pytest.mark.xdist_group("serve")  # (one worker: each server started once)
REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE_PY = REPO_ROOT / "dat_hf" / "serve.py"
NEW_TOKENS = 5
PROMPTS = ["Enter", "The course of true love", "Now, fair Hippolyta, our nuptial hour", "I will", "Take time",
           "Lysander and Helena"]
STREAMED = "Draws on apace"
CHAT = [{"role": "user", "content": "How now, my love!"}]
STOP_TOKENS = 24  # the greedy text that stop strings cut
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
# a small paged cache: sized from the machine's memory by default, which takes seconds to allocate on CPU
CB_FLAGS = ["--continuous-batching", "--cb-num-blocks", "32", "--cb-block-size", "16", "--cb-max-batch-tokens", "128"]
# --shutdown-grace of the servers in a subprocess, seconds: long enough for the requests in flight, or none at all
GRACE, NO_GRACE = ["--shutdown-grace", "2"], ["--shutdown-grace", "0"]
VARIANTS = {  # (remote code, flags, the signal that stops it; None: in this process, on a thread)
    "in-process": (False, [], None),
    "in-process-continuous-batching": (False, CB_FLAGS, None),
    "installed": (False, GRACE, signal.SIGINT),
    "installed-continuous-batching": (False, [*CB_FLAGS, *NO_GRACE], signal.SIGTERM),
    "remote-code": (True, ["--trust-remote-code", *NO_GRACE], signal.SIGTERM),
    "remote-code-continuous-batching": (True, ["--trust-remote-code", *CB_FLAGS, *GRACE], signal.SIGINT),
}
# how the process ends after a graceful shutdown: uvicorn raises the signal again; Ctrl+C then ends in the CLI's
# "Aborted!" (exit status 1 from click; 130 from typer, Transformers' CLI before huggingface_hub 2), SIGTERM kills it
EXIT_STATUS = {signal.SIGINT: (1, 130), signal.SIGTERM: (-signal.SIGTERM,)}
# where dat_hf is not installed: the file run alone (`import dat_hf` fails as it would there, in the processes the
# server spawns too: a `dat_hf` that cannot be imported first on the path, which they inherit)
WITHOUT_DAT_HF = """
import runpy, sys
from pathlib import Path
stub = Path({stub!r}) / "dat_hf"
stub.mkdir(parents=True, exist_ok=True)
(stub / "__init__.py").write_text("raise ModuleNotFoundError('No module named dat_hf', name='dat_hf')")
sys.path.insert(0, str(stub.parent))
assert not any(Path(p or ".").resolve() == Path({repo!r}) for p in sys.path), sys.path
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def ascii_tokenizer():
    """A byte-level BPE tokenizer over ASCII text only, that prepends `<s>`: every token is whole characters, so a
    streamed text (decoded token by token) is never held back at an incomplete UTF-8 sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = Path(corpus_file()).read_text(encoding="utf-8").encode("ascii", "ignore").decode()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<s>", "</s>"], show_progress=False))  # no initial alphabet: ASCII only
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny DAT saved with its tokenizer and a chat template (the remote code beside it), and the local greedy
    texts: {"completions": {prompt: text}, "chat": text}."""
    folder = tmp_path_factory.mktemp("served") / "dat"
    tokenizer = ascii_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(vocab_size=len(tokenizer), initializer_range=0.5, eos_token_id=None)).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    def greedy(inputs, new_tokens=NEW_TOKENS):
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    completions = {prompt: greedy(tokenizer(prompt, return_tensors="pt")) for prompt in [*PROMPTS, STREAMED]}
    long_text = greedy(tokenizer(PROMPTS[1], return_tensors="pt"), STOP_TOKENS)
    long_chat = greedy(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True,
                                                     return_tensors="pt"), STOP_TOKENS)
    chat = greedy(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt"))
    texts = [*completions.values(), chat]
    assert len(set(texts)) == len(texts), f"the prompts must give different texts (a mix-up shows): {texts}"
    return dict(folder=str(folder), completions=completions, chat=chat, long_text=long_text, long_chat=long_chat,
                limits=model.continuous_batching_limits())


def batched(server, served) -> bool:
    """Whether the server generates with continuous batching: asked, and the model's limits allow it (the installed
    release's paged cache among them; else the server falls back to `generate`, warning)."""
    return "--continuous-batching" in VARIANTS[server.variant][1] and not served["limits"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`dat_hf.serve` in a subprocess on 127.0.0.1, its output in `log`; `client` is an OpenAI client on it."""

    def __init__(self, folder: str, remote: bool, flags: list[str], workdir: Path):
        port = free_port()
        self.model = folder  # the name requests give: the folder, as the server was given it
        self.log = workdir / "server.log"
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.start(folder, remote, ["--host", "127.0.0.1", "--port", str(port), *flags], workdir)
        self.wait_until_ready()

    def start(self, folder, remote, flags, workdir):
        args = [folder, *flags]
        if remote:  # no PYTHONPATH, cwd outside the checkout, `python -I` (no script or cwd path entry)
            script = WITHOUT_DAT_HF.format(repo=str(REPO_ROOT), stub=str(workdir / "without"))
            command = [sys.executable, "-I", "-c", script, str(SERVE_PY), *args]
            env = offline_env(None, HF_HOME=str(workdir / "hf_home"), HF_MODULES_CACHE=str(workdir / "hf_modules"))
        else:
            command = [sys.executable, "-m", "dat_hf.serve", *args]
            env = offline_env(str(REPO_ROOT))
        with open(self.log, "w") as log:
            # (SIGINT as a terminal sends it, whatever this process inherited: a suite started as a background job
            # of a non-interactive shell ignores SIGINT, and so would the server, exiting 0 after its shutdown)
            self.process = subprocess.Popen(command, cwd=REPO_ROOT if not remote else workdir, env=env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=default_sigint)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def exited(self) -> int | None:
        return self.process.poll()

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


    def wait_until_ready(self, timeout: float = 180):
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.exited() is not None:
                pytest.fail(f"the server exited ({self.exited()}) before answering:\n{self.output()[-5000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        pytest.fail(f"the server did not answer within {timeout} s:\n{self.output()[-5000:]}")

    def stop(self, sig) -> tuple[int, float]:
        """Send `sig`; (exit status, seconds to exit)."""
        start = time.monotonic()
        self.process.send_signal(sig)
        try:
            status = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"the server did not exit within 30 s of {sig.name}:\n{self.output()[-5000:]}")
        return status, time.monotonic() - start


class InProcessServer(Server):
    """The same server in this process: `dat_hf.serve.main` on a thread, stopped by `stop_servers` (as SIGTERM stops
    the command); the server's log lines in `log`. The HTTP answers without an interpreter start for the server
    (where the release runs its model in a process of its own, Transformers spawns that one); signals and remote
    code need the subprocesses."""

    def start(self, folder, remote, flags, workdir):
        import logging
        import threading

        from dat_hf import serve

        assert not remote
        self.handler = logging.FileHandler(self.log)
        logging.getLogger("transformers").addHandler(self.handler)
        self.thread = threading.Thread(target=serve.main, args=([folder, *flags],), name="dat_hf.serve", daemon=True)
        self.thread.start()

    def exited(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def close(self):
        import logging

        from dat_hf import serve

        serve.stop_servers()
        self.thread.join(timeout=30)
        logging.getLogger("transformers").removeHandler(self.handler)
        self.handler.close()
        assert not self.thread.is_alive(), "the server on a thread did not stop"


def default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module", params=[name if VARIANTS[name][2] is None else
                                        pytest.param(name, marks=pytest.mark.integration) for name in VARIANTS])
def server(request, served, tmp_path_factory):
    remote, flags, sig = VARIANTS[request.param]
    server = (Server if sig is not None else InProcessServer)(served["folder"], remote, flags,
                                                             tmp_path_factory.mktemp(request.param))
    server.variant = request.param
    yield server
    server.close()


def complete(server, prompt: str, stream: bool = False, model: str | None = None) -> tuple[str, str]:
    """(text, finish reason) of a greedy completion."""
    response = server.client.completions.create(model=model or server.model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                temperature=0, stream=stream)
    if not stream:
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = [chunk.choices[0] for chunk in response]
    return "".join(choice.text for choice in chunks), chunks[-1].finish_reason


def test_concurrent_completions_are_the_local_greedy_text(server, served):
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        answers = [pool.submit(complete, server, prompt) for prompt in PROMPTS]
        streamed = pool.submit(complete, server, STREAMED, stream=True)
        results = {prompt: answer.result() for prompt, answer in zip(PROMPTS, answers)}
        results[STREAMED] = streamed.result()
    assert {prompt: text for prompt, (text, _) in results.items()} == served["completions"]
    assert {reason for _, reason in results.values()} == {"length"}
    fell_back = "--continuous-batching" in VARIANTS[server.variant][1] and not batched(server, served)
    assert ("Continuous batching cannot serve this DAT model" in server.output()) == fell_back, server.output()[-3000:]


def test_chat_completions_are_the_local_greedy_text(server, served):
    model = server.model
    reply = server.client.chat.completions.create(model=model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content == served["chat"]
    chunks = server.client.chat.completions.create(model=model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                                   stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == served["chat"]


def test_bad_requests_get_400_and_the_server_serves_on(server, served):
    limit = tiny_config().max_position_embeddings
    too_long = " ".join(PROMPTS * 8)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(server, too_long, stream=stream)
        assert refused.value.status_code == 400
        assert f"`max_position_embeddings` = {limit}" in refused.value.body["message"], refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": too_long}],
                                              max_tokens=NEW_TOKENS)
    assert f"`max_position_embeddings` = {limit}" in refused.value.body["message"], refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, PROMPTS[0], model="no-such-model")
    assert "no-such-model" in refused.value.body["message"], refused.value.body
    assert complete(server, PROMPTS[1]) == (served["completions"][PROMPTS[1]], "length")
    # a completion stops where the context is full
    response = server.client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=2 * limit,
                                                temperature=0)
    assert response.usage.prompt_tokens + response.usage.completion_tokens == limit, response.usage
    assert response.choices[0].finish_reason == "length"


def post(connection, path: str, body, headers=None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST of `body` (bytes as they are, else JSON) on `connection`."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    return response.status, json.loads(payload) if payload else {}, dict(response.getheaders())


def health_seconds(server) -> float:
    start = time.monotonic()
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
        assert response.status == 200
    return time.monotonic() - start


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def send_huge_body(server, size: int, chunked: bool) -> tuple[int, float]:
    """Send a body of `size` bytes to /v1/completions as a client that reads an early answer does (curl with
    `Expect: 100-continue` reads it before sending): (status, seconds to the answer). `chunked`: no
    Content-Length, the body in chunks."""
    host, port = server.url.removeprefix("http://").split(":")
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        pending = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{length}" \
                  f"\r\n\r\n".encode()
        block, sent, answer = b'{"prompt": "' + b"x" * 65536, 0, b""
        while b"\r\n\r\n" not in answer and time.monotonic() - start < 30:
            if not pending and sent < size:
                piece = block[:size - sent]
                pending, sent = (b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece), sent + len(piece)
            readable, writable, _ = select.select([sock], [sock] if pending else [], [], 1)
            if readable:
                answer += sock.recv(65536) or b"\r\n\r\n"
            elif writable:
                try:
                    pending = pending[sock.send(pending):]
                except OSError:  # (the server closed its side after answering)
                    pending, sent = b"", size
    return int(answer.split(b" ")[1]), time.monotonic() - start


def test_a_huge_body_is_refused_before_it_is_read(server):
    """50 MB with a Content-Length: 413 before it is read; without one (chunked): 413 once past the limit. `/health`
    answers meanwhile, and the server's memory does not grow by the body."""
    pid = server.process.pid if hasattr(server, "process") else os.getpid()
    before = rss_mb(pid)
    with ThreadPoolExecutor(2) as pool:
        for chunked in (False, True):
            answer = pool.submit(send_huge_body, server, 50 * 2**20, chunked)
            time.sleep(0.2)
            assert health_seconds(server) < 1
            status, seconds = answer.result()
            assert status == 413, status
            assert seconds < 2, f"{seconds:.1f} s to refuse 50 MB ({'chunked' if chunked else 'Content-Length'})"
    assert rss_mb(pid) - before < 100
    # under the body limit but far past the context: refused without tokenizing it, while /health answers
    connection = http.client.HTTPConnection(*server.url.removeprefix("http://").split(":"), timeout=30)
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, connection, "/v1/completions", {"model": server.model, "prompt": "x" * 3_000_000})
        assert health_seconds(server) < 1
        status, body, _ = answer.result()
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "refused without being tokenized" in body["error"]["message"], body
    assert time.monotonic() - start < 2


BAD_FIELDS = [  # (field, value) that each get a 400 naming the field
    ("max_tokens", "ten"), ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", "hot"), ("temperature", -1), ("temperature", 3), ("top_p", 0), ("frequency_penalty", "x"),
    ("stop", 5), ("stop", []), ("stop", ""), ("stop", ["a", "b", "c", "d", "e"]), ("stream", "yes"), ("seed", "x"),
    ("prompt", 123), ("prompt", ["a", "b"]), ("prompt", "\ud800"), ("n", 2), ("logprobs", 1), ("logprobs", True),
    ("echo", True), ("best_of", 2), ("suffix", "the end"), ("presence_penalty", 0.5), ("stream_options", {"x": 1}),
    ("generation_config", "{not json"), ("generation_config", '{"temperature": -3}'), ("user", 7),
]
BAD_CHAT_FIELDS = [
    ("messages", []), ("messages", "hi"), ("messages", [{"role": "user", "content": 123}]),
    ("messages", [{"role": "wizard", "content": "x"}]), ("messages", [{"role": "user", "content": "\ud800"}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ("max_completion_tokens", 0), ("logit_bias", {"x": 1}), ("logit_bias", {"1": 500}), ("logit_bias", {"100000": 1}),
    ("n", 2), ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
]


def test_bad_fields_are_refused_by_name_on_a_connection_that_stays_open(server):
    connection = http.client.HTTPConnection(*server.url.removeprefix("http://").split(":"), timeout=30)
    good = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0}
    chat = {"model": server.model, "messages": CHAT, "max_tokens": NEW_TOKENS, "temperature": 0}
    sock = None
    for path, request, cases in (("/v1/completions", good, BAD_FIELDS), ("/v1/chat/completions", chat,
                                                                           BAD_CHAT_FIELDS)):
        for field, value in cases:
            body = json.dumps({**request, field: value}).encode()  # (a lone surrogate as JSON writes it: "\\ud800")
            status, answer, headers = post(connection, path, body)
            assert status == 400, (field, value, status, answer)
            assert answer["error"]["param"].split(".")[0].split("[")[0] == field, (field, value, answer)
            assert f"`{field}" in answer["error"]["message"] or field == "messages", (field, answer)
            assert headers.get("connection") != "close", (field, headers)
            sock = sock or connection.sock
            assert connection.sock is sock, f"the connection was closed after `{field}`"
        assert post(connection, path, {**request, "n": 1, "logprobs": False})[0] == 200
    assert connection.sock is sock
    status, answer, _ = post(connection, "/v1/completions", {**good, "unknown_field": 1})
    assert status == 422 and "unknown_field" in answer["error"]["message"], answer


def test_stop_ends_the_text_before_the_stop_string(server, served):
    """`stop`: the text up to the stop string's first occurrence, without it, `finish_reason: "stop"`; the same in
    both modes (each compared with the local greedy text), streamed or not, completions and chat."""
    for endpoint, text in (("completions", served["long_text"]), ("chat", served["long_chat"])):
        middle = len(text) // 2
        stop = text[middle:middle + 3]
        expected = text[:text.find(stop)]
        assert 0 < len(expected) < len(text) - 3, (text, stop)
        for stream in (False, True):
            for stops in (stop, ["never seen", stop]):
                kwargs = dict(model=server.model, max_tokens=STOP_TOKENS, temperature=0, stop=stops, stream=stream)
                if endpoint == "completions":
                    response = server.client.completions.create(prompt=PROMPTS[1], **kwargs)
                    chunks = list(response) if stream else [response]
                    got = "".join(chunk.choices[0].text for chunk in chunks)
                else:
                    response = server.client.chat.completions.create(messages=CHAT, **kwargs)
                    chunks = [chunk for chunk in response if chunk.choices] if stream else [response]
                    got = "".join((chunk.choices[0].delta.content if stream else chunk.choices[0].message.content)
                                  or "" for chunk in chunks)
                assert (got, chunks[-1].choices[0].finish_reason) == (expected, "stop"), (endpoint, stream, stops)
    response = server.client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=NEW_TOKENS,
                                                temperature=0, stop="never seen")
    assert (response.choices[0].text, response.choices[0].finish_reason) == (served["completions"][PROMPTS[1]],
                                                                             "length")


def test_a_model_is_retrieved_by_its_id(server):
    model = server.client.models.retrieve(server.model)
    assert model.id == server.model
    with pytest.raises(openai.NotFoundError) as missing:
        server.client.models.retrieve("no-such-model")
    assert "no-such-model" in missing.value.body["message"]


def test_sampling_is_served_as_asked(server, served):
    """`temperature` > 0 samples (the model's generation config is greedy); with continuous batching, whose batch
    samples every request as the first asked, other sampling settings are refused by name."""
    kwargs = dict(model=server.model, prompt=PROMPTS[1], max_tokens=NEW_TOKENS)
    assert complete(server, PROMPTS[1])[0] == served["completions"][PROMPTS[1]]  # (the batch, if any, is greedy)
    if batched(server, served):
        with pytest.raises(openai.BadRequestError) as refused:
            server.client.completions.create(temperature=1.5, **kwargs)
        assert refused.value.body["param"] == "temperature", refused.value.body
        return
    texts = {server.client.completions.create(temperature=2, seed=seed, **kwargs).choices[0].text
             for seed in range(4)}
    assert len(texts - {served["completions"][PROMPTS[1]]}) >= 2, texts


def in_flight_request(server, index: int) -> str:
    """One of the requests in flight at a shutdown (every other one streamed), to its end: "done" (the whole
    answer), "503" (refused: the grace period was over) or "closed" (a stream cut short)."""
    kwargs = dict(model=server.model, prompt=PROMPTS[index % len(PROMPTS)], max_tokens=40, temperature=0)
    client = server.client.with_options(timeout=60)
    try:
        if index % 2:
            chunks = list(client.completions.create(stream=True, **kwargs))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            assert client.completions.create(**kwargs).choices[0].finish_reason in ("stop", "length")
        return "done"
    except openai.InternalServerError as error:
        assert error.status_code == 503 and "shutting down" in error.body["message"], error
        return "503"
    except Exception as error:  # noqa: BLE001  (the client's transport error: openai's, or its HTTP library's)
        transport = isinstance(error, openai.APIConnectionError) or "TransportError" in {
            kind.__name__ for kind in type(error).__mro__}
        assert transport and not isinstance(error, openai.APITimeoutError), repr(error)
        return "closed"


@pytest.mark.integration
def test_several_api_servers_are_each_guarded(served, tmp_path):
    """`--api-server-count 2` (a release whose model runs in its own process: several API servers share it): the
    requests spread over both API servers, each hooked as the command's process is (`DATServe.run`, the settings
    through the environment): a bad field refused by name, the body limit the command was given, greedy text."""
    import inspect

    from transformers.cli.serve import Serve

    if "api_server_count" not in inspect.signature(Serve).parameters:
        pytest.skip("the installed release serves from one process (no --api-server-count)")
    server = Server(served["folder"], False, ["--api-server-count", "2", "--max-request-bytes", "2000"], tmp_path)
    try:
        connection = http.client.HTTPConnection(*server.url.removeprefix("http://").split(":"), timeout=60)
        for _ in range(6):  # (new connections: the kernel spreads them over the two servers' shared socket)
            connection.close()
            status, answer, _ = post(connection, "/v1/completions", {"model": server.model, "prompt": "x", "n": 2})
            assert status == 400 and answer["error"]["param"] == "n", answer
            connection.close()
            status, answer, _ = post(connection, "/v1/completions", {"model": server.model, "prompt": "x" * 3000})
            assert status == 413 and "2000 bytes" in answer["error"]["message"], answer
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda prompt: complete(server, prompt)[0], PROMPTS[:4]))
        assert texts == [served["completions"][prompt] for prompt in PROMPTS[:4]]
        assert "Traceback" not in server.output(), server.output()[-3000:]
    finally:
        server.close()


@pytest.mark.integration
def test_shutdown_on_a_signal(server):
    """With 16 requests in flight: the server stops admitting, exits within its grace period + 5 s, and every client
    gets its answer, a 503 or a closed stream (none waits)."""
    sig = VARIANTS[server.variant][2]
    if sig is None:
        pytest.skip("a server in this process is stopped by the test, not by a signal")
    with ThreadPoolExecutor(16) as pool:
        clients = [pool.submit(in_flight_request, server, index) for index in range(16)]
        time.sleep(0.5)
        status, seconds = server.stop(sig)
        outcomes = [client.result(timeout=10) for client in clients]
    output = server.output()
    assert "Traceback" not in output, output[-5000:]
    assert "Application shutdown complete" in output and "Finished server process" in output, output[-3000:]
    assert status in EXIT_STATUS[sig], (status, output[-3000:])
    flags = VARIANTS[server.variant][1]
    grace = float(flags[flags.index("--shutdown-grace") + 1])
    assert seconds < grace + 5, f"{seconds:.1f} s to exit on {sig.name}"
    print(sig.name, f"{seconds:.1f} s", {outcome: outcomes.count(outcome) for outcome in set(outcomes)})


def test_a_request_cut_short_by_the_shutdown_gets_503_before_the_process_ends():
    """`RequestGuard`: a request uvicorn cancels (its grace period over) before its answer started gets 503, and the
    lifespan's shutdown waits for it (uvicorn would end the process first); a started stream is closed."""
    from dat_hf.serve import RequestGuard

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await receive()
        await receive()
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()  # (a generation that does not finish in time)

    async def run():
        guard, sent = RequestGuard(app), {"/slow": [], "/stream": []}
        requests = [asyncio.create_task(guard({"type": "http", "path": path, "headers": []},
                                              _body(b"{}"), _recorder(sent[path]))) for path in sent]
        await asyncio.sleep(0.05)
        assert guard.in_flight == 2
        shutdown = asyncio.Queue()
        lifespan = asyncio.create_task(guard({"type": "lifespan"}, shutdown.get, None))
        for request in requests:
            request.cancel()
        await shutdown.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(lifespan, 1)
        assert guard.in_flight == 0
        return sent

    sent = asyncio.run(run())
    assert sent["/slow"][0]["status"] == 503 and b"shutting down" in sent["/slow"][1]["body"], sent["/slow"]
    assert [message["type"] for message in sent["/stream"]] == ["http.response.start"]  # (then closed)


def test_a_body_that_does_not_arrive_gets_408():
    """A client that announces a body and holds the connection without sending it gets 408 after `--body-timeout`."""
    from dat_hf.serve import RequestGuard, Settings, hook_server

    async def app(scope, receive, send):
        raise AssertionError("the app runs only once the body is there")

    async def never():
        await asyncio.Event().wait()

    sent = []
    hook_server(Settings(body_timeout=0.2))
    try:
        start = time.monotonic()
        asyncio.run(RequestGuard(app)({"type": "http", "path": "/v1/completions",
                                       "headers": [(b"content-length", b"100")]}, never, _recorder(sent)))
    finally:
        hook_server()
    assert sent[0]["status"] == 408 and b"--body-timeout" in sent[1]["body"], sent
    assert 0.2 <= time.monotonic() - start < 2


@pytest.mark.parametrize("hooked", [False, True], ids=["transformers", "dat_hf"])
def test_generations_cancelled_by_the_shutdown_leave_no_traceback(hooked):
    """Three generations submitted to the server's inference thread, their requests cancelled while the first runs
    (uvicorn's grace period over): with the hook, the first one's answer is dropped, the two queued are not run, and the
    event loop reports no error; the thread then serves the next request. Transformers' own `async_submit` runs all
    three and sets each answer on its cancelled future (`InvalidStateError`, a traceback in the server's log: seen in
    CI as a flaky `test_shutdown_on_a_signal`)."""
    import inspect
    import threading

    from transformers.cli.serving import utils

    from dat_hf.serve import ThreadEngine, _cancellable, find_engine

    if find_engine() is not ThreadEngine:
        pytest.skip("the installed release runs its model in a process of its own, whose cancels Transformers "
                    "handles (test_shutdown_on_a_signal reads the log of each variant for a traceback)")

    own = inspect.unwrap(utils.InferenceThread.async_submit)  # (Transformers', whether or not this process hooked it)
    submit = _cancellable(own) if hooked else own
    errors, ran = [], []

    async def run():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["exception"]))
        thread, release = utils.InferenceThread(), threading.Event()

        def generate(index):
            ran.append(index)
            release.wait(5)
            return index

        answers = [submit(thread, generate, index) for index in range(3)]
        await asyncio.sleep(0.1)  # (the first one is running)
        for answer in answers:
            answer.cancel()
        release.set()
        await asyncio.sleep(0.3)
        return await asyncio.wait_for(submit(thread, lambda: "next"), 5)

    assert asyncio.run(run()) == "next"
    if hooked:
        assert ran == [0] and errors == [], (ran, errors)
    else:  # (the fault the hook removes, still there upstream: when it is gone, the hook can go)
        assert ran == [0, 1, 2] and errors and all(isinstance(e, asyncio.InvalidStateError) for e in errors), errors


def _recorder(messages: list):
    async def send(message):
        messages.append(message)

    return send


def _body(data: bytes):
    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    return receive


def test_the_server_settings_reach_uvicorn_and_the_command_line():
    """`--max-request-bytes` and `--shutdown-grace` are dat_hf.serve's, the rest goes to `transformers serve`; the
    grace becomes uvicorn's `timeout_graceful_shutdown` (the seam: Transformers' `Serve` builds `uvicorn.Config`)."""
    import uvicorn

    from dat_hf.serve import Settings, hook_server, parse_settings

    settings, rest = parse_settings(["my-dat", "--shutdown-grace", "3.5", "--port", "9", "--max-request-bytes", "99",
                                     "--body-timeout", "2"])
    assert (settings, rest) == (Settings(max_request_bytes=99, shutdown_grace=3.5, body_timeout=2),
                                ["my-dat", "--port", "9"])
    assert parse_settings(["my-dat"])[0] == Settings()
    for bad in (["--max-request-bytes", "0"], ["--shutdown-grace", "-1"], ["--body-timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_settings(bad)
    hook_server(settings)
    try:
        assert uvicorn.Config(lambda scope, receive, send: None).timeout_graceful_shutdown == 3.5
        assert uvicorn.Config(lambda scope, receive, send: None, timeout_graceful_shutdown=1).timeout_graceful_shutdown == 1
    finally:
        hook_server()


def test_chat_needs_a_chat_template_and_prompts_are_measured_without_tokenizing_huge_texts(served):
    """`check_prompt`: a tokenizer without a chat template gets a 400 naming it; a prompt longer than any of
    `most_characters` is refused without a call to the tokenizer; one that fits is measured exactly."""
    from transformers import AutoTokenizer

    from dat_hf.serve import Refusal, check_prompt, most_characters

    tokenizer = AutoTokenizer.from_pretrained(served["folder"])
    config = tiny_config()
    messages = [{"role": "user", "content": "Hello"}]
    check_prompt({"messages": messages}, "chat", config, tokenizer, messages, {})
    tokenizer.chat_template = None
    with pytest.raises(Refusal, match="no chat template") as refused:
        check_prompt({"messages": messages}, "chat", config, tokenizer, messages, {})
    assert refused.value.param == "messages"
    limit = config.max_position_embeddings
    longest = max(map(len, tokenizer.get_vocab()))
    assert most_characters(tokenizer, limit) == 4 * limit * longest

    class Counting:  # the tokenizer, its calls counted
        def __init__(self):
            self.calls = 0

        def __call__(self, text):
            self.calls += 1
            return tokenizer(text)

        def get_vocab(self):
            return tokenizer.get_vocab()

    counting = Counting()
    with pytest.raises(Refusal, match="without being tokenized"):
        check_prompt({"prompt": "x" * (most_characters(tokenizer, limit) + 1)}, "completions", config, counting)
    assert counting.calls == 0
    with pytest.raises(Refusal, match=f"`max_position_embeddings` = {limit}"):
        check_prompt({"prompt": "Enter " * limit}, "completions", config, counting)
    check_prompt({"prompt": "Enter"}, "completions", config, counting)
    assert counting.calls == 2


def test_continuous_batching_falls_back_to_generate_where_it_cannot_serve_dat(caplog):
    """A model continuous batching cannot serve (its `continuous_batching_limits`) is served by `generate` (as the
    server does for a model without continuous batching), the server warning with the field; the server's own
    refusal stands. Both engines: one asks the model, the other the model's config (a model on the meta device)."""
    served, flex = DATForCausalLM(tiny_config()), DATForCausalLM(tiny_config(relational_attn_implementation="flex_attention"))
    for model in (served, flex):
        model.config.architectures = ["DATForCausalLM"]  # (as a saved folder's config names it)
    for engine, given in ((ThreadEngine, lambda model: model), (ProcessEngine, lambda model: model.config)):
        choose = _servable(lambda state, model, second: True, engine.limits_of)
        assert choose(None, given(served), None) == (not served.continuous_batching_limits())  # (the release's too)
        assert not choose(None, given(flex), None)
        assert "`relational_attn_implementation`='flex_attention'" in caplog.text
        assert not _servable(lambda state, model, second: False, engine.limits_of)(None, given(served), None)
    assert ProcessEngine.limits_of(transformers.LlamaConfig()) == []  # (a model that is not DAT's: the server's call)


def test_the_batch_refuses_by_name_the_sampling_it_cannot_give():
    """`check_batch_sampling` (a model in its own process, Transformers 5.25: the batch samples as the model's
    generation config says, each request setting only what the batch's processors take per request): what it cannot
    give is refused naming the field, first in the message (the server names it again from there: `refusal_of`)."""
    from dat_hf.serve import Refusal, check_batch_sampling, refusal_of

    def manager(per_request=(), **config):
        return SimpleNamespace(generation_config=transformers.GenerationConfig(**config),
                               logit_processor=SimpleNamespace(supported_keys={name: float for name in per_request}))

    def request(**asked):
        return {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, **asked}

    greedy, sampled = manager(), manager(("temperature", "top_k"), do_sample=True, temperature=0.7, top_k=20)
    check_batch_sampling(greedy, request(temperature=0.0))
    check_batch_sampling(sampled, request(do_sample=True, temperature=1.3, top_k=5, top_p=1.0))  # (per request)
    check_batch_sampling(sampled, request(temperature=0.0))  # (greedy per request: top_k=1)
    refused = {"temperature": (greedy, request(do_sample=True, temperature=1.5)),
               "top_p": (sampled, request(do_sample=True, temperature=0.7, top_p=0.5)),
               "frequency_penalty": (greedy, request(repetition_penalty=1.5))}
    for field, (batch, asked) in refused.items():
        with pytest.raises(Refusal) as refusal:
            check_batch_sampling(batch, asked)
        assert refusal.value.param == field and refusal_of(ValueError(str(refusal.value))).param == field
    with pytest.raises(Refusal, match="`temperature`"):
        check_batch_sampling(manager(("temperature",), do_sample=True, temperature=0.7), request(temperature=0.0))
