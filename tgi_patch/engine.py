"""A continuous-batching speculative engine with D-Cut adaptive verification.

Each `step()`: requests waiting for a slot join (their prompts are prefilled in the same target forward as everyone
else's verification); the drafter proposes a block per running request with a confidence per token; D-Cut chooses which
draft tokens to verify (a prefix per request, the globally most likely to be accepted, under a budget); the target
verifies all of them, for all requests, in **one** packed forward; every request advances by its own accepted count.

Lossless: a greedy request's tokens equal its own plain greedy decoding whatever else is in the batch, and a sampled
request is exact rejection sampling, its random numbers keyed by its seed and token positions only.

    engine = SpeculativeEngine(target, drafter, verify="auto")
    rid = engine.add_request(input_ids, SamplingParams(max_new_tokens=64))
    while engine.has_work():
        for event in engine.step(): ...
"""

from __future__ import annotations

import math

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from angelspec_hf.modeling.candidate_generator import mean_accepted_length, ngram_continuation
from angelspec_hf.prompts import chat_ids

from . import kernels
from .dcut import AcceptanceCalibrator, CostModel, load_or_profile
from .drafting import BatchDrafter
from .paged import RAGGED_ATTENTION, PagedKVPool, RaggedStep
from .penalties import PenaltyState, apply_penalties
from .sampling import ACCEPT, DRAFT, RESAMPLE, process_logits, sample_from, uniforms

FINISH_LENGTH, FINISH_EOS, FINISH_CANCELLED = "length", "eos_token", "cancelled"


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids
    repetition_penalty: float = 1.0  # 1 = off; see penalties.py for the three rules
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_n_tokens: int = 0  # report the n most likely tokens at every generated position

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty, self.frequency_penalty, self.presence_penalty) != (1.0, 0.0, 0.0)

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and > 0 when sampling, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**63:
            raise ValueError(f"top_k must be an integer in [0, 2**63), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not isinstance(self.top_n_tokens, int) or not 0 <= self.top_n_tokens <= 1024:
            raise ValueError(f"top_n_tokens must be an integer in [0, 1024], got {self.top_n_tokens!r}")


@dataclass
class TokenEvent:
    request_id: int
    token_ids: list[int]
    logprobs: list[float]
    from_draft: list[bool]
    finished: bool = False
    finish_reason: str | None = None
    top_tokens: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), most likely first


@dataclass
class StepTrace:
    """What one step did, per running request (same order) and in total."""

    request_ids: list[int] = field(default_factory=list)
    draft_tokens: list[list[int]] = field(default_factory=list)
    survival: list[list[float]] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)  # prompt tokens prefilled this step per request (0: decoding)
    budget: int = 0  # draft tokens verified in total
    choice: str = "plain"  # "speculative": drafted this step; "plain": decoded without drafting
    verified_tokens: int = 0
    pruned_tokens: int = 0
    drafted_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop: frozenset
    slot: int = -1
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    prefilled: bool = False
    penalties: PenaltyState | None = None


def parse_verify(verify) -> tuple[str, int | None]:
    """`"auto"` → D-Cut with the cost model; an int → fixed budget of draft tokens per step; `"depth:K"` → every
    request verifies up to K draft tokens; `"full"` → the whole block (plain speculative decoding)."""
    if verify == "auto" or verify == "full":
        return verify, None
    if isinstance(verify, int) and not isinstance(verify, bool) and verify >= 0:
        return "budget", verify
    if isinstance(verify, str) and verify.startswith("depth:") and verify[6:].isdigit():
        return "depth", int(verify[6:])
    if isinstance(verify, str) and verify.isdigit():
        return "budget", int(verify)
    raise ValueError(f"verify must be 'auto', 'full', an integer budget >= 0 or 'depth:K', got {verify!r}")


