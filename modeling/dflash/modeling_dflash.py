"""DFlash drafter: a block of `[last verified token, MASK × (block_size - 1)]` denoised in one forward.

The target's hidden states at `config.target_layer_ids` are concatenated, projected (`fc`) and normalised
(`hidden_norm`) into a context that every draft layer sees as extra keys/values in front of the block (non-causal
attention). Embedding and LM head are the target's. Weight names follow z-lab's DFlash checkpoints; `forward` meets
transformers' built-in DFlash contract (`speculation_type="dflash"`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (Qwen3Attention, Qwen3DecoderLayer, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding, eager_attention_forward, rotate_half)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..drafter_utils import DrafterOutput, DrafterPreTrainedModel, draft_loop, library, padding_to_additive_mask
from .configuration_dflash import DFlashConfig


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, S, D]; cos/sin [B, S, D]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(Qwen3Attention):
    """# diff with Qwen3: keys/values are `[context; block]`, queries only the block, and no causal mask."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, context_states=None, **kwargs):
        batch, q_len, _ = hidden_states.shape
        kv_states = hidden_states if context_states is None else torch.cat([context_states, hidden_states], dim=1)
        kv_len = kv_states.shape[1]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_states).view(batch, kv_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_states).view(batch, kv_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings  # [B, kv_len, D]: context positions then block positions
        query, key = _rotate(query, cos[:, -q_len:], sin[:, -q_len:]), _rotate(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                     eager_attention_forward)
        out, weights = attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, is_causal=False,
        )
        return self.o_proj(out.reshape(batch, q_len, -1).contiguous()), weights


class DFlashDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer with `DFlashAttention`; `context_states` travels to the attention through the layer's kwargs."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DFlashAttention(config, layer_idx)


class DFlashDrafter(DrafterPreTrainedModel):
    config_class = DFlashConfig
    config: DFlashConfig
    _no_split_modules = ["DFlashDecoderLayer"]
    _transformers_dflash_layout = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        num_features = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(num_features, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._build_extra_modules(config)
        self.post_init()

    def _build_extra_modules(self, config: DFlashConfig) -> None:
        """Hook for subclasses to add modules before weights are initialised."""

    def grow_layers(self, num_layers: int) -> None:
        """*library*: deepen the drafter to `num_layers` without changing what it computes (warm starts)."""
        library("drafter_library").grow_layers(self, num_layers)

    @property
    def num_draft_tokens(self) -> int:
        return self.config.block_size - 1

    def layer_contexts(self, context_hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """The keys/values context each layer sees: here one shared projection `hidden_norm(fc(features))`."""
        shared = self.hidden_norm(self.fc(context_hidden_states))
        return [shared] * len(self.layers)

    def forward(self, noise_embeds: torch.Tensor, context_hidden_states: torch.Tensor,
                position_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None, cache=None,
                previous_ids: torch.LongTensor | None = None, **kwargs) -> DrafterOutput:
        r"""
        noise_embeds (`torch.FloatTensor` of shape `(batch_size, block_size, hidden_size)`):
            Target embeddings of `[anchor, MASK, ..., MASK]`.
        context_hidden_states (`torch.FloatTensor` of shape `(batch_size, num_new, hidden_size * len(target_layer_ids))`):
            Target features of the tokens not yet in `cache` (the whole context when `cache` is None).
        position_ids (`torch.LongTensor` of shape `(batch_size, num_new + block_size)`, *optional*):
            Positions of the new context tokens then of the block; defaults to following the cache.
        attention_mask (`torch.Tensor`, *optional*):
            A 2-D padding mask over `cache + num_new + block_size` keys, or a 4-D additive mask
            `(batch_size, 1, block_size, kv_len)` (training packs many blocks into one forward this way).
        previous_ids (`torch.LongTensor` of shape `(batch_size, block_size)`, *optional*):
            Training only: the true token before each row, for DFly's teacher-forced AR head.

        Returns `DrafterOutput`: `last_hidden_state` `(batch_size, block_size, hidden_size)` after the final norm (and
        DFly's AR head when `previous_ids` is given); the target's LM head turns rows 1.. into draft logits.
        """
        batch, block, _ = noise_embeds.shape
        num_new = context_hidden_states.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + num_new + block, device=noise_embeds.device).expand(batch, -1)
        mask = padding_to_additive_mask(attention_mask, block, noise_embeds.dtype)
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)
        hidden = noise_embeds
        for layer, context in zip(self.layers, self.layer_contexts(context_hidden_states)):
            hidden = layer(hidden, attention_mask=mask, cache=cache, position_embeddings=position_embeddings,
                           context_states=context)
        return DrafterOutput(last_hidden_state=self.correct_rows(self.norm(hidden), previous_ids), cache=cache)

    def correct_rows(self, hidden: torch.Tensor, previous_ids: torch.LongTensor | None) -> torch.Tensor:
        """Hook for DFly's AR head (teacher-forced in training); DFlash's rows go to the LM head unchanged."""
        return hidden

    def position_logits(self, rows, anchors, embed_tokens, lm_head):
        """`logits_at(j, token j - 1)` for `draft_loop` over the block rows `(batch_size, K, hidden_size)` after the
        anchor: DFlash's rows are independent, so all K go through the LM head in one call."""
        logits = lm_head(rows.to(lm_head.weight.dtype))  # [B, K, V]
        return lambda j, previous: logits[:, j]

    def draft(self, context_hidden_states, next_ids, num_new, anchors, num_tokens, embed_tokens, lm_head, select,
              keep_going=None, *, cache):
        """Ingest the new context and denoise one block `[anchor, MASK × (block_size - 1)]` in one forward (the block
        is transient in `cache`); draft positions are block rows 1.. (see `DrafterPreTrainedModel.draft`)."""
        block = self.config.block_size
        masks = anchors.new_full((anchors.shape[0], block - 1), self.config.mask_token_id)
        noise_embeds = embed_tokens(torch.cat([anchors[:, None], masks], dim=1)).to(self.dtype)
        layer_cache, position_ids, attention_mask = cache.prepare(num_new, block, self.dtype)
        hidden = self(noise_embeds, context_hidden_states.to(self.dtype), position_ids, attention_mask,
                      layer_cache).last_hidden_state  # [B, block, H]
        logits_at = self.position_logits(hidden[:, 1 : num_tokens + 1], anchors, embed_tokens, lm_head)
        return draft_loop(logits_at, num_tokens, select, keep_going, anchors)


__all__ = ["DFlashDrafter", "DFlashAttention", "DFlashDecoderLayer"]
