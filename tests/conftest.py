"""Shared test setup: offline Hub, few threads (tiny models train much faster on 2 cores), tiny configs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import dat_hf  # noqa: E402,F401  (registers the Auto classes)
from dat_hf import DATConfig  # noqa: E402


def tiny_config(**overrides) -> DATConfig:
    """A tiny DAT language model config (d=32, 2 layers, 2+2 heads) for fast tests."""
    kwargs = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
        intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64,
        max_relative_position=8,
    )
    kwargs.update(overrides)
    return DATConfig(**kwargs)


@pytest.fixture
def tiny():
    return tiny_config


def enable_checkpointing(model):
    """Turn on activation checkpointing: `activation_checkpointing_enable`, or on Transformers 5.17 (which has not
    that name) `gradient_checkpointing_enable`, a deprecated alias of it in later versions."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def set_torch_config(request, config_module, name: str, value):
    """Set a knob of one of torch's private config modules (`torch._dynamo.config`, `torch._inductor.config`) for one
    test, with the module's own `patch` (monkeypatch's undo deletes a config module's attribute, and every later use
    of the knob fails), where the installed torch has it: such knobs work around a torch release's bugs and may be
    gone in later releases, where the test then runs without the workaround instead of erroring."""
    if hasattr(config_module, name):
        patch = config_module.patch(**{name: value})
        patch.__enter__()
        request.addfinalizer(lambda: patch.__exit__(None, None, None))


# ---- the differential fuzzer (tests/test_fuzz_attention.py) -------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--fuzz-seed", type=int, default=None,
                     help="replay one case of the differential fuzzer (the seed a failure printed); default: a fresh "
                          "seed per run, printed in the header and at the end")
    parser.addoption("--fuzz-cases", type=int, default=2000,
                     help="random cases of the slow fuzz test (`-m slow`)")


def pytest_configure(config):
    import random

    seed = config.getoption("--fuzz-seed", default=None)
    config.fuzz_seed = seed if seed is not None else random.SystemRandom().randrange(10**6, 2**31)


def fuzz_seed_line(config) -> str:
    return f"fuzz seed: {config.fuzz_seed} (replay: pytest tests/test_fuzz_attention.py --fuzz-seed {config.fuzz_seed})"


def pytest_report_header(config):  # shown unless -q
    return fuzz_seed_line(config)


def pytest_terminal_summary(terminalreporter, config):
    """The seed again at the end, where -q (scripts/test.sh) still shows it, when a test drew from it."""
    if getattr(config, "fuzz_seed_used", False):
        terminalreporter.write_line(fuzz_seed_line(config))


@pytest.fixture
def fuzz_seed(request):
    request.config.fuzz_seed_used = True
    return request.config.fuzz_seed
