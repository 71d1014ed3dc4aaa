"""dat_hf: the Dual Attention Transformer as a Hugging Face Transformers model family.

`import dat_hf` registers every config and model class with the Auto classes, and the language models' model types
(`dat`, `dat_seq2seq`) in Transformers' causal-LM and seq2seq-LM name mappings, by which lm-eval's `HFLM`, the
`Trainer`'s label smoothing and `transformers serve` tell the two apart. `dat_hf.export` (ExecuTorch-style export) is
imported on first use.
"""

from transformers import (
    AutoConfig,
    AutoModelForImageClassification,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers import AutoModelForSeq2SeqLM
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

# from its module, not `transformers.AutoImageProcessor`: Transformers 5.17 files the Auto class under the torchvision
# backend, so without torchvision the top-level name is a placeholder that raises ImportError
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from .configuration_dat import DATConfig, DATEncoderConfig, DualAttentionConfig
from .modeling_dat import (
    DATEncoderModel,
    DATForCausalLM,
    DATForSequenceClassification,
    DATForTokenClassification,
    DATModel,
    DATPreTrainedModel,
    SAVE_LOAD_HOOKS,
)
from .safe_folders import install as install_safe_folders

from .configuration_dat_vision import DATVisionConfig
from .image_processing_dat import DATImageProcessor
from .modeling_dat_vision import DATForImageClassification, DATVisionModel, DATVisionPreTrainedModel

from .configuration_dat_seq2seq import DATSeq2SeqConfig
from .modeling_dat_seq2seq import DATForSeq2SeqLM, DATSeq2SeqModel, DATSeq2SeqPreTrainedModel
from .pipeline_text2text import DATText2TextPipeline  # registers the `dat-text2text` pipeline task
from .kernels import load_cpu_kernel  # registers the compiled backends (never imported by the model files)
from .conversion import AuthorsCheckpointWarning, register_authors_format
from .transformers_compat import TESTED_TRANSFORMERS, UntestedTransformersWarning, warn_if_untested_transformers

__version__ = "0.1.0"

warn_if_untested_transformers()  # (a release newer than the newest tested one: once, naming the tested range)

# crash-safe saving and the checks of local folders on load, for every DAT class (the model files, copied as a saved
# folder's remote code, hold only the hook points: there saving and loading are Transformers' own)
install_safe_folders(SAVE_LOAD_HOOKS)

AutoConfig.register("dat", DATConfig, exist_ok=True)
AutoModel.register(DATConfig, DATModel, exist_ok=True)
AutoModelForCausalLM.register(DATConfig, DATForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DATConfig, DATForSequenceClassification, exist_ok=True)
AutoConfig.register("dat_encoder", DATEncoderConfig, exist_ok=True)
AutoModel.register(DATEncoderConfig, DATEncoderModel, exist_ok=True)
AutoModelForTokenClassification.register(DATEncoderConfig, DATForTokenClassification, exist_ok=True)

# saved folders carry the modeling code (remote code) for every Auto class of the family
DATConfig.register_for_auto_class("AutoConfig")
DATModel.register_for_auto_class("AutoModel")
DATForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DATForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
DATEncoderConfig.register_for_auto_class("AutoConfig")
DATEncoderModel.register_for_auto_class("AutoModel")
DATForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")

# vision: ViDAT image classifier and its Pillow-backend image processor (no torchvision needed)
AutoConfig.register("dat_vision", DATVisionConfig, exist_ok=True)
AutoModel.register(DATVisionConfig, DATVisionModel, exist_ok=True)
AutoModelForImageClassification.register(DATVisionConfig, DATForImageClassification, exist_ok=True)
AutoImageProcessor.register(DATVisionConfig, image_processor_classes={"pil": DATImageProcessor}, exist_ok=True)
DATVisionConfig.register_for_auto_class("AutoConfig")
DATVisionModel.register_for_auto_class("AutoModel")
DATForImageClassification.register_for_auto_class("AutoModelForImageClassification")
DATImageProcessor.register_for_auto_class("AutoImageProcessor")

# seq2seq: encoder-decoder DAT (see dat_hf.pipeline_text2text for the `dat-text2text` pipeline)
AutoConfig.register("dat_seq2seq", DATSeq2SeqConfig, exist_ok=True)
AutoModel.register(DATSeq2SeqConfig, DATSeq2SeqModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(DATSeq2SeqConfig, DATForSeq2SeqLM, exist_ok=True)
DATSeq2SeqConfig.register_for_auto_class("AutoConfig")
DATSeq2SeqModel.register_for_auto_class("AutoModel")
DATForSeq2SeqLM.register_for_auto_class("AutoModelForSeq2SeqLM")

# model type -> class name, which lm-eval (`HFLM`'s backend, else "neither marked as CausalLM or Seq2SeqLM"), the
# Trainer (label smoothing shifts the labels of a causal LM) and `transformers serve` read; the Auto classes resolve
# the classes registered above first, and never look up a model type that is not in CONFIG_MAPPING_NAMES
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("dat", DATForCausalLM.__name__)
MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.setdefault("dat_seq2seq", DATForSeq2SeqLM.__name__)

# `AutoModelForCausalLM.from_pretrained` also loads the authors' `dual-attention` Hub checkpoints (converted on load)
register_authors_format()


def __getattr__(name):
    """`dat_hf.export` on first use (it imports Transformers' ExecuTorch integration, which `import dat_hf` skips)."""
    if name == "export":
        import importlib

        return importlib.import_module(".export", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_reference_model(module, **kwargs):
    """Convert a live `dual_attention` model into the matching dat_hf model (see `dat_hf.conversion`)."""
    from .conversion import from_reference_model as convert

    return convert(module, **kwargs)


__all__ = [
    "DATConfig",
    "DualAttentionConfig",
    "DATEncoderConfig",
    "DATEncoderModel",
    "DATForTokenClassification",
    "DATModel",
    "DATForCausalLM",
    "DATForSequenceClassification",
    "DATPreTrainedModel",
    "from_reference_model",
    "AuthorsCheckpointWarning",
    "TESTED_TRANSFORMERS",
    "UntestedTransformersWarning",
    "DATVisionConfig",
    "DATVisionModel",
    "DATVisionPreTrainedModel",
    "DATForImageClassification",
    "DATImageProcessor",
    "DATSeq2SeqConfig",
    "DATSeq2SeqModel",
    "DATSeq2SeqPreTrainedModel",
    "DATForSeq2SeqLM",
    "DATText2TextPipeline",
    "load_cpu_kernel",
]
