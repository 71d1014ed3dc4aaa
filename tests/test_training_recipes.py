"""The training recipes of docs/training.md run as written on a CPU-only machine (integration: `bash scripts/test.sh -m
integration tests/test_training_recipes.py`): every `--use_cpu` launch of `scripts/train_causal_lm.py` in the page's
bash blocks (one process; DDP through torchrun and through Accelerate; FSDP through Accelerate's config and through
`--fsdp`, both of which run as DDP on the CPU and say so in one warning; DeepSpeed ZeRO-2 and ZeRO-3 through Accelerate
and ZeRO-3 through torchrun) and the tensor-parallel snippet under torchrun with 2 processes.

The commands are read from the page, so the page and this test cannot drift: each runs in a folder holding the
repository's `scripts/` and `configs/` (the page runs every command from the repository root) and the page's
`fsdp.json`, with its `...` (or, without one, its end) given the arguments of a tiny 2-step run
(`lm_helpers.train_args`, which come last and so win over the page's sizes and output folder), on one thread per
process. The launchers run from this interpreter (`python -m torch.distributed.run`, `python -m
accelerate.commands.launch`) on a free port each.

The default suite checks what needs no process: that the page holds each of these commands and the snippet, and the
FSDP-on-CPU warning's logic (`dat_hf.training.FSDPOnCPUWarningMixin`)."""

import json
import re
import shlex
import socket
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import yaml
from lm_helpers import REPO_ROOT, run_group, subprocess_env, train_args
from safetensors.torch import load_file
from snippets import extract_snippets

from dat_hf.training import FSDPOnCPUWarningMixin, fsdp_fallback_warning

pytestmark = pytest.mark.xdist_group("training_recipes")  # (one worker: the runs share a folder, 2 cores)

