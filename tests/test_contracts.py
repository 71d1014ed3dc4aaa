"""The ops that take over a whole step meet the model through explicit contracts (`dat_hf/kernels/contracts.py`):

- every field of every DAT config is classified for every op (a new field fails here, named, until it is);
- a field's value an op declines keeps that op away (the layer computes the step part by part, with the same tokens
  and scores), and the op's spec names the field;
- a module the op has not seen (a PEFT adapter, a hook, a replaced or re-bound module, a bias it does not read) keeps it
  away too, also when the change comes after the op has run;
- no module of dat_hf writes another object's `_`-attributes (the kernels reach cache layers, layers and plans
  through public methods).
"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import set_kernels_aside, tiny_config
from torch import nn

from dat_hf import DATForCausalLM
from dat_hf.attention_plan import AttentionPlan
from dat_hf.configuration_dat import DualAttentionConfig
from dat_hf.kernel_hooks import BACKENDS
from dat_hf.kernels import contracts
from dat_hf.kernels import cpu as kernel
from dat_hf.masking_dat import AttentionMask

REPO = Path(__file__).resolve().parents[1]
OPS = {"layer_step": "layer_step_op", "dual_attention_step": "decoding_step_op"}  # (the step ops and their C++ ops)


def config_classes() -> list:
    """Every DAT config class (`DualAttentionConfig` and its subclasses, those `import dat_hf` registers)."""
    found, todo = [], [DualAttentionConfig]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def test_every_config_field_is_classified_for_every_op():
    """A field a DAT config gains fails here until `contracts.FIELDS` says, for every op, whether it covers the field
    (computes any value), never reads it, checks it per call, or runs only for some values."""
    fields = {}
    for cls in config_classes():  # (a field named with the class that first has it: the base before subclasses)
        fields.update({field.name: cls.__name__ for field in dataclasses.fields(cls) if field.name not in fields})
    unclassified = sorted(f"{cls}.{name}" for name, cls in fields.items() if name not in contracts.FIELDS)
    assert not unclassified, (
        f"config fields no op's contract classifies: {unclassified}; add each to `FIELDS` in "
        "dat_hf/kernels/contracts.py (COVERED, OUTSIDE, PER_CALL, or {op: Requires(...)}), and give a declined value "
        "a case in tests/test_contracts.py's DECLINED")
    stale = set(contracts.FIELDS) - set(fields)
    assert not stale, f"FIELDS names fields no config has: {stale}"
    kinds = (contracts.COVERED, contracts.OUTSIDE, contracts.PER_CALL)
    for name, entry in contracts.FIELDS.items():
        rules = entry.values() if isinstance(entry, dict) else [entry]
        assert not isinstance(entry, dict) or set(entry) <= set(contracts.OPS), name
        assert all(rule in kinds or isinstance(rule, contracts.Requires) for rule in rules), name


def test_every_op_says_what_it_computes():
    """Each op has its module types, what it reads of them and a registered function; the `cpu` backend's call
    carries every field the table rules on for it."""
    assert set(contracts.MODULE_TYPES) == set(contracts.OPS)
    for op, types in contracts.MODULE_TYPES.items():
        if types is not None:
            assert op in contracts.READS and contracts.ROOTS[op] in types, op
    functions = {"layer_step": kernel.cpu_layer_step, "dual_attention_step": kernel.cpu_decoding_step,
                 "symbolic_attention": kernel.cpu_symbolic_attention}
    for op, function in functions.items():
        assert [backend.function for backend in BACKENDS.of(op).values()] == [function]
    ruled = {field for field, entry in contracts.FIELDS.items()
             if isinstance(entry, dict) and isinstance(entry.get("cpu_relational"), contracts.Requires)}
    assert ruled == set(kernel.CALL_FIELDS)


# a value each `Requires` rule declines (a new rule fails `test_every_declined_value_has_a_case` until it has one)
DECLINED = {
    "num_sensory_heads": 0,
    "num_relational_heads": 0,
    "relation_activation": "relu",
    "share_attention_params": True,
    "symbol_retrieval": "position_relative",
    "hidden_act": "gelu",
    "norm_type": "layernorm",
    "pre_norm": False,
    "attention_bias": True,
    "mlp_bias": True,
}


def test_every_declined_value_has_a_case():
    ruled = {field for field, entry in contracts.FIELDS.items()
             if isinstance(entry, dict) and any(isinstance(rule, contracts.Requires) for rule in entry.values())}
    assert ruled == set(DECLINED)
    for field, value in DECLINED.items():
        for op, rule in contracts.FIELDS[field].items():
            assert not rule.takes(value), (field, op)


def model_of(**overrides):
    torch.manual_seed(0)
    return DATForCausalLM(tiny_config(initializer_range=0.2, **overrides)).eval()


def generate_counting(model, ids, monkeypatch, aside=False):
    """Greedy tokens and scores of 5 new tokens, and {op: its C++ op's calls} (the step ops set aside with `aside`)."""
    calls = {op: [] for op in OPS}
    with monkeypatch.context() as patch, torch.no_grad():
        for op, name in OPS.items():
            original = getattr(kernel, name)
            patch.setattr(kernel, name, lambda *args, _o=original, _c=calls[op]: _c.append(1) or _o(*args))
        if aside:
            set_kernels_aside(patch, tuple(OPS))
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.scores), {op: len(c) for op, c in calls.items()}


