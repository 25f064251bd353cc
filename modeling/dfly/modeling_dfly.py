"""DFly drafter: DFlash's parallel block backbone, plus

1. hybrid target conditioning: each draft layer's key/value context is the shared projection `fc(features)` plus its
   own learned softmax mixture of the raw target layers, normalised (`layer_fusion_weights`, one row per layer);
2. a predecessor-conditioned autoregressive head: block position j's hidden state is corrected by a gated MLP of
   itself and the embedding of the token chosen at position j - 1, before the target's LM head. The backbone still
   runs once per block; only this small head runs left to right. Its output projection starts at zero, so an
   untrained head leaves DFlash's logits unchanged.

Weight names map one-to-one onto Tencent AngelSpec's DFly checkpoints (`modeling/converters.py`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from ..dflash.modeling_dflash import DFlashDrafter
from ..drafter_utils import library
from .configuration_dfly import DFlyConfig


class DFlyARHead(nn.Module):
    """`h + down(act(gate(z)) * up(z))` with `z = [norm(h); norm(embed(previous token))]`."""

    def __init__(self, config: DFlyConfig):
        super().__init__()
        hidden, inner = config.hidden_size, config.ar_head_intermediate_size
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.embed_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(2 * hidden, inner, bias=False)
        self.up_proj = nn.Linear(2 * hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.down_proj._zero_init = True
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, previous_embeds: torch.Tensor) -> torch.Tensor:
        # hidden, previous_embeds: [..., H] (any leading shape: one position at inference, a block in training)
        z = torch.cat([self.hidden_norm(hidden), self.embed_norm(previous_embeds)], dim=-1)
        return hidden + self.down_proj(self.act_fn(self.gate_proj(z)) * self.up_proj(z))


class DFlyDrafter(DFlashDrafter):
    config_class = DFlyConfig
    config: DFlyConfig
    _transformers_dflash_layout = False  # the AR head sits between the backbone and the LM head

    def _build_extra_modules(self, config: DFlyConfig) -> None:
        num_layers, num_features = config.num_hidden_layers, len(config.target_layer_ids)
        if config.use_layer_fusion:
            self.layer_fusion_weights = nn.Parameter(torch.zeros(num_layers, num_features))
        self.ar_head = DFlyARHead(config) if config.use_ar_head else None

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DFlyDrafter) and module.config.use_layer_fusion:
            from transformers import initialization as init

            init.zeros_(module.layer_fusion_weights)  # softmax(0) = an even mixture of the target layers

    def layer_contexts(self, context_hidden_states: torch.Tensor) -> list[torch.Tensor]:
        if not self.config.use_layer_fusion:
            return super().layer_contexts(context_hidden_states)
        shared = self.fc(context_hidden_states)  # [B, N, H]
        per_layer = context_hidden_states.unflatten(-1, (len(self.config.target_layer_ids), -1))  # [B, N, T, H]
        mix = torch.softmax(self.layer_fusion_weights.float(), dim=-1).to(per_layer.dtype)  # [L, T]
        fused = torch.einsum("bnth,lt->lbnh", per_layer, mix)
        return [self.hidden_norm(shared + fused[i]) for i in range(len(self.layers))]

    def grow_ar_head(self, width: int) -> None:
        """*library*: widen the AR head's inner projection to `width` without changing what it computes (warm
        starts)."""
        library("drafter_library").grow_ar_head(self, width)

    def bind_embeddings(self, embed_tokens: nn.Module) -> None:
        """Training: give the AR head the target's (frozen) embedding table; it is not stored in the drafter."""
        self._embed_tokens = [embed_tokens]  # a list, so it is not registered as a submodule

    def correct_rows(self, hidden: torch.Tensor, previous_ids: torch.LongTensor | None) -> torch.Tensor:
        if previous_ids is None or self.ar_head is None:
            return hidden
        if not getattr(self, "_embed_tokens", None):
            raise ValueError("teacher-forced AR head needs the target's embedding: call drafter.bind_embeddings(...)")
        return self.ar_head(hidden, self._embed_tokens[0](previous_ids).to(hidden.dtype))

    def ar_logits(self, hidden: torch.Tensor, previous_ids: torch.LongTensor, embed_tokens, lm_head) -> torch.Tensor:
        """Logits `[B, K, V]` for block rows with hidden `[B, K, H]` and predecessors `[B, K]`."""
        if self.ar_head is not None:
            hidden = self.ar_head(hidden, embed_tokens(previous_ids).to(hidden.dtype))
        return lm_head(hidden.to(lm_head.weight.dtype))

    def position_logits(self, rows, anchors, embed_tokens, lm_head):
        """With the AR head, row j is corrected by the token chosen at j - 1 (the anchor for row 0): computed one
        position at a time, only as far as drafting goes."""
        if self.ar_head is None:
            return super().position_logits(rows, anchors, embed_tokens, lm_head)
        return lambda j, previous: self.ar_logits(rows[:, j], anchors if j == 0 else previous, embed_tokens, lm_head)


__all__ = ["DFlyDrafter", "DFlyARHead"]
