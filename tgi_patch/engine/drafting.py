"""Batched drafting over a ragged batch: each sequence ingests its own number of new target features into the
drafter's paged KV pool, then drafts after its own anchor. The drafting itself is the family's `drafter.draft`, the
same code the batch-1 `generate()` hook runs; here only the pool is the engine's (`PoolDraftCache`), and the
speculative entries of chained steps are dropped afterwards.

`select(logits [B, V], j)` picks draft token j for every sequence and returns `(tokens [B], probs [B, V] | None,
confidence [B])`: the engine's per-request greedy/sampling choice (`verification.draft_selector`), the drafter's
processed distribution (needed for exact rejection sampling) and the drafter's confidence there (D-Cut's signal).
`keep_going(confidence [B], j)`, if given, is asked after each position whether any sequence could still have
position j + 1 verified; drafting stops when none could (DFly's AR head and MTP's chained steps are sequential: a
position nobody verifies is not computed).
"""

from __future__ import annotations

import torch

from angelspec_hf.attention import GQA_SDPA_ATTENTION
from angelspec_hf.modeling.drafter_utils import DrafterPreTrainedModel

from . import kernels
from .paged import DRAFT_POOL_ATTENTION, PagedKVPool, PoolDraftCache, pages_for


class BatchDrafter:
    def __init__(self, drafter, target, max_seqs: int, kv_cache_tokens: int = 1024):
        drafter.check_target(target)
        if not isinstance(drafter, DrafterPreTrainedModel):
            raise TypeError(f"the batched engine drafts with AngelSpec drafters, not {type(drafter).__name__}")
        self.drafter = drafter
        self.embed = target.get_input_embeddings()
        self.lm_head = drafter.draft_lm_head(target.get_output_embeddings())  # pruned rows, if any
        c = drafter.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.pool = PagedKVPool(c.num_hidden_layers, c.num_key_value_heads, head_dim, drafter.dtype, drafter.device,
                                max_seqs, num_pages=pages_for(kv_cache_tokens))
        self.num_draft_tokens = drafter.num_draft_tokens
        # where a kernel reads the pool (CUDA; a CPU in fp32), the drafter's attention does too, instead of gathering
        # every page (only over SDPA, the drafters' default; the registered function is SDPA for every other call)
        self.in_place = (kernels.reads_pool_in_place(self.pool.k)
                         and drafter.config._attn_implementation in ("sdpa", GQA_SDPA_ATTENTION, DRAFT_POOL_ATTENTION))
        if self.in_place:
            drafter.set_attn_implementation(DRAFT_POOL_ATTENTION)

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    @torch.no_grad()
    def draft(self, slots, features, next_ids, new, anchors, num_tokens, select, keep_going=None, *,
              slots_host: list[int] | None = None, new_host: list[int] | None = None):
        """slots `[B]`; features `[B, n_max, F]` (padded; `new [B]` valid per row) of the tokens accepted since the
        last call; next_ids `[B, n_max]` the token after each of them (MTP's input); anchors `[B]` the last accepted
        token (not yet seen by the target); `slots_host` / `new_host`: `slots` and `new` as host lists (else read).
        Returns tokens `[B, K]`, probs `[B, K, V]` or None, confidence `[B, K]`."""
        slots_host = slots.tolist() if slots_host is None else slots_host
        new_host = new.tolist() if new_host is None else new_host
        context = self.pool.lengths[slots] + new  # what each sequence keeps: its accepted context
        context_host = [self.pool.held[s] + n for s, n in zip(slots_host, new_host)]
        out = self.drafter.draft(features, next_ids, new, anchors, num_tokens, self.embed, self.lm_head, select,
                                 keep_going, cache=PoolDraftCache(self.pool, slots, slots_host, new, new_host,
                                                                 in_place=self.in_place))
        self.pool.set_lengths(slots_host, context_host, slots, context)  # chained (speculative) entries are dropped
        return out