def assert_same_as_part_by_part(model, ids, monkeypatch):
    """Generation equals the layers computed part by part -> the step ops' call counts."""
    tokens, scores, calls = generate_counting(model, ids, monkeypatch)
    expected_tokens, expected_scores, aside = generate_counting(model, ids, monkeypatch, aside=True)
    assert aside == {op: 0 for op in OPS}
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)
    return calls


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def test_the_ops_run_a_model_they_compute(ids, monkeypatch):
    calls = assert_same_as_part_by_part(model_of(), ids, monkeypatch)
    assert calls["layer_step"] == 2 * 4 and calls["dual_attention_step"] == 0  # (2 layers, 4 decoding steps)


@pytest.mark.parametrize("field", sorted(DECLINED))
def test_a_declined_value_keeps_the_op_away(field, ids, monkeypatch):
    """A config with a value an op declines: that op never runs, its spec names the field, and generation is the
    layer's computed part by part (an op that covers the field may still run)."""
    model = model_of(**{field: DECLINED[field]})
    calls = assert_same_as_part_by_part(model, ids, monkeypatch)
    layer = model.model.layers[0]
    for op, module in (("layer_step", layer), ("dual_attention_step", layer.dual_attn)):
        if isinstance(contracts.rule(field, op), contracts.Requires):
            assert calls[op] == 0, (op, calls)
            assert f"`{field}=" in contracts.spec(op, module).declines
    if field == "hidden_act":  # (the layer op declines, the dual attention's op covers it)
        assert calls["dual_attention_step"] == 2 * 4


@pytest.mark.parametrize("field", sorted(f for f, e in contracts.FIELDS.items()
                                         if isinstance(e, dict) and "cpu_relational" in e))
def test_a_declined_value_keeps_the_cpu_backend_away(field):
    """The `cpu` relational backend is not planned for a config value the table declines for it, and says why."""
    if "cpu" not in BACKENDS.of("relational"):
        pytest.skip("the CPU kernel is not built here")
    config = tiny_config(**{field: DECLINED[field]})
    x = torch.zeros(1, 1, config.hidden_size)
    with torch.no_grad():
        plan = AttentionPlan.build({"causal": AttentionMask(None, None, True)}, config, x)
    assert plan.relational["causal"].name != "cpu"
    assert f"`{field}=" in kernel.supports_cpu(plan.relational["causal"].call)


