"""The model runner: everything that touches the models' tensors. It owns the target's paged KV pool, each slot's
anchor (the last emitted token, not yet seen by the target) and the target features of accepted tokens the drafter
has not ingested yet; it builds the inputs of the one packed target forward per step (prompts of new requests,
`[anchor, draft[:depth]]` of the others), runs it, and returns the logits of every verified position; it feeds the
drafter its pending features and times dummy steps for the cost model (`dcut.load_or_profile` takes the runner).

It knows nothing of requests, sampling or D-Cut: the engine hands it slots, token ids and depths."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from angelspec_hf.modeling.draft_policy import clock

from .drafting import BatchDrafter
from .paged import RAGGED_ATTENTION, PagedKVPool, RaggedStep, pages_for


@dataclass
class PackedForward:
    """One step's target forward, as verification and `ModelRunner.advance` need it."""

    logits: torch.Tensor  # [P, V] the logits of the positions some row verifies (only those are computed)
    positions: torch.Tensor  # [B, span] index into `logits` of each row's verified positions: j after draft j - 1
    # (0: the anchor), padded by repeating the row's last
    hidden_states: tuple | None  # the target's hidden states (packed), when the drafter reads features
    step: RaggedStep
    fed: torch.Tensor  # [B, n_max] token ids fed per row
    new: torch.Tensor  # [B] tokens fed per row
    num_prefill: int  # the first rows prefill prompts

    @property
    def scored(self) -> torch.Tensor:
        """`[B, span, V]` logits at each row's verified positions (a copy, padded to the deepest row:
        `verification.verify_forward` reads only the rows it needs where it can)."""
        return self.logits[self.positions]


