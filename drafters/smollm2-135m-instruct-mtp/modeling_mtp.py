"""MTP drafter: one (or a few) causal decoder layers that predict the token after next, step by step.

At position t the input is `eh_proj([hnorm(h_t); enorm(embed(x_{t+1}))])`, where `h_t` is the target's hidden state
(`target_layer_ids`, by default its last layer) and `x_{t+1}` the next token; the output, through the final norm and
the target's LM head, predicts `x_{t+2}`. With `layout="eagle3"` the same drafter has EAGLE-3's architecture instead
(`Eagle3DecoderLayer`: three target layers fused by `fc`, the embedding and the state normed inside the layer), which
vLLM and SGLang serve once exported with `converters.export_eagle`. Drafting more tokens chains the drafter's own output hidden state in place
of the target's (as at training time, when the loss unrolls the same chain). The drafter keeps a KV cache over the
accepted context and drops its speculative entries after every round. Embedding and LM head are the target's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .drafter_utils import DrafterOutput, DrafterPreTrainedModel, additive_mask, draft_loop
from .configuration_mtp import MTPConfig


def causal_additive_mask(query_length: int, past_length: int, dtype, device) -> torch.Tensor:
    """`[1, 1, q, past + q]` additive mask: query i sees every cached key and new keys 0..i."""
    kv = past_length + query_length
    allowed = torch.arange(kv, device=device)[None, :] <= (past_length + torch.arange(query_length, device=device))[:, None]
    return additive_mask(allowed, dtype)[None, None]


class Eagle3DecoderLayer(GradientCheckpointingLayer):
    """EAGLE-3's draft layer as vLLM (`llama_eagle3.LlamaDecoderLayer`, layer 0) and SGLang (`llama_eagle3.
    LlamaDecoderLayer`) run it. Diff with `LlamaDecoderLayer`: attention reads `[input_layernorm(embeds);
    hidden_norm(hidden)]`, so q/k/v take `2 * hidden_size` inputs, and the residual is the un-normed `hidden`."""

    def __init__(self, config: MTPConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)  # Llama's: no QK-norm
        for name in ("q_proj", "k_proj", "v_proj"):
            width = getattr(self.self_attn, name).out_features
            setattr(self.self_attn, name, nn.Linear(2 * config.hidden_size, width, bias=config.attention_bias))
        self.mlp = Qwen3MLP(config)  # = LlamaMLP without bias (gate/up/down)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # on the embeddings
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, inputs_embeds, attention_mask=None, cache=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        attn_input = torch.cat([self.input_layernorm(inputs_embeds), self.hidden_norm(hidden_states)], dim=-1)  # [B, T, 2H]
        attn_output, _ = self.self_attn(attn_input, position_embeddings=position_embeddings,
                                        attention_mask=attention_mask, cache=cache, **kwargs)
        hidden_states = residual + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MTPDrafter(DrafterPreTrainedModel):
    config_class = MTPConfig
    config: MTPConfig
    _no_split_modules = ["Qwen3DecoderLayer", "Eagle3DecoderLayer"]

    def __init__(self, config: MTPConfig):
        super().__init__(config)
        if config.layout == "eagle3":
            self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
            self.layers = nn.ModuleList([Eagle3DecoderLayer(config, 0)])
        else:
            self.hnorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.enorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.layers = nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    @property
    def num_draft_tokens(self) -> int:
        return self.config.num_draft_tokens

    def forward(
        self,
        context_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        lm_head: nn.Module | None = None,
        **kwargs,
    ) -> DrafterOutput:
        r"""
        context_hidden_states (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size * len(target_layer_ids))`):
            Target hidden states `h_t`, or the drafter's own previous output `(batch_size, seq_len, hidden_size)` when
            chaining (with `layout="eagle3"` only the former goes through `fc`, as in vLLM and SGLang).
        inputs_embeds (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`):
            Target embeddings of the next tokens `x_{t+1}`. Training passes `(batch_size, S, seq_len, hidden_size)`
            (the next tokens of S chained steps) to unroll S steps in one call, see `_unrolled`.
        attention_mask (`torch.Tensor` of shape `(batch_size, 1, seq_len, past + seq_len)`, *optional*):
            Additive mask; defaults to causal over `cache + seq_len`.

        Returns `DrafterOutput`: `last_hidden_state` `(batch_size, seq_len, hidden_size)` is the pre-norm output that
        chains into the next step; `logits` `(batch_size, seq_len, vocab_size)` when `lm_head` is given.
        """
        if inputs_embeds.dim() == 4:
            return self._unrolled(context_hidden_states, inputs_embeds, lm_head)
        hidden = self._step(context_hidden_states, inputs_embeds, position_ids, attention_mask, cache)
        logits = self.head(hidden, lm_head) if lm_head is not None else None
        return DrafterOutput(last_hidden_state=hidden, logits=logits, cache=cache)

    def _step(self, context_hidden_states, inputs_embeds, position_ids, attention_mask, cache) -> torch.Tensor:
        """One drafting step's pre-norm output `(batch_size, seq_len, hidden_size)` (`forward`'s arguments). Training's
        unrolled steps call it directly, not `self(...)`: a forward wrapped once in a mixed-precision context (as
        accelerate wraps it) must not be re-entered from inside itself, which would leave autocast switched on."""
        batch, seq_len, _ = inputs_embeds.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq_len, device=inputs_embeds.device).expand(batch, -1)
        if attention_mask is None and seq_len > 1:
            attention_mask = causal_additive_mask(seq_len, past, inputs_embeds.dtype, inputs_embeds.device)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        if self.config.layout == "eagle3":
            hidden = context_hidden_states
            if hidden.shape[-1] != self.config.hidden_size:  # target features [B, T, 3H]; a chained state is [B, T, H]
                hidden = self.fc(hidden)
            hidden = self.layers[0](hidden, inputs_embeds, attention_mask=attention_mask, cache=cache,
                                    position_embeddings=position_embeddings)
        else:
            hidden = self.eh_proj(torch.cat([self.hnorm(context_hidden_states), self.enorm(inputs_embeds)], dim=-1))
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=attention_mask, cache=cache, position_embeddings=position_embeddings)
        return hidden

    def _unrolled(self, target_hidden: torch.Tensor, step_embeds: torch.Tensor, lm_head=None) -> DrafterOutput:
        """Training: S chained steps over a whole sequence in one call, attending as drafting does.

        Step 1 reads the target's hidden state `h_t` with `embed(x_{t+1})` at position t; step j > 1 reads its own
        step j-1 output at index t with `embed(x_{t+j})` at position t + j - 1. A step-j query at index t sees step-1
        keys at indices <= t (the accepted context) and, of later steps, only its own chain (index t) - the KV cache
        drafting builds. Returns `last_hidden_state` `(batch, S, L, hidden)`.
        """
        batch, steps, length, _ = step_embeds.shape
        device, dtype = step_embeds.device, step_embeds.dtype
        cache = DynamicCache(config=self.config)
        index = torch.arange(length, device=device)
        context_keys = index[None, :] <= index[:, None]  # [L, L] causal
        own_chain = index[None, :] == index[:, None]
        hidden, outputs = target_hidden, []
        for j in range(steps):
            allowed = torch.cat([context_keys] + [own_chain] * j, dim=1)  # [L, (j + 1) L]
            mask = additive_mask(allowed, dtype)
            positions = (index + j).expand(batch, -1)
            hidden = self._step(hidden, step_embeds[:, j], positions, mask[None, None], cache)
            outputs.append(hidden)
        stacked = torch.stack(outputs, dim=1)
        return DrafterOutput(last_hidden_state=stacked, logits=self.head(stacked, lm_head) if lm_head else None)

    def head(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.norm(hidden).to(lm_head.weight.dtype))

    def draft(self, context_hidden_states, next_ids, num_new, anchors, num_tokens, embed_tokens, lm_head, select,
              keep_going=None, *, cache):
        """Ingest the pairs `(h_t, x_{t+1})` of the new context, then draft one step per token: step j + 1 chains the
        drafter's own output after step j with the token chosen there (see `DrafterPreTrainedModel.draft`; the
        chained entries stay in `cache` for the caller to drop)."""
        layer_cache, position_ids, attention_mask = cache.prepare(num_new, 0, self.dtype)
        hidden = self(context_hidden_states.to(self.dtype), embed_tokens(next_ids).to(self.dtype), position_ids,
                      attention_mask, layer_cache).last_hidden_state
        hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), num_new - 1]  # [B, H] at each anchor
        one = torch.ones_like(num_new)

        def logits_at(j, previous):
            nonlocal hidden
            if j:  # chain: the drafter's own output stands in for the target's hidden state
                layer_cache, position_ids, attention_mask = cache.prepare(one, 0, self.dtype, num_new_host=1)
                hidden = self(hidden[:, None], embed_tokens(previous[:, None]).to(self.dtype), position_ids,
                              attention_mask, layer_cache).last_hidden_state[:, 0]
            return self.head(hidden, lm_head)

        return draft_loop(logits_at, num_tokens, select, keep_going, anchors)


__all__ = ["MTPDrafter"]
