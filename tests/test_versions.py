"""Every Transformers release setup.cfg allows: the tested range is stated once and warned about past its end; the cache
argument works under both of its names; nothing prints an error or a deprecation at import, in a forward, in
`generate`, in Trainer's evaluation or when saving. (.ci/run runs this module on the floor, the tested set and the
newest releases.)"""

import configparser
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from packaging.requirements import Requirement

from dat_hf import DATForCausalLM, UntestedTransformersWarning, warn_if_untested_transformers
from dat_hf.transformers_compat import TESTED_TRANSFORMERS, output_cache

REPO = Path(__file__).resolve().parents[1]


def pinned_version(constraints: str, package: str) -> str:
    for line in (REPO / "constraints" / constraints).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            if requirement.name == package:
                return str(requirement.specifier).removeprefix("==")
    raise AssertionError(f"constraints/{constraints} pins no {package}")


def test_tested_range_is_the_constraints_and_the_floor():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requirement = next(Requirement(line) for line in setup["options"]["install_requires"].split()
                       if line.startswith("transformers"))
    floor = next(spec.version for spec in requirement.specifier if spec.operator == ">=")
    assert TESTED_TRANSFORMERS == (pinned_version("floor.txt", "transformers"), pinned_version("tested.txt", "transformers"))
    assert TESTED_TRANSFORMERS[0].startswith(floor)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"{TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}" in readme
    tested_torch = ".".join(pinned_version("tested.txt", "torch").split(".")[:2])  # (scripts/install.sh installs it)
    assert f"PyTorch {tested_torch} " in readme


def test_the_floor_pins_the_floors_of_setup_cfg():
    """Each package constraints/floor.txt pins and setup.cfg gives a floor (`>=`, the dev extras included: Triton,
    whose floor is the lent GPU image's) is pinned at that floor, so CI's floor leg runs what setup.cfg allows."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines() + setup["options.extras_require"]["dev"].splitlines()
    floors = {}
    for line in filter(None, (line.strip() for line in lines)):
        if not line.startswith("#"):
            requirement = Requirement(line)
            floors.update({requirement.name: s.version for s in requirement.specifier if s.operator == ">="})
    checked = 0
    for package, floor in floors.items():
        try:
            pinned = pinned_version("floor.txt", package)
        except AssertionError:  # not pinned there (torch: the tested release)
            continue
        assert pinned.split(".")[:len(floor.split("."))] == floor.split("."), (package, floor, pinned)
        checked += 1
    assert checked == 7 and "triton" in floors  # the six of install_requires that floor.txt pins, and triton


def test_a_newer_transformers_warns_naming_the_tested_range():
    oldest, newest = TESTED_TRANSFORMERS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not warn_if_untested_transformers(newest)
        assert not warn_if_untested_transformers(oldest)
        assert warn_if_untested_transformers("9.0.0")
    assert len(caught) == 1 and caught[0].category is UntestedTransformersWarning
    assert f"{oldest} to {newest}" in str(caught[0].message) and "9.0.0" in str(caught[0].message)


def test_the_cache_under_both_names():
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.3)).eval()
    ids = torch.randint(1, 97, (2, 6))
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
        for name in ("cache", "past_key_values"):
            cache = output_cache(model(ids[:, :-1], use_cache=True))
            step = model(ids[:, -1:], **{name: cache}).logits[:, 0]
            torch.testing.assert_close(step, logits, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="`cache`.*not both"):
            model(ids[:, -1:], cache=cache, past_key_values=cache)


# run in a fresh interpreter: what a user sees at import and in the common calls (warnings always shown, Transformers'
# own log lines included)
SCRIPT = textwrap.dedent("""
    import warnings
    warnings.simplefilter("always")
    import torch
    import dat_hf
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from dat_hf import DATConfig, DATForCausalLM, DATForSeq2SeqLM, DATSeq2SeqConfig
    print("IMPORTED", flush=True)
    torch.manual_seed(0)
    config = DATConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
                       intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=64)
    model = DATForCausalLM(config).eval()
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
    model.save_pretrained("{folder}/lm")
    AutoModelForCausalLM.from_pretrained("{folder}/lm").generate(ids, max_new_tokens=2, do_sample=False)
    data = Dataset.from_dict({{"input_ids": ids.tolist(), "labels": ids.tolist()}})
    args = TrainingArguments("{folder}/run", per_device_eval_batch_size=2, use_cpu=True, report_to=[])
    metrics = Trainer(model=model, args=args, eval_dataset=data).evaluate()
    assert "eval_loss" in metrics, metrics
    seq2seq = DATForSeq2SeqLM(DATSeq2SeqConfig(vocab_size=40, hidden_size=32, encoder_layers=1, num_hidden_layers=1,
                                               decoder_start_token_id=1, pad_token_id=0)).eval()
    seq2seq.generate(torch.randint(2, 40, (2, 5)), max_new_tokens=3, do_sample=False)
    seq2seq.save_pretrained("{folder}/seq2seq")
    print("DONE", flush=True)