PAGE = REPO_ROOT / "docs" / "training.md"
# the launches of the page, by launcher and what selects the parallelism: {recipe: processes}
RECIPES = {
    "python": 1,
    "torchrun": 2,
    "torchrun --fsdp": 2,
    "torchrun --deepspeed": 2,
    "accelerate --multi_gpu": 2,
    "accelerate fsdp.yaml": 2,
    "accelerate deepspeed_zero2.yaml": 2,
    "accelerate deepspeed_zero3.yaml": 2,
}
FSDP_WARNING = "FSDP was requested by"
ZERO_FILES = {  # DeepSpeed's checkpoint files at step 2 (`global_step2/`): ZeRO-3 partitions the model's states too
    2: {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"},
    3: {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"},
}


def bash_commands(text: str) -> list[str]:
    """The commands of a Markdown text's ```bash blocks: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for command in re.sub(r"\\\n\s*", "", block).splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def recipe(words: list[str]) -> str | None:
    """A command's launch (a key of RECIPES), or None for a command that is no launch of the training script."""
    if "scripts/train_causal_lm.py" not in words:
        return None
    if words[0] == "python":
        return "python"
    if words[0] == "torchrun":
        extra = [flag for flag in ("--fsdp", "--deepspeed") if flag in words]
        return " ".join(["torchrun", *extra])
    if words[:2] == ["accelerate", "launch"]:
        if "--config_file" in words:
            return f"accelerate {Path(words[words.index('--config_file') + 1]).name}"
        return "accelerate --multi_gpu" if "--multi_gpu" in words else "accelerate"
    return None


def cpu_recipes() -> dict[str, list[str]]:
    """{recipe: the words of its `--use_cpu` command} from the page (one command each; evaluation runs left out)."""
    found = {}
    for command in bash_commands(PAGE.read_text(encoding="utf-8")):
        words = shlex.split(command)
        name = recipe(words)
        if name is None or "--use_cpu" not in words or "--do_eval" in words or "--enable_jit_checkpoint" in words:
            continue  # (the Preemption section's commands: tests/test_preemption.py)
        assert name not in found, f"docs/training.md has two CPU commands for {name}: {found[name]} and {words}"
        found[name] = words
    return found


def tp_snippet():
    """The tensor-parallel snippet (```python no-run, `# torchrun --nproc_per_node 2 tp.py` on its first line)."""
    snippets = [s for s in extract_snippets(PAGE.read_text(encoding="utf-8"), "docs/training.md")
                if s.code.startswith("# torchrun --nproc_per_node 2 tp.py")]
    assert len(snippets) == 1, "docs/training.md: the tensor-parallel snippet (`# torchrun ... tp.py`) is missing"
    return snippets[0]


def processes(words: list[str]) -> int:
    """The processes a command starts, as written (`--nproc_per_node`, `--num_processes`; else 1)."""
    counts = [int(words[i + 1]) for i, word in enumerate(words[:-1]) if word in ("--nproc_per_node", "--num_processes")]
    return counts[0] if counts else 1


def test_the_page_has_a_cpu_command_for_every_launch():
    found = cpu_recipes()
    assert set(found) == set(RECIPES), f"missing {set(RECIPES) - set(found)}, unexpected {set(found) - set(RECIPES)}"
    for name, words in found.items():
        assert words[words.index("--config_name") + 1] == "dat-tiny" and processes(words) == RECIPES[name], words
    assert "--mixed_precision" in found["accelerate fsdp.yaml"]  # fsdp.yaml's bf16 autocast off, as the page says
    assert "import dat_hf" in tp_snippet().code  # (without it, the Auto classes do not know DAT)


# ---- the FSDP-on-CPU warning, in this process ------------------------------------------------------------------------
def fsdp_case(fsdp=None, distributed="MULTI_CPU", processes=2, device="cpu", mixed_precision="no"):
    from accelerate.utils import DistributedType

    args = types.SimpleNamespace(fsdp=fsdp, device=torch.device(device), bf16=False, fp16=False, process_index=0)
    accelerator = types.SimpleNamespace(distributed_type=DistributedType(distributed), num_processes=processes,
                                        mixed_precision=mixed_precision)
    return args, accelerator


def test_fsdp_fallback_warning_names_what_runs_instead(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    warning = fsdp_fallback_warning(*fsdp_case(fsdp=True))
    assert "by `--fsdp`" in warning and "its 2 processes train as plain DDP (MULTI_CPU, gloo)" in warning
    assert "Nothing is sharded" in warning and "To shard, train on GPUs" in warning and "--use_cpu" in warning
    assert "autocast" not in warning

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch` with fsdp.yaml, without --use_cpu
    warning = fsdp_fallback_warning(*fsdp_case(distributed="NO", processes=1, mixed_precision="bf16"))
    assert "`accelerate launch` with an FSDP config" in warning
    assert "each of the 2 launched processes trains alone" in warning and "add `--use_cpu`" in warning
    assert "`mixed_precision: bf16`" in warning and "--mixed_precision no" in warning

    assert fsdp_fallback_warning(*fsdp_case(distributed="FSDP")) is None  # FSDP runs
    assert fsdp_fallback_warning(*fsdp_case(device="cuda")) is None  # (not on the CPU)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert fsdp_fallback_warning(*fsdp_case()) is None  # no FSDP asked for


class _TrainerStub:
    def __init__(self, args, accelerator):
        self.args, self.accelerator = args, accelerator


class _Warned(FSDPOnCPUWarningMixin, _TrainerStub):
    pass


def test_the_trainer_warns_once_on_rank_0(monkeypatch, caplog):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    for rank, expected in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level("WARNING", logger="dat_hf.training.trainer"):
            _Warned(*fsdp_case(fsdp=True))
        assert len([r for r in caplog.records if FSDP_WARNING in r.getMessage()]) == expected, (rank, caplog.text)
    monkeypatch.setenv("RANK", "0")
    caplog.clear()
    with caplog.at_level("WARNING", logger="dat_hf.training.trainer"):
        _Warned(*fsdp_case())  # no FSDP asked for: no warning
    assert FSDP_WARNING not in caplog.text


# ---- the commands, run (integration) ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv_of(words: list[str], tiny: list[str]) -> list[str]:
    """A page command as this interpreter runs it, on a free port, `...` given the tiny run's arguments."""
    if words[0] == "python":
        launcher, rest = [sys.executable], words[1:]
    elif words[0] == "torchrun":
        launcher, rest = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port())], words[1:]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
        rest = words[2:]
    if "..." in rest:
        i = rest.index("...")
        return launcher + rest[:i] + tiny + rest[i + 1:]
    return launcher + rest + tiny


class Runs:
    """Each recipe run once, on demand, in `folder` (what the tests of this module share)."""

    def __init__(self, folder: Path, model_folder: Path):
        self.folder, self.model_folder, self.done = folder, model_folder, {}
        for name in ("scripts", "configs"):
            (folder / name).symlink_to(REPO_ROOT / name)
        fsdp_config = yaml.safe_load((REPO_ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text())["fsdp_config"]
        (folder / "fsdp.json").write_text(json.dumps(fsdp_config))  # the page's fsdp.json

    def run(self, name: str):
        if name not in self.done:
            out = f"runs/{name.replace(' ', '_').replace('--', '')}"
            extra = ("--save_strategy", "steps", "--save_steps", "2") if "deepspeed" in name else ()
            tiny = train_args(out, *extra, max_steps=2, batch_size=2)
            cmd = argv_of(cpu_recipes()[name], tiny)
            start = time.perf_counter()
            proc = run_group(cmd, timeout=300, cwd=self.folder, env=subprocess_env())
            wall = time.perf_counter() - start
            print(f"\n{name}: {wall:.1f} s wall")
            self.done[name] = (proc, self.folder / out)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, untrained_lm_folder):
    return Runs(tmp_path_factory.mktemp("recipes"), untrained_lm_folder)


def trained(runs, name):
    """The run's process and its folder, after the checks every launch passes: it ended well, trained 2 steps in
    its processes (the losses logged) and saved a DAT model."""
    proc, out = runs.run(name)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    record = json.loads((out / "training_run.json").read_text())
    assert record["steps"] == 2 and record["world_size"] == RECIPES[name], (name, record)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), (name, history)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DATForCausalLM"]
    assert "model.embed_tokens.weight" in load_file(out / "model.safetensors")
    return proc, out, losses


@pytest.mark.integration
@pytest.mark.parametrize("name", ["python", "torchrun", "accelerate --multi_gpu"])
def test_single_process_and_ddp_commands_run(runs, name):
    proc, _, _ = trained(runs, name)
    assert FSDP_WARNING not in proc.stdout + proc.stderr


@pytest.mark.integration
@pytest.mark.parametrize("name", ["accelerate fsdp.yaml", "torchrun --fsdp"])
def test_fsdp_commands_run_as_ddp_and_say_so(runs, name):
    proc, _, losses = trained(runs, name)
    output = proc.stdout + proc.stderr
    assert output.count(FSDP_WARNING) == 1, output[-6000:]  # once, on rank 0
    assert "its 2 processes train as plain DDP (MULTI_CPU, gloo)" in output
    # the same run as DDP through torchrun: same seed, data and 2 processes
    assert losses == pytest.approx(trained(runs, "torchrun")[2], rel=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("name, stage", [("accelerate deepspeed_zero2.yaml", 2), ("accelerate deepspeed_zero3.yaml", 3),
                                         ("torchrun --deepspeed", 3)])
def test_deepspeed_commands_run(runs, name, stage):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install deepspeed")
    _, out, _ = trained(runs, name)
    # DeepSpeed's engine trained over 2 data-parallel ranks at this ZeRO stage: its checkpoint's files say so
    files = {p.name for p in (out / "checkpoint-2" / "global_step2").iterdir()}
    other_stage = ZERO_FILES[3 if stage == 2 else 2] - ZERO_FILES[stage]
    assert ZERO_FILES[stage] <= files and not other_stage & files, files


@pytest.mark.integration
def test_tensor_parallel_snippet_runs_under_torchrun(runs, tmp_path):
    """The snippet as written, as its first line launches it, in a folder where `runs/dat-343m` is a tiny saved DAT
    (the session's untrained model and tokenizer): generation, a training step and `save_pretrained` on 2 ranks."""
    snippet = tp_snippet()
    (tmp_path / "tp.py").write_text(snippet.code)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "dat-343m").symlink_to(runs.model_folder)
    launch = shlex.split(snippet.code.splitlines()[0].lstrip("# "))[:4]
    assert launch == ["torchrun", "--nproc_per_node", "2", "tp.py"], launch
    # (each rank's output in a file of its own: on one pipe the two ranks' prints may interleave within a line)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port()), "--log-dir",
           str(tmp_path / "logs"), "--redirects", "1", *launch[1:]]
    start = time.perf_counter()
    proc = run_group(cmd, timeout=300, cwd=tmp_path, env=subprocess_env())
    print(f"\ntensor-parallel snippet (torchrun, 2 processes): {time.perf_counter() - start:.1f} s wall")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    outputs = sorted((tmp_path / "logs").rglob("stdout.log"))
    generated = [line for out in outputs for line in out.read_text().splitlines() if "The quick brown fox" in line]
    assert len(outputs) == 2 and len(generated) == 2 and generated[0] == generated[1], generated  # same tokens

    from transformers import AutoModelForCausalLM

    from dat_hf import DATForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "dat-343m-tp")
    initial = DATForCausalLM.from_pretrained(runs.model_folder)
    assert type(saved) is DATForCausalLM
    moved = max((p - initial.state_dict()[n]).abs().max().item() for n, p in saved.state_dict().items())
    assert 0 < moved < 1e-2, moved  # one AdamW step of lr 1e-4, gathered from both ranks
