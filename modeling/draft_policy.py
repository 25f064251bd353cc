"""How many tokens the `generate()` hook drafts in a round: as many as pay for themselves, possibly none.

This is D-Cut's reasoning at batch 1, over the parts in `angelspec_hf.policy` that the batched engine shares: a round
drafting `k` tokens costs `draft(k) + step(1 + k)` seconds (`RoundCosts`, profiled once per models and hardware, refined
from the rounds timed and written back to the cache) and yields `1 + accepted` tokens, acceptance per draft position
calibrated on the drafter's confidence (`AcceptanceCalibrator`); a plain step costs `step(1)` and yields one. The policy
drafts the next token only while a round stopped at it or at some later position is expected to deliver more tokens per
second than one stopped here (`step(n)` need not be a line: `StepCost`), and takes a plain step when no block is
expected to beat plain decoding, or when drafted rounds have delivered fewer tokens per second than plain ones
(`MeasuredRates`): then it backs off (`BackOff`) and probes again later. A probe the acceptance model advises against is
a *shadow draft*: the drafter proposes its first token beside a plain step and the target's own distribution there says
how likely it was to be accepted (greedy: whether it is the target's token; sampling: `sum_x min(p(x), q(x))`), so
position 0 is learned without verifying anything; the output comes from the plain step alone and the shadow draws no
random numbers.

Exact for sampling: whether position `j + 1` is drafted (and so verified) is decided after the token at `j` is drawn,
from its confidence (known before it was drawn), never from the token at `j + 1`; whether a round drafts at all,
from earlier rounds only. The state lives on the drafter (`drafter.draft_policy(target)`), so what one call learned
serves the next; what depends on the text (the back-off, the rate of drafted rounds) starts afresh with each call.
"""

from __future__ import annotations

from angelspec_hf.policy import (AcceptanceCalibrator, BackOff, LinearFit, MeasuredRates, QuietWindow, RoundCosts, StepCost,
                                 StepKind)


def decoding_mode(generation_config) -> str | None:
    """The decoding mode a call's acceptance is calibrated under (`DraftLengthPolicy.new_sequence`): None for greedy
    decoding, "sampled" otherwise. Two modes, not one per sampling configuration: the policy's state stays bounded
    whatever values the calls bring."""
    return "sampled" if getattr(generation_config, "do_sample", False) else None


