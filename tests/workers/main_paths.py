"""The main paths a user runs, in one process started with Transformers' deprecations as errors
(`python -W error::FutureWarning -W error::DeprecationWarning`; tests/test_versions.py runs it on the newest releases):
generate with each cache, a Trainer step, continuous batching, save and reload, the server's start and one request of
each kind (in its own process too, where the release spawns one: the warning options pass to it). Prints one line per
path, then DONE; the test reads the output for Transformers' deprecations logged instead of warned.

    python -W error::FutureWarning -W error::DeprecationWarning tests/workers/main_paths.py FOLDER
"""

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, GenerationConfig, Trainer, TrainingArguments

from dat_hf import DATConfig, DATForCausalLM, DATForSeq2SeqLM, DATSeq2SeqConfig, serve


def config(**overrides):
    return DATConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
                     intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64,
                     eos_token_id=None, **overrides)


def request(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers={
                "Content-Type": "application/json"}), timeout=120) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        raise AssertionError(f"{url} {body}: {error.code} {error.read()[:2000]}") from None


def main(folder: Path):
    torch.manual_seed(0)
    model = DATForCausalLM(config()).eval()
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for cache in (None, "static"):  # (the offloaded cache needs CUDA)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache_implementation=cache)
        print("generate", cache or "dynamic", flush=True)
    window = DATForCausalLM(config(relational_bias="sliding_window", sliding_window_size=4)).eval()
    window.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    print("generate static sliding window", flush=True)
    batched = model.generate_batch([[1, 2, 3], [4, 5]], generation_config=GenerationConfig(
        max_new_tokens=3, do_sample=False, eos_token_id=0), progress_bar=False)
    assert all(len(output.generated_tokens) == 3 for output in batched.values()), batched
    print("continuous batching", flush=True)

    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(str(folder / "run"), per_device_train_batch_size=2, max_steps=1, use_cpu=True,
                             report_to=[], save_strategy="no")
    Trainer(model=DATForCausalLM(config()), args=args, train_dataset=data).train()
    print("trainer step", flush=True)

    model.save_pretrained(folder / "lm")
    reloaded = AutoModelForCausalLM.from_pretrained(folder / "lm")
    assert torch.equal(reloaded.generate(ids, max_new_tokens=2, do_sample=False), model.generate(
        ids, max_new_tokens=2, do_sample=False))
    seq2seq = DATForSeq2SeqLM(DATSeq2SeqConfig(vocab_size=40, hidden_size=32, encoder_layers=1, num_hidden_layers=1,
                                               decoder_start_token_id=1, pad_token_id=0)).eval()
    seq2seq.generate(torch.randint(2, 40, (2, 5)), max_new_tokens=3, do_sample=False)
    seq2seq.save_pretrained(folder / "seq2seq")
    type(seq2seq).from_pretrained(folder / "seq2seq")
    print("save and reload", flush=True)

    served = str(folder / "served")
    model.save_pretrained(served)
    make_tokenizer().save_pretrained(served)
    for flags in ([], ["--continuous-batching", "--cb-num-blocks", "16"]):  # (not --cb-block-size: deprecated)
        port = free_port()
        thread = threading.Thread(target=serve.main, args=([served, "--host", "127.0.0.1", "--port", str(port),
                                                             *flags],), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                request(f"{url}/health")
                break
            except OSError:
                time.sleep(0.2)
        prompt = {"model": served, "max_tokens": 3, "temperature": 0}
        chat = {**prompt, "messages": [{"role": "user", "content": "hello"}]}
        request(f"{url}/v1/completions", {**prompt, "prompt": "hello"})
        request(f"{url}/v1/completions", {**prompt, "prompt": "hello", "stream": True})
        request(f"{url}/v1/completions", {**prompt, "prompt": "hello", "stop": "e"})
        request(f"{url}/v1/chat/completions", chat)
        request(f"{url}/v1/chat/completions", {**chat, "stream": True})
        request(f"{url}/v1/models/{served}")
        serve.stop_servers()
        thread.join(60)
        assert not thread.is_alive()
        print("server", *flags[:1], flush=True)
    print("DONE", flush=True)


def make_tokenizer():
    """A byte-level BPE tokenizer over a few lines, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["Now, fair Hippolyta, our nuptial hour draws on apace", "hello there, the course of true love"] * 4
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=64, special_tokens=["<s>", "</s>"],
                                                            show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main(Path(sys.argv[1]))
