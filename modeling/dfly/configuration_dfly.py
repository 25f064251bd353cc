"""Configuration of the DFly drafter: DFlash's block backbone with hybrid target conditioning and an AR head."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from ..dflash.configuration_dflash import DFlashConfig


@strict
class DFlyConfig(DFlashConfig):
    r"""
    use_ar_head (`bool`, defaults to `True`):
        Condition block position j's logits on the token chosen at position j - 1 (a small gated MLP on
        `[norm(h_j); norm(embed(token_{j-1}))]` added to `h_j`, zero-initialised so an untrained head changes nothing).
    ar_head_intermediate_size (`int`, *optional*):
        Width of that MLP; defaults to `hidden_size`.
    use_layer_fusion (`bool`, defaults to `True`):
        Give each draft layer its own learned mixture of the raw target layers on top of the shared projection
        (hybrid conditioning). `False` gives every layer DFlash's one shared context (an ablation).
    """

    model_type = "angelspec_dfly"

    use_ar_head: bool = True
    ar_head_intermediate_size: int | None = None
    use_layer_fusion: bool = True

    def __post_init__(self, **kwargs):
        if self.ar_head_intermediate_size is None:
            self.ar_head_intermediate_size = self.hidden_size
        super().__post_init__(**kwargs)
        if self.ar_head_intermediate_size < 1:
            raise ValueError(f"ar_head_intermediate_size must be positive, got {self.ar_head_intermediate_size}")
