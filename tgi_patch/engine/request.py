"""What goes into the engine and what comes out: a request's `SamplingParams`, its state while it runs (`Request`),
the `TokenEvent`s a step emits per request, and the `StepTrace` of what a step did."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .sampling import PenaltyState

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
    repetition_penalty: float = 1.0  # 1 = off; see sampling.py for the three penalty rules
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
    choice: str = "plain"  # "speculative": the drafter ran; "lookup": n-gram lookups only; "plain": nothing proposed
    verified_tokens: int = 0
    pruned_tokens: int = 0
    drafted_tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0  # of `seconds`, the drafting call's

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Request:
    """One request while the engine holds it: its prompt, parameters, random seed, stop ids, the slot it runs in (-1:
    waiting) and the tokens generated so far."""

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
