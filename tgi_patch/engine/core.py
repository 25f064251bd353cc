"""A continuous-batching speculative engine with D-Cut adaptive verification.

Each `step()`: requests waiting for a slot join (their prompts are prefilled in the same target forward as everyone
else's verification); D-Cut decides what kind of step this is (the drafter runs, or only n-gram lookups are proposed,
or nothing); the drafter proposes a block per running request with a confidence per token; D-Cut chooses which
draft tokens to verify (a prefix per request, the globally most likely to be accepted, under a budget); the target
verifies all of them, for all requests, in **one** packed forward; every request advances by its own accepted count.

Lossless: a greedy request's tokens equal its own plain greedy decoding whatever else is in the batch; a seeded sampled
request's equal its own plain sampling with that seed (Gumbel-max draws from noise keyed by its seed, position and
token, its drafts coupled to the same noise), and an unseeded one is exact rejection sampling (`sampling.py`).

    engine = SpeculativeEngine(target, drafter, verify="auto")
    rid = engine.add_request(input_ids, SamplingParams(max_new_tokens=64))
    for events in engine.steps():  # step() until every request is done (the server's worker steps on its own)
        for event in events: ...

This module only orchestrates; each job has its module: `scheduler.py` (who runs), `model_runner.py` (the models'
tensors: KV pool, the packed forward, drafting inputs, profiling), `dcut.py` (what to draft and verify),
`verification.py` (sampling and acceptance), `request.py` (what goes in and comes out).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, fields, replace

import torch

from angelspec_hf.modeling.candidate_generator import mean_accepted_length
from angelspec_hf.policy import (CostModel, GrowingCorpus, StepKind, clock, draft_confidence, load_or_profile,
                                 plan_acceptance)
from angelspec_hf.prompts import chat_ids

from . import verification
from .config import EngineConfig
from .dcut import DCutPolicy, LookupChoice, parse_verify
from .model_runner import ModelRunner, PackedForward
from .request import FINISH_ERROR, Request, SamplingParams, StepTrace, TokenEvent, int64_seed
from .sampling import PenaltyState
from .scheduler import ScheduledBatch, Scheduler
from .transfer import upload

logger = logging.getLogger(__name__)

@dataclass
class Proposal:
    """The draft tokens a step may verify, per row of its `ScheduledBatch` (prefilling rows carry none)."""

    tokens: torch.Tensor  # [B, K]
    probs: torch.Tensor | None  # [B, K, V] the drafter's processed distribution q (None: every request greedy)
    conf: torch.Tensor | None  # [B, K] D-Cut's confidence (None: nothing drafted)
    lookup: torch.Tensor | None  # [B] bool: the row carries an n-gram lookup instead of the drafter's block
    num_drafted: torch.Tensor  # [B] valid draft tokens per row
    kind: StepKind  # DRAFT (the drafter ran), PROBE (it ran for a few rows), LOOKUP (n-gram lookups only) or PLAIN
    drafter_rows: torch.Tensor | None = None  # [B] bool: the rows the drafter drafted (None: it did not run)
    full_rows: torch.Tensor | None = None  # [B] bool: those of them whose whole block may be verified
    draft_seconds: float = 0.0  # the drafting call's wall time
    draft_rows: int = 0  # the rows of the drafting call
    draft_features: int = 0  # the padded pending feature positions it ingested
    num_drafted_host: list[int] | None = None  # `num_drafted` where the host knows it without reading it
    corpus: torch.Tensor | None = None  # [B] bool: of the `lookup` rows, those carrying a corpus lookup

    @property
    def drafted(self) -> bool:
        return self.kind.drafts

    @property
    def proposed(self) -> torch.Tensor:
        """`[B]` bool: the rows that carry a proposal (the drafter's block or an n-gram lookup)."""
        rows = torch.zeros_like(self.num_drafted, dtype=torch.bool)
        if self.drafter_rows is not None:
            rows |= self.drafter_rows
        if self.lookup is not None:
            rows |= self.lookup
        return rows


@dataclass
class Drafted(LookupChoice):
    """What `_draft` proposes: `LookupChoice`'s fields (`use` None when lookups are off; `lengths` None when every
    decoding row carries the whole block), the rows the drafter drafted (`drafter_rows [n_dec]` bool) and how many
    positions it drafted (`width`: its block, or fewer where drafting stopped early)."""

    drafter_rows: torch.Tensor | None = None
    width: int = 0


class SpeculativeEngine:
    """Continuous batching with speculative decoding: `add_request`, then `step()` until `has_work` is False.

    Its settings are an `EngineConfig` (`config`; `self.config` holds it; each field's help says what it does, as
    `angelspec serve --help` lists them); each of its fields may also be given as a keyword argument, which overrides
    the config's (`dataclasses.replace`, validated again); any other keyword is a `TypeError`. `cost_model` (a fixed
    `CostModel`, else profiled once and cached in `config.cost_model_cache`) and `calibrator` (an
    `AcceptanceCalibrator` to start from) are runtime objects, not settings."""

    KV_TOKENS_PER_SEQUENCE = 1024

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, *, cost_model=None, calibrator=None,
                 **overrides):
        unknown = sorted(set(overrides) - {f.name for f in fields(EngineConfig)})
        if unknown:
            raise TypeError(f"SpeculativeEngine got unexpected keyword argument(s) {', '.join(unknown)}; the settings "
                            f"are EngineConfig's fields: {', '.join(f.name for f in fields(EngineConfig))}")
        config = replace(config or EngineConfig(), **overrides)  # validated again with the overrides
        self.config = config
        if drafter is not None:
            drafter.check_target(target)
        mode, mode_value = parse_verify(config.verify)
        self.target, self.drafter = target, drafter
        self.max_batch_size = max_batch_size = config.max_batch_size
        self.isolate_faults = config.isolate_faults
        self.max_prefill_tokens = config.max_prefill_tokens
        kv_cache_tokens = config.kv_cache_tokens
        if kv_cache_tokens is None:
            kv_cache_tokens = max_batch_size * self.KV_TOKENS_PER_SEQUENCE
        self.runner = ModelRunner(target, drafter, max_batch_size, kv_cache_tokens)
        self.device = self.runner.device
        self.early_stop_drafting = (self.device.type == "cpu" if config.early_stop_drafting is None
                                    else config.early_stop_drafting)
        text_config = target.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_total_tokens = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        eos = target.generation_config.eos_token_id if target.generation_config is not None else None
        self.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        # n-gram lookup proposals: the drafter config's `lookup_tokens` unless given
        lookup_tokens = config.lookup_tokens
        if lookup_tokens is None:
            lookup_tokens = getattr(drafter.config, "lookup_tokens", 0) if drafter is not None else 0
        self.policy = DCutPolicy(
            mode, mode_value, cost_model=cost_model, calibrator=calibrator, probe_every=config.probe_every,
            load_cost_model=lambda: load_or_profile(self.runner, config.cost_model_cache),
            lookup_tokens=lookup_tokens,
            lookup_max_ngram=getattr(drafter.config, "lookup_max_ngram", 3) if drafter is not None else 3,
            measure=config.measure_rates, plan=self.plan_acceptance)
        self.policy.calibrator.to(self.device)  # updated and read by every step where the step runs
        self.policy.lookup_calibrator.to(self.device)
        # lookups in the drafter's corpus of the target's earlier outputs, beside the n-gram ones
        self.policy.corpus = getattr(drafter, "lookup_corpus", None) if lookup_tokens else None
        if hasattr(self.policy.corpus, "warm"):  # its suffix array built now, not inside the first step that looks up
            self.policy.corpus.warm()
        if lookup_tokens and config.corpus_window_tokens:  # and in the replies it serves (`GrowingCorpus`)
            self.policy.corpus = GrowingCorpus(self.policy.corpus, config.corpus_window_tokens)
        self.policy.corpus_calibrator.to(self.device)
        self.scheduler = Scheduler(max_batch_size, config.max_prefill_tokens, release=self._release)
        self.last_step: StepTrace | None = None
        self._probe_rows_host: list[int] | None = None  # a probe's rows as `_propose` chose them, for `_draft`
        self.totals = {"steps": 0, "speculative_steps": 0, "tokens": 0, "decode_row_steps": 0, "drafted": 0,
                       "verified": 0, "accepted": 0, "pruned": 0, "lookup_rows": 0, "corpus_rows": 0, "lookup_steps": 0,
                       "requests_finished": 0, "seconds": 0.0}
        if self.policy.mode == "auto":
            _ = self.cost_model  # profiled (or read from the cache) now, before any request: it uses idle slots

    # ---- public API --------------------------------------------------------------------------------------------------
    @property
    def cost_model(self) -> CostModel:
        return self.policy.cost_model

    @property
    def pool(self):
        """The target's paged KV pool."""
        return self.runner.pool

    @property
    def batch_drafter(self):
        return self.runner.batch_drafter

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def steps(self):
        """`step()` while there is work, yielding each step's events; requests added meanwhile are served too."""
        while self.has_work():
            yield self.step()

    def add_request(self, input_ids, params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        params.validate()
        prompt = self._checked_prompt(input_ids, params)
        seed = int64_seed(params.seed) if params.seed is not None else random.getrandbits(62)
        stop = frozenset(params.stop_token_ids if params.stop_token_ids is not None else self.eos_ids)
        request = Request(self.scheduler.new_id(), prompt, params, seed, stop)
        if params.penalised:
            request.penalties = PenaltyState(prompt, self.vocab_size, self.device)
        self.scheduler.add(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        self.scheduler.cancel(request_id)

    @property
    def stats(self) -> dict:
        t = self.totals
        rounds = t["decode_row_steps"]
        stats = dict(t)
        stats["mean_accepted_length"] = mean_accepted_length(t["accepted"], rounds)
        stats["tokens_per_second"] = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
        stats["running"], stats["waiting"] = self.num_running, self.num_waiting
        stats["last_budget"] = self.last_step.budget if self.last_step else 0
        stats["last_choice"] = self.last_step.choice if self.last_step else "plain"
        stats["calibration_error"] = self.policy.calibrator.calibration_error()
        stats["reliability"] = self.policy.calibrator.reliability()
        stats["kv_tokens_allocated"] = self.pool.tokens_allocated
        return stats

    # ---- one step ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """One step for every running request (new ones joining first). When it raises before anything is kept, the
        models' state is restored and the step is retried on halves of the batch (`_isolate`): the requests whose
        step fails on their own finish with `finish_reason="error"` and the reason in `TokenEvent.error`; every
        other request advances by one step as if they had never been there (`isolate_faults=False`: raise)."""
        start = clock(self.device)
        events = self.scheduler.drop_cancelled()
        self.scheduler.admit()
        try:
            return events + self._step(start)
        except Exception as error:
            if not self.isolate_faults or isinstance(error, StepKeptError):
                raise
            logger.warning("a step failed (%s: %s); retrying it on parts of the batch", type(error).__name__, error)
            return events + self._isolate(sorted(self.scheduler.running), error)

    def _step(self, start: float, hold=frozenset()) -> list[TokenEvent]:
        """A step of the running requests except those in the slots `hold`. Until verification has decided, it only
        writes model state that `runner.snapshot()` restores, so a step that raises by then leaves no trace."""
        batch = self.scheduler.schedule(self.device, hold)
        if batch is None:
            self.last_step = None
            return []
        trace = StepTrace()
        saved = self.runner.snapshot()
        try:
            # 1. draft; 2. choose what to verify
            proposal = self._propose(batch)
            accept = self._acceptance(proposal.conf, proposal.lookup, proposal.corpus)
            depth = self._select(accept, proposal.num_drafted, batch.num_decode, trace, batch.sampled, proposal)
            # the forward's shape: the depths, known to the host unless D-Cut chose them on the device (a budget,
            # "auto", n-gram lookups), where they are the step's one read before the forward
            depth_host = self.policy.depth_on_host(proposal.num_drafted_host, accept is not None)
            if depth_host is None:
                depth_host = depth.tolist()
            # 3. one packed target forward: prompts of new requests, [anchor, draft[:depth]] of the others
            forward = self.runner.forward(batch.slots, batch.prompts, proposal.tokens, depth,
                                          slots_host=batch.slots_host, depth_host=depth_host)
            # 4. verify every request in one call
            verified = verification.verify_forward(forward, proposal.tokens, proposal.probs, depth, batch.requests,
                                                  self._process)
        except BaseException:
            self.runner.restore(saved)
            raise
        # 5. advance every request by its own count; 6. bookkeeping. From here the step is kept: a failure is not
        # retried (the requests have advanced), it propagates (a request's own bookkeeping fault fails it alone:
        # `Scheduler.update`)
        try:
            emitted, host = self._advance(batch, proposal, depth, forward, verified, depth_host, trace)
            self._record(trace, batch, proposal, depth, verified, emitted, start, host)
        except Exception as error:
            raise StepKeptError(f"a step failed after keeping its tokens: {type(error).__name__}: {error}") from error
        return emitted

    def _isolate(self, slots: list[int], error: Exception) -> list[TokenEvent]:
        """The failed step of the requests in `slots`, retried on halves (bisection): a part that steps cleanly
        advances, a part that fails is halved again, and a request whose step fails alone finishes with an error
        event. A fault one request causes costs about 2 log2(B) extra steps; a fault every request causes fails
        them all, each after its own try."""
        if not slots:
            return []
        if len(slots) == 1:
            request = self.scheduler.running[slots[0]]
            logger.error("request %d failed on its own: %s: %s", request.id, type(error).__name__, error)
            return [self.scheduler.fail(request, f"{type(error).__name__}: {error}")]
        events = []
        mid = len(slots) // 2
        for part in (slots[:mid], slots[mid:]):
            hold = frozenset(self.scheduler.running) - set(part)
            try:
                events += self._step(clock(self.device), hold)
            except StepKeptError:
                raise
            except Exception as part_error:  # noqa: BLE001 - narrowed down, then reported per request
                events += self._isolate([s for s in part if s in self.scheduler.running], part_error)
        return events

    def _propose(self, batch: ScheduledBatch) -> Proposal:
        """Draft tokens for every decoding request, by the step's kind (`DCutPolicy.step_kind`): the drafter's block,
        or an n-gram lookup where that is expected to do better ("draft"; "probe": the drafter drafts for a few rows
        only); n-gram lookups alone, without running the drafter ("lookup"); nothing ("plain": nobody decoding, or
        D-Cut backing off)."""
        n_pre = batch.num_prefill
        tokens = torch.zeros(len(batch), 0, dtype=torch.long, device=self.device)
        probs = conf = lookup = corpus = row_limit = drafter_rows = rows_host = None
        kind, seconds, features, draft_rows, drafted_width = StepKind.PLAIN, 0.0, 0, 0, 0
        remaining = batch.remaining_host[n_pre:]  # every decision below reads host values only
        if batch.num_decode > 0:
            width = self.policy.draft_width(self.batch_drafter.num_draft_tokens) if self.batch_drafter else 0
            if not any(r > 1 for r in remaining):  # every row is at its last token: nothing to draft
                width = 0
            pending = self.runner.pending_host(batch.slots_host[n_pre:]) if self.batch_drafter else None
            catch_up = batch.num_decode * max(pending) if self.batch_drafter else 0
            horizon = sum(remaining) // len(remaining)  # their mean, rounded down
            kind = self.policy.step_kind(batch.num_decode, width, catch_up, horizon)
        if kind.drafts:
            rows_host = self.policy.probe_rows(pending, remaining) if kind == StepKind.PROBE else None
            draft_rows = batch.num_decode if rows_host is None else len(rows_host)
            features = draft_rows * max(pending if rows_host is None else [pending[r] for r in rows_host])
            self._probe_rows_host = rows_host
            rows = None if rows_host is None else upload(rows_host, self.device)
            start = clock(self.device)
            drafted = self._draft(batch, rows)
            seconds = clock(self.device) - start
            tokens, probs, conf, lookup, row_limit = drafted.tokens, drafted.probs, drafted.conf, drafted.use, \
                drafted.lengths
            drafter_rows, drafted_width, corpus = drafted.drafter_rows, drafted.width, drafted.corpus
        elif kind == StepKind.LOOKUP:
            found = self._lookup_only(batch)
            tokens, probs, conf, lookup, row_limit = found.tokens, found.probs, found.conf, found.use, found.lengths
            corpus = found.corpus
        if kind != StepKind.PLAIN:
            tokens, conf = _pad_rows(tokens, n_pre), _pad_rows(conf, n_pre)
            probs = _pad_rows(probs, n_pre) if probs is not None else None
            drafter_rows = _pad_rows(drafter_rows, n_pre) if drafter_rows is not None else None
        num_drafted = (batch.remaining - 1).clamp(min=0, max=tokens.shape[1])
        num_drafted[:n_pre] = 0
        width = tokens.shape[1]
        num_drafted_host = [0] * n_pre + [min(max(r - 1, 0), width) for r in remaining]
        if row_limit is not None:
            num_drafted[n_pre:] = torch.minimum(num_drafted[n_pre:], row_limit)
            lookup = torch.cat([lookup.new_zeros(n_pre), lookup])
            corpus = None if corpus is None else torch.cat([corpus.new_zeros(n_pre), corpus])
            # the host knows the limit of a probe without lookups (its rows' width); a lookup's is the device's
            probed = set(rows_host) if kind == StepKind.PROBE and not self.policy.uses_lookup else None
            num_drafted_host = None if probed is None else [
                n if i >= n_pre and i - n_pre in probed else 0 for i, n in enumerate(num_drafted_host)]
        full_rows = None
        if drafter_rows is not None:
            if lookup is not None:
                drafter_rows &= ~lookup  # a row whose lookup replaced its block
            # what D-Cut may remember of the drafter: blocks not cut short by their request's end
            full_rows = drafter_rows & (batch.remaining - 1 >= drafted_width)
        return Proposal(tokens, probs, conf, lookup, num_drafted, kind, drafter_rows, full_rows, seconds, draft_rows,
                        features, num_drafted_host, corpus if row_limit is not None else None)

    def _draft(self, batch: ScheduledBatch, rows=None) -> Drafted:
        """The decoding rows' proposals when the drafter drafts for all of them, or for the decoding rows `rows`
        (indices) only (`Drafted`)."""
        n_pre, dec = batch.num_prefill, slice(batch.num_prefill, None)
        requests, remaining, n_dec = batch.requests[dec], batch.remaining[dec], batch.num_decode
        drafted = torch.ones(n_dec, dtype=torch.bool, device=self.device)
        if rows is None:
            rows_host = list(range(n_dec))
        else:  # the rows as the host chose them (`_propose`), else read
            rows_host = self._probe_rows_host
            rows_host = rows.tolist() if rows_host is None or len(rows_host) != len(rows) else rows_host
            drafted = torch.zeros_like(drafted).index_fill_(0, rows, True)
        self._probe_rows_host = None
        chosen = [requests[i] for i in rows_host]
        k = self.policy.draft_width(self.batch_drafter.num_draft_tokens)
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])
        keep_going = self.policy.drafting_bound(pick(remaining), batch.num_decode, pick(batch.sampled[dec])
                                                ) if self.early_stop_drafting else None
        select = verification.draft_selector(chosen, self.device, self._process, self.draft_confidence,
                                             getattr(self.batch_drafter.lm_head, "ids", None))
        tokens, probs, conf = self.runner.draft(pick(batch.slots[dec]), k, select, keep_going,
                                                slots_host=[batch.slots_host[n_pre + i] for i in rows_host])
        width = tokens.shape[1]  # k, or fewer where `keep_going` stopped
        if rows is not None:  # the other rows: nothing from the drafter
            tokens, conf = _scatter_rows(tokens, rows, n_dec), _scatter_rows(conf, rows, n_dec)
            probs = _scatter_rows(probs, rows, n_dec) if probs is not None else None
        if not self.policy.uses_lookup:
            limit = None if rows is None else torch.where(drafted, width, 0)
            return Drafted(tokens, probs, conf, None if rows is None else torch.zeros_like(drafted), limit, None,
                           drafted, width)
        found = self._lookup(requests, batch.remaining_host[n_pre:], batch.sampled[dec], tokens, probs, conf,
                             None if rows is None else drafted)
        return Drafted(found.tokens, found.probs, found.conf, found.use, found.lengths, found.corpus, drafted, width)

    def _lookup_only(self, batch: ScheduledBatch) -> LookupChoice:
        """The proposals of a lookup step: each decoding row's n-gram lookup, where it has one, and nothing
        else (a deterministic proposal: its q is one-hot, which rejection-sampled rows are verified against)."""
        dec = slice(batch.num_prefill, None)
        n_dec, sampled = batch.num_decode, batch.sampled[dec]
        tokens = torch.zeros(n_dec, 0, dtype=torch.long, device=self.device)
        conf = torch.zeros(n_dec, 0, device=self.device)
        probs = torch.zeros(n_dec, 0, self.vocab_size, device=self.device) if any(batch.sampled_host[dec]) else None
        return self._lookup(batch.requests[dec], batch.remaining_host[dec], sampled, tokens, probs, conf)

    def _advance(self, batch: ScheduledBatch, proposal: Proposal, depth, forward: PackedForward,
                 verified: verification.Verified, depth_host: list[int], trace: StepTrace):
        """Calibration learns the step's outcomes (on the device); the host reads everything it needs of the step
        in one copy (`_read`); the runner keeps the accepted tokens (KV, drafter features, anchors); the scheduler
        hands them to their requests and finishes those that ended. Returns the events and what was read."""
        if proposal.kind != StepKind.PLAIN:
            self.policy.observe(proposal.conf, depth, verified.num_accepted, proposal.proposed, proposal.lookup,
                                proposal.corpus)
        host = self._read(proposal, verified, trace)
        host["depth"] = depth_host
        self.runner.advance(forward, batch.slots, verified.num_accepted, verified.emitted, verified.next_token,
                            num_accepted_host=host["num_accepted"])
        top = verified.top
        if host.get("top") is not None:
            top = verification.top_lists(*host["top"], batch.requests)
        events = self.scheduler.update(batch.requests, host["emitted"], host["num_accepted"], host["logprobs"], top)
        if isinstance(self.policy.corpus, GrowingCorpus):  # finished replies: looked up from the next step on
            for request, event in zip(batch.requests, events):
                # not a rejection-sampled reply: its random numbers are keyed by a seed drawn from `random`, which a
                # caller who reseeds it hands to a later request too, whose draft would then depend on its own draws
                unseeded = request.params.do_sample and not request.coupled
                if event.finished and event.finish_reason != FINISH_ERROR and request.generated and not unseeded:
                    self.policy.corpus.add(request.prompt[-self.policy.corpus.max_match:] + request.generated)
        return events, host

    def _read(self, proposal: Proposal, verified: verification.Verified, trace: StepTrace) -> dict:
        """The step's one read of the device: every value the host needs afterwards (accepted counts, emitted tokens
        and their log-probabilities, top tokens, the trace's drafts and survival, the proposal's counts, D-Cut's
        plan and per-position acceptance totals) packed into one float64 tensor (exact for token ids, counts and
        float32 values), copied once, and split into host lists."""
        rows, span = verified.emitted.shape
        parts: dict[str, tuple] = {}  # name: (tensor, shape of its host list)
        parts["num_accepted"] = (verified.num_accepted, (rows,))
        parts["emitted"] = (verified.emitted, (rows, span))
        parts["logprobs"] = (verified.logprobs, (rows, span))
        parts["draft_tokens"] = (proposal.tokens, tuple(proposal.tokens.shape))
        survival = getattr(trace, "_survival", None)
        if survival is not None:
            parts["survival"] = (survival, tuple(survival.shape))
        if proposal.num_drafted_host is None:
            parts["num_drafted"] = (proposal.num_drafted, (rows,))
        if proposal.lookup is not None:
            parts["lookup"] = (proposal.lookup, (rows,))
        if proposal.corpus is not None:
            parts["corpus"] = (proposal.corpus, (rows,))
        if verified.top_candidates is not None:
            values, ids = verified.top_candidates
            parts["top_values"], parts["top_ids"] = (values, tuple(values.shape)), (ids, tuple(ids.shape))
        plan = self.policy.last_plan
        if plan is not None:
            parts["planned"], parts["planned_rows"] = (plan[0], tuple(plan[0].shape)), (plan[1], tuple(plan[1].shape))
        if self.policy.mode == "auto":  # what `drafting_may_pay` plans with before any drafted row is remembered
            totals = self.policy.calibrator.position_totals()
            parts["position_totals"] = (totals, tuple(totals.shape))
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t, _ in parts.values()]).tolist()  # the one read
        host, at = {}, 0
        for name, (tensor, shape) in parts.items():
            size = 1
            for n in shape:
                size *= n
            values = flat[at : at + size]
            at += size
            if tensor.dtype in (torch.long, torch.int32, torch.bool):
                values = [int(v) for v in values]
            host[name] = _unflatten(values, shape)
        if "top_values" in host:
            host["top"] = (host.pop("top_values"), host.pop("top_ids"))
        if "planned" in host:
            self.policy.remember_plan(host.pop("planned"), host.pop("planned_rows"))
        if "position_totals" in host:
            self.policy.calibrator.set_position_totals(host.pop("position_totals"))
        host["num_drafted"] = host.get("num_drafted", proposal.num_drafted_host)
        return host

    def _record(self, trace: StepTrace, batch: ScheduledBatch, proposal: Proposal, depth,
                verified: verification.Verified, events: list[TokenEvent], start: float, host: dict) -> None:
        """The step's trace (`last_step`) and the running totals (`stats`), from what the step read (`_read`)."""
        seconds = clock(self.device) - start
        trace.request_ids = [r.id for r in batch.requests]
        trace.draft_tokens = host["draft_tokens"]
        trace.verified, trace.accepted = host["depth"], host["num_accepted"]
        if hasattr(trace, "_survival"):
            trace.survival = host.get("survival", [])
            del trace._survival
        trace.budget = sum(host["depth"])
        trace.prefill = [len(p) for p in batch.prompts] + [0] * batch.num_decode
        trace.choice = {StepKind.DRAFT: "speculative"}.get(proposal.kind, proposal.kind.value)
        trace.drafted_tokens = sum(host["num_drafted"])
        trace.verified_tokens = sum(host["depth"])
        trace.pruned_tokens = trace.drafted_tokens - trace.verified_tokens
        trace.seconds, trace.draft_seconds = seconds, proposal.draft_seconds
        self.last_step = trace
        t = self.totals
        t["steps"] += 1
        t["speculative_steps"] += int(proposal.drafted)
        t["lookup_steps"] += int(proposal.kind == StepKind.LOOKUP and trace.verified_tokens > 0)
        t["tokens"] += sum(len(e.token_ids) for e in events)
        t["decode_row_steps"] += batch.num_decode
        t["drafted"] += trace.drafted_tokens
        t["verified"] += trace.verified_tokens
        accepted = sum(host["num_accepted"][batch.num_prefill:])
        t["accepted"] += accepted
        t["pruned"] += trace.pruned_tokens
        t["lookup_rows"] += sum(host["lookup"]) if "lookup" in host else 0
        t["corpus_rows"] += sum(host["corpus"]) if "corpus" in host else 0
        t["seconds"] += seconds
        decode_tokens = accepted + batch.num_decode
        # the measured kind: what the step cost is what it did (a lookup step that verified nothing was plain)
        kind = StepKind.PLAIN if proposal.kind == StepKind.LOOKUP and not trace.verified_tokens else proposal.kind
        self.policy.observe_step(kind, batch.num_prefill, batch.num_decode, decode_tokens, seconds,
                                 fed_tokens=batch.num_decode + trace.verified_tokens,
                                 draft_seconds=proposal.draft_seconds, draft_rows=proposal.draft_rows,
                                 draft_features=proposal.draft_features)

    def _release(self, slot: int) -> None:
        """A request finished: free what its slot holds (the scheduler's callback)."""
        self.runner.release(slot)
        self.totals["requests_finished"] += 1

    def _checked_prompt(self, input_ids, params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in (input_ids.reshape(-1).tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not prompt:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        vocab = self.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        if len(prompt) + params.max_new_tokens > self.max_total_tokens:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"target's maximum length {self.max_total_tokens}")
        if len(prompt) > self.max_prefill_tokens:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_prefill_tokens={self.max_prefill_tokens}")
        return prompt

    # ---- the rules, as methods a subclass may swap (the tests swap in known-wrong ones to prove their power); the
    # policy is given `plan_acceptance` once, at construction --------------------------------------------------------
    def draft_confidence(self, probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """`angelspec_hf.policy.draft_confidence` (why it may not look at `token`: the comment above it)."""
        return draft_confidence(probs, token)

    def plan_acceptance(self, accept: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """`angelspec_hf.policy.plan_acceptance`."""
        return plan_acceptance(accept, sampled)

    def _process(self, logits, requests, span):
        """Each request's sampling distribution: `verification.process_requests`."""
        return verification.process_requests(logits, requests, span)

    def _acceptance(self, conf, lookup, corpus=None):
        return self.policy.acceptance(conf, lookup, corpus)

    def _lookup(self, requests, remaining, sampled, tokens, probs, conf, drafted=None) -> LookupChoice:
        span = self.policy.lookup_tokens
        if self.batch_drafter is not None:
            span = min(span, self.batch_drafter.num_draft_tokens)
        return self.policy.lookup(requests, remaining, sampled, tokens, probs, conf, span, drafted)

    def _select(self, accept, num_drafted, n_dec, trace, sampled, proposal=None) -> torch.Tensor:
        """D-Cut's depth `[B]` per row (`DCutPolicy.select`) for the step's `proposal` (None: a drafted one), recorded
        in `trace`."""
        if accept is None:
            return torch.zeros_like(num_drafted)
        drafted, full = (True, None) if proposal is None else (proposal.drafted, proposal.full_rows)
        # a bound on the tokens drafted, from shapes alone (`select` would read their sum)
        depth, survival = self.policy.select(accept, num_drafted, n_dec, sampled, drafted, full,
                                             max_extra=accept.shape[0] * accept.shape[1])
        trace._survival = survival  # read with the step's results (`_read`)
        return depth


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` after `n` rows of zeros (the prefilling rows, which carry no draft)."""
    return torch.cat([x.new_zeros(n, *x.shape[1:]), x])


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """`x` (one entry per index in `rows`) placed at those rows of `n` rows of zeros."""
    out = x.new_zeros(n, *x.shape[1:])
    out[rows] = x
    return out


def _unflatten(values: list, shape: tuple) -> list:
    """The flat host list `values` as nested lists of `shape` (as `tensor.tolist()` gives them)."""
    if len(shape) <= 1:
        return values
    inner = 1
    for n in shape[1:]:
        inner *= n
    return [_unflatten(values[i * inner : (i + 1) * inner], shape[1:]) for i in range(shape[0])]


def generate_batch(target, drafter, prompts, *, tokenizer=None, max_new_tokens: int = 64, verify=None,
                   do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int | None = None, max_batch_size: int | None = None, config: EngineConfig | None = None,
                   engine: SpeculativeEngine | None = None, return_engine: bool = False):
    """Generate for many prompts at once with the continuous-batching speculative engine.

    prompts: token-id lists (or strings, with `tokenizer`: the chat template is applied). Returns the generated token
    ids per prompt, in order (and the engine when `return_engine`). Request i gets seed `seed + i` when `seed` is set.
    The engine: `engine` when given, else one built from `config` (default `EngineConfig()`: verify "auto", 32
    slots) with `verify` and `max_batch_size` overriding it where given. Raises `GenerationFailed` (after the other
    prompts finished) when some prompts failed on their own.
    """
    if engine is None:
        overrides = {k: v for k, v in (("verify", verify), ("max_batch_size", max_batch_size)) if v is not None}
        engine = SpeculativeEngine(target, drafter, config, **overrides)
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer")
            prompt = chat_ids(tokenizer, prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=None if seed is None else seed + i)
        ids.append(engine.add_request(prompt, params))
    outputs, errors = {i: [] for i in ids}, {}
    for events in engine.steps():
        for event in events:
            outputs[event.request_id].extend(event.token_ids)
            if event.error is not None:
                errors[ids.index(event.request_id)] = event.error
    result = [outputs[i] for i in ids]
    if errors:
        failure = GenerationFailed("; ".join(f"prompt {i}: {why}" for i, why in sorted(errors.items())))
        failure.outputs, failure.failed = result, sorted(errors)
        raise failure
    return (result, engine) if return_engine else result


class StepKeptError(RuntimeError):
    """A step failed after its requests had advanced (while keeping its tokens or recording it): not retried."""


class GenerationFailed(RuntimeError):
    """Some prompts of `generate_batch` failed on their own (the others ran to their end): `failed` lists their
    indices, `outputs` every prompt's tokens (those of a failed prompt up to its failure)."""

    outputs: list[list[int]]
    failed: list[int]
