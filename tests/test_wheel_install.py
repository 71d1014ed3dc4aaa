"""A wheel built from the checkout is enough to run the scripts: `pip wheel` of this checkout's files, installed into
a fresh virtual environment, runs the demo and the image-classification and seq2seq training scripts from a folder
outside the checkout, and their saved models load.

The virtual environment sees this interpreter's installed packages (torch, transformers, ... are not downloaded
again) through a `.pth` file listing their folders. Unlike `venv --system-site-packages`, that does not run the
`.pth` hooks of those folders, so a development (editable) install of dat_hf there stays invisible: `import dat_hf`
fails in the environment until the wheel is installed, and then resolves into the environment's site-packages. The
scripts run from a copy of `scripts/` and `model_cards/` (nothing else of the checkout), with no PYTHONPATH.

Integration (about a minute on 2 cores: building the wheel, three script runs of a few seconds of training each,
each paying the imports of torch and transformers): `bash scripts/test.sh -m integration tests/test_wheel_install.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dat_hf.kernels.cpu_build import HEADERS, SOURCES
from dat_hf.training import list_metrics, list_presets

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("wheel")]  # (processes; the wheel built once)


def checkout_files() -> list[str]:
    """The checkout's files (tracked, plus untracked ones that git does not ignore)."""
    out = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         capture_output=True, text=True, check=True).stdout
    return [name for name in out.split("\0") if name and (REPO_ROOT / name).is_file()]


def copy_checkout(dest: Path, under: tuple[str, ...] = ()) -> Path:
    for name in checkout_files():
        if not under or name.split("/")[0] in under:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, dest / name)
    return dest


