"""Configuration of the DFlash drafter (block diffusion conditioned on several target layers)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_drafter import DrafterConfig


def evenly_spaced_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Pick `num_ids` 0-based target layers spread from the second layer to three before the last (DFlash's choice)."""
    if num_ids < 1:
        raise ValueError(f"num_ids must be >= 1, got {num_ids}")
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, max(num_target_layers - 3, 1)
    span = end - start
    return sorted({int(round(start + i * span / (num_ids - 1))) for i in range(num_ids)})


@strict
class DFlashConfig(DrafterConfig):
    r"""
    block_size (`int`, defaults to 8):
        Tokens per drafted block: the last verified token followed by `block_size - 1` mask tokens, so each block
        proposes `block_size - 1` draft tokens.
    mask_token_id (`int`, *optional*):
        A **target** vocabulary id whose (target) embedding fills the masked block positions.
    """

    model_type = "angelspec_dflash"

    block_size: int = 8
    mask_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.mask_token_id is None:
            self.mask_token_id = self.pad_token_id if self.pad_token_id is not None else self.vocab_size - 1
        super().__post_init__(**kwargs)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor and at least one mask), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if any(t != "full_attention" for t in self.layer_types):
            raise ValueError(f"DFlash drafters use full attention in every layer, got layer_types={self.layer_types}")

    def _default_layer_ids(self) -> list[int]:
        depth = self.num_target_layers or self.num_hidden_layers
        return evenly_spaced_layer_ids(depth, max(self.num_hidden_layers, 4))

    @classmethod
    def target_defaults(cls, target_config, overrides: dict) -> dict:
        num_layers = overrides.get("num_hidden_layers", 2)
        return {
            "num_hidden_layers": num_layers,
            # DFlash reads as many target layers as it has layers; we read at least four (a 2-layer drafter of a
            # 30-layer target then sees layers 1, 10, 18 and 27).
            "target_layer_ids": evenly_spaced_layer_ids(target_config.num_hidden_layers, max(num_layers, 4)),
        }
