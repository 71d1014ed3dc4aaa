"""dat_hf: the Dual Attention Transformer as a Hugging Face Transformers model family.

`import dat_hf` registers every config and model class with the Auto classes, and the language models' model types
(`dat`, `dat_seq2seq`) in Transformers' causal-LM and seq2seq-LM name mappings, by which lm-eval's `HFLM`, the
`Trainer`'s label smoothing and `transformers serve` tell the two apart. `dat_hf.export` (ExecuTorch-style export) is
imported on first use.
"""

import importlib
import warnings

import transformers
from packaging.version import Version
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

# from its module, not `transformers.AutoImageProcessor`: Transformers 5.17 files the Auto class under the torchvision
# backend, so without torchvision the top-level name is a placeholder that raises ImportError
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from .configuration_dat import DATConfig, DualAttentionConfig
from .modeling_dat import DATForCausalLM, DATForSequenceClassification, DATModel, DATPreTrainedModel, SAVE_LOAD_HOOKS
from .configuration_dat_encoder import DATEncoderConfig
from .modeling_dat_encoder import ENCODER_AUTO_CLASSES, DATEncoderModel, DATForTokenClassification
from .safe_folders import install as install_safe_folders

from .configuration_dat_vision import DATVisionConfig
from .image_processing_dat import DATImageProcessor
from .modeling_dat_vision import DATForImageClassification, DATVisionModel, DATVisionPreTrainedModel

from .configuration_dat_seq2seq import DATSeq2SeqConfig
from .modeling_dat_seq2seq import DATForSeq2SeqLM, DATSeq2SeqModel, DATSeq2SeqPreTrainedModel
from .pipeline_text2text import DATText2TextPipeline  # registers the `dat-text2text` pipeline task
from .kernels import load_cpu_kernel  # registers the compiled backends (never imported by the model files)
from .kernel_hooks import INPUT_CHECKS
from .input_validation import install as install_input_checks  # (never imported by the model files either)
from .conversion import AuthorsCheckpointWarning, register_authors_format
from .transformers_compat import TESTED_TRANSFORMERS

__version__ = "0.1.0"


class UntestedTransformersWarning(UserWarning):
    """The installed Transformers is newer than the newest release dat_hf was tested with."""


def warn_if_untested_transformers(installed: str = transformers.__version__) -> bool:
    """Warn if the installed Transformers is newer than `TESTED_TRANSFORMERS`; -> whether it warned."""
    oldest, newest = TESTED_TRANSFORMERS
    if Version(installed).release <= Version(newest).release:
        return False
    warnings.warn(
        f"dat_hf was tested with transformers {oldest} to {newest}; {installed} is newer and untested. If generation, "
        f"caching or training misbehaves, install a tested release: pip install 'transformers>={oldest},<={newest}'.",
        UntestedTransformersWarning, stacklevel=3)
    return True


warn_if_untested_transformers()  # (a release newer than the newest tested one: once, naming the tested range)

# crash-safe saving and the checks of local folders on load, for every DAT class (the model files, copied as a saved
# folder's remote code, hold only the hook points: there saving and loading are Transformers' own)
install_safe_folders(SAVE_LOAD_HOOKS)
# the checks of the forward inputs (a `ValueError` naming the argument), likewise kept out of the remote code
install_input_checks(INPUT_CHECKS)

# The registration table: each family's `auto_classes` (Auto class -> `module.Class`, in its modeling file, which
# `save_pretrained` also writes as the folder's remote-code `auto_map`). A new head is one entry there.
FAMILIES = (DATPreTrainedModel.auto_classes, ENCODER_AUTO_CLASSES, DATVisionPreTrainedModel.auto_classes,
            DATSeq2SeqPreTrainedModel.auto_classes)
# model type -> class name, which lm-eval (`HFLM`'s backend, else "neither marked as CausalLM or Seq2SeqLM"), the
# Trainer (label smoothing shifts the labels of a causal LM) and `transformers serve` read; the Auto classes resolve
# the registered classes first, and never look up a model type that is not in CONFIG_MAPPING_NAMES
LM_NAME_MAPPINGS = {"AutoModelForCausalLM": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    "AutoModelForSeq2SeqLM": MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}


def register_family(auto_classes: dict[str, str]) -> None:
    """Register a family's config and models with the Auto classes (in this process, and for remote code on save)."""
    classes = {auto_name: getattr(importlib.import_module(f".{target.rsplit('.', 1)[0]}", __name__),
                                  target.rsplit(".", 1)[1])
               for auto_name, target in auto_classes.items()}
    config_class = classes.pop("AutoConfig")
    transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    config_class.register_for_auto_class("AutoConfig")
    for auto_name, model_class in classes.items():
        getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_name)
        if auto_name in LM_NAME_MAPPINGS:
            LM_NAME_MAPPINGS[auto_name].setdefault(config_class.model_type, model_class.__name__)


for auto_classes in FAMILIES:
    register_family(auto_classes)
# the ViDAT image processor (Pillow backend: no torchvision needed)
AutoImageProcessor.register(DATVisionConfig, image_processor_classes={"pil": DATImageProcessor}, exist_ok=True)
DATImageProcessor.register_for_auto_class("AutoImageProcessor")

# `AutoModelForCausalLM.from_pretrained` also loads the authors' `dual-attention` Hub checkpoints (converted on load)
register_authors_format()


def __getattr__(name):
    """`dat_hf.export` on first use (it imports Transformers' ExecuTorch integration, which `import dat_hf` skips)."""
    if name == "export":
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
