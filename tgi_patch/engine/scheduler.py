"""The scheduler decides who runs: requests wait in arrival order, join the running batch while a slot is free and
their prompts fit the step's prefill budget, and leave it when they finish or are cancelled. Each step it hands the
engine a `ScheduledBatch` (requests to prefill first, then those decoding), and afterwards advances every request by
the tokens verification emitted for it, applying stop ids and the length limit.

It knows nothing of models: freeing a finished request's memory is the `release(slot)` callback it is given."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .transfer import upload
from .request import FINISH_CANCELLED, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, Request, TokenEvent


@dataclass
class ScheduledBatch:
    """The requests one step runs: the `num_prefill` new ones (their prompts are prefilled) first, then those
    decoding, each group in slot order."""

    requests: list[Request]
    slots: torch.Tensor  # [B]
    num_prefill: int
    remaining: torch.Tensor  # [B] tokens each request may still generate
    # [B] bool: the request is rejection-sampled (sampled without a seed), so D-Cut plans it from its first draft
    # position only (`dcut.py`); greedy and seeded (`Request.coupled`) requests are verified by exact match
    sampled: torch.Tensor
    # the same as host lists: what the engine plans with (it never reads the tensors back)
    slots_host: list[int] = field(default_factory=list)
    remaining_host: list[int] = field(default_factory=list)
    sampled_host: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_decode(self) -> int:
        return len(self.requests) - self.num_prefill

    @property
    def prompts(self) -> list[list[int]]:
        """The prompts of the requests prefilled this step."""
        return [r.prompt for r in self.requests[: self.num_prefill]]


class Scheduler:
    def __init__(self, max_batch_size: int, max_prefill_tokens: int, release: Callable[[int], None]):
        self.max_prefill_tokens = max_prefill_tokens
        self.release = release  # frees what a finished request's slot holds (KV pages, drafter state)
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.requests: dict[int, Request] = {}  # id -> request, waiting or running
        self.free_slots = list(range(max_batch_size - 1, -1, -1))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, request: Request) -> None:
        self.requests[request.id] = request
        self.waiting.append(request)

    def cancel(self, request_id: int) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.cancelled = True

    def drop_cancelled(self) -> list[TokenEvent]:
        """Remove cancelled requests, waiting or running; a finishing event for each."""
        events = []
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self.requests.pop(request.id, None)
            events.append(TokenEvent(request.id, [], [], [], True, FINISH_CANCELLED))
        for slot, request in list(self.running.items()):
            if request.cancelled:
                self.finish(request)
                events.append(TokenEvent(request.id, [], [], [], True, FINISH_CANCELLED))
        return events

    def admit(self) -> None:
        """Waiting requests join, in order, while a slot is free and their prompts fit `max_prefill_tokens`."""
        budget = self.max_prefill_tokens
        while self.waiting and self.free_slots and len(self.waiting[0].prompt) <= budget:
            request = self.waiting.popleft()
            budget -= len(request.prompt)
            request.slot = self.free_slots.pop()
            self.running[request.slot] = request

    def schedule(self, device, hold=frozenset()) -> ScheduledBatch | None:
        """This step's batch: the running requests but those in the slots `hold` (None when nothing runs)."""
        slots_all = sorted(s for s in self.running if s not in hold)
        if not slots_all:
            return None
        prefill = [s for s in slots_all if not self.running[s].prefilled]
        decode = [s for s in slots_all if self.running[s].prefilled]
        order = prefill + decode
        requests = [self.running[s] for s in order]
        remaining = [r.params.max_new_tokens - len(r.generated) for r in requests]
        sampled = [r.params.do_sample and not r.coupled for r in requests]
        packed = upload([order, remaining, sampled], device)  # one copy to the device
        return ScheduledBatch(requests, packed[0], len(prefill), packed[1], packed[2].bool(), order, remaining,
                              sampled)

    def fail(self, request: Request, error: str) -> TokenEvent:
        """End `request` on its own error (its slot freed, unless it already was): the event that says so."""
        if self.running.get(request.slot) is request:
            self.finish(request)
        return TokenEvent(request.id, [], [], [], True, FINISH_ERROR, error=error)

    def finish(self, request: Request) -> None:
        slot = request.slot
        self.running.pop(slot, None)
        self.requests.pop(request.id, None)
        self.release(slot)
        self.free_slots.append(slot)

    def update(self, requests: list[Request], emitted: list[list[int]], num_accepted: list[int],
               logprobs: list[list[float]], top: list | None) -> list[TokenEvent]:
        """Advance each request by its accepted drafts and the token after them (a request prefilled this step: by its
        first token), cut at a stop id or the length limit; finish those that ended. One event per request (a
        request whose update raises fails alone: `fail`)."""
        events = []
        for row, (request, tokens, n, lps) in enumerate(zip(requests, emitted, num_accepted, logprobs)):
            try:
                events.append(self._update_one(request, tokens, n, lps, top[row] if top is not None else None))
            except Exception as error:  # noqa: BLE001 - this request's own fault: the others' updates go on
                events.append(self.fail(request, f"{type(error).__name__}: {error}"))
        return events

    def _update_one(self, request: Request, tokens: list[int], n: int, lps: list[float], top) -> TokenEvent:
        """`update` of one request: its event (`top`: its top tokens per emitted position, or None)."""
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
        top_tokens = top[:count] if top is not None else None
        if reason is not None:
            self.finish(request)
        return TokenEvent(request.id, tokens, lps, from_draft, reason is not None, reason, top_tokens)