class SpeculativeEngine:
    def __init__(self, target, drafter=None, *, verify="auto", max_batch_size: int = 32, cost_model=None,
                 cost_model_cache=None, max_prefill_tokens: int = 4096, probe_every: int = 8, calibrator=None,
                 lookup_tokens: int | None = None):
        if drafter is not None:
            drafter.check_target(target)
        self.mode, self.mode_value = parse_verify(verify)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.target, self.drafter = target.eval(), drafter
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.probe_every = probe_every
        self.device = next(target.parameters()).device
        config = target.config.get_text_config()
        if config._attn_implementation != RAGGED_ATTENTION:
            target.set_attn_implementation(RAGGED_ATTENTION)  # plain SDPA for every other call
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pool = PagedKVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, target.dtype,
                                self.device, max_batch_size)
        self.max_total_tokens = getattr(config, "max_position_embeddings", None) or 1 << 30
        self.batch_drafter = BatchDrafter(drafter, target, max_batch_size) if drafter is not None else None
        self.layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
        eos = target.generation_config.eos_token_id if target.generation_config is not None else None
        self.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self.calibrator = calibrator or AcceptanceCalibrator()
        # n-gram lookup proposals (the drafter config's `lookup_tokens` unless given): confidence = matched n-gram
        # length / lookup_max_ngram, calibrated on their own
        config_lookup = getattr(drafter.config, "lookup_tokens", 0) if drafter is not None else 0
        self.lookup_tokens = config_lookup if lookup_tokens is None else lookup_tokens
        if self.lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0, got {self.lookup_tokens}")
        self.lookup_max_ngram = getattr(drafter.config, "lookup_max_ngram", 3) if drafter is not None else 3
        self.lookup_calibrator = AcceptanceCalibrator(prior=0.5)
        self.cost_model_cache = cost_model_cache
        self._cost_model = cost_model
        self._ids = itertools.count()
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}  # slot -> request
        self.requests: dict[int, _Request] = {}
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        self.anchor = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        # target features of accepted tokens the drafter has not ingested yet (packed, with owner slot and position)
        feat_dim = target.config.hidden_size * len(self.layer_ids)
        self.pending_feat = torch.zeros(0, feat_dim, dtype=target.dtype, device=self.device)
        self.pending_slot = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pending_next = torch.zeros(0, dtype=torch.long, device=self.device)
        self.plain_steps_left = 0
        self._backoff = probe_every
        self.max_backoff = 8 * probe_every
        self.last_step: StepTrace | None = None
        if self.mode == "auto" and self._cost_model is None:
            self._cost_model = load_or_profile(self, cost_model_cache)  # before any request: it uses idle slots
        self.totals = {"steps": 0, "speculative_steps": 0, "tokens": 0, "decode_row_steps": 0, "drafted": 0,
                       "verified": 0, "accepted": 0, "pruned": 0, "lookup_rows": 0, "requests_finished": 0,
                       "seconds": 0.0}

    # ---- public API ------------------------------------------------------------------------------------------------
    @property
    def cost_model(self) -> CostModel:
        if self._cost_model is None:
            self._cost_model = load_or_profile(self, self.cost_model_cache)
        return self._cost_model

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, input_ids, params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in (input_ids.reshape(-1).tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not prompt:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        vocab = self.target.config.get_text_config().vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        if len(prompt) + params.max_new_tokens > self.max_total_tokens:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"target's maximum length {self.max_total_tokens}")
        if len(prompt) > self.max_prefill_tokens:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_prefill_tokens={self.max_prefill_tokens}")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        stop = frozenset(params.stop_token_ids if params.stop_token_ids is not None else self.eos_ids)
        request = _Request(next(self._ids), prompt, params, seed, stop)
        if params.penalised:
            request.penalties = PenaltyState(prompt, vocab, self.device)
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.cancelled = True

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
        stats["calibration_error"] = self.calibrator.calibration_error()
        stats["reliability"] = self.calibrator.reliability()
        stats["kv_tokens_allocated"] = self.pool.tokens_allocated
        return stats

    # ---- one step ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        start = time.perf_counter()
        events = self._drop_cancelled()
        self._admit()
        if not self.running:
            self.last_step = None
            return events
        trace = StepTrace()
        slots_all = sorted(self.running)
        prefill = [s for s in slots_all if not self.running[s].prefilled]
        decode = [s for s in slots_all if self.running[s].prefilled]
        order = prefill + decode
        requests = [self.running[s] for s in order]
        dev = self.device
        slots = torch.tensor(order, dtype=torch.long, device=dev)
        n_pre, n_dec = len(prefill), len(decode)
        remaining = torch.tensor([r.params.max_new_tokens - len(r.generated) for r in requests], device=dev)

        # 1. draft
        k = 0
        draft = torch.zeros(len(order), 0, dtype=torch.long, device=dev)
        draft_probs, conf, lookup, row_limit = None, None, None, None
        sampled = torch.tensor([r.params.do_sample for r in requests], device=dev)
        draft_now = self.batch_drafter is not None and n_dec > 0 and self._should_draft()
        if draft_now:
            k = self.batch_drafter.num_draft_tokens
            if self.mode in ("depth", "budget"):  # no row ever verifies more: do not draft more
                k = min(k, self.mode_value)
            keep_going = self._drafting_bound(remaining[n_pre:], requests, n_dec) if self.mode == "auto" else None
            d_tokens, d_probs, d_conf = self._draft(slots[n_pre:], requests[n_pre:], k, keep_going)
            if self.lookup_tokens and self.mode != "depth":
                d_tokens, d_probs, d_conf, lookup, row_limit = self._lookup(
                    requests[n_pre:], remaining[n_pre:], sampled[n_pre:], d_tokens, d_probs, d_conf)
            k = d_tokens.shape[1]
            draft = torch.cat([d_tokens.new_zeros(n_pre, k), d_tokens])
            conf = torch.cat([d_conf.new_zeros(n_pre, k), d_conf])
            if d_probs is not None:
                draft_probs = torch.cat([d_probs.new_zeros(n_pre, *d_probs.shape[1:]), d_probs])
        num_drafted = (remaining - 1).clamp(min=0, max=k)
        num_drafted[:n_pre] = 0
        if row_limit is not None:
            num_drafted[n_pre:] = torch.minimum(num_drafted[n_pre:], row_limit)
            lookup = torch.cat([lookup.new_zeros(n_pre), lookup])

        # 2. choose what to verify
        base_tokens = sum(len(r.prompt) for r in requests[:n_pre]) + n_dec
        accept = self._acceptance(conf, lookup)
        depth = self._select(accept, num_drafted, len(order), base_tokens, n_dec, trace, sampled)

        # 3. one packed target forward: prompts of new requests, [anchor, draft[:depth]] of the others
        new = torch.cat([torch.tensor([len(r.prompt) for r in requests[:n_pre]], dtype=torch.long, device=dev),
                         1 + depth[n_pre:]])
        n_max = int(new.max())
        fed = torch.zeros(len(order), n_max, dtype=torch.long, device=dev)
        for i, r in enumerate(requests[:n_pre]):  # a new request's prompt: once per request
            fed[i, : len(r.prompt)] = torch.tensor(r.prompt, device=dev)
        if n_dec:
            fed[n_pre:, 0] = self.anchor[slots[n_pre:]]
            if k:
                fed[n_pre:, 1 : 1 + k] = draft[n_pre:, : n_max - 1] if n_max - 1 < k else draft[n_pre:]
        step = RaggedStep.build(self.pool, slots, new, packed=True)
        positions = (step.held[step.token_row] + step.token_col)[None]
        kwargs = {"output_hidden_states": [i + 1 for i in self.layer_ids]} if self.layer_ids else {}
        out = self.target(input_ids=fed[step.token_row, step.token_col][None], position_ids=positions,
                          use_cache=False, ragged=step, **kwargs)
        logits = out.logits[0]  # [T, V]
        step.commit()

        # 4. verify every request in one call
        ends = new.cumsum(0) - 1  # packed index of each row's last fed token
        span = int(depth.max()) + 1 if len(depth) else 1
        ar = torch.arange(span, device=dev)[None, :]
        rows_index = (ends - depth)[:, None] + torch.minimum(ar, depth[:, None])
        raw = logits[rows_index]  # [B, span, V]
        raw = self._penalise(raw, draft, requests)
        greedy = torch.tensor([not r.params.do_sample for r in requests], device=dev)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=dev)
        gen_pos = torch.tensor([len(r.generated) for r in requests], device=dev)[:, None] + ar
        scores = raw
        if not bool(greedy.all()):
            probs = self._process(raw.reshape(-1, raw.shape[-1]), requests, span).reshape(raw.shape)
            scores = torch.where(greedy[:, None, None], raw, probs)
        draft_v = draft[:, : span - 1]
        q = draft_probs[:, : span - 1] if draft_probs is not None else None
        num_accepted, next_token = kernels.verify(
            scores, draft_v, q, depth, greedy, uniforms(seeds[:, None], gen_pos[:, : span - 1], ACCEPT),
            uniforms(seeds[:, None], gen_pos, RESAMPLE),
        )

        # 5. advance every request by its own count
        kept = torch.where(torch.arange(len(order), device=dev) < n_pre, new, 1 + num_accepted)
        self.pool.lengths[slots] = step.held + kept
        if draft_now and n_dec:
            rows = torch.arange(len(order), device=dev) >= n_pre
            for calibrator, chosen in ((self.calibrator, rows if lookup is None else rows & ~lookup),
                                       (self.lookup_calibrator, None if lookup is None else rows & lookup)):
                if chosen is not None and bool(chosen.any()):
                    calibrator.update(conf[chosen], depth[chosen], num_accepted[chosen])
        emitted = torch.cat([draft_v, draft_v.new_zeros(len(order), 1)], 1)
        emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
        log_probs = torch.log_softmax(raw.float(), -1)
        logprobs = log_probs.gather(-1, emitted[..., None]).squeeze(-1)
        top = self._top_tokens(log_probs, requests)
        if self.batch_drafter is not None:
            self._keep_features(out, step, slots, kept, fed, emitted, num_accepted, n_pre)
        self.anchor[slots] = next_token
        events += self._emit(requests, emitted.tolist(), num_accepted.tolist(), logprobs.tolist(), top)

        # 6. bookkeeping
        seconds = time.perf_counter() - start
        trace.request_ids = [r.id for r in requests]
        trace.draft_tokens = draft[:, :k].tolist() if k else [[] for _ in requests]
        trace.verified, trace.accepted = depth.tolist(), num_accepted.tolist()
        trace.prefill = new[:n_pre].tolist() + [0] * n_dec
        trace.choice = "speculative" if draft_now else "plain"
        trace.drafted_tokens = int(num_drafted.sum())
        trace.verified_tokens = int(depth.sum())
        trace.pruned_tokens = trace.drafted_tokens - trace.verified_tokens
        trace.seconds = seconds
        self.last_step = trace
        t = self.totals
        t["steps"] += 1
        t["speculative_steps"] += int(draft_now)
        t["decode_row_steps"] += n_dec
        t["drafted"] += trace.drafted_tokens
        t["verified"] += trace.verified_tokens
        t["accepted"] += int(num_accepted[n_pre:].sum())
        t["pruned"] += trace.pruned_tokens
        t["lookup_rows"] += int(lookup.sum()) if lookup is not None else 0
        t["seconds"] += seconds
        return events

    # ---- pieces ------------------------------------------------------------------------------------------------------
    def _drop_cancelled(self) -> list[TokenEvent]:
        events = []
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self.requests.pop(request.id, None)
            events.append(TokenEvent(request.id, [], [], [], True, FINISH_CANCELLED))
        for slot, request in list(self.running.items()):
            if request.cancelled:
                self._finish(request)
                events.append(TokenEvent(request.id, [], [], [], True, FINISH_CANCELLED))
        return events

    def _admit(self) -> None:
        budget = self.max_prefill_tokens
        while self.waiting and self.free_slots and len(self.waiting[0].prompt) <= budget:
            request = self.waiting.popleft()
            budget -= len(request.prompt)
            request.slot = self.free_slots.pop()
            self.running[request.slot] = request

    def _finish(self, request: _Request) -> None:
        slot = request.slot
        self.running.pop(slot, None)
        self.requests.pop(request.id, None)
        self.pool.release(slot)
        if self.batch_drafter is not None:
            self.batch_drafter.release(slot)
            keep = self.pending_slot != slot
            self.pending_feat, self.pending_slot = self.pending_feat[keep], self.pending_slot[keep]
            self.pending_next = self.pending_next[keep]
        self.free_slots.append(slot)
        self.totals["requests_finished"] += 1

    def _should_draft(self) -> bool:
        if self.mode != "auto":
            return True
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        return True

    def _process(self, logits, requests, span):
        temperature = torch.tensor([r.params.temperature if r.params.do_sample else 1.0 for r in requests],
                                   device=logits.device).repeat_interleave(span)
        top_k = torch.tensor([r.params.top_k for r in requests], device=logits.device).repeat_interleave(span)
        top_p = torch.tensor([r.params.top_p for r in requests], device=logits.device).repeat_interleave(span)
        return process_logits(logits, temperature, top_k, top_p)

    def _penalise(self, raw, draft, requests):
        """`raw [B, span, V]` with each penalised request's rows penalised position by position (penalties.py)."""
        rows = [i for i, r in enumerate(requests) if r.penalties is not None]
        if not rows:
            return raw
        sub = [requests[i] for i in rows]
        index = torch.tensor(rows, device=raw.device)

        def per_request(name):
            return torch.tensor([getattr(r.params, name) for r in sub], device=raw.device)

        raw = raw.float().clone()
        raw[index] = apply_penalties(raw[index], draft[index], torch.stack([r.penalties.seen for r in sub]),
                                     torch.stack([r.penalties.counts for r in sub]), per_request("repetition_penalty"),
                                     per_request("frequency_penalty"), per_request("presence_penalty"))
        return raw

    def _top_tokens(self, log_probs, requests):
        """`[B][span]` lists of (id, logprob) of the n most likely tokens for requests asking for them, else None."""
        n = max(r.params.top_n_tokens for r in requests)
        if n == 0:
            return None
        values, ids = log_probs.topk(min(n, log_probs.shape[-1]), dim=-1)
        return [[list(zip(i[: r.params.top_n_tokens], v[: r.params.top_n_tokens])) for i, v in zip(ii, vv)]
                if r.params.top_n_tokens else None for r, ii, vv in zip(requests, ids.tolist(), values.tolist())]

    def _drafting_bound(self, remaining, requests, n_dec):
        """`keep_going` for drafting in "auto" mode: position j + 1 can be worth verifying only while some request's
        calibrated survival through j is at least `c · n_dec / verify(rows, tokens)` (an extra verified token costs c
        seconds; below that bound it adds fewer tokens per second than a plain step makes). Survival uses the
        confidences of positions up to j, known before token j is drawn, so stopping here keeps sampling exact."""
        cost = self.cost_model
        rows = len(requests)
        base = sum(len(r.prompt) for r in requests if not r.prefilled) + n_dec
        bound = cost.verify_coef[2] * n_dec / cost.verify(rows, base)
        survival = torch.ones(len(remaining), device=remaining.device)

        def keep_going(conf, j):
            nonlocal survival
            survival = survival * self.calibrator.at(conf, j)
            return bool(((survival >= bound) & (remaining - 1 > j + 1)).any())

        return keep_going

    def _draft(self, slots, requests, k, keep_going=None):
        """Feed each request's pending target features to the drafter and draft k tokens after its anchor."""
        dev = self.device
        row_of_slot = torch.full((self.max_batch_size,), -1, dtype=torch.long, device=dev)
        row_of_slot[slots] = torch.arange(len(slots), device=dev)
        rows = row_of_slot[self.pending_slot]
        order = torch.sort(rows, stable=True).indices
        order = order[rows[order] >= 0]  # by request, oldest first
        rows = rows[order]
        new = torch.bincount(rows, minlength=len(slots))
        cols = torch.arange(len(rows), device=dev) - (new.cumsum(0) - new)[rows]
        n_max = int(new.max())
        features = self.pending_feat.new_zeros(len(slots), n_max, self.pending_feat.shape[1])
        features[rows, cols] = self.pending_feat[order]
        next_ids = torch.zeros(len(slots), n_max, dtype=torch.long, device=dev)
        next_ids[rows, cols] = self.pending_next[order]
        self.pending_feat = self.pending_feat[:0]
        self.pending_slot, self.pending_next = self.pending_slot[:0], self.pending_next[:0]

        greedy = torch.tensor([not r.params.do_sample for r in requests], device=dev)
        all_greedy = bool(greedy.all())
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=dev)
        gen_pos = torch.tensor([len(r.generated) for r in requests], device=dev)

        def select(logits, j):
            if all_greedy:
                probs = torch.softmax(logits.float(), -1)
                token = probs.argmax(-1)
                return token, None, self.draft_confidence(probs, token)
            probs = self._process(logits, requests, 1)
            sampled = sample_from(probs, uniforms(seeds, gen_pos + j, DRAFT))
            token = torch.where(greedy, logits.argmax(-1), sampled)
            greedy_probs = torch.softmax(logits.float(), -1)
            conf = torch.where(greedy, self.draft_confidence(greedy_probs, token), self.draft_confidence(probs, token))
            return token, probs, conf

        anchors = self.anchor[slots]
        return self.batch_drafter.draft(slots, features, next_ids, new, anchors, k, select, keep_going)

    # ---- D-Cut, and why it stays exact for sampled requests ------------------------------------------------------
    # Rejection sampling (Leviathan et al.) emits a token distributed as the target's p at draft position k only if the
    # draft token d_k is distributed as q_k *given that position k is verified*. So whether k is verified may depend
    # on anything known before d_k is drawn (the drafted prefix d_<k, the drafter's distribution q_k, calibrated
    # statistics, other requests' drafts, which use their own random streams) but never on d_k or later tokens. The
    # two rules below keep that: the confidence of position k is a function of q_k alone (`draft_confidence`), and in
    # "auto" mode a sampled request verifies every position whose survival clears a threshold planned without its
    # own later positions (`plan_acceptance`). Ranking by q(d_k) — the probability of the token actually drawn — made
    # verification favour tokens the drafter over-proposes and skewed the output (issue 11). Greedy requests have no
    # randomness to bias and keep every signal. Fixed budgets are exact as they are: with draft-independent keys a
    # position is chosen when fewer than `budget` keys rank above it, and a row's later keys never rank above it.

    def draft_confidence(self, probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """D-Cut's confidence `[B]` in a drafted position: the peak of the drafter's distribution `probs [B, V]` there
        (for a greedy row, the probability of its argmax draft `token`; for a sampled row known before drawing)."""
        return probs.max(-1).values

    def plan_acceptance(self, accept: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """The acceptance probabilities `[B, K]` "auto" mode plans the step with: a sampled row's own positions after
        the first depend on its drawn tokens, so it is planned as if every position were as likely as its first."""
        return torch.where(sampled[:, None], accept[:, :1].expand_as(accept), accept)

    def _acceptance(self, conf, lookup):
        """Calibrated acceptance `[B, K]` of every drafted position (None when nothing was drafted): the drafter's
        calibration, or the lookup's for rows that carry an n-gram lookup."""
        if conf is None or conf.shape[1] == 0:
            return None
        accept = self.calibrator(conf)
        if lookup is not None and bool(lookup.any()):
            accept = torch.where(lookup[:, None], self.lookup_calibrator(conf), accept)
        return accept

    def _lookup(self, requests, remaining, sampled, tokens, probs, conf):
        """Give each decode request the n-gram lookup continuation of its context (the tokens that followed the latest
        earlier occurrence of its last `lookup_max_ngram` or fewer tokens) in place of the drafter's block, where the
        lookup is expected to have more tokens accepted. Returns the new `tokens, probs, conf`, which rows took a
        lookup `[B]` and how many positions each row carries `[B]`.

        Exact for sampled requests: a lookup is a deterministic proposal (its q is one-hot), and the choice reads only
        what is known before the drafter's first token was drawn (the lookup's own calibrated acceptance, and the
        drafter's as `plan_acceptance` plans it: from its first position's confidence)."""
        width, dev = tokens.shape[1], tokens.device
        span = min(self.lookup_tokens, self.batch_drafter.num_draft_tokens)
        found = [ngram_continuation(torch.tensor(r.prompt + r.generated), self.lookup_max_ngram,
                                    max(0, min(span, left - 1))) for r, left in zip(requests, remaining.tolist())]
        lengths = torch.tensor([len(cont) for cont, _ in found], device=dev)
        if not bool((lengths > 0).any()):
            return tokens, probs, conf, torch.zeros_like(lengths, dtype=torch.bool), torch.full_like(lengths, width)
        wide = max(width, int(lengths.max()))
        l_tokens = torch.zeros(len(requests), wide, dtype=torch.long, device=dev)
        for i, (cont, _) in enumerate(found):
            l_tokens[i, : len(cont)] = torch.tensor(cont, dtype=torch.long, device=dev)
        valid = torch.arange(wide, device=dev)[None, :] < lengths[:, None]
        matched = torch.tensor([n for _, n in found], device=dev) / self.lookup_max_ngram
        l_conf = torch.where(valid, matched[:, None].expand(-1, wide), torch.zeros((), device=dev))
        l_expected = (torch.cumprod(self.lookup_calibrator(l_conf), 1) * valid).sum(1)
        d_expected = torch.cumprod(self.plan_acceptance(self.calibrator(conf), sampled), 1).sum(1) if width else 0.0
        use = (lengths > 0) & (l_expected > d_expected)

        def widen(x):
            return torch.cat([x, x.new_zeros(x.shape[0], wide - width, *x.shape[2:])], 1)

        tokens = torch.where(use[:, None], l_tokens, widen(tokens))
        conf = torch.where(use[:, None], l_conf, widen(conf))
        if probs is not None:
            one_hot = torch.zeros_like(widen(probs)).scatter_(2, l_tokens[..., None], 1.0)
            probs = torch.where(use[:, None, None], one_hot, widen(probs))
        return tokens, probs, conf, use, torch.where(use, lengths, torch.full_like(lengths, width))

    def _select(self, accept, num_drafted, rows, base_tokens, n_dec, trace, sampled) -> torch.Tensor:
        if accept is None:
            return torch.zeros_like(num_drafted)
        if self.mode == "depth":
            depth = num_drafted.clamp(max=self.mode_value)
            survival = torch.cumprod(accept, 1)
        elif self.mode == "full":
            depth, survival = num_drafted.clone(), torch.cumprod(accept, 1)
        elif self.mode == "budget":
            depth, survival, _ = kernels.dcut_select(accept, num_drafted, self.mode_value)
        else:
            cost = self.cost_model
            max_extra = int(num_drafted.sum())
            costs = cost.step_costs(rows, base_tokens, max_extra, drafted=True, device=accept.device)
            plan = self.plan_acceptance(accept, sampled)
            depth, planned, chosen = kernels.dcut_select(plan, num_drafted, max_extra, costs, float(n_dec))
            ar = torch.arange(accept.shape[1], device=accept.device)[None, :]
            valid = ar < num_drafted[:, None]
            survival = torch.where(valid, torch.cumprod(accept.float(), 1), torch.zeros((), device=valid.device))
            # sampled rows: every position whose survival clears the plan's lowest chosen survival (none: +inf)
            threshold = torch.where(ar < depth[:, None], planned, torch.full_like(planned, float("inf"))).amin()
            depth = torch.where(sampled, ((survival >= threshold) & valid).sum(1), depth)
            # Would plain decoding (no drafting at all) have done better? Then skip drafting for a while.
            gain = float(n_dec + (planned.reshape(-1).sort(descending=True).values[: int(chosen)].sum()))
            speculative_rate = gain / float(costs[int(chosen)])
            plain_rate = n_dec / cost.verify(rows, base_tokens)
            if speculative_rate < plain_rate:  # back off exponentially while drafting keeps losing
                self.plain_steps_left = self._backoff
                self._backoff = min(2 * self._backoff, self.max_backoff)
            else:
                self._backoff = self.probe_every
        trace.survival = survival.tolist()
        trace.budget = int(depth.sum())
        return depth

    def _keep_features(self, out, step, slots, kept, fed, emitted, num_accepted, n_pre):
        """Queue the target features of the tokens kept this step (and the token after each) for the drafter."""
        keep = step.token_col < kept[step.token_row]
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], -1)[keep]
        rows, cols = step.token_row[keep], step.token_col[keep]
        # the token after fed[r, c]: the next fed token, or the token emitted after the last kept one
        after = torch.cat([fed[:, 1:], fed.new_zeros(len(fed), 1)], 1)
        last = cols == kept[rows] - 1
        next_ids = torch.where(last, emitted[rows, num_accepted[rows]], after[rows, cols])
        self.pending_feat = torch.cat([self.pending_feat, feats.to(self.pending_feat.dtype)])
        self.pending_slot = torch.cat([self.pending_slot, slots[rows]])
        self.pending_next = torch.cat([self.pending_next, next_ids])

    def _emit(self, requests, emitted, num_accepted, logprobs, top=None) -> list[TokenEvent]:
        events = []
        for row, (request, tokens, n, lps) in enumerate(zip(requests, emitted, num_accepted, logprobs)):
            first_step = not request.prefilled
            request.prefilled = True
            count = 1 if first_step else n + 1
            tokens, lps = tokens[:count], lps[:count]
            from_draft = [False] if first_step else [True] * n + [False]
            room = request.params.max_new_tokens - len(request.generated)
            reason = None
            for i, token in enumerate(tokens):
                if token in request.stop:
                    count, reason = i + 1, FINISH_EOS
                    break
            if reason is None and count >= room:
                count, reason = room, FINISH_LENGTH
            tokens, lps, from_draft = tokens[:count], lps[:count], from_draft[:count]
            request.generated.extend(tokens)
            if request.penalties is not None:
                request.penalties.add(tokens)
            self.totals["tokens"] += len(tokens)
            top_tokens = top[row][:count] if top is not None and top[row] is not None else None
            events.append(TokenEvent(request.id, tokens, lps, from_draft, reason is not None, reason, top_tokens))
            if reason is not None:
                self._finish(request)
        return events

    # ---- profiling -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def time_dummy_steps(self, rows: int, tokens_per_row, context: int, repeats: int = 2) -> list[dict]:
        """For `rows` dummy sequences of `context` tokens: the median seconds of one verification forward adding each
        of `tokens_per_row` tokens per sequence, and of one drafting call. Uses idle slots and gives them back."""
        import statistics

        if self.running:
            raise RuntimeError("profile the cost model before serving requests")
        dev = self.device
        slots = torch.arange(rows, device=dev)
        vocab = self.target.config.get_text_config().vocab_size
        kwargs = {"output_hidden_states": [i + 1 for i in self.layer_ids]} if self.layer_ids else {}

        def forward(count):
            step = RaggedStep.build(self.pool, slots, torch.full((rows,), count, device=dev), packed=True)
            ids = torch.randint(3, vocab, (1, len(step.token_row)), device=dev)
            start = time.perf_counter()
            self.target(input_ids=ids, position_ids=(step.held[step.token_row] + step.token_col)[None],
                        use_cache=False, ragged=step, **kwargs)
            return time.perf_counter() - start, step

        _, step = forward(context)
        step.commit()
        samples = []
        for t in tokens_per_row:
            sample = {"rows": rows, "tokens_per_row": t,
                      "verify": statistics.median(forward(t)[0] for _ in range(repeats))}
            samples.append(sample)
        if self.batch_drafter is not None:
            t = tokens_per_row[0]
            features = torch.randn(rows, t, self.pending_feat.shape[1], dtype=self.target.dtype, device=dev)
            ids = torch.randint(3, vocab, (rows, t), device=dev)

            def select(logits, j):
                conf, token = torch.softmax(logits.float(), -1).max(-1)
                return token, None, conf

            def draft():
                start = time.perf_counter()
                self.batch_drafter.draft(slots, features, ids, torch.full((rows,), t, device=dev), ids[:, -1],
                                         self.batch_drafter.num_draft_tokens, select)
                self.batch_drafter.pool.lengths[slots] = 0
                return time.perf_counter() - start

            samples[0]["draft"] = statistics.median(draft() for _ in range(repeats))
        for s in range(rows):
            self.pool.release(s)
            if self.batch_drafter is not None:
                self.batch_drafter.release(s)
        return samples


def generate_batch(target, drafter, prompts, *, tokenizer=None, max_new_tokens: int = 64, verify="auto",
                   do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int | None = None, max_batch_size: int = 32, engine: SpeculativeEngine | None = None,
                   return_engine: bool = False):
    """Generate for many prompts at once with the continuous-batching speculative engine.

    prompts: token-id lists (or strings, with `tokenizer`: the chat template is applied). Returns the generated token
    ids per prompt, in order (and the engine when `return_engine`). Request i gets seed `seed + i` when `seed` is set.
    """
    engine = engine or SpeculativeEngine(target, drafter, verify=verify, max_batch_size=max_batch_size)
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer")
            prompt = chat_ids(tokenizer, prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=None if seed is None else seed + i)
        ids.append(engine.add_request(prompt, params))
    outputs = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id].extend(event.token_ids)
    result = [outputs[i] for i in ids]
    return (result, engine) if return_engine else result
