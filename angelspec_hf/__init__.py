"""angelspec-hf: lossless speculative decoding for Hugging Face causal LMs with trained drafters.

`import angelspec_hf` registers the drafters with `AutoConfig` / `AutoModel`; nothing else happens on import (the
`generate()` routing is installed when a drafter is first constructed, see `angelspec_hf.modeling.candidate_generator`).
"""

from transformers import AutoConfig, AutoModel

from angelspec_hf.modeling import (
    DRAFTERS,
    DFlashConfig,
    DFlashDrafter,
    DFlyConfig,
    DFlyDrafter,
    DrafterPreTrainedModel,
    MTPConfig,
    MTPDrafter,
    SpeculationStats,
    load_foreign_checkpoint,
)
from angelspec_hf.targets import load_default_target, load_target

for _config_cls, _model_cls in DRAFTERS.values():
    AutoConfig.register(_config_cls.model_type, _config_cls, exist_ok=True)
    AutoModel.register(_config_cls, _model_cls, exist_ok=True)


def load_drafter(name_or_path, **kwargs) -> DrafterPreTrainedModel:
    """A drafter from a folder or Hub id: native AngelSpec, z-lab DFlash or AngelSpec DFly layout."""
    model = load_foreign_checkpoint(None, name_or_path, **kwargs)
    return model if model is not None else AutoModel.from_pretrained(name_or_path, **kwargs).eval()


__version__ = "0.1.0"
__all__ = [
    "DFlashConfig", "DFlashDrafter", "DFlyConfig", "DFlyDrafter", "DrafterPreTrainedModel", "MTPConfig",
    "MTPDrafter", "SpeculationStats", "load_default_target", "load_drafter", "load_target",
]


def generate_batch(target, drafter, prompts, **kwargs):
    """Batched speculative generation (continuous batching + D-Cut): see `angelspec_hf.tgi_patch.engine`."""
    from angelspec_hf.tgi_patch.engine import generate_batch as _generate_batch

    return _generate_batch(target, drafter, prompts, **kwargs)


__all__ += ["generate_batch"]