""")


@pytest.mark.integration
def test_no_error_or_deprecation_at_import_forward_generate_evaluate_save(tmp_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(folder=tmp_path)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0 and "DONE" in run.stdout, run.stderr[-3000:]
    before_import = run.stdout.split("IMPORTED")[0]
    assert before_import == "", before_import  # (auto_docstring prints `[ERROR] ...` lines on stdout)
    lines = [line for line in (run.stdout + run.stderr).splitlines()
             if UntestedTransformersWarning.__name__ not in line]  # (the newest releases may be past the tested set)
    flagged = [line for line in lines if any(word in line for word in (
        "[ERROR]", "FutureWarning", "DeprecationWarning", "deprecated", "is deprecated"))]
    assert not flagged, "\n".join(flagged)


# Transformers' deprecations as errors (a deprecation is the next release's break); logged ones read from the output
DEPRECATIONS_AS_ERRORS = ["-W", "error::FutureWarning", "-W", "error::DeprecationWarning"]
DEPRECATED = ("FutureWarning", "DeprecationWarning", "deprecated")


def deprecations(output: str) -> list[str]:
    """The lines of `output` that warn or log a deprecation (the newest releases may be past the tested set: that
    warning is not one)."""
    return [line for line in output.splitlines() if any(word in line for word in DEPRECATED)
            and UntestedTransformersWarning.__name__ not in line]


@pytest.mark.integration
def test_the_main_paths_use_nothing_deprecated(tmp_path):
    """Generate with each cache, continuous batching, a Trainer step, save and reload, the server's start and one
    request of each kind (both modes), in a process (and the server's model process) where Transformers'
    `FutureWarning` and `DeprecationWarning` are errors (tests/workers/main_paths.py); then the model's tensor-parallel
    load, a step, `generate` and a save over 2 ranks likewise. (.ci/run: the newest releases.)"""
    from lm_helpers import run_group, subprocess_env

    env = subprocess_env()
    run = subprocess.run([sys.executable, *DEPRECATIONS_AS_ERRORS, str(REPO / "tests" / "workers" / "main_paths.py"),
                          str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "DONE" in run.stdout, output[-5000:]
    assert not deprecations(output), "\n".join(deprecations(output))
    for path in ("generate dynamic", "generate static", "continuous batching", "trainer step", "save and reload",
                 "server\n", "server --continuous-batching"):
        assert path in run.stdout, (path, run.stdout)

    torch.manual_seed(0)
    folder = tmp_path / "tp"
    DATForCausalLM(tiny_config()).save_pretrained(folder)
    out = tmp_path / "tp-out"
    out.mkdir()
    env = subprocess_env(PYTHONWARNINGS="error::FutureWarning,error::DeprecationWarning")
    proc = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      str(REPO / "tests" / "workers" / "tp_check.py"), str(out), str(folder)], timeout=300, cwd=REPO,
                     env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert not deprecations(output), "\n".join(deprecations(output))