class DraftLengthPolicy:
    """Per-round draft length for the batch-1 hook (see the module docstring). `measure=False`: no measured-rate
    back-off (decisions then do not depend on timing); `shadow_probes=False`: probes always draft. `device`: the
    models' (refined costs are written back to the cache only after rounds during which other processes left the CPU
    alone: `QuietWindow`)."""

    SAVE_EVERY = 32  # timed rounds between write-backs of the refined costs to the cache file

    def __init__(self, costs: RoundCosts, max_tokens: int, probe_every: int = 4, max_backoff: int = 64,
                 measure: bool = True, shadow_probes: bool = True, device="cpu"):
        self.step = StepCost(*costs.step_coef, prior_span=max_tokens + 1, plain=costs.plain_step,
                             table=costs.step_table)
        self.draft = LinearFit(*costs.draft_coef, prior_span=max_tokens)
        self.costs = costs
        self._timed, self._window = 0, QuietWindow(device)
        self.max_tokens, self.probe_every = max_tokens, probe_every
        self._calibrations: dict = {}  # decoding mode -> (drafter, n-gram lookup, corpus lookup) calibrators
        self.mode = None
        self.calibrator, self.lookups, self.corpus_lookups = self._calibrations_for(None)
        self.backoff = BackOff(probe_every, max_backoff)
        self.shadow_probes, self.shadow_due = shadow_probes, False  # this round's plain step carries a shadow draft
        self.measured = MeasuredRates() if measure else None
        self._round: list[float] = []
        self._survival = self._expected = 1.0

    def _calibrations_for(self, mode) -> tuple[AcceptanceCalibrator, AcceptanceCalibrator, AcceptanceCalibrator]:
        if mode not in self._calibrations:
            n = self.max_tokens
            self._calibrations[mode] = (
                AcceptanceCalibrator(num_positions=n, prior_weight=2.0, prior_scale=0.7),
                AcceptanceCalibrator(prior=0.5, num_positions=max(n, 16)),
                # corpus lookups (`CorpusIndex`): per-token confidences, calibrated like a drafter's
                AcceptanceCalibrator(num_positions=max(n, 16), prior_weight=2.0, prior_scale=0.8))
        return self._calibrations[mode]

    def new_sequence(self, mode=None) -> None:
        """A new `generate()` call: the back-off restarts (a pause under way ends in its probe at once) and the
        measured rate of drafted rounds is forgotten; the costs, the calibration and the plain rate carry over.

        `mode`: the call's decoding mode (`decoding_mode()`: None for greedy, "sampled").
        Acceptance is calibrated apart per mode: a greedy token is accepted when it is the target's argmax, a sampled
        one with probability `min(1, p / q)` (a lookup's: `p`), so rates learned in greedy calls overstate sampled
        ones, and a server or a benchmark alternating the two would otherwise draft sampled rounds too long."""
        self.mode = mode
        self.calibrator, self.lookups, self.corpus_lookups = self._calibrations_for(mode)
        self.backoff.restart()
        if self.measured is not None:
            self.measured.forget(StepKind.DRAFT)

    # ---- the decisions ---------------------------------------------------------------------------------------------
    def expected_rates(self, max_tokens: int) -> list[float]:
        """Expected tokens per second of a round drafting k = 0 .. `max_tokens` tokens (0: a plain step)."""
        rates, survival, tokens = [1.0 / self.step(1)], 1.0, 1.0
        for k, mean in enumerate(self.calibrator.position_rates(max_tokens), start=1):
            survival *= mean
            tokens += survival
            rates.append(tokens / (self.draft(k) + self.step(1 + k)))
        return rates

    def expected_rate(self, k: int) -> float:
        return self.expected_rates(k)[k]

    def best_rate(self, max_tokens: int) -> float:
        """Expected tokens per second of the best of a plain step and a drafted round of up to `max_tokens`."""
        return max(self.expected_rates(max_tokens))

    def expected_to_pay(self, max_tokens: int) -> bool:
        """Is some block of up to `max_tokens` expected to deliver more tokens per second than a plain step?"""
        rates = self.expected_rates(max_tokens)
        return max(rates[1:]) > rates[0]

    def measured_loss(self) -> bool:
        """Have drafted rounds delivered fewer tokens per second than plain ones, as measured?"""
        return self.measured is not None and self.measured.loses(1)

    def start_round(self, max_tokens: int) -> bool:
        """Draft this round? False during a back-off, when no block is expected to pay, when drafted rounds have
        measured slower than plain ones (a back-off starts), and one round in `probe_every` while plain rounds are
        unmeasured. After a back-off, a probe: a drafted round, or a shadow draft (`shadow_due`) when the acceptance
        model says drafting would not pay."""
        self._round, self._survival, self._expected = [], 1.0, 1.0
        self.shadow_due = False
        if max_tokens < 1 or self.backoff.waiting():
            return False
        if self.backoff.take_probe():
            if self.shadow_probes and not self.expected_to_pay(max_tokens):
                self.shadow_due = True
                self.backoff.lost(now=True)
                return False
            return True
        if self.measured is not None and self.measured.plain_due(1, self.probe_every):
            return False
        if self.expected_to_pay(max_tokens) and not self.measured_loss():
            self.backoff.reset()
            return True
        self.backoff.lost(now=True)
        return False

    def keep_drafting(self, confidence: float, max_tokens: int) -> bool:
        """After drafting one more position with `confidence` (the peak of the drafter's distribution there): is the
        next position worth drafting and verifying? Yes when a round stopped at some later position, those after this
        one expected at their positions' mean acceptance, has a better expected rate than one stopped here: not only
        the next, since a step's cost can jump at one size and stay flat after it (`StepCost`)."""
        j = len(self._round)
        self._round.append(confidence)
        self._survival *= self.calibrator.rate(j, confidence)
        self._expected += self._survival
        k = j + 1
        if k >= max_tokens:
            return False
        here = self._expected / (self.draft(k) + self.step(1 + k))
        survival, expected = self._survival, self._expected
        for later, mean in enumerate(self.calibrator.position_rates(max_tokens)[k:], start=k + 1):
            survival *= mean
            expected += survival
            if expected / (self.draft(later) + self.step(1 + later)) > here:
                return True
        return False

    def lookup_length(self, confidence: float, available: int, draft_tokens: int, repeating: bool = False) -> int:
        """How many tokens of an n-gram lookup continuation (`available`, matched with `confidence` = matched length
        / longest) to verify: the length with the best expected tokens per second (a lookup costs no drafting), or 0
        when a drafted round or a plain step is expected to do better. `repeating`: the round before verified a lookup
        and accepted all of it, so the text is repeating a span of its context, and the whole continuation is
        verified (a lookup's acceptance is calibrated per position and confidence, which cannot tell a loop from a
        chance match: docs/benchmarks.md, "Lookups that learn a loop"). Reads the context and past rounds only."""
        if repeating:
            return available
        return self.lookup_plan([confidence] * available, draft_tokens)[0]

    def lookup_plan(self, confidences: list[float], draft_tokens: int, corpus: bool = False) -> tuple[int, float]:
        """`(k, rate)`: how many tokens of a lookup proposal to verify, each with its confidence (an n-gram lookup's
        matched length / longest for every token; a corpus lookup's own per-token confidence, `corpus=True`, calibrated
        apart), and the expected tokens per second of verifying them; `k = 0` (and the rate of the best of a drafted
        round and a plain step) when no length is expected to beat those."""
        best_k, best = 0, self.best_rate(draft_tokens)
        for k, rate in self._lookup_rates(confidences, corpus):
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    def lookup_rate(self, confidences: list[float], corpus: bool = False) -> float:
        """Expected tokens per second of verifying the whole lookup proposal `confidences` (`lookup_plan`'s)."""
        rate = 1.0 / self.step(1)
        for _, rate in self._lookup_rates(confidences, corpus):
            pass
        return rate

    def _lookup_rates(self, confidences: list[float], corpus: bool):
        """`(k, expected tokens per second)` of verifying the first k tokens of a lookup proposal, k = 1, 2, ..."""
        calibrator = self.corpus_lookups if corpus else self.lookups
        survival, tokens = 1.0, 1.0
        for k, confidence in enumerate(confidences, start=1):
            survival *= calibrator.rate(k - 1, confidence)
            tokens += survival
            yield k, tokens / self.step(1 + k)

    # ---- what happened -----------------------------------------------------------------------------------------------
    def observe(self, drafted: int, accepted: int, draft_seconds: float | None, step_seconds: float | None,
                round_seconds: float | None = None) -> None:
        """A verified round (or a plain step, `drafted = 0`): `draft_seconds` drafting, `step_seconds` the target
        forward with verification, `round_seconds` the whole round's wall time (None: not timed, e.g. after prefill)."""
        if round_seconds is not None and self.measured is not None:
            kind = StepKind.DRAFT if drafted else StepKind.PLAIN
            self.measured.observe(kind, 1, 1 + accepted, round_seconds)
        if drafted:
            self.calibrator.update_round(self._round[:drafted], accepted)
            if draft_seconds is not None:
                self.draft.add(drafted, draft_seconds)
        if step_seconds is not None:
            self.step.add(1 + drafted, step_seconds)
            self._timed_round()

    def observe_lookup(self, confidence: float | list[float], proposed: int, accepted: int,
                       step_seconds: float | None, corpus: bool = False) -> None:
        """A round that verified `proposed` tokens of a lookup: an n-gram lookup matched with `confidence`, or (a
        list, `corpus=True`) a corpus lookup with these per-token confidences."""
        confidences = list(confidence)[:proposed] if corpus else [confidence] * proposed
        (self.corpus_lookups if corpus else self.lookups).update_round(confidences, accepted)
        if step_seconds is not None:
            self.step.add(1 + proposed, step_seconds)
            self._timed_round()

    def observe_shadow(self, confidence: float, accepted: float, draft_seconds: float | None) -> None:
        """A shadow draft's outcome: the drafter's confidence at position 0 and the probability, known exactly from the
        target's distribution at the plain step beside it, that its token would have been accepted. When drafting is
        now expected to pay (and the measured rates do not say otherwise), the back-off ends: the next round drafts."""
        self.calibrator.observe(0, confidence, accepted)
        if draft_seconds is not None:
            self.draft.add(1, draft_seconds)
        if self.expected_to_pay(self.max_tokens) and not self.measured_loss():
            self.backoff.cancel()

    def _timed_round(self) -> None:
        self._timed += 1
        if self._timed % self.SAVE_EVERY == 0 and self._window.quiet():
            c = self.costs
            table = self.step.table
            RoundCosts(self.step.coef, self.draft.coef, c.key, c.path, plain_step=self.step.plain,
                       step_table=None if table is None else tuple(table)).save()
