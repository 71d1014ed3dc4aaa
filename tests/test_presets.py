"""Model presets (parameter counts on the meta device, against the published sizes and the authors' `dual_attention`
models) and the Accelerate config files (parsed and validated by Accelerate's own launch code, nothing launched)."""

from pathlib import Path

import pytest
import torch
from lm_helpers import import_script

from dat_hf import DATForCausalLM
from dat_hf.training import list_presets, load_preset_config, preset_metadata

REPO_ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = {"dat-343m": 343e6, "dat-1.27b": 1.27e9, "transformer-353m": 353e6, "transformer-1.31b": 1.31e9}


MATCHED = {"dat-tiny": "transformer-tiny", "dat-small": "transformer-small"}


def test_presets_present():
    assert set(PUBLISHED) | set(MATCHED) | set(MATCHED.values()) <= set(list_presets())


@pytest.mark.parametrize("dat, baseline", sorted(MATCHED.items()))
def test_small_presets_are_matched_in_parameters(dat, baseline):
    """Equal parameters outside the embeddings within 1% (recorded in the presets); the embeddings (tied, vocab_size
    x hidden_size, set by the tokenizer) are the same size on both sides and reported separately."""
    counts = {}
    for name in (dat, baseline):
        config = load_preset_config(name, vocab_size=4096)
        with torch.device("meta"):
            model = DATForCausalLM(config)
        body = model.num_parameters(exclude_embeddings=True)
        assert model.num_parameters() - body == 4096 * config.hidden_size, name
        assert body == preset_metadata(name)["non_embedding_parameters"], name
        counts[name] = (body, config)
    (dat_body, dat_config), (base_body, base_config) = counts[dat], counts[baseline]
    assert abs(dat_body - base_body) / dat_body < 0.01, counts
    assert preset_metadata(dat)["matched_baseline"] == baseline and base_config.num_relational_heads == 0
    assert dat_config.num_attention_heads == base_config.num_attention_heads
    assert (dat_config.hidden_size, dat_config.num_hidden_layers) == (base_config.hidden_size,
                                                                     base_config.num_hidden_layers)


def _meta_count(name):
    config = load_preset_config(name)
    with torch.device("meta"):
        model = DATForCausalLM(config)
    return config, model.num_parameters()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_sizes(name):
    config, n = _meta_count(name)
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.03, f"{name}: {n:,}"
    meta = preset_metadata(name)
    assert meta["published_parameters"] == PUBLISHED[name]
    # exactly the authors' implementation with the same hyperparameters (counted in the test below)
    assert n == meta["reference_parameters"]
    assert config.vocab_size == 50304 and config.num_hidden_layers == 24


def test_matched_baselines_have_the_same_total_heads():
    for dat, baseline in (("dat-343m", "transformer-353m"), ("dat-1.27b", "transformer-1.31b")):
        a, b = load_preset_config(dat), load_preset_config(baseline)
        assert b.num_relational_heads == 0 and a.num_attention_heads == b.num_attention_heads
        assert (a.hidden_size, a.num_hidden_layers, a.intermediate_size) == (b.hidden_size, b.num_hidden_layers,
                                                                              b.intermediate_size)


def _reference_count(d, layers, sa, ra, nkv, ns=None, sh=None, nr=None):
    from dual_attention.language_models import DualAttnTransformerLM, TransformerLM

    common = dict(vocab_size=50304, d_model=d, n_layers=layers, dff=None, dropout_rate=0.0, activation="swiglu",
                  norm_first=True, max_block_size=1024, norm_type="rmsnorm", pos_enc_type="RoPE", bias=False)
    with torch.device("meta"):
        if ra == 0:
            model = TransformerLM(n_heads=sa, block_kwargs=dict(attn_kwargs=dict(n_kv_heads=nkv)), **common)
        else:
            model = DualAttnTransformerLM(
                n_heads_sa=sa, n_heads_ra=ra, symbol_retrieval_kwargs=dict(d_model=d, n_symbols=ns, n_heads=sh),
                sa_kwargs=dict(n_kv_heads=nkv), ra_kwargs=dict(n_kv_heads=nkv, n_relations=nr,
                                                               rel_activation="identity"), **common)
    return sum(p.numel() for p in model.parameters())  # nn.Module: shared (tied) parameters once


