"""Tensor parallelism (`DistributedConfig(tp_plan="auto")`, `dat_hf/tensor_parallel_dat.py`): the plans of every
family, and 2 processes (`torchrun`, gloo, CPU) against one: logits, a training step (loss, every gradient, SGD),
greedy `generate` with the cache, `save_pretrained` of the sharded model reloaded in one process; the remote code's
path (each projection through its TP style) against the installed kernel's (one local product per layer's input)."""

import json
import sys

import pytest
import torch
from lm_helpers import REPO_ROOT, run_group, subprocess_env

from dat_hf import (DATConfig, DATForCausalLM, DATForImageClassification, DATForSeq2SeqLM, DATSeq2SeqConfig,
                    DATVisionConfig)
from dat_hf.tensor_parallel_dat import ALL_PARALLEL_STYLES, GATHER_STYLE, HEADS_STYLE, plan_rule

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_symbols=8, symbolic_attention_heads=2, intermediate_size=96)

# name -> (model class, config): the causal LM's default, GQA, sliding window, position-relative symbols, and the
# options that drop projections (shared attention parameters, symmetric relations, an ungated MLP); seq2seq with
# dual cross-attention; vision
VARIANTS = {
    "default": (DATForCausalLM, lambda: DATConfig(vocab_size=96, num_sensory_heads=2, num_relational_heads=2,
                                                  **SMALL)),
    "gqa": (DATForCausalLM, lambda: DATConfig(vocab_size=96, num_sensory_heads=4, num_relational_heads=4,
                                              num_sensory_key_value_heads=2, num_relational_key_value_heads=2, **SMALL)),
    "window": (DATForCausalLM, lambda: DATConfig(vocab_size=96, num_sensory_heads=2, num_relational_heads=2,
                                                 relational_bias="sliding_window", sliding_window_size=4, **SMALL)),
    "relative": (DATForCausalLM, lambda: DATConfig(vocab_size=96, num_sensory_heads=2, num_relational_heads=2,
                                                   symbol_retrieval="position_relative", max_relative_position=4,
                                                   **SMALL)),
    "shared-symmetric-gelu": (DATForCausalLM, lambda: DATConfig(
        vocab_size=96, num_sensory_heads=2, num_relational_heads=2, share_attention_params=True,
        symmetric_relations=True, hidden_act="gelu", relation_activation="relu", **SMALL)),
    # widths 2 ranks split unevenly (vocabulary, MLP, relation projections of 3 x 5), every bias, post-norm, positional
    # symbols
    "uneven-biases-postnorm": (DATForCausalLM, lambda: DATConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
        num_relations=3, relation_dim=5, intermediate_size=95, attention_bias=True, attention_out_bias=True,
        mlp_bias=True, pre_norm=False, symbol_retrieval="positional", hidden_act="gelu")),
    "seq2seq": (DATForSeq2SeqLM, lambda: DATSeq2SeqConfig(
        vocab_size=96, num_sensory_heads=2, num_relational_heads=2, encoder_layers=2, cross_attention="dual",
        decoder_start_token_id=0, pad_token_id=0, **SMALL)),
    "vision": (DATForImageClassification, lambda: DATVisionConfig(num_sensory_heads=2, num_relational_heads=2,
                                                                  image_size=8, patch_size=4, num_labels=3, **SMALL)),
    # one key/value head per head type: 2 ranks cannot each hold whole heads
    "kv1": (DATForCausalLM, lambda: DATConfig(vocab_size=96, num_sensory_heads=2, num_relational_heads=2,
                                              num_sensory_key_value_heads=1, num_relational_key_value_heads=1,
                                              **SMALL)),
}


def save_variant(name, path):
    torch.manual_seed(0)
    model_class, config = VARIANTS[name]
    model_class(config()).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "kv1"])
def test_plan_names_every_layer_projection_and_nothing_else(name):
    """The config's plan (`base_model_tp_plan`, declared as Llama's, plus the head's `_tp_plan`) shards every
    projection of every layer, and each rule the model keeps names a module or parameter of it (Transformers warns
    about rules that match nothing): the rules for modules a variant lacks are dropped, the others kept."""
    model_class, config = VARIANTS[name]
    config = config()
    model = model_class(config)
    plan = model.tp_plan
    names = {plan_rule(n) for n, _ in [*model.named_modules(), *model.named_parameters()]}
    assert set(plan) <= names, sorted(set(plan) - names)
    # (the rules of dat_hf's plan; Transformers 5.17 adds an `embed_tokens` rule to the plan of every tied config)
    own = {f"{model.base_model_prefix}.{rule}" for rule in config.base_model_tp_plan} | set(model_class._tp_plan or {})
    assert own & names <= set(plan), sorted(own & names - set(plan))
    if name == "shared-symmetric-gelu":  # (no sensory q/k, no k_rel_proj, no MLP gate: their rules dropped)
        assert {"model.layers.*.mlp.gate_proj", "model.layers.*.dual_attn.relational.k_rel_proj"} <= own - set(plan)
    projections = {plan_rule(n).removesuffix(".weight") for n, _ in model.named_parameters()
                   if ".layers." in n and (n.endswith("proj.weight") or n.endswith("relation_proj"))}
    assert projections and projections <= set(plan), sorted(projections - set(plan))
    styles = {rule.rsplit(".", 1)[-1]: style for rule, style in plan.items()}
    assert styles.get("relation_proj", HEADS_STYLE) == HEADS_STYLE
    assert styles.get("q_rel_proj", GATHER_STYLE) == GATHER_STYLE
    assert styles["o_proj"] == styles["down_proj"] == "rowwise"


