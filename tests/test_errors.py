"""Invalid configs and inputs raise a ValueError whose message names the problem (one test each)."""

import json

import pytest
import torch

from conftest import tiny_config
from dat_hf import DATConfig, DATForCausalLM, DATForSequenceClassification, DATModel
from dat_hf.transformers_compat import output_cache

# ---- configs ----------------------------------------------------------------------------------------------------


def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"`hidden_size` \(30\) must be divisible by the total number of heads"):
        tiny_config(hidden_size=30)  # 2 + 2 heads


def test_no_heads_at_all():
    with pytest.raises(ValueError, match=r"num_sensory_heads.*num_relational_heads.*at least 1"):
        tiny_config(num_sensory_heads=0, num_relational_heads=0)


def test_negative_head_count():
    with pytest.raises(ValueError, match=r"`num_sensory_heads` must be a non-negative integer"):
        tiny_config(num_sensory_heads=-2, num_relational_heads=6)


def test_unknown_symbol_retrieval():
    with pytest.raises(ValueError, match=r"`symbol_retrieval` must be one of .*'symbolic_attention'.*'banana'"):
        tiny_config(symbol_retrieval="banana")


def test_unknown_position_embedding_type():
    with pytest.raises(ValueError, match=r"`position_embedding_type` must be one of .*'alibi'"):
        tiny_config(position_embedding_type="alibi")


def test_unknown_norm_type():
    with pytest.raises(ValueError, match=r"`norm_type` must be one of .*'batchnorm'"):
        tiny_config(norm_type="batchnorm")


def test_unknown_relation_activation():
    with pytest.raises(ValueError, match=r"`relation_activation` must be one of .*'softplus'"):
        tiny_config(relation_activation="softplus")


def test_unknown_hidden_act():
    with pytest.raises(ValueError, match=r"`hidden_act` must be one of .*'mish'"):
        tiny_config(hidden_act="mish")


def test_relational_kv_heads_not_dividing_heads():
    message = r"`num_relational_heads` \(2\) must be divisible by `num_relational_key_value_heads` \(3\)"
    with pytest.raises(ValueError, match=message):
        tiny_config(num_relational_key_value_heads=3)


def test_sensory_kv_heads_not_dividing_heads():
    message = r"`num_sensory_heads` \(2\) must be divisible by `num_sensory_key_value_heads` \(3\)"
    with pytest.raises(ValueError, match=message):
        tiny_config(num_sensory_key_value_heads=3)


def test_share_attention_params_with_unequal_heads():
    with pytest.raises(ValueError, match=r"share_attention_params.*num_sensory_heads.*num_relational_heads.*1 != 3"):
        tiny_config(share_attention_params=True, num_sensory_heads=1, num_relational_heads=3)


def test_share_attention_params_with_unequal_kv_heads():
    with pytest.raises(ValueError, match=r"share_attention_params.*key_value_heads"):
        tiny_config(share_attention_params=True, num_relational_key_value_heads=1)


def test_relational_bias_list_of_wrong_length():
    with pytest.raises(ValueError, match=r"`relational_bias` has 3 entries but `num_hidden_layers` is 2"):
        tiny_config(relational_bias=["causal", "causal", "causal"])


def test_unknown_relational_bias():
    with pytest.raises(ValueError, match=r"`relational_bias` entries must be in .*'zigzag'"):
        tiny_config(relational_bias="zigzag")


def test_unknown_relational_bias_in_list():
    with pytest.raises(ValueError, match=r"`relational_heads_bias` entries must be in .*'zigzag'"):
        tiny_config(relational_heads_bias=["causal", "zigzag"])


def test_bidirectional_bias_in_causal_lm():
    with pytest.raises(ValueError, match=r"`relational_bias`='full' is not allowed for `dat` models"):
        tiny_config(relational_bias="full")


