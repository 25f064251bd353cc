"""The model runner: everything that touches the models' tensors. It owns the target's paged KV pool, each slot's
anchor (the last emitted token, not yet seen by the target) and the target features of accepted tokens the drafter
has not ingested yet; it builds the inputs of the one packed target forward per step (prompts of new requests,
`[anchor, draft[:depth]]` of the others), runs it, and returns the logits of every verified position; it feeds the
drafter its pending features and times dummy steps for the cost model (`angelspec_hf.policy.load_or_profile` takes the runner).

It knows nothing of requests, sampling or D-Cut: the engine hands it slots, token ids and depths, each also as host
integers where a shape depends on it, so that it never reads the device to size a step: its per-slot state (KV
lengths, page tables, anchors, pending-feature counts) lives in persistent device tensors updated in place, with host
mirrors of the counts."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from angelspec_hf.policy import clock

from . import kernels
from .drafting import BatchDrafter
from .paged import RAGGED_ATTENTION, PagedKVPool, RaggedStep, pages_for
from .transfer import upload


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
        # the packed target's attention where it is not the reference's gather + SDPA on this device: its steps cost
        # otherwise, so the engine's cost profiles are keyed by it, the kernel's version and whether the drafter reads
        # its pool through it (`policy.load_or_profile`); None keeps old keys
        cpu_kernel = (self.device.type == "cpu" and self.pool.k.dtype == torch.float32
                      and kernels.cpu_attention.enabled() and kernels.cpu_attention.available())
        self.attention_kind = f"cpu-kernel:{kernels.cpu_attention.source_version()}" if cpu_kernel else None
        if cpu_kernel and self.batch_drafter is not None and self.batch_drafter.in_place:
            self.attention_kind += ";drafter"  # the drafter's attention reads its pool through the kernel too
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
        self._live_host = [0] * max_batch_size  # the same, on the host
        self._dead = 0  # pending rows of released slots, dropped when the chunks are next joined
        # Given to the packed forward as its (prepared, 4-D) attention mask, which transformers then passes through
        # untouched: ragged attention builds its own masks, and without one transformers would build a `[T, T]`
        # mask for nothing, after reading the positions back to look for packed sequences
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    def snapshot(self) -> tuple:
        """What a step writes before it keeps anything (`advance`): the KV lengths of the target's and the drafter's
        pools, the pending features the drafter ingests and the anchors; `restore` puts them back after a step that
        failed. KV entries written past the restored lengths are unused and overwritten; pages a step reserved stay
        with their slot until it is released."""
        drafter = self.batch_drafter
        drafter_lengths = (drafter.pool.lengths.clone(), list(drafter.pool.held)) if drafter is not None else None
        return ((self.pool.lengths.clone(), list(self.pool.held)), drafter_lengths, list(self._pending),
                (self._live.clone(), list(self._live_host)), self._dead, self.anchor.clone())

    def restore(self, saved: tuple) -> None:
        lengths, drafter_lengths, pending, live, dead, anchor = saved
        self.pool.lengths.copy_(lengths[0])
        self.pool.held[:] = lengths[1]
        if drafter_lengths is not None:
            self.batch_drafter.pool.lengths.copy_(drafter_lengths[0])
            self.batch_drafter.pool.held[:] = drafter_lengths[1]
        self._pending, self._dead = pending, dead
        self._live.copy_(live[0])
        self._live_host[:] = live[1]
        self.anchor.copy_(anchor)

    def release(self, slot: int) -> None:
        """Free everything `slot` holds: its KV pages, its drafter state and its pending features."""
        self.pool.release(slot)
        if self.batch_drafter is not None:
            self.batch_drafter.release(slot)
            self._dead += self._live_host[slot]
            self._live[slot] = 0
            self._live_host[slot] = 0
            self._epoch[slot] += 1
            if self._dead > sum(self._live_host):  # so memory follows the live requests' pending rows
                self._pending, self._dead = [self._pending_rows()], 0

    def _joined(self) -> tuple[torch.Tensor, ...]:
        """Every pending chunk joined, `(feat, slot, next, epoch)` (rows of released slots included)."""
        if not self._pending:
            long = torch.zeros(0, dtype=torch.long, device=self.device)
            return torch.zeros(0, self.feat_dim, dtype=self.target.dtype, device=self.device), long, long, long
        return tuple(torch.cat(parts) for parts in zip(*self._pending))

    def _pending_rows(self) -> tuple[torch.Tensor, ...]:
        """The pending rows of live slots, oldest first, as one chunk `(feat, slot, next, epoch)` (selected by a
        stable sort, live rows first, and the host's count of them: no read of the device)."""
        pending = self._joined()
        live = pending[3] == self._epoch[pending[1]]
        order = torch.sort((~live).to(torch.uint8), stable=True).indices[: sum(self._live_host)]
        return tuple(x[order] for x in pending)

    # ---- drafting ----------------------------------------------------------------------------------------------------
    def pending(self, slots) -> torch.Tensor:
        """`[B]` target features each of `slots` has waiting for the drafter (what its next drafting call ingests)."""
        return self._live[slots]

    def pending_host(self, slots: list[int]) -> list[int]:
        """`pending` of `slots` (a list), from the host's mirror."""
        return [self._live_host[s] for s in slots]

    def draft(self, slots, k, select, keep_going=None, *, slots_host: list[int] | None = None):
        """Feed each slot's pending target features to the drafter and draft k tokens after its anchor (`select` and
        `keep_going` as `BatchDrafter.draft` takes them); other slots keep theirs pending. `slots_host`: `slots` as
        a host list (else read). Returns tokens `[B, K]`, probs `[B, K, V]` or None, confidence `[B, K]`."""
        dev = self.device
        slots_host = slots.tolist() if slots_host is None else slots_host
        new_host = self.pending_host(slots_host)
        taken, live = sum(new_host), sum(self._live_host)
        row_of_slot = torch.full((self.max_batch_size,), len(slots_host), dtype=torch.long, device=dev)
        row_of_slot[slots] = torch.arange(len(slots_host), device=dev)
        pending = self._joined()
        pending_feat, pending_slot, pending_next, pending_epoch = pending
        # one stable sort: the drafting rows' features by request, oldest first; then the other live slots' (kept
        # pending, in their order); then the rows of released slots (dropped). The host knows how many of each.
        rows = row_of_slot[pending_slot]
        dead = pending_epoch != self._epoch[pending_slot]
        order = torch.sort(torch.where(dead, len(slots_host) + 1, rows), stable=True).indices
        order, others = order[:taken], order[taken:live]
        rows = rows[order]
        new = upload(new_host, dev)
        cols = torch.arange(taken, device=dev) - (new.cumsum(0) - new)[rows]
        n_max = max(new_host, default=0)
        features = pending_feat.new_zeros(len(slots_host), n_max, self.feat_dim)
        features[rows, cols] = pending_feat[order]
        next_ids = torch.zeros(len(slots_host), n_max, dtype=torch.long, device=dev)
        next_ids[rows, cols] = pending_next[order]
        self._pending, self._dead = ([tuple(x[others] for x in pending)] if live > taken else []), 0
        self._live[slots] = 0
        for s in slots_host:
            self._live_host[s] = 0
        anchors = self.anchor[slots]
        return self.batch_drafter.draft(slots, features, next_ids, new, anchors, k, select, keep_going,
                                        slots_host=slots_host, new_host=new_host)

    # ---- the packed target forward -----------------------------------------------------------------------------------
    def forward(self, slots, prompts: list[list[int]], draft, depth, *, slots_host: list[int] | None = None,
                depth_host: list[int] | None = None) -> PackedForward:
        """One packed target forward over `slots`: the first `len(prompts)` rows prefill their prompts, the others
        feed `[anchor, draft[:depth]]` (draft `[B, K]`, depth `[B]`). `slots_host` / `depth_host`: `slots` and
        `depth` as host lists, from which every shape is taken (else they are read)."""
        n_pre, dev = len(prompts), self.device
        slots_host = slots.tolist() if slots_host is None else slots_host
        depth_host = depth.tolist() if depth_host is None else depth_host
        new_host = [len(p) for p in prompts] + [1 + d for d in depth_host[n_pre:]]
        new = torch.cat([upload(new_host[:n_pre], dev), 1 + depth[n_pre:]])
        fed = self._fed_tokens(slots, prompts, draft, max(new_host, default=0))
        step = RaggedStep.build(self.pool, slots, new, packed=True, slots_host=slots_host, new_host=new_host)
        # the LM head runs on the positions some row verifies only (a prompt needs its last token's): `keep`, sorted,
        # and each row's verified positions as indices into it, both from the host's counts
        positions = self._positions_host(new_host, depth_host)
        keep = sorted({p for row in positions for p in row})
        index = {p: i for i, p in enumerate(keep)}
        out = self._run_target(step, fed[step.token_row, step.token_col][None], logits_to_keep=upload(keep, dev))
        step.commit()
        return PackedForward(out.logits[0], upload([[index[p] for p in row] for row in positions], dev),
                             out.hidden_states, step, fed, new, n_pre)

    def _fed_tokens(self, slots, prompts, draft, n_max: int) -> torch.Tensor:
        """`[B, n_max]`: a new request's prompt (once per request), else its anchor then its draft tokens."""
        n_pre, k = len(prompts), draft.shape[1]
        fed = torch.zeros(len(slots), n_max, dtype=torch.long, device=self.device)
        if prompts:  # every prompt in one copy
            fed[:n_pre] = upload([p + [0] * (n_max - len(p)) for p in prompts], self.device)
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
        return self.target(input_ids=input_ids, position_ids=positions, attention_mask=self._no_mask, use_cache=False,
                           ragged=step, logits_to_keep=logits_to_keep, **kwargs)

    @staticmethod
    def _positions(new, depth) -> torch.Tensor:
        """`_positions_host` of tensors, as a tensor on their device (reads them: for callers outside a step)."""
        return torch.tensor(ModelRunner._positions_host(new.tolist(), depth.tolist()), device=new.device)

    @staticmethod
    def _positions_host(new: list[int], depth: list[int]) -> list[list[int]]:
        """`[B][span]` packed indices of each row's last `depth + 1` fed tokens (padded by repeating its last one)."""
        span = max(depth, default=0) + 1
        ends, total = [], 0
        for n in new:  # packed index of each row's last fed token
            total += n
            ends.append(total - 1)
        return [[e - d + min(j, d) for j in range(span)] for e, d in zip(ends, depth)]

    def advance(self, fwd: PackedForward, slots, num_accepted, emitted, next_token, *,
                num_accepted_host: list[int] | None = None) -> None:
        """Keep what verification accepted: each slot's KV length, the features the drafter will read, the anchor.
        emitted `[B, span]`: the accepted drafts then the next token; next_token `[B]`; `num_accepted_host`: the
        accepted counts as a host list (else read)."""
        if num_accepted_host is None:
            num_accepted_host = num_accepted.tolist()
        step = fwd.step
        kept_host = step.new_host[: fwd.num_prefill] + [1 + n for n in num_accepted_host[fwd.num_prefill:]]
        kept = torch.where(torch.arange(len(slots), device=slots.device) < fwd.num_prefill, fwd.new, 1 + num_accepted)
        self.pool.set_lengths(step.slots_host, [h + k for h, k in zip(step.held_host, kept_host)], slots,
                              step.held + kept)
        if self.batch_drafter is not None:
            self._keep_features(fwd, slots, kept, emitted, num_accepted, kept_host)
        self.anchor[slots] = next_token

    def _keep_features(self, fwd: PackedForward, slots, kept, emitted, num_accepted, kept_host: list[int]):
        """Queue the target features of the tokens kept this step (and the token after each) for the drafter."""
        step, fed = fwd.step, fwd.fed
        keep_host, start = [], 0
        for n, k in zip(step.new_host, kept_host):  # packed indices of the kept tokens: each row's first `kept`
            keep_host += range(start, start + k)
            start += n
        keep = upload(keep_host, self.device)
        feats = torch.cat([fwd.hidden_states[i + 1][0] for i in self.layer_ids], -1)[keep]
        rows, cols = step.token_row[keep], step.token_col[keep]
        # the token after fed[r, c]: the next fed token, or the token emitted after the last kept one
        after = torch.cat([fed[:, 1:], fed.new_zeros(len(fed), 1)], 1)
        last = cols == kept[rows] - 1
        next_ids = torch.where(last, emitted[rows, num_accepted[rows]], after[rows, cols])
        owners = slots[rows]
        self._pending.append((feats.to(self.target.dtype), owners, next_ids, self._epoch[owners]))
        self._live.index_add_(0, owners, torch.ones_like(owners))
        for s, k in zip(step.slots_host, kept_host):
            self._live_host[s] += k

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
            self.batch_drafter.pool.set_lengths(slots.tolist(), [0] * rows)
            return seconds

        return statistics.median(draft() for _ in range(repeats))
