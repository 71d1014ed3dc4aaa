"""Transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`) on the three DAT families.

The tests come from the source distribution of the installed Transformers version, fetched into `.cache/` by
`python scripts/fetch_transformers_tests.py` (which `scripts/install.sh` runs). The testers below follow the model
tests of the Transformers repository (`tests/models/llama`, `vit`, `t5`): a tiny config, the inputs of
`prepare_config_and_inputs_for_common`, and a `unittest.TestCase` per family.

The sdist ships `tests/test_modeling_common.py` and `tests/test_configuration_common.py` but not the modules they
import from `tests/generation/`, `tests/exporters/` and `tests/utils/`; see `install_missing_modules`.
"""

import contextlib
import importlib
import importlib.util
import sys
import types
import unittest
import unittest.mock
from pathlib import Path

import pytest
import torch
from transformers.models.auto import modeling_auto

import dat_hf  # noqa: F401  (registers the Auto classes)
from dat_hf import (
    DATConfig,
    DATForCausalLM,
    DATForImageClassification,
    DATForSeq2SeqLM,
    DATForSequenceClassification,
    DATModel,
    DATSeq2SeqConfig,
    DATSeq2SeqModel,
    DATVisionConfig,
    DATVisionModel,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_transformers_tests",
                                                  REPO_ROOT / "scripts" / "fetch_transformers_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_missing_modules(package: str):
    """Register the three modules that `test_modeling_common` / `test_configuration_common` import but the sdist lacks:

    - `exporters.test_export.ExportTesterMixin`, a base of `ModelTesterMixin` holding the `torch.export` tests: an
      empty mixin (those tests do not run here);
    - `generation.test_utils.GenerationTesterMixin`: a name only, which no tester below inherits (the generation tests
      are not in the sdist; `tests/test_generation.py` covers DAT generation);
    - `utils.test_configuration_utils.config_common_kwargs`: the `PreTrainedConfig` base fields with values other
      than their defaults, which `ConfigTester.check_config_arguments_init` passes to each config class and reads
      back.
    """
    stand_ins = {
        "exporters.test_export": {"ExportTesterMixin": type("ExportTesterMixin", (), {})},
        "generation.test_utils": {"GenerationTesterMixin": type("GenerationTesterMixin", (), {})},
        "utils.test_configuration_utils": {"config_common_kwargs": {
            "return_dict": False,
            "output_hidden_states": True,
            "output_attentions": True,
            "dtype": "float16",
            "chunk_size_feed_forward": 3,
            "architectures": ["DATForCausalLM"],
            "id2label": {0: "negative", 1: "positive"},
            "label2id": {"negative": 0, "positive": 1},
            "problem_type": "single_label_classification",
        }},
    }
    for dotted, attributes in stand_ins.items():
        parent = dotted.split(".")[0]
        sys.modules.setdefault(f"{package}.{parent}", types.ModuleType(f"{package}.{parent}"))
        module = types.ModuleType(f"{package}.{dotted}")
        module.__dict__.update(attributes)
        sys.modules[f"{package}.{dotted}"] = module


def import_common_tests():
    """-> (test_modeling_common, test_configuration_common) from the cache, or a FileNotFoundError saying how to
    fetch them."""
    fetch_script = load_fetch_script()
    if not fetch_script.is_fetched():
        raise FileNotFoundError(
            f"Transformers' common tests are not in {fetch_script.tests_package_dir()}: run "
            "`python scripts/fetch_transformers_tests.py` (or `bash scripts/install.sh`)."
        )
    package_dir = fetch_script.tests_package_dir()
    if str(package_dir.parent) not in sys.path:
        sys.path.insert(0, str(package_dir.parent))
    install_missing_modules(package_dir.name)
    return (importlib.import_module(f"{package_dir.name}.test_modeling_common"),
            importlib.import_module(f"{package_dir.name}.test_configuration_common"))


try:
    modeling_common, configuration_common = import_common_tests()
    MISSING = None
except FileNotFoundError as err:
    MISSING = str(err)


def test_transformers_common_tests_are_fetched():
    """The test cases below exist only when the common tests are fetched: their absence fails here."""
    if MISSING is not None:
        pytest.fail(MISSING, pytrace=False)


# the bases of the test cases; without the fetched tests, none (plain classes that pytest does not collect)
TEST_BASES = (modeling_common.ModelTesterMixin, unittest.TestCase) if MISSING is None else ()

# Transformers' built-in model-name mappings decide which classes get labels in the common tests; `import dat_hf`
# adds only its language models to the causal / seq2seq LM names (for Trainer and lm-eval), so its other classes
# join those mappings while the test cases run
DAT_MAPPING_NAMES = {
    "MODEL_MAPPING_NAMES": {"dat": "DATModel", "dat_vision": "DATVisionModel", "dat_seq2seq": "DATSeq2SeqModel"},
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": {"dat": "DATForCausalLM"},
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": {"dat": "DATForSequenceClassification"},
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": {"dat_vision": "DATForImageClassification"},
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": {"dat_seq2seq": "DATForSeq2SeqLM"},
}


@pytest.fixture(scope="module", autouse=True)
def dat_in_model_mappings():
    with contextlib.ExitStack() as stack:
        for name, entries in DAT_MAPPING_NAMES.items():
            stack.enter_context(unittest.mock.patch.dict(getattr(modeling_auto, name), entries))
        yield


class DualAttentionTester:
    """The sizes every tiny config shares: width 32, 2 layers of 2 sensory + 2 relational heads of width 8."""

    batch_size = 13
    is_training = True
    hidden_size = 32
    num_hidden_layers = 2
    num_sensory_heads = 2
    num_relational_heads = 2
    num_attention_heads = num_sensory_heads + num_relational_heads  # the heads `attentions` covers
    intermediate_size = 37

    def __init__(self, parent):
        self.parent = parent

    def dual_attention_kwargs(self) -> dict:
        return dict(hidden_size=self.hidden_size, num_sensory_heads=self.num_sensory_heads,
                    num_relational_heads=self.num_relational_heads, intermediate_size=self.intermediate_size,
                    num_symbols=8, symbolic_attention_heads=2)


class DATModelTester(DualAttentionTester):
    """Causal LM: token inputs with right padding (sequence i has i + 1 tokens)."""

    seq_length = 7
    vocab_size = 99
    num_labels = 3
    pad_token_id = 0

    def get_config(self):
        return DATConfig(vocab_size=self.vocab_size, num_hidden_layers=self.num_hidden_layers,
                         max_position_embeddings=64, num_labels=self.num_labels, pad_token_id=self.pad_token_id,
                         **self.dual_attention_kwargs())

    def prepare_config_and_inputs_for_common(self):
        input_ids = modeling_common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class NoGenerationTesterMixin:
    """Test cases of generative classes: Transformers' `GenerationTesterMixin` is not in the sdist (see
    `install_missing_modules`), so the common test that asks for it cannot pass."""

    @unittest.skip(reason="GenerationTesterMixin (tests/generation/) is not in the Transformers sdist; DAT generation "
                          "is tested in tests/test_generation.py")
    def test_generation_tester_mixin_inheritance(self):
        pass


class DATModelTest(NoGenerationTesterMixin, *TEST_BASES):
    all_model_classes = (DATModel, DATForCausalLM, DATForSequenceClassification)

    def setUp(self):
        self.model_tester = DATModelTester(self)
        self.config_tester = configuration_common.ConfigTester(self, config_class=DATConfig, hidden_size=48)

    def test_config(self):
        self.config_tester.run_common_tests()


class DATVisionModelTester(DualAttentionTester):
    """ViDAT: 12x12 RGB images in 2x2 patches (36 patches + CLS)."""

    image_size = 12
    patch_size = 2
    num_channels = 3
    num_labels = 10
    seq_length = (image_size // patch_size) ** 2 + 1

    def get_config(self):
        return DATVisionConfig(image_size=self.image_size, patch_size=self.patch_size, num_channels=self.num_channels,
                               num_hidden_layers=self.num_hidden_layers, num_labels=self.num_labels,
                               **self.dual_attention_kwargs())

    def prepare_config_and_inputs_for_common(self):
        pixel_values = modeling_common.floats_tensor(
            [self.batch_size, self.num_channels, self.image_size, self.image_size])
        return self.get_config(), {"pixel_values": pixel_values}


class DATVisionModelTest(*TEST_BASES):
    all_model_classes = (DATVisionModel, DATForImageClassification)
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = DATVisionModelTester(self)
        self.config_tester = configuration_common.ConfigTester(
            self, config_class=DATVisionConfig, has_text_modality=False, hidden_size=48)

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip(reason="ViDAT does not use inputs_embeds (as ViT)")
    def test_inputs_embeds(self):
        pass

    def test_model_get_set_embeddings(self):
        """As ViT's: the input embeddings are the patch embeddings (a module, not an `nn.Embedding`)."""
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), torch.nn.Module)
            output_embeddings = model.get_output_embeddings()
            self.assertTrue(output_embeddings is None or isinstance(output_embeddings, torch.nn.Linear))