def run(cmd, cwd, env, timeout=600):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd[:4]))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(python of the environment with the wheel installed, its site-packages, a clean env dict, the wheel path)."""
    root = tmp_path_factory.mktemp("wheel")
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    base_env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                    TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", HF_MODULES_CACHE=str(root / "modules"),
                    PIP_DISABLE_PIP_VERSION_CHECK="1")

    source = copy_checkout(root / "source")
    run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-w", root / "dist"],
        cwd=root, env=base_env)
    wheel = next((root / "dist").glob("dat_hf-*.whl"))

    run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], cwd=root, env=base_env)
    python = root / "venv" / "bin" / "python"
    venv_site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root,
                         env=base_env).stdout.strip())
    outer_sites = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(p)]
    (venv_site / "outer_packages.pth").write_text("\n".join(outer_sites) + "\n")

    probe = "import dat_hf, sys; print(dat_hf.__file__)"
    before = subprocess.run([python, "-c", probe], cwd=root, env=base_env, capture_output=True, text=True)
    assert before.returncode != 0 and "No module named 'dat_hf'" in before.stderr, before.stdout + before.stderr

    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", wheel], cwd=root,
        env=base_env)
    return python, venv_site, base_env, wheel


def test_wheel_ships_the_package_data_and_nothing_else(wheel_env):
    names = zipfile.ZipFile(wheel_env[3]).namelist()
    assert {f"dat_hf/training/presets/{p}.json" for p in list_presets()} <= set(names)
    assert {f"dat_hf/kernels/csrc/{source.name}" for source in SOURCES + HEADERS} <= set(names)
    assert {f"dat_hf/training/metrics/{m}/{m}.py" for m in list_metrics()} <= set(names)
    assert {"dat_hf/training/metrics/accuracy/README.md"} <= set(names)  # (the modules' cards too)
    assert not [n for n in names if n.split("/")[0] in ("tests", "scripts", "configs", "docs", "model_cards")]


def test_installed_package_is_the_wheel(wheel_env, tmp_path):
    python, venv_site, env, _ = wheel_env
    code = ("import json, sys, dat_hf, dat_hf.training as t; print(json.dumps({'file': dat_hf.__file__, "
            "'path': sys.path, 'presets': t.list_presets(), 'metrics': t.list_metrics(), "
            "'accuracy': t.load_metric('accuracy').compute(predictions=[1, 0], references=[1, 1]), "
            "'cpu_kernel': dat_hf.load_cpu_kernel()}))")
    info = json.loads(run([python, "-c", code], cwd=tmp_path, env=env).stdout.strip().splitlines()[-1])
    assert Path(info["file"]).resolve().is_relative_to(venv_site.resolve())
    assert not any(p and Path(p).resolve() == REPO_ROOT for p in info["path"]), info["path"]
    assert info["presets"] == list_presets() and info["metrics"] == list_metrics()
    assert info["accuracy"] == {"accuracy": 0.5}
    assert info["cpu_kernel"] == (shutil.which("c++") is not None)  # its C++ sources ship in the wheel


@pytest.fixture(scope="module")
def scripts_copy(tmp_path_factory):
    """`scripts/` and `model_cards/` of the checkout, alone in a folder (no dat_hf next to them)."""
    return copy_checkout(tmp_path_factory.mktemp("user_checkout"), under=("scripts", "model_cards")) / "scripts"


def test_demo_runs_from_the_wheel(wheel_env, scripts_copy, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    python, _, env, _ = wheel_env
    out = tmp_path / "demo"
    proc = run([python, scripts_copy / "demo.py", "--output_dir", out, "--train_seconds", "2", "--max_files", "2",
                "--vocab_size", "300", "--block_size", "32", "--batch_size", "4", "--max_new_tokens", "4"],
               cwd=tmp_path, env=env)
    assert f"saved to {out}" in proc.stdout and (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("ROMEO:", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    assert "## Usage" in (out / "README.md").read_text()  # the model card template was found


def test_image_classification_script_runs_from_the_wheel(wheel_env, scripts_copy, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageClassification
    from transformers.models.auto.image_processing_auto import AutoImageProcessor  # see dat_hf/__init__.py

    python, _, env, _ = wheel_env
    rng = np.random.RandomState(0)
    for label, brightness in (("dark", 40), ("light", 215)):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(8):
            pixels = np.clip(rng.normal(brightness, 20, (8, 8)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / label / f"{i}.png")
    out = tmp_path / "run"
    run([python, scripts_copy / "train_image_classification.py", "--dataset", "images", "--num_eval", "4",
         "--output_dir", "run", "--use_cpu", "--image_size", "8", "--patch_size", "4", "--hidden_size", "16",
         "--num_hidden_layers", "1", "--num_attention_heads", "2", "--num_relational_heads", "1",
         "--intermediate_size", "32", "--num_symbols", "4", "--symbolic_attention_heads", "2",
         "--num_train_epochs", "1", "--per_device_train_batch_size", "4", "--report_to", "none",
         "--disable_tqdm", "true"], cwd=tmp_path, env=env)
    metrics = json.loads((out / "all_results.json").read_text())
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    model = AutoModelForImageClassification.from_pretrained(out)
    processor = AutoImageProcessor.from_pretrained(out)
    image = Image.open(tmp_path / "images" / "dark" / "0.png")
    assert model(**processor(image, return_tensors="pt")).logits.shape == (1, 2)


def test_seq2seq_script_runs_from_the_wheel(wheel_env, scripts_copy, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    python, _, env, _ = wheel_env
    run([python, scripts_copy / "train_seq2seq.py", "--output_dir", "run", "--max_steps", "3", "--use_cpu",
         "--report_to", "none", "--n_train_per_module", "16", "--n_test_per_module", "4",
         "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--hidden_size", "32",
         "--encoder_layers", "1", "--decoder_layers", "1", "--num_symbols", "8", "--max_target_length", "8",
         "--save_strategy", "no", "--disable_tqdm", "true"], cwd=tmp_path, env=env)
    result = json.loads((tmp_path / "run" / "exact_match.json").read_text())
    assert 0.0 <= result["exact_match"] <= 1.0
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run")
    assert type(model).__name__ == "DATForSeq2SeqLM"
