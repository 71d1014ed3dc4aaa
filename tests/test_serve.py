"""`python -m dat_hf.serve FOLDER` (dat_hf/serve.py): Transformers' OpenAI-compatible server on a saved DAT folder,
on 127.0.0.1 (a free port), with and without `--continuous-batching`: in this process on a thread (the default suite),
and (integration) in a subprocess, with dat_hf installed and from the folder's remote code (`--trust-remote-code`, the
file run alone in a process where `import dat_hf` fails).

Each server answers six concurrent completions and a streamed one, and chat completions (streamed and not), with the
local greedy text (`generate(do_sample=False)`, decoded as the server decodes: special tokens skipped); refuses a
prompt that fills the context and an unknown model with HTTP 400 and a message, and serves on after them; stops on
SIGINT / SIGTERM within seconds, its shutdown complete and no traceback.
"""

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
from conftest import tiny_config
from lm_helpers import corpus_file
from snippets import offline_env

from dat_hf import DATForCausalLM
from dat_hf.serve import _servable

pytestmark = pytest.mark.xdist_group("serve")  # (one worker: each server started once)
REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE_PY = REPO_ROOT / "dat_hf" / "serve.py"
NEW_TOKENS = 5
PROMPTS = ["Enter", "The course of true love", "Now, fair Hippolyta, our nuptial hour", "I will", "Take time",
           "Lysander and Helena"]
STREAMED = "Draws on apace"
CHAT = [{"role": "user", "content": "How now, my love!"}]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
# a small paged cache: sized from the machine's memory by default, which takes seconds to allocate on CPU
CB_FLAGS = ["--continuous-batching", "--cb-num-blocks", "32", "--cb-block-size", "16", "--cb-max-batch-tokens", "128"]
VARIANTS = {  # (remote code, flags, the signal that stops it; None: in this process, on a thread)
    "in-process": (False, [], None),
    "in-process-continuous-batching": (False, CB_FLAGS, None),
    "installed": (False, [], signal.SIGINT),
    "installed-continuous-batching": (False, CB_FLAGS, signal.SIGTERM),
    "remote-code": (True, ["--trust-remote-code"], signal.SIGTERM),
    "remote-code-continuous-batching": (True, ["--trust-remote-code", *CB_FLAGS], signal.SIGINT),
}
# how the process ends after a graceful shutdown: uvicorn raises the signal again; Ctrl+C then ends in the CLI's
# "Aborted!" (exit status 1 from click; 130 from typer, Transformers' CLI before huggingface_hub 2), SIGTERM kills it
EXIT_STATUS = {signal.SIGINT: (1, 130), signal.SIGTERM: (-signal.SIGTERM,)}
# where dat_hf is not installed: the file run alone (`import dat_hf` fails as it would there)
WITHOUT_DAT_HF = """
import runpy, sys
from pathlib import Path
sys.modules["dat_hf"] = None
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

    def greedy(inputs):
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    completions = {prompt: greedy(tokenizer(prompt, return_tensors="pt")) for prompt in [*PROMPTS, STREAMED]}
    chat = greedy(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt"))
    texts = [*completions.values(), chat]
    assert len(set(texts)) == len(texts), f"the prompts must give different texts (a mix-up shows): {texts}"
    return dict(folder=str(folder), completions=completions, chat=chat)


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
            command = [sys.executable, "-I", "-c", WITHOUT_DAT_HF.format(repo=str(REPO_ROOT)), str(SERVE_PY), *args]
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
    """The same server in this process: Transformers' `Serve` on a thread (its `non_blocking` mode), with what
    `python -m dat_hf.serve` adds (`register_architectures`, `hook_server`); the server's log lines in `log`. The
    HTTP answers without an interpreter start (the default suite); signals and remote code need the subprocesses."""

    def start(self, folder, remote, flags, workdir):
        import logging

        from transformers.cli.serve import Serve

        from dat_hf.serve import hook_server, register_architectures

        assert not remote
        register_architectures()
        hook_server()
        self.handler = logging.FileHandler(self.log)
        logging.getLogger("transformers").addHandler(self.handler)
        kwargs, words = {}, iter(flags)  # the command line's flags as `Serve`'s arguments
        for flag in words:
            name = flag.removeprefix("--").replace("-", "_")
            kwargs[name] = True if flag == "--continuous-batching" else next(words)
        kwargs = {name: int(value) if isinstance(value, str) and value.isdigit() else value
                  for name, value in kwargs.items()}
        self.serve = Serve(folder, non_blocking=True, **kwargs)

    def exited(self) -> int | None:
        return None if self.serve._thread.is_alive() else 0

    def close(self):
        import logging

        self.serve.kill_server()
        logging.getLogger("transformers").removeHandler(self.handler)
        self.handler.close()

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
    continuous_batching = "--continuous-batching" in VARIANTS[server.variant][1]
    assert f"CB: {continuous_batching}" in server.output()  # (the server falls back to `generate` with a warning)


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
        assert f"`max_position_embeddings` = {limit}" in refused.value.body["detail"], refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": too_long}],
                                              max_tokens=NEW_TOKENS)
    assert f"`max_position_embeddings` = {limit}" in refused.value.body["detail"], refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, PROMPTS[0], model="no-such-model")
    assert "no-such-model" in refused.value.body["detail"], refused.value.body
    assert complete(server, PROMPTS[1]) == (served["completions"][PROMPTS[1]], "length")
    # a completion stops where the context is full
    response = server.client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=2 * limit,
                                                temperature=0)
    assert response.usage.prompt_tokens + response.usage.completion_tokens == limit, response.usage
    assert response.choices[0].finish_reason == "length"


@pytest.mark.integration
def test_shutdown_on_a_signal(server):
    sig = VARIANTS[server.variant][2]
    if sig is None:
        pytest.skip("a server in this process is stopped by the test, not by a signal")
    status, seconds = server.stop(sig)
    output = server.output()
    assert "Traceback" not in output, output[-5000:]
    assert "Application shutdown complete" in output and "Finished server process" in output, output[-3000:]
    assert status in EXIT_STATUS[sig], (status, output[-3000:])
    assert seconds < 15, f"{seconds:.1f} s to exit on {sig.name}"


def test_continuous_batching_falls_back_to_generate_where_it_cannot_serve_dat(caplog):
    """A configuration continuous batching cannot serve is served by `generate` (as the server does for a model
    without continuous batching), the server warning with the field; the server's own refusal stands."""
    choose = _servable(lambda state, model, modality: True)
    assert choose(None, SimpleNamespace(config=tiny_config()), None)
    flex = tiny_config(relational_attn_implementation="flex_attention")
    assert not choose(None, SimpleNamespace(config=flex), None)
    assert "`relational_attn_implementation`='flex_attention'" in caplog.text
    assert not _servable(lambda state, model, modality: False)(None, SimpleNamespace(config=tiny_config()), None)
