"""The seams between dat_hf and Transformers' internals, walked on the installed release: `dat_hf.transformers_compat`
(`INTERNALS`: the model files, kernels and training helpers) and `dat_hf/serve.py` (`SERVER_INTERNALS`: the server).
Each internal exists with the shape dat_hf needs (a failure names the one that moved, the release installed and the
newest tested); one removed by hand stops its feature at the start with that message; DAT's overrides take what
Transformers passes; no module reaches an internal except through its seam. (.ci/run runs this module on the floor,
the tested set and the newest releases.)"""

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from conftest import tiny_config
from packaging.version import Version

import dat_hf
from dat_hf import DATForCausalLM, serve, transformers_compat
from dat_hf.transformers_compat import CB, INTERNALS, TP, TransformersMoved, difference, moved, require

REPO = Path(__file__).resolve().parents[1]
INSTALLED = Version(transformers.__version__).release


def applies(internal) -> bool:
    """Whether dat_hf uses `internal` on the installed release (before its `since`, the feature is refused by
    name: `test_continuous_batching.test_paged_cache_api_of_the_installed_release`)."""
    return Version(internal.since).release <= INSTALLED


@pytest.mark.parametrize("internal", INTERNALS, ids=[internal.name for internal in INTERNALS])
def test_each_internal_of_the_library_seam_is_as_dat_hf_needs_it(internal):
    what = difference(internal)
    if internal.optional or not applies(internal):
        return  # (optional: dat_hf's own fallback runs; not yet: the feature is refused, naming it)
    assert what is None, transformers_compat.moved_message(internal, what)


ENGINE = serve.find_engine()


@pytest.mark.parametrize("internal", [i for i in serve.SERVER_INTERNALS if i.engine in ("both", ENGINE.name)],
                         ids=lambda internal: internal.name)
def test_each_internal_of_the_server_seam_is_as_dat_hf_serve_needs_it(internal):
    what = internal.difference()
    assert what is None, serve.moved_message(internal, what)


def test_the_tables_state_the_tested_releases_once():
    assert serve.TESTED_TRANSFORMERS == transformers_compat.TESTED_TRANSFORMERS == dat_hf.TESTED_TRANSFORMERS
    for checked in (transformers_compat.CHECKED_RELEASES, serve.SERVER_CHECKED_RELEASES):
        assert set(transformers_compat.TESTED_TRANSFORMERS) <= set(checked)
    # every internal is documented: what dat_hf needs of it, who reaches it, a shape or an existence check
    for internal in INTERNALS:
        assert internal.need and internal.used_by and internal.feature in (TP, CB, "generation", "training", "export")
    assert {internal.engine for internal in serve.SERVER_INTERNALS} == {"both", "thread", "process"}


def test_a_removed_internal_stops_its_feature_at_the_start_naming_it(monkeypatch):
    """Tensor parallelism: `shard_param` of Transformers' base style removed -> `require` and the model's load name it
    (the internal, the installed release, the newest tested and the command), before anything is sharded."""
    from transformers.distributed import tensor_parallel

    others = moved(CB)  # (empty, or the floor's refusal of continuous batching)
    monkeypatch.delattr(tensor_parallel.TensorParallelLayer, "shard_param")
    moved.cache_clear()
    try:
        message = "\n".join(moved(TP))
        name = "transformers.distributed.tensor_parallel.TensorParallelLayer.shard_param"
        assert f"`{name}`" in message and f"transformers {transformers.__version__}" in message
        newest = transformers_compat.TESTED_TRANSFORMERS[1]
        assert f"pip install 'transformers=={newest}'" in message
        with pytest.raises(TransformersMoved, match="TensorParallelLayer.shard_param"):
            require(TP)
        model = DATForCausalLM(tiny_config())
        with pytest.raises(TransformersMoved, match="TensorParallelLayer.shard_param"):  # (the load's first step)
            DATForCausalLM.maybe_distribute_model(model, SimpleNamespace(tp_size=2), object())
        assert moved(CB) == others  # (the other features go on)
    finally:
        monkeypatch.undo()
        moved.cache_clear()


def test_a_moved_paged_cache_refuses_continuous_batching_naming_it(monkeypatch):
    from transformers.generation import continuous_batching

    if moved(CB):
        pytest.skip("the installed release's paged cache is not the one DAT uses (its refusal: "
                    "test_continuous_batching.test_paged_cache_api_of_the_installed_release)")

    def update(self, key_states, value_states, layer_idx, read_index, write_index):  # (5.17's form)
        raise AssertionError("never called")

    monkeypatch.setattr(continuous_batching.PagedAttentionCache, "update", update)
    moved.cache_clear()
    try:
        model = DATForCausalLM(tiny_config())
        assert any("PagedAttentionCache.update" in limit for limit in model.continuous_batching_limits())
        with pytest.raises(ValueError, match="its parameters are .*read_index"):
            model.init_continuous_batching()
    finally:
        monkeypatch.undo()
        moved.cache_clear()