def test_installed_projection_kernel_splits_a_rank_rows_by_part():
    """`dat_hf.kernels.tensor_parallel`, the kernel of `project_fused` (the 2-process test checks its values against
    the reference's): taken for sharded projections only; one rank's local product split by part, from the widths the
    reference's outputs have (colwise: the rank's heads; `dat_gather`: the whole relations, 3 x 5 over 2 ranks)."""
    from dat_hf.dual_attention import head_linears
    from dat_hf.kernel_hooks import registered_kernels
    from dat_hf.kernels import tensor_parallel

    assert registered_kernels("project_fused") == [tensor_parallel.sharded_projections]
    attn = DATForCausalLM(VARIANTS["uneven-biases-postnorm"][1]()).model.layers[0].dual_attn
    sen, rel = attn.sensory, attn.relational
    assert not tensor_parallel.accepts_sharded(attn.input_projections, sen, rel, None)
    for heads in (sen, rel):  # rank 0 of 2 (`use_local_heads`)
        heads.num_heads //= 2
        heads.num_kv_heads //= 2
    attn.plan_projections()
    fused = attn.input_projections
    linears = head_linears(sen, rel, fused.projections)
    weights = [torch.empty(-(-linear.out_features // 2), 1) for linear in linears]  # rank 0's rows
    assert fused.widths == (4 * 16, 16, 15, 15)
    assert tensor_parallel.local_widths(fused, sen, rel, linears, weights) == [4 * 16, 16, 8, 8]


def test_continuous_batching_refuses_a_tensor_parallel_model():
    model = DATForCausalLM(VARIANTS["default"][1]())
    model._tp_size = 2
    with pytest.raises(ValueError, match="tensor-parallel DAT model"):
        model.init_continuous_batching()


def user_plan(plan: dict, replicated: str) -> dict:
    """A user's plan (`DistributedConfig(tp_plan=...)`) that leaves the rules containing `replicated` unsharded."""
    if "replicate" in ALL_PARALLEL_STYLES:  # (Transformers 5.24: the rules override the model's)
        return {rule: "replicate" for rule in plan if replicated in rule}
    return {rule: style for rule, style in plan.items() if replicated not in rule}  # (5.17: the plan replaces it)


def refused_variants() -> set:
    """Variants the installed Transformers refuses to shard: before 5.24 (no `transformers.distributed.parallel_utils`)
    Transformers' own check wants every sharded width divisible by tp_size."""
    try:
        import transformers.distributed.parallel_utils  # noqa: F401
    except ImportError:
        return {"uneven-biases-postnorm"}
    return set()


@pytest.mark.integration
def test_two_processes_match_one(tmp_path):
    """The model's plan over 2 ranks against one process, for every variant; users' plans that leave attention, or
    the relational heads only, replicated; a head count 2 ranks cannot split is refused by name; the default model in
    a 2-stage pipeline instead (`DistributedConfig(pp_size=2)`), and loaded with the deprecated `tp_plan="auto"`."""
    specs = [save_variant(name, tmp_path / name) + ("!" if name in refused_variants() else "")
             for name in VARIANTS if name != "kv1"]
    config = DATConfig(vocab_size=96, num_sensory_heads=2, num_relational_heads=2, **SMALL)
    plan = DATForCausalLM(config).tp_plan
    for replicated in (".dual_attn.", ".relational."):
        plan_file = tmp_path / f"replicated{replicated.replace('.', '-')}json"
        plan_file.write_text(json.dumps(user_plan(plan, replicated)))
        specs.append(f"{specs[0]}@{plan_file}")
    specs.append(save_variant("kv1", tmp_path / "kv1") + "!")
    specs.append(f"{specs[0]}|pp")
    specs.append(f"{specs[0]}|legacy")  # (`tp_plan="auto"`, deprecated by Transformers, still taken)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / "tests" / "workers" / "tp_check.py"), str(out), *specs]
    proc = run_group(cmd, timeout=300, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] or all(a["folder"] == b["folder"] for a, b in zip(*ranks))
    for result in ranks[0] + ranks[1]:
        name = result["folder"]
        if name == "kv1":
            assert result["error"] is not None and "tp_size=2" in result["error"], result
            assert "1 key/value heads" in result["error"], result
            continue
        if name.endswith("|legacy"):
            assert result["logits_diff"] < 1e-5 and result["sharded_weights"] > 0, result
            continue
        if name.endswith("|pp"):  # each rank holds half of the layers (Transformers' naive pipeline)
            assert result["logits_diff"] < 1e-5, result
            assert result["layers"].count("DATDecoderLayer") == 1 and "PipelineIdentityLayer" in result["layers"]
            continue
        if name in refused_variants():
            assert result["error"] is not None and "must be divisible by the tensor parallel size" in result["error"]
            continue
        assert result["tp_size"] == 2, result
        if "@" in name:  # attention, or the relational heads, replicated
            assert 0 < result["sharded_weights"] < result["projection_weights"], result
        else:
            assert result["sharded_weights"] == result["projection_weights"] > 0, result
            assert result["kernel_calls"] > 0, result  # (so the remote code's path below is another path)
        assert max(result["remote_logits_diff"], result["remote_loss_diff"], result["remote_grad_diff"]) < 1e-5, result
        assert result["logits_diff"] < 1e-5, result
        assert result["loss_diff"] < 1e-5 and result["grad_diff"] < 1e-5 and not result["grads_missing"], result
        assert result["step_logits_moved"] > 1e-2 and result["step_logits_diff"] < 1e-5, result
        assert result.get("generate_equal", True), result
        assert result["reload_diff"] < 1e-5, result
