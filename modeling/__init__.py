"""AngelSpec drafters as `PreTrainedModel`s: MTP (autoregressive), DFlash (block diffusion) and DFly (DFlash + hybrid
target conditioning + an autoregressive head).

A drafter's Hub folder carries its family's files (`configuration_*.py`, `modeling_*.py`, `configuration_drafter.py`,
`drafter_utils.py`; `drafter_library.export_code` writes them); the rest of this package is the library's: the
generate() hook (`candidate_generator.py`, `draft_policy.py`), `drafter_library.py` and the converters."""

from .candidate_generator import (
    AngelSpecCandidateGenerator,
    SpeculationStats,
    disable_generate_hook,
    enable_generate_hook,
    generate_hook_enabled,
)
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
    "disable_generate_hook", "enable_generate_hook", "generate_hook_enabled", "export_eagle", "export_zlab_dflash", "load_foreign_checkpoint",
]