def test_reference_parameter_counts_recorded_in_presets():
    pytest.importorskip("dual_attention")
    counts = {
        "dat-343m": _reference_count(1024, 24, 8, 8, 4, ns=1024, sh=8),
        "dat-1.27b": _reference_count(2048, 24, 16, 16, 8, ns=2048, sh=16, nr=128),
        "transformer-353m": _reference_count(1024, 24, 16, 0, None),
        "transformer-1.31b": _reference_count(2048, 24, 32, 0, None),
    }
    for name, n in counts.items():
        assert preset_metadata(name)["reference_parameters"] == n, name


def test_train_help_lists_every_preset(capsys, monkeypatch):
    train = import_script("train_causal_lm")
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps the help at the terminal width (and at hyphens)
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert f"Model preset ({', '.join(list_presets())}; in dat_hf/training/presets/)" in capsys.readouterr().out
    assert len(list_presets()) == len(list((REPO_ROOT / "dat_hf" / "training" / "presets").glob("*.json"))) == 8


def test_tiny_preset_runs():
    config = load_preset_config("dat-tiny", vocab_size=100)
    model = DATForCausalLM(config).eval()
    out = model(input_ids=torch.randint(0, 100, (2, 16)))
    assert out.logits.shape == (2, 16, 100)
    assert model.num_parameters() < 2_000_000


ACCELERATE_CONFIGS = {
    "single_process": "NO",
    "multi_gpu_ddp": "MULTI_GPU",
    "fsdp": "FSDP",
    "deepspeed_zero2": "DEEPSPEED",
    "deepspeed_zero3": "DEEPSPEED",
}


@pytest.mark.parametrize("name", sorted(ACCELERATE_CONFIGS))
def test_accelerate_config_is_accepted(name, monkeypatch):
    """Each file goes through what `accelerate launch --config_file FILE` does before starting processes: the
    config class, the launch-argument validation, the launcher's environment, and the plugin built from it."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    monkeypatch.chdir(REPO_ROOT)  # the DeepSpeed JSON paths are relative to the repository root
    path = f"configs/accelerate/{name}.yaml"
    config = load_config_from_file(path)
    assert isinstance(config, ClusterConfig) and config.distributed_type.value == ACCELERATE_CONFIGS[name]

    args = launch_command_parser().parse_args(["--config_file", path, "scripts/train_causal_lm.py", "--max_steps", "1"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    assert args.training_script == "scripts/train_causal_lm.py"
    if args.use_deepspeed:
        # as `launch_command` does before `deepspeed_launcher`
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        plugin = DeepSpeedPlugin()
        stage = 2 if name.endswith("zero2") else 3
        assert plugin.zero_stage == stage and plugin.deepspeed_config["zero_optimization"]["stage"] == stage
        assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"  # filled by TrainingArguments
        assert plugin.zero3_init_flag == (stage == 3)
    elif args.use_fsdp:
        env = prepare_multi_gpu_env(args)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["DATDecoderLayer"]
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"  # the final model is gathered in full (Trainer)
        from dat_hf.modeling_dat import DATDecoderLayer  # the class to wrap exists

        assert DATDecoderLayer.__name__ in DATForCausalLM._no_split_modules
    elif args.multi_gpu:
        env = prepare_multi_gpu_env(args)
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and args.num_processes == 8
    else:
        cmd, env = prepare_simple_launcher_cmd_env(args)
        assert cmd[-3:] == ["scripts/train_causal_lm.py", "--max_steps", "1"] and args.num_processes == 1


def test_launch_commands_documented():
    docs = (REPO_ROOT / "docs" / "training.md").read_text()
    for name in ACCELERATE_CONFIGS:
        assert f"configs/accelerate/{name}.yaml" in docs, name
    assert "torchrun --nproc_per_node" in docs and "--num_machines 2" in docs and "--nnodes 2" in docs
