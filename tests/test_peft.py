"""LoRA (peft) on DAT's sensory and relational projections, trained with Trainer, saved, reloaded onto a fresh base."""

import pytest
import torch

peft = pytest.importorskip("peft")

from lm_helpers import corpus_file, tokenizer_dir  # noqa: E402

from dat_hf import DATForCausalLM  # noqa: E402
from dat_hf.training import load_preset_config  # noqa: E402

TARGETS = ["q_attn_proj", "k_attn_proj", "q_rel_proj", "k_rel_proj", "symbol_proj", "q_proj", "k_proj", "v_proj",
           "o_proj"]


def test_lora_on_relational_and_sensory_projections(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    from dat_hf.training.text_data import load_text_dataset, tokenize_and_pack

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    data = tokenize_and_pack(load_text_dataset(data_files=[corpus_file()]), tokenizer, block_size=32,
                             max_train_samples=64, max_eval_samples=8)
    torch.manual_seed(0)
    config = load_preset_config("dat-tiny", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_symbols=8, max_position_embeddings=64)
    base = DATForCausalLM(config)
    base.save_pretrained(tmp_path / "base")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    adapted = {name.rsplit(".lora_A", 1)[0].split(".")[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert set(TARGETS) <= adapted  # every sensory and relational projection got an adapter
    relational = [n for n, _ in model.named_modules() if n.endswith("relational.q_rel_proj")]
    assert len(relational) == config.num_hidden_layers
    trainable, total = model.get_nb_trainable_parameters()  # peft's own count
    assert 0 < trainable < 0.2 * total

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8,
                             learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data["train"], data_collator=default_data_collator)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # the adapters were trained (B starts at zero)
    for name, value in model.get_base_model().state_dict().items():  # the base weights were not
        key = name.replace(".base_layer", "")
        if "lora_" not in name and key in base_state:
            assert torch.equal(value, base_state[key]), name

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    batch = torch.tensor(data["validation"]["input_ids"][:4])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch).logits
        fresh = DATForCausalLM.from_pretrained(tmp_path / "base")
        plain = fresh(input_ids=batch).logits
        reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        got = reloaded(input_ids=batch).logits
        merged = reloaded.merge_and_unload()(input_ids=batch).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, expected, atol=1e-4, rtol=1e-4)
    assert (plain - expected).abs().max() > 1e-3  # the adapters change the outputs


def test_lora_on_mlp_down_projection_is_not_bypassed():
    """The MLP's recomputing training path reads `down_proj.weight` directly; a LoRA-wrapped down_proj must take the
    plain path so the adapter is in the forward and gets gradients."""
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_config

    torch.manual_seed(0)
    model = get_peft_model(DATForCausalLM(tiny_config()), LoraConfig(r=2, target_modules=["down_proj"],
                                                                      lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # B starts at zero: make the adapter change the outputs
    model.train()
    x = torch.randint(0, model.config.vocab_size, (2, 6))
    out = model(input_ids=x, labels=x)
    with model.disable_adapter():
        assert not torch.allclose(model(input_ids=x).logits, out.logits)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