def test_sliding_window_without_size():
    with pytest.raises(ValueError, match=r"'sliding_window' needs `sliding_window_size`"):
        tiny_config(relational_bias="sliding_window")


def test_sparse_without_block_or_edges():
    with pytest.raises(ValueError, match=r"'sparse' needs `sparse_block_size` or `sparse_edges`"):
        tiny_config(relational_bias="sparse")


def test_sparse_edges_malformed():
    with pytest.raises(ValueError, match=r"`sparse_edges` entries must be \[receiver, sender\]"):
        tiny_config(relational_bias="sparse", sparse_edges=[[0, 1, 2]])


@pytest.mark.parametrize("field", ["attention_dropout", "hidden_dropout", "embedding_dropout", "symbol_dropout"])
def test_negative_dropout(field):
    with pytest.raises(ValueError, match=rf"`{field}` must be a probability in \[0, 1\), got -0.1"):
        tiny_config(**{field: -0.1})


def test_dropout_of_one():
    with pytest.raises(ValueError, match=r"`hidden_dropout` must be a probability"):
        tiny_config(hidden_dropout=1.0)


def test_rope_with_odd_head_dim():
    with pytest.raises(ValueError, match=r"RoPE needs an even head dimension"):
        tiny_config(hidden_size=36)  # 4 heads of 9


def test_num_relations_not_dividing():
    with pytest.raises(ValueError, match=r"`num_relations` \(3\) must divide"):
        tiny_config(num_relations=3)  # 2 heads * 8 = 16 not divisible by 3


def test_symbolic_attention_heads_not_dividing_hidden_size():
    with pytest.raises(ValueError, match=r"divisible by `symbolic_attention_heads` \(3\)"):
        tiny_config(symbolic_attention_heads=3)


def test_tie_symbol_library_with_relative_symbols():
    with pytest.raises(ValueError, match=r"`tie_symbol_library` is not available with .*position_relative"):
        tiny_config(tie_symbol_library=True, shared_symbol_retriever=False, symbol_retrieval="position_relative")


@pytest.mark.parametrize("field,value", [("vocab_size", 0), ("hidden_size", -32), ("num_hidden_layers", 0),
                                         ("max_position_embeddings", 0), ("intermediate_size", 0)])
def test_non_positive_sizes(field, value):
    with pytest.raises(ValueError, match=rf"`{field}` must be a positive integer, got {value}"):
        tiny_config(**{field: value})


def test_invalid_config_json_is_rejected_on_load(tmp_path):
    config = tiny_config().to_dict()
    config["norm_type"] = "groupnorm"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"`norm_type` must be one of"):
        DATConfig.from_pretrained(tmp_path)


# ---- forward inputs ---------------------------------------------------------------------------------------------


def make(**overrides):
    torch.manual_seed(0)
    return DATForCausalLM(tiny_config(**overrides)).eval()


def ids(batch=2, length=5):
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(0))


def test_sequence_longer_than_learned_positions():
    model = make(position_embedding_type="learned", max_position_embeddings=8)
    model(ids(1, 8))  # exactly the limit is fine
    message = r"Position 8 is out of range for the learned positions.*`max_position_embeddings` = 8"
    with pytest.raises(ValueError, match=message):
        model(ids(1, 9))


def test_cache_growing_past_learned_positions():
    model = make(position_embedding_type="learned", max_position_embeddings=8)
    out = model(ids(1, 6), use_cache=True)
    out = model(ids(1, 2), cache=output_cache(out), use_cache=True)
    with pytest.raises(ValueError, match=r"out of range for the learned positions.*`max_position_embeddings` = 8"):
        model(ids(1, 1), cache=output_cache(out), use_cache=True)


def test_sequence_longer_than_positional_symbols():
    model = make(symbol_retrieval="positional", max_symbol_positions=4)
    with pytest.raises(ValueError, match=r"out of range for the positional symbols.*`max_symbol_positions` = 4"):
        model(ids(1, 5))


