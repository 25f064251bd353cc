"""What goes into the engine and what comes out: a request's `SamplingParams`, its state while it runs (`Request`),
the `TokenEvent`s a step emits per request, and the `StepTrace` of what a step did."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .sampling import PenaltyState

FINISH_LENGTH, FINISH_EOS, FINISH_CANCELLED = "length", "eos_token", "cancelled"
FINISH_ERROR = "error"  # the request failed on its own (`TokenEvent.error` says why); the others ran on

# Bounds that keep a float valid once cast to the float32 the sampling kernels compute with: a positive value below
# FLOAT32_MIN_POSITIVE (the smallest positive float32, 1.4e-45, rounded down) would round to 0 or to it, one above
# FLOAT32_MAX_FINITE (the largest, 3.4028e38, rounded down) may round to inf. The server's schema states the same.
FLOAT32_MIN_POSITIVE = 1e-45
FLOAT32_MAX_FINITE = 3.4e38


def _number(value) -> bool:
    """A real number (not a bool, not NaN) that a float holds (an int past float's range is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return not math.isnan(float(value))
    except OverflowError:
        return False


def int64_seed(seed: int) -> int:
    """A seed (any integer: TGI's are u64, OpenAI's any) as the signed int64 of its low 64 bits, the random streams'
    key: seeds equal modulo 2**64 are the same seed."""
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


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
        """Refuses (`ValueError`) what the engine cannot run exactly: every float must stay a valid value once cast to
        the float32 the sampling kernels compute with (`FLOAT32_MIN_POSITIVE`, `FLOAT32_MAX_FINITE`), so no accepted
        value turns into 0, inf or NaN there. A temperature has no upper bound (as in TGI): the kernels clamp it to
        the largest float32, where sampling is already uniform over the allowed tokens."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool, got {self.do_sample!r}")
        if self.do_sample and not (_number(self.temperature) and self.temperature >= FLOAT32_MIN_POSITIVE):
            raise ValueError(f"temperature must be >= {FLOAT32_MIN_POSITIVE} (a smaller one is 0 as a float32) when "
                             f"sampling, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**63:
            raise ValueError(f"top_k must be an integer in [0, 2**63), got {self.top_k!r}")
        for name, low, high in (("top_p", FLOAT32_MIN_POSITIVE, 1.0),
                                ("repetition_penalty", FLOAT32_MIN_POSITIVE, FLOAT32_MAX_FINITE),
                                ("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if not (_number(value) and low <= value <= high):
                raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer (used modulo 2**64), got {self.seed!r}")
        if isinstance(self.top_n_tokens, bool) or not isinstance(self.top_n_tokens, int) or \
                not 0 <= self.top_n_tokens <= 1024:
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
    error: str | None = None  # with finish_reason "error": why this request failed


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
    ngram_index: object = field(default=None, repr=False, compare=False)  # `angelspec_hf.policy.NgramIndex` of its context

    @property
    def coupled(self) -> bool:
        """Sampled with a seed of its own: its tokens are Gumbel-max draws keyed by (seed, position, token), its drafts
        coupled to the same noise and verified by exact match, so the seed reproduces them in any batch (`sampling.py`);
        a sampled request without one is rejection-sampled."""
        return self.params.do_sample and self.params.seed is not None