def test_a_removed_server_internal_stops_the_server_at_its_start_naming_it(monkeypatch, capsys):
    """The server: a handler method it needs removed -> `hook_server` raises before hooking anything, and
    `python -m dat_hf.serve` exits with that one message (no traceback)."""
    from transformers.cli.serving import utils

    monkeypatch.delattr(utils.BaseHandler, "get_processor_inputs_from_messages")
    with pytest.raises(serve.ServerMoved, match="BaseHandler.get_processor_inputs_from_messages") as moved_error:
        serve.hook_server()
    message = str(moved_error.value)
    assert f"transformers {transformers.__version__}" in message
    assert f"pip install 'transformers=={serve.TESTED_TRANSFORMERS[1]}'" in message
    with pytest.raises(SystemExit) as stopped:
        serve.main(["some-folder"])
    assert "BaseHandler.get_processor_inputs_from_messages" in str(stopped.value.code)


def test_a_release_with_neither_engine_is_named(monkeypatch):
    for engine in serve.ENGINES:
        monkeypatch.setattr(engine, "found_by", engine.found_by + "_moved")
    with pytest.raises(serve.ServerMoved, match="cannot tell how .* runs its model") as moved_error:
        serve.find_engine()
    assert all(f"`{engine.found_by}`" in str(moved_error.value) for engine in serve.ENGINES)


# DAT's overrides of the methods in the table: (the table's name, DAT's method)
OVERRIDES = {
    "transformers.GenerationMixin._prepare_cache_for_generation": "dat_hf.modeling_dat.DATGenerationMixin",
    "transformers.GenerationMixin._get_static_cache_init_shape": "dat_hf.modeling_dat.DATGenerationMixin",
    "transformers.PreTrainedModel.init_parallel_plans": "dat_hf.modeling_dat.DATPreTrainedModel",
    "transformers.PreTrainedModel.maybe_distribute_model": "dat_hf.modeling_dat.DATPreTrainedModel",
    "transformers.GenerationMixin.init_continuous_batching": "dat_hf.modeling_dat.DATGenerationMixin",
    "transformers.PreTrainedModel._can_set_attn_implementation": "dat_hf.modeling_dat_seq2seq.DATSeq2SeqPreTrainedModel",
    "transformers.Trainer._save_checkpoint": "dat_hf.training.trainer.AtomicCheckpointMixin",
    "transformers.Trainer._save": "dat_hf.training.trainer.FSDPModelSaveMixin",
    "transformers.Trainer._issue_warnings_after_load": "dat_hf.training.trainer.ResumeMixin",
}


@pytest.mark.parametrize("name", OVERRIDES)
def test_dat_overrides_take_what_transformers_passes(name):
    """Each method DAT overrides is in the table, and DAT's override takes the parameters the table says Transformers
    passes (a release that renames one fails here, not as an override silently never called)."""
    import pkgutil

    internal = next(internal for internal in INTERNALS if internal.name == name)
    owner = pkgutil.resolve_name(OVERRIDES[name])
    method = name.rpartition(".")[2]
    assert method in vars(owner), f"{owner.__name__} no longer overrides {method}"
    ours = list(inspect.signature(getattr(owner, method)).parameters)
    assert ours[:len(internal.parameters)] == list(internal.parameters), (name, ours)


# internals a module reaches only through its seam: (an import of a module under these, where it may be)
SEAM_ONLY = {"transformers.distributed.tensor_parallel": "transformers_compat.py",
             "transformers.generation.continuous_batching": "transformers_compat.py",
             "transformers.cli": "serve.py"}


def test_internals_are_reached_only_through_the_seams():
    """No module of dat_hf imports the tensor-parallel styles, continuous batching or the server's modules except its
    seam, and only the seam reads `config._attn_implementation` (Transformers' mask builders' stand-in config sets
    it)."""
    reached = []
    for path in sorted((REPO / "dat_hf").rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                for internal, seam in SEAM_ONLY.items():
                    if (module == internal or module.startswith(internal + ".")) and path.name != seam:
                        reached.append(f"{path.relative_to(REPO)}:{node.lineno} imports {module}")
            if (isinstance(node, ast.Attribute) and node.attr == "_attn_implementation"
                    and isinstance(node.ctx, ast.Load) and path.name != "transformers_compat.py"):
                reached.append(f"{path.relative_to(REPO)}:{node.lineno} reads `._attn_implementation`")
    assert not reached, "\n".join(reached)


def test_the_server_hooks_what_its_engine_offers():
    """Once hooked, each entry of the engine is wrapped once (hooking again changes nothing), and the table's checks
    see Transformers' own objects through the hooks."""
    serve.hook_server()
    from transformers.cli.serving import completion

    hooked = completion.CompletionHandler.handle_request
    assert hooked.dat_hf_hook and inspect.unwrap(hooked) is not hooked
    serve.hook_server()
    assert completion.CompletionHandler.handle_request is hooked
    assert all(internal.difference() is None for internal in serve.SERVER_INTERNALS
               if internal.engine in ("both", ENGINE.name))
