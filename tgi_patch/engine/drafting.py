"""Batched drafting for every drafter family over a ragged batch: each sequence ingests its own number of new target
features into the drafter's paged KV pool, then drafts a block after its own anchor.

`select(logits [B, V], j)` picks draft token j for every sequence and returns `(tokens [B], probs [B, V] | None,
confidence [B])`: the engine's per-request greedy/sampling choice (`verification.draft_selector`), the drafter's
processed distribution (needed for exact rejection sampling) and the drafter's confidence there (D-Cut's signal). `keep_going(confidence [B], j)`, if
given, is asked after each position whether any sequence could still have position j + 1 verified; drafting stops
when none could (DFly's AR head and MTP's chained steps are sequential: a position nobody verifies is not computed).
"""

from __future__ import annotations

import torch

from angelspec_hf.modeling import DFlashDrafter, MTPDrafter

from .paged import PagedKVPool, PoolCache, RaggedStep


class BatchDrafter:
    def __init__(self, drafter, target, max_seqs: int):
        drafter.check_target(target)
        if not isinstance(drafter, (DFlashDrafter, MTPDrafter)):
            raise TypeError(f"the batched engine drafts with AngelSpec drafters, not {type(drafter).__name__}")
        self.drafter = drafter
        self.embed = target.get_input_embeddings()
        self.lm_head = drafter.draft_lm_head(target.get_output_embeddings())  # pruned rows, if any
        c = drafter.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.pool = PagedKVPool(c.num_hidden_layers, c.num_key_value_heads, head_dim, drafter.dtype, drafter.device,
                                max_seqs)
        self.num_draft_tokens = drafter.num_draft_tokens
        self.needs_next_ids = isinstance(drafter, MTPDrafter)

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    @torch.no_grad()
    def draft(self, slots, features, next_ids, new, anchors, num_tokens, select, keep_going=None):
        """slots `[B]`; features `[B, n_max, F]` (padded; `new [B]` valid per row) of the tokens accepted since the
        last call; next_ids `[B, n_max]` the token after each of them (MTP's input); anchors `[B]` the last accepted
        token (not yet seen by the target). Returns tokens `[B, K]`, probs `[B, K, V]` or None, confidence `[B, K]`."""
        features = features.to(self.drafter.dtype)
        if isinstance(self.drafter, MTPDrafter):
            steps = self._mtp(slots, features, next_ids, new, num_tokens, select, keep_going)
        else:
            steps = self._block(slots, features, new, anchors, num_tokens, select, keep_going)
        if not steps:
            empty = anchors.new_zeros(len(slots), 0)
            return empty, None, empty.float()
        tokens, probs, conf = zip(*steps)
        probs = None if probs[0] is None else torch.stack(probs, 1)
        return torch.stack(tokens, 1), probs, torch.stack(conf, 1)

    def _block(self, slots, features, new, anchors, num_tokens, select, keep_going):
        drafter, block = self.drafter, self.drafter.config.block_size
        step = RaggedStep.build(self.pool, slots, new, packed=False)
        cache = PoolCache(step, transient=block)
        n_max = features.shape[1]
        ar = torch.arange(max(n_max, block), device=slots.device)[None, :]
        positions = torch.cat([step.held[:, None] + ar[:, :n_max], (step.held + new)[:, None] + ar[:, :block]], 1)
        masks = anchors.new_full((len(slots), block - 1), drafter.config.mask_token_id)
        noise = self.embed(torch.cat([anchors[:, None], masks], 1)).to(drafter.dtype)
        hidden = drafter(noise, features, position_ids=positions, attention_mask=cache.block_mask(block, noise.dtype),
                         cache=cache).last_hidden_state
        step.commit()
        out, previous = [], anchors
        for j in range(num_tokens):
            row = hidden[:, j + 1]
            if getattr(drafter, "ar_head", None) is not None:
                logits = drafter.ar_logits(row, previous, self.embed, self.lm_head)
            else:
                logits = self.lm_head(row.to(self.lm_head.weight.dtype))
            previous, probs, conf = select(logits, j)
            out.append((previous, probs, conf))
            if keep_going is not None and not keep_going(conf, j):
                break
        return out

    def _mtp(self, slots, features, next_ids, new, num_tokens, select, keep_going):
        drafter = self.drafter
        step = RaggedStep.build(self.pool, slots, new, packed=False)
        positions = step.query_positions()
        hidden = drafter(features, self.embed(next_ids).to(drafter.dtype), position_ids=positions,
                         attention_mask=step.causal_mask(features.dtype), cache=PoolCache(step)).last_hidden_state
        step.commit()
        base = self.pool.lengths[slots].clone()
        hidden = hidden[torch.arange(len(slots), device=slots.device), new - 1]  # [B, H]
        ones = torch.ones_like(new)
        out = []
        for j in range(num_tokens):
            token, probs, conf = select(drafter.head(hidden, self.lm_head), j)
            out.append((token, probs, conf))
            if keep_going is not None and not keep_going(conf, j):
                break
            if j + 1 < num_tokens:  # chain: the drafter's own output stands in for the target's hidden state
                chain = RaggedStep.build(self.pool, slots, ones, packed=False)
                hidden = drafter(hidden[:, None], self.embed(token[:, None]).to(drafter.dtype),
                                 position_ids=chain.held[:, None], attention_mask=chain.causal_mask(hidden.dtype),
                                 cache=PoolCache(chain)).last_hidden_state[:, 0]
                chain.commit()
        self.pool.lengths[slots] = base  # speculative entries are dropped
        return out