def test_wrong_attention_mask_shape():
    model = make()
    message = r"`attention_mask` must have shape \[batch, past \+ seq_len\] = \[2, 5\].*got \[2, 4\]"
    with pytest.raises(ValueError, match=message):
        model(ids(2, 5), attention_mask=torch.ones(2, 4, dtype=torch.long))


def test_attention_mask_wrong_batch():
    model = make()
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape .*got \[1, 5\]"):
        model(ids(2, 5), attention_mask=torch.ones(1, 5, dtype=torch.long))


def test_attention_mask_not_covering_cache():
    model = make()
    out = model(ids(1, 4), use_cache=True)
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape \[batch, past \+ seq_len\] = \[1, 5\]"):
        model(ids(1, 1), cache=output_cache(out), attention_mask=torch.ones(1, 1, dtype=torch.long))


def test_both_input_ids_and_inputs_embeds():
    model = make()
    x = ids(1, 3)
    with pytest.raises(ValueError, match=r"exactly one of `input_ids` or `inputs_embeds`"):
        model(input_ids=x, inputs_embeds=model.get_input_embeddings()(x))


def test_neither_input_ids_nor_inputs_embeds():
    model = make()
    with pytest.raises(ValueError, match=r"exactly one of `input_ids` or `inputs_embeds`"):
        model(attention_mask=torch.ones(1, 3, dtype=torch.long))


def test_input_ids_of_wrong_rank():
    model = make()
    with pytest.raises(ValueError, match=r"`input_ids` must be a tensor of shape \[batch, seq_len\], got shape \[5\]"):
        model(ids(1, 5)[0])


def test_position_ids_of_wrong_length():
    model = make()
    with pytest.raises(ValueError, match=r"`position_ids` must be of shape \[batch, seq_len\] = \[1, 5\].*got shape \[1, 4\]"):
        model(ids(1, 5), position_ids=torch.arange(4)[None])


def test_graph_bias_without_adjacency():
    model = make(relational_bias="graph")
    with pytest.raises(ValueError, match=r"`relational_bias='graph'` needs `graph_adjacency`"):
        model(ids(1, 4))


def test_graph_adjacency_of_wrong_dtype():
    model = make(relational_heads_bias="graph")
    with pytest.raises(ValueError, match=r"`graph_adjacency` must be a bool tensor, got dtype torch.float32"):
        model(ids(1, 4), graph_adjacency=torch.ones(1, 4, 4))


def test_graph_adjacency_of_wrong_shape():
    model = make(relational_bias="graph")
    with pytest.raises(ValueError, match=r"`graph_adjacency` must have shape \[batch, n, n\] = \[1, 4, 4\]"):
        model(ids(1, 4), graph_adjacency=torch.ones(1, 3, 3, dtype=torch.bool))


def test_graph_bias_with_cache():
    model = make(relational_bias="graph")
    adjacency = torch.ones(1, 3, 3, dtype=torch.bool)
    out = model(ids(1, 3), graph_adjacency=adjacency, use_cache=True)
    with pytest.raises(ValueError, match=r"`graph` relational bias does not support a KV cache"):
        model(ids(1, 1), cache=output_cache(out), graph_adjacency=torch.ones(1, 1, 1, dtype=torch.bool))


def test_sequence_classification_batch_without_pad_or_mask():
    torch.manual_seed(0)
    model = DATForSequenceClassification(tiny_config(num_labels=2)).eval()
    model(ids(1, 4))  # a single sequence needs neither
    with pytest.raises(ValueError, match=r"Cannot handle batch sizes > 1 if no padding token is defined"):
        model(ids(2, 4))


def test_base_model_errors_too():
    """The checks live in the base model, so every head gets them."""
    model = DATModel(tiny_config()).eval()
    with pytest.raises(ValueError, match=r"exactly one of `input_ids` or `inputs_embeds`"):
        model()