class DATSeq2SeqModelTester(DualAttentionTester):
    """Encoder-decoder (2 + 2 layers): right-padded sources (source i has i + 1 tokens), unpadded targets but the
    first, left-padded by 2."""

    encoder_seq_length = 7
    decoder_seq_length = 7
    seq_length = decoder_seq_length  # the labels' length in the common tests
    vocab_size = 99
    pad_token_id = 0
    eos_token_id = 1
    decoder_start_token_id = 0

    def get_config(self):
        return DATSeq2SeqConfig(
            vocab_size=self.vocab_size, encoder_layers=self.num_hidden_layers, decoder_layers=self.num_hidden_layers,
            max_position_embeddings=64, pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id,
            decoder_start_token_id=self.decoder_start_token_id, **self.dual_attention_kwargs(),
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = modeling_common.ids_tensor([self.batch_size, self.encoder_seq_length], self.vocab_size)
        decoder_input_ids = modeling_common.ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size)
        decoder_attention_mask = torch.ones_like(decoder_input_ids)
        decoder_attention_mask[0, :2] = 0
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.tril(torch.ones_like(input_ids)),
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_attention_mask,
        }
        return self.get_config(), inputs


class DATSeq2SeqModelTest(NoGenerationTesterMixin, *TEST_BASES):
    all_model_classes = (DATSeq2SeqModel, DATForSeq2SeqLM)
    is_encoder_decoder = True

    def setUp(self):
        self.model_tester = DATSeq2SeqModelTester(self)
        self.config_tester = configuration_common.ConfigTester(self, config_class=DATSeq2SeqConfig, hidden_size=48)

    def test_config(self):
        self.config_tester.run_common_tests()
