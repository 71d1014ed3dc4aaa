"""Hub format acceptance tests: save/load round trips, safetensors only, auto_map, remote code without dat_hf
(in this process with dat_hf hidden, and in a subprocess where `import dat_hf` fails), and the text-generation
pipeline from a saved folder."""

import ast
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    pipeline,
)

import dat_hf
from conftest import tiny_config
from remote_code import run_without_dat_hf

from dat_hf.transformers_compat import paged_cache_limits
from dat_hf import (DATConfig, DATEncoderConfig, DATForCausalLM, DATForImageClassification, DATForSeq2SeqLM,
                    DATForSequenceClassification, DATForTokenClassification, DATModel, DATSeq2SeqConfig,
                    DATVisionConfig)

pytestmark = pytest.mark.xdist_group("hub")  # (one worker: the module-scoped remote-code runs once)
PACKAGE_DIR = Path(dat_hf.__file__).parent
REPO_ROOT = PACKAGE_DIR.parent
AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification")
# modules only the installed package needs (hooked in by `import dat_hf`): never copied as remote code
LOCAL_ONLY = {"atomic_save.py", "checkpoint_bounds.py", "input_validation.py", "safe_folders.py"}

TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall Death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them.
"""
PROMPT = "Shall I compare thee"


def relative_imports(path: Path) -> set[str]:
    """Module names imported as `from .module import X` by a file."""
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}


def modeling_closure() -> set[str]:
    """Every dat_hf file the remote-code loader must copy for modeling_dat.py (recursively)."""
    todo, seen = ["modeling_dat"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(relative_imports(PACKAGE_DIR / f"{name}.py"))
    return {f"{name}.py" for name in seen}


def make_model(cls=DATForCausalLM, seed=0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("initializer_range", 0.1)
    return cls(tiny_config(**overrides)).eval()


def input_ids(batch=2, length=6, vocab=97, seed=1):
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- round trips ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(symbol_retrieval="position_relative", position_embedding_type="learned", relation_activation="relu",
         tie_word_embeddings=False, norm_type="layernorm", shared_symbol_retriever=False,
         relational_bias=["causal", "sliding_window"], sliding_window_size=2, num_relational_key_value_heads=1),
], ids=["default", "variant"])
def test_save_load_round_trip(tmp_path, overrides):
    model = make_model(**overrides)
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids).logits
    folder = tmp_path / "saved"
    model.save_pretrained(folder)

    files = set(os.listdir(folder))
    assert "model.safetensors" in files
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")) for f in files), files
    assert {"config.json", "configuration_dat.py"} | modeling_closure() <= files
    assert os.listdir(tmp_path) == ["saved"]  # no temporary folder left behind

    loaded = DATForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
    for k, v in overrides.items():
        assert getattr(loaded.config, k) == v
    # every saved tensor is a parameter/buffer of the model, with the same values
    state = load_file(folder / "model.safetensors")
    own = model.state_dict()
    for k, v in state.items():
        assert torch.equal(v, own[k]), k
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    else:
        assert "lm_head.weight" in state
        assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


def test_save_load_sequence_classification_and_base(tmp_path):
    clf = make_model(DATForSequenceClassification, num_labels=3, pad_token_id=0)
    ids = input_ids()
    clf.save_pretrained(tmp_path / "clf")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf").eval()
    assert type(loaded) is DATForSequenceClassification
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, clf(ids).logits)
        # the base model inside a head checkpoint loads with AutoModel
        base = AutoModel.from_pretrained(tmp_path / "clf").eval()
        assert type(base) is DATModel
        assert torch.equal(base(ids).last_hidden_state, clf.model(ids).last_hidden_state)


def test_config_auto_map(tmp_path):
    make_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "dat"
    auto_map = config["auto_map"]
    for auto in AUTO_CLASSES:
        assert auto in auto_map, f"auto_map lacks {auto}"
        module, cls = auto_map[auto].split(".")
        assert (tmp_path / f"{module}.py").is_file()
        assert hasattr(dat_hf, cls)
    assert auto_map["AutoConfig"].endswith(".DATConfig")
    assert auto_map["AutoModelForCausalLM"].endswith(".DATForCausalLM")
    assert auto_map["AutoModelForSequenceClassification"].endswith(".DATForSequenceClassification")
    assert auto_map["AutoModel"].endswith(".DATModel")
    # the copied files are the package's own sources
    for name in modeling_closure():
        assert (tmp_path / name).read_text() == (PACKAGE_DIR / name).read_text()


def family_models():
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_sensory_heads=2, num_relational_heads=2,
                intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, max_position_embeddings=16)
    return {
        "causal_lm": lambda: DATForCausalLM(DATConfig(vocab_size=16, **tiny)),
        "vision": lambda: DATForImageClassification(DATVisionConfig(image_size=8, patch_size=4, num_channels=1,
                                                                    num_labels=2, **tiny)),
        "seq2seq": lambda: DATForSeq2SeqLM(DATSeq2SeqConfig(vocab_size=16, encoder_layers=1, **tiny)),
        "encoder": lambda: DATForTokenClassification(DATEncoderConfig(vocab_size=16, num_labels=3, **tiny)),
    }


@pytest.mark.parametrize("family", ["causal_lm", "vision", "seq2seq", "encoder"])
def test_copied_code_is_the_model_definition(family, tmp_path):
    """`save_pretrained` copies the model's definition only: dat_hf's crash-safe saving and its checks of untrusted
    folders (installed into the hook points by `import dat_hf`) stay in the package."""
    model = family_models()[family]()
    model.save_pretrained(tmp_path)
    copied = {path.name for path in tmp_path.glob("*.py")}
    assert "configuration_dat.py" in copied and "modeling_dat.py" in copied
    assert not copied & LOCAL_ONLY, copied & LOCAL_ONLY
    # ... yet in this process (dat_hf imported) saving and loading go through them
    from dat_hf import safe_folders

    assert dat_hf.modeling_dat.SAVE_LOAD_HOOKS == {"save": safe_folders.save, "load": safe_folders.load,
                                                   "build": safe_folders.build}


def test_auto_classes_in_process(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is DATConfig
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is DATForCausalLM  # the installed classes, not a remote-code copy
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # trust_remote_code with dat_hf imported still gives the local class
    again = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(again) is DATForCausalLM


def test_save_is_idempotent_and_overwrites(tmp_path):
    """Saving twice into the same folder replaces the weights (crash-safe save: see test_atomic_save.py)."""
    make_model(seed=0).save_pretrained(tmp_path)
    second = make_model(seed=1)
    second.save_pretrained(tmp_path)
    loaded = DATForCausalLM.from_pretrained(tmp_path).eval()
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, second(ids).logits)


# ---- tokenizer + pipeline ---------------------------------------------------------------------------------------


def train_byte_level_bpe(text: str, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    """A saved tiny DAT LM with a trained byte-level BPE tokenizer beside it."""
    folder = tmp_path_factory.mktemp("dat_lm")
    tokenizer = train_byte_level_bpe(TEXT)
    assert tokenizer.decode(tokenizer(PROMPT)["input_ids"]) == PROMPT
    torch.manual_seed(0)
    # no eos_token_id on the model: generation always runs max_new_tokens
    config = tiny_config(vocab_size=len(tokenizer), initializer_range=0.5, symbol_retrieval="position_relative")
    model = DATForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_pipeline(folder, **kwargs):
    generator = pipeline("text-generation", model=str(folder), device="cpu", **kwargs)
    return generator, generator(PROMPT, max_new_tokens=6, do_sample=False)[0]["generated_text"]


def test_text_generation_pipeline(lm_folder):
    generator, text = run_pipeline(lm_folder)
    assert type(generator.model) is DATForCausalLM
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    # the pipeline's text is the greedy continuation of model.generate
    tok = generator.tokenizer
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    out = generator.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 6
    assert text == tok.decode(out[0], skip_special_tokens=True)


# ---- remote code in a process without dat_hf -------------------------------------------------------------------

# the fresh interpreter's start: the checkout is not on the path
CHILD_START = f'''
import sys
from pathlib import Path
assert not any(p and Path(p).resolve() == Path({str(REPO_ROOT.resolve())!r}) for p in sys.path), sys.path
'''
# what runs there, or in this process: `run_without_dat_hf`, with argv the work folder, the prompt, the folders' tag
CHILD = r'''
import json, os, sys
from pathlib import Path
work, PROMPT, TAG = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, pipeline)

try:
    import dat_hf  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("dat_hf is importable")

folder = work / f"model-{TAG}"  # (the folders' names are their code's module names: one per run)
inputs = load_file(work / "inputs.safetensors")
results, report = {}, {}
with torch.no_grad():
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    report["config_class"] = type(config).__module__ + "." + type(config).__name__
    report["model_class"] = type(model).__module__ + "." + type(model).__name__
    results["logits"] = model(inputs["input_ids"]).logits
    results["generated"] = model.generate(inputs["input_ids"], max_new_tokens=5, do_sample=False, pad_token_id=0)
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    report["base_class"] = type(base).__name__
    results["hidden"] = base(inputs["input_ids"]).last_hidden_state
    clf = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True, num_labels=2)
    report["clf_class"] = type(clf).__name__
    # the bidirectional family (its own config and modeling files)
    tagger = AutoModelForTokenClassification.from_pretrained(work / f"encoder-{TAG}", trust_remote_code=True).eval()
    report["tagger_class"] = type(tagger).__module__ + "." + type(tagger).__name__
    results["tags"] = tagger(inputs["input_ids"]).logits

    # saved again by the remote code: Transformers' own save_pretrained (dat_hf's crash-safe saving is not copied)
    model.save_pretrained(work / f"resaved-{TAG}")
    report["resaved_files"] = sorted(os.listdir(work / f"resaved-{TAG}"))
    results["resaved_logits"] = AutoModelForCausalLM.from_pretrained(work / f"resaved-{TAG}", trust_remote_code=True)(
        inputs["input_ids"]).logits

    # continuous batching from the folder's code (its `cache_dat`): each request as `generate` alone, or refused by
    # name where the installed release's paged cache is not the one DAT's layers use (the floor)
    report["batching_limits"] = model.continuous_batching_limits()
    if not report["batching_limits"]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        prompts = [row.tolist() for row in inputs["input_ids"]]
        batched = model.generate_batch(
            prompts, generation_config=GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None),
            continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=16))
        results["batched"] = torch.tensor([batched[key].generated_tokens for key in sorted(batched)])

    generator = pipeline("text-generation", model=str(work / f"lm-{TAG}"), trust_remote_code=True, device="cpu")
    report["pipeline_model_class"] = type(generator.model).__module__ + "." + type(generator.model).__name__
    report["pipeline_text"] = generator(PROMPT, max_new_tokens=6, do_sample=False)[0]["generated_text"]
report["modules"] = sorted(name for name in sys.modules if name.startswith("transformers_modules.") and TAG in name)
save_file({k: v.contiguous() for k, v in results.items()}, str(work / "results.safetensors"))
(work / "report.json").write_text(json.dumps(report))
'''


# in this process, and (integration: it starts an interpreter) in a fresh one
@pytest.fixture(scope="module", params=["in-process", pytest.param("fresh-interpreter", marks=pytest.mark.integration)])
def remote_run(request, tmp_path_factory, lm_folder):
    """Save a model, run the child's code once, collect its results: in this process `without_dat_hf`, or in a
    fresh interpreter (cwd outside the repo, no PYTHONPATH, dat_hf blocked)."""
    work = tmp_path_factory.mktemp(f"remote-{request.param}")  # (a folder name of its own: the modules' name)
    model = make_model(symbol_retrieval="positional", num_relational_key_value_heads=1)
    tag = f"{os.getpid()}_{request.param.replace('-', '_')}"
    model.save_pretrained(work / f"model-{tag}")
    torch.manual_seed(0)
    tagger = DATForTokenClassification(DATEncoderConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
        intermediate_size=64, num_symbols=8, symbolic_attention_heads=2, num_labels=3, initializer_range=0.1)).eval()
    tagger.save_pretrained(work / f"encoder-{tag}")
    ids = input_ids(2, 6)
    save_file({"input_ids": ids}, str(work / "inputs.safetensors"))
    os.symlink(lm_folder, work / f"lm-{tag}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    env.update(HF_HOME=str(work / "hf_home"), HF_MODULES_CACHE=str(work / "hf_modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    code = (CHILD_START if request.param == "fresh-interpreter" else "") + CHILD
    run_without_dat_hf(request.param, code, [work, PROMPT, tag], cwd=work, env=env)
    with torch.no_grad():
        expected = {"logits": model(ids).logits, "hidden": model.model(ids).last_hidden_state,
                    "generated": model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0),
                    "tags": tagger(ids).logits}
    return dict(results=load_file(work / "results.safetensors"), report=json.loads((work / "report.json").read_text()),
                expected=expected)


def test_remote_code_loads_without_dat_hf(remote_run):
    report = remote_run["report"]
    assert report["model_class"].endswith(".DATForCausalLM")
    assert not report["model_class"].startswith("dat_hf")
    assert "transformers_modules" in report["model_class"]
    assert "transformers_modules" in report["config_class"]
    assert report["base_class"] == "DATModel"
    assert report["clf_class"] == "DATForSequenceClassification"
    assert report["tagger_class"].endswith(".DATForTokenClassification")
    assert "transformers_modules" in report["tagger_class"]
    # only the model's definition was imported: nothing of dat_hf's saving and loading machinery
    loaded = {name.rsplit(".", 1)[-1] + ".py" for name in report["modules"]}
    assert "modeling_dat.py" in loaded and not loaded & LOCAL_ONLY, report["modules"]


def test_remote_code_saves_and_loads_plainly(remote_run):
    """Without dat_hf the remote code saves with Transformers' `save_pretrained` (no staging or backup folders, no
    journal) and the saved folder loads back to the same model."""
    files = remote_run["report"]["resaved_files"]
    assert not [name for name in files if name.startswith(".dat_hf")], files
    assert {"config.json", "model.safetensors", "modeling_dat.py"} <= set(files)
    assert not set(files) & LOCAL_ONLY
    torch.testing.assert_close(remote_run["results"]["resaved_logits"], remote_run["expected"]["logits"],
                               atol=1e-5, rtol=1e-5)


def test_remote_code_same_outputs(remote_run):
    results, expected = remote_run["results"], remote_run["expected"]
    # (float32: here dat_hf's CPU kernels run, there the PyTorch references, which sum in other orders)
    torch.testing.assert_close(results["logits"], expected["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["hidden"], expected["hidden"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["tags"], expected["tags"], atol=1e-5, rtol=1e-5)
    assert torch.equal(results["generated"], expected["generated"])


def test_remote_code_batches_continuously(remote_run):
    """Continuous batching runs from a folder's code alone (`cache_dat` is remote code): the same tokens as
    `generate`, request by request; on a release whose paged cache differs, the refusal names it."""
    limits = remote_run["report"]["batching_limits"]
    if limits:
        assert limits == [paged_cache_limits()] and paged_cache_limits() is not None
        return
    generated = remote_run["expected"]["generated"]
    assert torch.equal(remote_run["results"]["batched"], generated[:, -5:])


def test_remote_code_pipeline(remote_run, lm_folder):
    report = remote_run["report"]
    assert "transformers_modules" in report["pipeline_model_class"]
    text = report["pipeline_text"]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    _, local_text = run_pipeline(lm_folder)
    assert text == local_text
