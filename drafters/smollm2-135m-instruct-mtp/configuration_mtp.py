"""Configuration of the MTP drafter (autoregressive multi-token prediction, DeepSeek-V3 MTP / EAGLE style)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_drafter import DrafterConfig


@strict
class MTPConfig(DrafterConfig):
    r"""
    num_draft_tokens (`int`, defaults to 4):
        Tokens drafted per verification round, one drafter step each.
    target_layer_ids (`list[int]`):
        Exactly one target layer, by default the last: the drafter's input at position t is
        `eh_proj([norm(h_t); norm(embed(x_{t+1}))])`.

    Example:

    ```python
    >>> from angelspec_hf import MTPConfig, MTPDrafter
    >>> drafter = MTPDrafter(MTPConfig.from_target(target.config, num_draft_tokens=4))
    ```
    """

    model_type = "angelspec_mtp"

    num_draft_tokens: int = 4

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if len(self.target_layer_ids) != 1:
            raise ValueError(f"an MTP drafter reads exactly one target layer, got target_layer_ids={self.target_layer_ids}")

    @classmethod
    def target_defaults(cls, target_config, overrides: dict) -> dict:
        return {"num_hidden_layers": 1, "target_layer_ids": [target_config.num_hidden_layers - 1]}
