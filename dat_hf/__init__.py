"""dat_hf: the Dual Attention Transformer as a Hugging Face Transformers model family.

`import dat_hf` registers every config and model class with the Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .configuration_dat import DATConfig, DualAttentionConfig
from .modeling_dat import DATForCausalLM, DATForSequenceClassification, DATModel, DATPreTrainedModel

__version__ = "0.1.0"

AutoConfig.register("dat", DATConfig, exist_ok=True)
AutoModel.register(DATConfig, DATModel, exist_ok=True)
AutoModelForCausalLM.register(DATConfig, DATForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DATConfig, DATForSequenceClassification, exist_ok=True)

# saved folders carry the modeling code (remote code) for every Auto class of the family
DATConfig.register_for_auto_class("AutoConfig")
DATModel.register_for_auto_class("AutoModel")
DATForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DATForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")


def from_reference_model(module, **kwargs):
    """Convert a live `dual_attention` model into the matching dat_hf model (see `dat_hf.conversion`)."""
    from .conversion import from_reference_model as convert

    return convert(module, **kwargs)


__all__ = [
    "DATConfig",
    "DualAttentionConfig",
    "DATModel",
    "DATForCausalLM",
    "DATForSequenceClassification",
    "DATPreTrainedModel",
    "from_reference_model",
]