# ---- modules the ops have not seen ---------------------------------------------------------------------------------
def lora_wrapped(model, target: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    return get_peft_model(model, LoraConfig(r=2, target_modules=[target], init_lora_weights=False)).eval()


@pytest.mark.parametrize("target", ["q_rel_proj", "o_proj", "gate_proj"])
def test_a_lora_adapter_keeps_the_ops_away(target, ids, monkeypatch):
    """A projection wrapped by PEFT (a LoRA adapter the ops do not compute) changes the output; the ops that would
    read it decline (the spec names the wrapper), and generation is the wrapped layer's."""
    plain = generate_counting(model_of(), ids, monkeypatch)[1]
    model = lora_wrapped(model_of(), target)
    calls = assert_same_as_part_by_part(model, ids, monkeypatch)
    assert not torch.allclose(generate_counting(model, ids, monkeypatch)[1], plain)  # (the adapter acts)
    layer = model.base_model.model.model.layers[0]
    assert calls["layer_step"] == 0
    assert "does not compute a" in contracts.spec("layer_step", layer).declines
    assert calls["dual_attention_step"] == (2 * 4 if target == "gate_proj" else 0)


def test_changes_after_the_ops_ran_keep_them_away(ids, monkeypatch):
    """The spec is decided again when a layer changes after the ops ran: a forward hook (a steering vector), a
    replaced projection with a bias the op does not read, an instance `forward` (as Accelerate's hooks set), a module
    written straight into `_modules` (then `contracts.refresh()`); undone, the ops run again."""
    model = model_of()
    layer = model.model.layers[1]
    assert assert_same_as_part_by_part(model, ids, monkeypatch)["layer_step"] == 8

    steer = torch.randn(layer.mlp.down_proj.out_features)
    hook = layer.mlp.register_forward_hook(lambda module, args, output: output + steer)
    calls = assert_same_as_part_by_part(model, ids, monkeypatch)
    assert calls == {"layer_step": 4, "dual_attention_step": 4}  # (layer 1's op: its dual attention's)
    assert "has a hook" in contracts.spec("layer_step", layer).declines
    hook.remove()
    assert assert_same_as_part_by_part(model, ids, monkeypatch)["layer_step"] == 8

    original = layer.mlp.down_proj
    layer.mlp.down_proj = nn.Linear(original.in_features, original.out_features, bias=True)
    assert assert_same_as_part_by_part(model, ids, monkeypatch)["layer_step"] == 4
    assert "does not read `mlp.down_proj.bias`" in contracts.spec("layer_step", layer).declines
    layer.mlp.down_proj = original

    o_proj = layer.dual_attn.relational.o_proj
    o_proj.forward = lambda x, _forward=o_proj.forward: 2 * _forward(x)
    assert assert_same_as_part_by_part(model, ids, monkeypatch) == {"layer_step": 4, "dual_attention_step": 0}
    del o_proj.forward
    assert assert_same_as_part_by_part(model, ids, monkeypatch)["layer_step"] == 8

    layer.mlp._modules["up_proj"] = nn.Sequential(layer.mlp.up_proj)  # (bypasses torch's registration hooks)
    contracts.refresh()
    assert assert_same_as_part_by_part(model, ids, monkeypatch)["layer_step"] == 4


# ---- public contracts only ---------------------------------------------------------------------------------------
def private_writes(path: Path) -> list[str]:
    """Assignments in `path` to another object's `_`-attribute (not `self`/`cls`, not a class or function the file
    defines): `x._a = ...`, `x._a += ...`, `x.__dict__["_a"] = ...`, `x._modules[...] = ...` (and `_parameters`,
    `_buffers`), `setattr(x, "_a", ...)`."""
    tree = ast.parse(path.read_text())
    own = {"self", "cls"} | {node.name for node in ast.walk(tree)
                             if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}

    def foreign(node) -> bool:
        return not (isinstance(node, ast.Name) and node.id in own)

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_") and foreign(node.args[0])):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for sub in _elements(target):
                private = (isinstance(sub, ast.Attribute) and sub.attr.startswith("_") and not sub.attr.startswith("__")
                           and foreign(sub.value))
                into_dict = (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute)
                             and sub.value.attr in ("__dict__", "_modules", "_parameters", "_buffers")
                             and foreign(sub.value.value))
                if private or into_dict:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(sub)}")
    return found


def _elements(target):
    """The assigned expressions of a target (a tuple's elements)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _elements(element)
    elif isinstance(target, ast.Starred):
        yield from _elements(target.value)
    else:
        yield target


def test_no_module_writes_another_objects_private_state():
    found = [line for path in sorted((REPO / "dat_hf").rglob("*.py")) for line in private_writes(path)]
    assert not found, "writes to another object's `_`-attributes (use or add a public method):\n" + "\n".join(found)


def test_the_private_write_check_finds_each_form(tmp_path):
    sample = REPO / "tests" / "_private_write_sample.py"
    sample.write_text("class Own:\n    pass\n\n\ndef f(layer, model):\n    layer._length = 1\n    layer._n += 1\n"
                      "    model.__dict__['_plan'] = 2\n    model._modules['x'] = 3\n    setattr(layer, '_y', 4)\n"
                      "    Own._registered = 5\n    f._tag = 6\n    layer.public = 7\n")
    try:
        found = private_writes(sample)
    finally:
        sample.unlink()
    assert [line.split(": ", 1)[1] for line in found] == [
        "layer._length", "layer._n", "model.__dict__['_plan']", "model._modules['x']", "setattr(layer, '_y', 4)"]
