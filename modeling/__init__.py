"""AngelSpec drafters as `PreTrainedModel`s: MTP (autoregressive), DFlash (block diffusion) and DFly (DFlash + hybrid
target conditioning + an autoregressive head)."""

from .candidate_generator import AngelSpecCandidateGenerator, SpeculationStats
from .configuration_drafter import DrafterConfig
from .converters import export_eagle, export_zlab_dflash, load_foreign_checkpoint
from .dflash.configuration_dflash import DFlashConfig
from .dflash.modeling_dflash import DFlashDrafter
from .dfly.configuration_dfly import DFlyConfig
from .dfly.modeling_dfly import DFlyDrafter
from .drafter_utils import DrafterOutput, DrafterPreTrainedModel
from .mtp.configuration_mtp import MTPConfig
from .mtp.modeling_mtp import MTPDrafter

DRAFTERS = {"mtp": (MTPConfig, MTPDrafter), "dflash": (DFlashConfig, DFlashDrafter), "dfly": (DFlyConfig, DFlyDrafter)}

__all__ = [
    "AngelSpecCandidateGenerator", "DFlashConfig", "DFlashDrafter", "DFlyConfig", "DFlyDrafter", "DRAFTERS",
    "DrafterConfig", "DrafterOutput", "DrafterPreTrainedModel", "MTPConfig", "MTPDrafter", "SpeculationStats",
    "export_eagle", "export_zlab_dflash", "load_foreign_checkpoint",
]
