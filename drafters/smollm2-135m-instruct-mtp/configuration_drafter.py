"""Configuration fields shared by every AngelSpec drafter.

A drafter reads the hidden states of a *target* model and proposes tokens that the target then verifies. It shares the
target's token embedding and LM head (they are never stored in the drafter), so its `hidden_size` and `vocab_size` must
equal the target's. `DrafterConfig.from_target` builds a config that fits a given target.
"""

from __future__ import annotations

import copy

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config


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
class DrafterConfig(Qwen3Config):
    r"""
    Base of the drafter configurations (a Qwen3-style decoder: RMSNorm, rotary embeddings, QK-norm, SwiGLU).

    target_layer_ids (`list[int]`):
        0-based indices of the target's decoder layers whose outputs the drafter reads. Layer `i` is
        `target(..., output_hidden_states=True).hidden_states[i + 1]`.
    num_target_layers (`int`, *optional*):
        Depth of the target the drafter was built for; used to validate `target_layer_ids`.
    target_model_type (`str`, *optional*):
        `model_type` of the target the drafter was built for (informative; shown in errors and model cards).
    draft_stop_threshold (`float`, *optional*, defaults to 0.0):
        `generate()` hook: stop drafting a round once the product of the drafter's probabilities of its chosen
        tokens falls below this value (at least one token is always drafted). Fewer hopeless tokens means cheaper
        drafting and verification; 0 drafts the whole block. Output is unaffected (the target still verifies).
        Only read with `draft_length="full"`: `"auto"` subsumes it (it cuts by cost, not by a fixed confidence).
    draft_length (`str`, *optional*, defaults to `"auto"`):
        `generate()` hook: `"auto"` drafts, per round, only the tokens expected to pay for their drafting and
        verification on this machine, and none (a plain step) when drafting does not pay (`draft_policy.py`);
        `"full"` drafts the whole block (cut by `draft_stop_threshold` when set). Output is unaffected either way.
    draft_vocab_size (`int`, *optional*):
        Size of a pruned draft vocabulary (EAGLE-3's `d2t`, FR-Spec): the drafter scores only these target token
        ids, stored in the weights as `draft_vocab_ids`, with the matching rows of the target's LM head, so each
        draft token costs a fraction of the full LM head. Tokens outside get draft probability 0; verification is
        unchanged, so output stays exact. `None`: the whole vocabulary. Set with `drafter.set_draft_vocab(ids)`.
    lookup_tokens (`int`, *optional*, defaults to 0):
        `generate()` hook: also propose n-gram lookups (prompt lookup): the tokens that followed the latest earlier
        occurrence of the context's last `lookup_max_ngram` (or fewer) tokens, up to this many. Each round takes the
        lookup, the drafter's block or a plain step, whichever is expected to give the most tokens per second
        (`draft_length="auto"`; with `"full"`, a lookup whenever one matches at least 2 tokens). 0: drafter only.
    lookup_max_ngram (`int`, *optional*, defaults to 3):
        Longest context suffix matched by the lookup.
    """

    model_type = "angelspec_drafter"

    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    target_model_type: str | None = None
    draft_stop_threshold: float = 0.0
    draft_length: str = "auto"
    draft_vocab_size: int | None = None
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.target_layer_ids is None:
            self.target_layer_ids = self._default_layer_ids()
        ids = list(self.target_layer_ids)
        if not ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if not 0.0 <= self.draft_stop_threshold < 1.0:
            raise ValueError(f"draft_stop_threshold must be in [0, 1), got {self.draft_stop_threshold}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.lookup_tokens < 0 or self.lookup_max_ngram < 1:
            raise ValueError(f"lookup_tokens must be >= 0 and lookup_max_ngram >= 1, got {self.lookup_tokens} and "
                             f"{self.lookup_max_ngram}")
        if self.draft_length not in ("auto", "full"):
            raise ValueError(f"draft_length must be 'auto' or 'full', got {self.draft_length!r}")
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids must be distinct non-negative layer indices, got {ids}")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids {ids} reach layer {max(ids)} but the target has {self.num_target_layers} layers"
            )
        if self.hidden_size % self.num_attention_heads and self.head_dim is None:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def _default_layer_ids(self) -> list[int]:
        depth = self.num_target_layers or self.num_hidden_layers
        return [depth - 1]

    @classmethod
    def target_defaults(cls, target_config, overrides: dict) -> dict:
        """Family-specific defaults derived from the target's config (overridden by the families)."""
        return {}

    @classmethod
    def from_target(cls, target_config, **overrides) -> DrafterConfig:
        """A config whose sizes fit `target_config` (a `PreTrainedConfig` or a model); `overrides` win."""
        if hasattr(target_config, "config"):
            target_config = target_config.config
        tc = target_config.get_text_config()
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        fields = dict(
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=head_dim,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            rope_parameters=copy.deepcopy(getattr(tc, "rope_parameters", None)),
            num_target_layers=tc.num_hidden_layers,
            target_model_type=tc.model_type,
            bos_token_id=tc.bos_token_id,
            eos_token_id=tc.eos_token_id,
            pad_token_id=tc.pad_token_id,
        )
        fields.update(cls.target_defaults(tc, overrides))
        fields.update(overrides)
        return cls(**fields)
