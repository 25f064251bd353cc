"""Configuration fields shared by every AngelSpec drafter. A drafter reads the hidden states of a *target* model and
proposes tokens that the target verifies; it shares the target's embedding and LM head (never stored in the drafter), so
its `hidden_size` and `vocab_size` equal the target's (`DrafterConfig.from_target` builds a config that fits)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

from .drafter_utils import library


@strict
class DrafterConfig(Qwen3Config):
    r"""
    Base of the drafter configurations (a Qwen3-style decoder: RMSNorm, rotary embeddings, QK-norm, SwiGLU). Fields
    marked *hook* set the angelspec-hf library's `generate()` hook; the model itself does not read them.

    target_layer_ids (`list[int]`):
        0-based indices of the target's decoder layers whose outputs the drafter reads. Layer `i` is
        `target(..., output_hidden_states=True).hidden_states[i + 1]`.
    num_target_layers (`int`, *optional*):
        Depth of the target the drafter was built for; used to validate `target_layer_ids`.
    target_model_type (`str`, *optional*):
        `model_type` of the target the drafter was built for (informative; shown in errors and model cards).
    draft_stop_threshold (`float`, *optional*, defaults to 0.0):
        *Hook*, with `draft_length="full"`: end a round's draft once the product of the drafter's probabilities of its
        tokens falls below this value (at least one token is drafted; 0 drafts the whole block).
    draft_length (`str`, *optional*, defaults to `"auto"`):
        *Hook*: `"auto"` drafts, per round, only the tokens expected to pay for their drafting and verification on
        this machine (possibly none: a plain step); `"full"` the whole block. Output is the target's either way.
    draft_vocab_size (`int`, *optional*):
        Size of a pruned draft vocabulary (EAGLE-3's `d2t`, FR-Spec), its target token ids stored in the weights as
        `draft_vocab_ids`: drafting computes only those rows of the target's LM head, other tokens get draft
        probability 0 (verification is unchanged, so output stays exact). `None`: the whole vocabulary.
    lookup_tokens (`int`, *optional*, defaults to 0):
        *Hook*: also propose up to this many n-gram lookup tokens (those that followed the latest earlier occurrence
        of the context's last `lookup_max_ngram` or fewer tokens) when they are expected to beat the drafter's block.
    lookup_max_ngram (`int`, *optional*, defaults to 3):
        Longest context suffix the lookup matches.
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
            raise ValueError(f"target_layer_ids {ids} reach layer {max(ids)} but the target has "
                             f"{self.num_target_layers} layers")
        if self.hidden_size % self.num_attention_heads and self.head_dim is None:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    def _default_layer_ids(self) -> list[int]:
        depth = self.num_target_layers or self.num_hidden_layers
        return [depth - 1]

    @classmethod
    def target_defaults(cls, target_config, overrides: dict) -> dict:
        """Family-specific defaults derived from the target's config (overridden by the families)."""
        return {}

    @classmethod
    def from_target(cls, target_config, **overrides) -> DrafterConfig:
        """*library*: a config whose sizes fit `target_config` (a config or a model); `overrides` win."""
        return library("drafter_library").config_from_target(cls, target_config, **overrides)