class ModelRunner:
    def __init__(self, target, drafter, max_batch_size: int, kv_cache_tokens: int = 1024):
        self.target, self.drafter = target.eval(), drafter
        self.max_batch_size = max_batch_size
        self.device = next(target.parameters()).device
        config = target.config.get_text_config()
        if config._attn_implementation != RAGGED_ATTENTION:
            target.set_attn_implementation(RAGGED_ATTENTION)  # plain SDPA for every other call
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pool = PagedKVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, target.dtype,
                                self.device, max_batch_size, num_pages=pages_for(kv_cache_tokens))
        self.batch_drafter = (BatchDrafter(drafter, target, max_batch_size, kv_cache_tokens)
                              if drafter is not None else None)
        self.layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
        self.anchor = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        # Target features of accepted tokens the drafter has not ingested yet: one chunk per step, each row with its
        # owner slot, the token after it and the owner's epoch when it was kept (bumped when the slot is released, so a
        # released slot's rows are dropped without copying the rest). Joined only when the drafter reads them: joined
        # every step (as before), steps without drafting copied every pending feature each time, quadratic in the
        # steps since the last drafting call (at 32 requests of 100-250-token prompts about 60 MB a step: 32 x 200
        # tokens x 2,304 fp32 features).
        self.feat_dim = target.config.hidden_size * len(self.layer_ids)
        self._pending: list[tuple[torch.Tensor, ...]] = []  # (feat [n, F], slot [n], next [n], epoch [n])
        self._epoch = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self._live = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # pending rows per slot
        self._dead = 0  # pending rows of released slots, dropped when the chunks are next joined

    def snapshot(self) -> tuple:
        """What a step writes before it keeps anything (`advance`): the KV lengths of the target's and the drafter's
        pools, the pending features the drafter ingests and the anchors; `restore` puts them back after a step that
        failed. KV entries written past the restored lengths are unused and overwritten; pages a step reserved stay
        with their slot until it is released."""
        drafter_lengths = self.batch_drafter.pool.lengths.clone() if self.batch_drafter is not None else None
        return (self.pool.lengths.clone(), drafter_lengths, list(self._pending), self._live.clone(), self._dead,
                self.anchor.clone())

    def restore(self, saved: tuple) -> None:
        lengths, drafter_lengths, pending, live, dead, anchor = saved
        self.pool.lengths.copy_(lengths)
        if drafter_lengths is not None:
            self.batch_drafter.pool.lengths.copy_(drafter_lengths)
        self._pending, self._dead = pending, dead
        self._live.copy_(live)
        self.anchor.copy_(anchor)

    def release(self, slot: int) -> None:
        """Free everything `slot` holds: its KV pages, its drafter state and its pending features."""
        self.pool.release(slot)
        if self.batch_drafter is not None:
            self.batch_drafter.release(slot)
            self._dead += int(self._live[slot])
            self._live[slot] = 0
            self._epoch[slot] += 1
            if self._dead > int(self._live.sum()):  # so memory follows the live requests' pending rows
                self._pending, self._dead = [self._pending_rows()], 0

    def _pending_rows(self) -> tuple[torch.Tensor, ...]:
        """The pending rows of live slots, oldest first, as one chunk `(feat, slot, next, epoch)`."""
        if not self._pending:
            long = torch.zeros(0, dtype=torch.long, device=self.device)
            return torch.zeros(0, self.feat_dim, dtype=self.target.dtype, device=self.device), long, long, long
        feat, slot, after, epoch = (torch.cat(parts) for parts in zip(*self._pending))
        live = epoch == self._epoch[slot]
        return feat[live], slot[live], after[live], epoch[live]

    # ---- drafting ----------------------------------------------------------------------------------------------------
    def pending(self, slots) -> torch.Tensor:
        """`[B]` target features each of `slots` has waiting for the drafter (what its next drafting call ingests)."""
        return self._live[slots]

    def draft(self, slots, k, select, keep_going=None):
        """Feed each slot's pending target features to the drafter and draft k tokens after its anchor (`select` and
        `keep_going` as `BatchDrafter.draft` takes them); other slots keep theirs pending. Returns tokens `[B, K]`,
        probs `[B, K, V]` or None, confidence `[B, K]`."""
        dev = self.device
        row_of_slot = torch.full((self.max_batch_size,), -1, dtype=torch.long, device=dev)
        row_of_slot[slots] = torch.arange(len(slots), device=dev)
        pending = self._pending_rows()
        pending_feat, pending_slot, pending_next, _ = pending
        rows = row_of_slot[pending_slot]
        order = torch.sort(rows, stable=True).indices
        order = order[rows[order] >= 0]  # by request, oldest first
        rows = rows[order]
        new = torch.bincount(rows, minlength=len(slots))
        cols = torch.arange(len(rows), device=dev) - (new.cumsum(0) - new)[rows]
        n_max = int(new.max())
        features = pending_feat.new_zeros(len(slots), n_max, self.feat_dim)
        features[rows, cols] = pending_feat[order]
        next_ids = torch.zeros(len(slots), n_max, dtype=torch.long, device=dev)
        next_ids[rows, cols] = pending_next[order]
        others = row_of_slot[pending_slot] < 0  # slots not drafting now keep their pending features
        self._pending, self._dead = ([tuple(x[others] for x in pending)] if bool(others.any()) else []), 0
        self._live[slots] = 0
        anchors = self.anchor[slots]
        return self.batch_drafter.draft(slots, features, next_ids, new, anchors, k, select, keep_going)

    # ---- the packed target forward -----------------------------------------------------------------------------------
    def forward(self, slots, prompts: list[list[int]], draft, depth) -> PackedForward:
        """One packed target forward over `slots`: the first `len(prompts)` rows prefill their prompts, the others
        feed `[anchor, draft[:depth]]` (draft `[B, K]`, depth `[B]`)."""
        n_pre, dev = len(prompts), self.device
        new = torch.cat([torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev), 1 + depth[n_pre:]])
        fed = self._fed_tokens(slots, prompts, draft, new)
        step = RaggedStep.build(self.pool, slots, new, packed=True)
        positions = self._positions(new, depth)
        keep = torch.unique(positions)  # sorted: the LM head runs on these only (a prompt needs its last token's)
        out = self._run_target(step, fed[step.token_row, step.token_col][None], logits_to_keep=keep)
        step.commit()
        return PackedForward(out.logits[0], torch.searchsorted(keep, positions), out.hidden_states, step, fed, new,
                             n_pre)

    def _fed_tokens(self, slots, prompts, draft, new) -> torch.Tensor:
        """`[B, n_max]`: a new request's prompt (once per request), else its anchor then its draft tokens."""
        n_pre, k = len(prompts), draft.shape[1]
        n_max = int(new.max())
        fed = torch.zeros(len(slots), n_max, dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):
            fed[i, : len(prompt)] = torch.tensor(prompt, device=self.device)
        if len(slots) > n_pre:
            fed[n_pre:, 0] = self.anchor[slots[n_pre:]]
            if k:
                fed[n_pre:, 1 : 1 + k] = draft[n_pre:, : n_max - 1] if n_max - 1 < k else draft[n_pre:]
        return fed

    def _run_target(self, step: RaggedStep, input_ids, logits_to_keep=0):
        """The target over the packed tokens `input_ids [1, T]` of `step` (hidden states of the drafter's layers),
        with logits at the packed positions `logits_to_keep` (0: all)."""
        positions = (step.held[step.token_row] + step.token_col)[None]
        kwargs = {"output_hidden_states": [i + 1 for i in self.layer_ids]} if self.layer_ids else {}
        return self.target(input_ids=input_ids, position_ids=positions, use_cache=False, ragged=step,
                           logits_to_keep=logits_to_keep, **kwargs)

    @staticmethod
    def _positions(new, depth) -> torch.Tensor:
        """`[B, span]` packed indices of each row's last `depth + 1` fed tokens (padded by repeating its last one)."""
        ends = new.cumsum(0) - 1  # packed index of each row's last fed token
        span = int(depth.max()) + 1 if len(depth) else 1
        ar = torch.arange(span, device=new.device)[None, :]
        return (ends - depth)[:, None] + torch.minimum(ar, depth[:, None])

    def advance(self, fwd: PackedForward, slots, num_accepted, emitted, next_token) -> None:
        """Keep what verification accepted: each slot's KV length, the features the drafter will read, the anchor.
        emitted `[B, span]`: the accepted drafts then the next token; next_token `[B]`."""
        kept = torch.where(torch.arange(len(slots), device=slots.device) < fwd.num_prefill, fwd.new, 1 + num_accepted)
        self.pool.lengths[slots] = fwd.step.held + kept
        if self.batch_drafter is not None:
            self._keep_features(fwd, slots, kept, emitted, num_accepted)
        self.anchor[slots] = next_token

    def _keep_features(self, fwd: PackedForward, slots, kept, emitted, num_accepted):
        """Queue the target features of the tokens kept this step (and the token after each) for the drafter."""
        step, fed = fwd.step, fwd.fed
        keep = step.token_col < kept[step.token_row]
        feats = torch.cat([fwd.hidden_states[i + 1][0] for i in self.layer_ids], -1)[keep]
        rows, cols = step.token_row[keep], step.token_col[keep]
        # the token after fed[r, c]: the next fed token, or the token emitted after the last kept one
        after = torch.cat([fed[:, 1:], fed.new_zeros(len(fed), 1)], 1)
        last = cols == kept[rows] - 1
        next_ids = torch.where(last, emitted[rows, num_accepted[rows]], after[rows, cols])
        owners = slots[rows]
        self._pending.append((feats.to(self.target.dtype), owners, next_ids, self._epoch[owners]))
        self._live.index_add_(0, owners, torch.ones_like(owners))

    # ---- profiling ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def time_dummy_steps(self, rows: int, tokens_per_row, context: int, repeats: int = 2,
                         draft_features=(1,)) -> list[dict]:
        """For `rows` dummy sequences of `context` tokens: the median seconds of one verification forward adding each
        of `tokens_per_row` tokens per sequence, and of one drafting call after each of `draft_features` pending
        features per sequence (samples `draft`, `draft_features`; one per sample from the first). Uses idle slots and
        gives them back."""
        if any(self.pool.num_pages):  # a request holds KV pages: it is running
            raise RuntimeError("profile the cost model before serving requests")
        slots = torch.arange(rows, device=self.device)
        vocab = self.target.config.get_text_config().vocab_size
        _, step = self._time_verify(slots, context, vocab)
        step.commit()
        samples = []
        for t in tokens_per_row:
            sample = {"rows": rows, "tokens_per_row": t,
                      "verify": statistics.median(self._time_verify(slots, t, vocab)[0] for _ in range(repeats))}
            samples.append(sample)
        if self.batch_drafter is not None:
            for sample, features in zip(samples, draft_features):
                sample["draft"] = self._time_draft(slots, features, vocab, repeats)
                sample["draft_features"] = features
        for s in range(rows):
            self.pool.release(s)
            if self.batch_drafter is not None:
                self.batch_drafter.release(s)
        return samples

    def _time_verify(self, slots, count: int, vocab: int):
        """Seconds of one target forward adding `count` random tokens to each of `slots`, and its (uncommitted) step."""
        step = RaggedStep.build(self.pool, slots, torch.full((len(slots),), count, device=self.device), packed=True)
        ids = torch.randint(3, vocab, (1, len(step.token_row)), device=self.device)
        start = clock(self.device)
        self._run_target(step, ids)
        return clock(self.device) - start, step

    def _time_draft(self, slots, t: int, vocab: int, repeats: int) -> float:
        """Median seconds of one drafting call after `t` random features per slot (the drafter's KV left empty)."""
        rows, dev = len(slots), self.device
        features = torch.randn(rows, t, self.feat_dim, dtype=self.target.dtype, device=dev)
        ids = torch.randint(3, vocab, (rows, t), device=dev)

        def select(logits, j):
            conf, token = torch.softmax(logits.float(), -1).max(-1)
            return token, None, conf

        def draft():
            start = clock(dev)
            self.batch_drafter.draft(slots, features, ids, torch.full((rows,), t, device=dev), ids[:, -1],
                                     self.batch_drafter.num_draft_tokens, select)
            seconds = clock(dev) - start
            self.batch_drafter.pool.lengths[slots] = 0
            return seconds

        return statistics.median(draft() for _ in range(repeats))
