"""Attention of a DFlash / DFly training forward, without the work its mask throws away.

A training forward packs A blocks of B rows per sequence into one call (`trainer.pack_blocks`): the queries are the
A·B block rows, the keys the T context tokens followed by the same A·B rows, and each block sees the context before
its anchor and the B rows of its own block, never another block. Dense attention over that mask computes
A·B × (T + A·B) scores of which A·B × (T + B) are kept (at 128 anchors of 8 on 250-token sequences, a fifth). This
function computes only those: the context scores `[A·B, T]` under the context mask, each block's own `[B, B]`, one
softmax over both, so the result is dense attention's under the full mask (to rounding). It is registered with
transformers' `AttentionInterface` as `angelspec_block_training` and selected by `DrafterTrainer` for its training
steps only, with `--block_sparse_attention true` (`block_training_attention`); inference never uses it.

Measured on a 2-core CPU (docs/training.md): one layer's attention forward and backward at the CPU recipe's shapes
takes a third of dense SDPA's time, and an eager drafter step 15% less; under `--compile_drafter` the compiled dense
step is as fast, so the CPU defaults leave it off.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

BLOCK_TRAINING_ATTENTION = "angelspec_block_training"


def block_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query `[N, H, A·B, D]`; key / value `[N, Hkv, T + A·B, D]` (context, then the blocks' rows); `attention_mask`
    the context part only: additive `[N, 1, A·B, T]`. B is `module.config.block_size`. Returns `([N, A·B, H, D], None)`
    as transformers' attention functions do."""
    if dropout:
        raise ValueError("block training attention has no dropout")
    n, heads, rows, dim = query.shape
    kv_heads, block = key.shape[1], module.config.block_size
    context, anchors, group = key.shape[2] - rows, rows // block, heads // key.shape[1]
    if rows % block or context < 0 or attention_mask is None or attention_mask.shape[-1] != context:
        raise ValueError(f"block training attention needs A·B query rows (B = {block}) after T context keys and a "
                         f"context mask [N, 1, A·B, T]; got query {tuple(query.shape)}, key {tuple(key.shape)}, mask "
                         f"{None if attention_mask is None else tuple(attention_mask.shape)}")
    scale = dim**-0.5 if scaling is None else scaling
    # query heads h·group .. h·group + group - 1 share key head h, as in SDPA's enable_gqa
    grouped = query.reshape(n, kv_heads, group * rows, dim)
    context_scores = (grouped @ key[:, :, :context].transpose(-1, -2)).view(n, heads, rows, context) * scale
    context_scores = context_scores + attention_mask
    block_query = query.reshape(n, kv_heads, group, anchors, block, dim)
    block_key = key[:, :, context:].reshape(n, kv_heads, 1, anchors, block, dim)
    block_value = value[:, :, context:].reshape(n, kv_heads, 1, anchors, block, dim)
    block_scores = (block_query @ block_key.transpose(-1, -2)).view(n, heads, anchors, block, block) * scale
    scores = torch.cat([context_scores.view(n, heads, anchors, block, context), block_scores], dim=-1)
    weights = scores.float().softmax(-1).to(query.dtype)
    out = weights[..., :context].reshape(n, kv_heads, group * rows, context) @ value[:, :, :context]
    out = out.view(n, heads, rows, dim) + (
        weights[..., context:].reshape(n, kv_heads, group, anchors, block, block) @ block_value
    ).view(n, heads, rows, dim)
    return out.transpose(1, 2), None


AttentionInterface.register(BLOCK_TRAINING_ATTENTION, block_attention)


@contextlib.contextmanager
def block_training_attention(drafter):
    """Inside: `drafter`'s attention layers run `block_attention` (pass them the context mask only); after, what they
    ran before."""
    config = drafter.config
    before = config._attn_implementation
    config._attn_implementation = BLOCK_TRAINING_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
