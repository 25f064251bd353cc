"""What steps have actually delivered, and backing off when speculation loses: `StepKind`, `MeasuredRates`, `BackOff`.

Both policies (the batched engine's D-Cut and the `generate()` hook's draft length) decide from a plan first and
from measured rates second: whatever the plan says, a kind of step that has delivered fewer tokens per second than
plain steps is paused (`BackOff`), then tried again (a probe, which re-measures it)."""

from __future__ import annotations

from enum import Enum


class StepKind(str, Enum):
    """What an engine step (or a hook round) does. `UNDRAFTED` is a measurement pool, not a step: every `PLAIN` and
    `LOOKUP` step, as they came (what not running the drafter delivers)."""

    DRAFT = "draft"  # the drafter drafts for every decoding row (n-gram lookups may replace rows)
    PROBE = "probe"  # the drafter drafts for a few rows only: re-plans drafting cheaply; its rate is not measured
    LOOKUP = "lookup"  # n-gram lookups only, no drafter call
    PLAIN = "plain"  # nothing proposed
    UNDRAFTED = "undrafted"

    @property
    def drafts(self) -> bool:
        """The drafter runs in a step of this kind."""
        return self in (StepKind.DRAFT, StepKind.PROBE)


def _rate(sums) -> float:
    """Tokens per second of `MeasuredRates`' weighted sums."""
    return sums[0] / sums[1]


def _spread(sums) -> float:
    """The standard error of `_rate(sums)` (the delta method for a ratio of weighted sums)."""
    tokens, seconds, tt, ts, ss, _ = sums
    rate = tokens / seconds
    residual = max(tt - 2 * rate * ts + rate * rate * ss, 0.0)  # Σw²(t - rate·s)²
    return residual ** 0.5 / seconds


class MeasuredRates:
    """Decode tokens per second that steps of each kind (`StepKind`; the hook's rounds are `DRAFT` or `PLAIN`) have
    actually delivered, per batch size (rows decoding, in power-of-two buckets; the hook is batch 1), over steps
    without prefill. The cost model plans a step; these say whether such plans have paid on this machine, under its
    present load, with every overhead the model does not see. Both policies back off to plain steps by them.

    A rate is total tokens over total seconds, each step weighted `decay ** age` (age counted in steps of its own
    kind), with the standard error of that ratio estimate. A kind *loses* only when plain steps beat it by more than
    `z` standard errors: a speculative round yields anything from 1 to block + 1 tokens, so its delivered rate is
    noisy, and a rule that reacts to noise starts back-offs its probes cannot lift (docs/concepts.md, "Backing
    off"). A kind that loses every step by the same margin (a drafter never accepted) has no spread and is found out
    after `min_steps`."""

    PLAIN = StepKind.PLAIN

    def __init__(self, decay: float = 0.9, z: float = 1.0, min_steps: int = 3):
        self.decay, self.z, self.min_steps = decay, z, min_steps
        # per (kind, bucket): weighted sums [Σw·t, Σw·s, Σw²·t², Σw²·t·s, Σw²·s², steps] of tokens t and seconds s
        self._sums: dict[tuple, list[float]] = {}
        self._unmeasured = 0

    @staticmethod
    def bucket(n_dec: int) -> int:
        return max(n_dec, 1).bit_length()

    def observe(self, kind, n_dec: int, tokens: int, seconds: float) -> None:
        if n_dec <= 0 or seconds <= 0:
            return
        d, d2 = self.decay, self.decay ** 2
        old = self._sums.get((kind, self.bucket(n_dec)), [0.0] * 6)
        self._sums[(kind, self.bucket(n_dec))] = [
            d * old[0] + tokens, d * old[1] + seconds, d2 * old[2] + tokens * tokens,
            d2 * old[3] + tokens * seconds, d2 * old[4] + seconds * seconds, old[5] + 1]

    @property
    def rates(self) -> dict[tuple, float]:
        """Every measured rate, by (kind, bucket)."""
        return {key: sums[0] / sums[1] for key, sums in self._sums.items()}

    def get(self, kind, n_dec: int) -> float | None:
        sums = self._sums.get((kind, self.bucket(n_dec)))
        return None if sums is None else _rate(sums)

    def spread(self, kind, n_dec: int) -> float | None:
        """The standard error of `get(kind, n_dec)` (the delta method for a ratio of weighted sums)."""
        sums = self._sums.get((kind, self.bucket(n_dec)))
        return None if sums is None else _spread(sums)

    def forget(self, kind) -> None:
        """Drop the rates of one kind of step, at every batch size."""
        self._sums = {key: sums for key, sums in self._sums.items() if key[0] != kind}

    def loses(self, n_dec: int, kind=StepKind.DRAFT, against=PLAIN) -> bool:
        """Have steps of `kind` (drafted ones by default) at this batch size delivered fewer tokens per second than
        steps of kind `against` (plain ones by default), by more than `z` standard errors of the difference, over at
        least `min_steps` steps?"""
        spec = self._sums.get((kind, self.bucket(n_dec)))
        other = self._sums.get((against, self.bucket(n_dec)))
        if spec is None or other is None or spec[5] < self.min_steps:
            return False
        gap = _rate(other) - _rate(spec)
        return gap > 0 and gap > self.z * (_spread(spec) ** 2 + _spread(other) ** 2) ** 0.5

    def plain_due(self, n_dec: int, every: int) -> bool:
        """While other steps at this batch size have been measured and plain ones not: True once in `every` calls, for
        a plain step that measures them."""
        bucket = self.bucket(n_dec)
        others = any(b == bucket and kind != self.PLAIN for kind, b in self._sums)
        if not others or self.get(self.PLAIN, n_dec) is not None:
            return False
        self._unmeasured = (self._unmeasured + 1) % every
        return self._unmeasured == 0


class BackOff:
    """Skip an option for a while after it lost: `first` steps, doubling while it keeps losing (up to `cap`); the step
    after a pause tries it again (a probe, which re-measures it)."""

    def __init__(self, first: int, cap: int):
        self.first, self.cap = first, cap
        self.left, self.length = 0, first  # steps left in the pause; the next pause's length
        self.probe_due = False  # the option is tried at the first step after the pause
        self.probing = False  # the last `allows` was a probe

    def allows(self, losing: bool) -> bool:
        """May the option be taken this step? `losing`: it has measured worse than plain (a pause starts, this step
        its first)."""
        self.probing = False
        if self.waiting():
            return False
        if self.take_probe():
            self.probing = True
            return True
        if losing:
            self.lost(now=True)
            return False
        return True

    def waiting(self) -> bool:
        """One step of the pause, if one is under way (True: skip the option this step)."""
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def take_probe(self) -> bool:
        """True once after a pause: this step is the probe."""
        probe, self.probe_due = self.probe_due, False
        return probe

    def lost(self, now: bool = False) -> None:
        """Start a pause of the present length (`now`: this step is its first), a probe after it; the next pause is
        twice as long."""
        self.left = self.length - int(now)
        self.probe_due = True
        self.length = min(2 * self.length, self.cap)

    def reset(self) -> None:
        """The option paid: the next pause is short again."""
        self.length = self.first

    def cancel(self) -> None:
        """End any pause now, without a probe, and reset."""
        self.left, self.probe_due, self.length = 0, False, self.first

    def restart(self) -> None:
        """A new text: a pause under way ends at once in its probe (a pause earned on other text must not keep this
        one plain), and the next pause is short."""
        self.probe_due = self.probe_due or self.left > 0
        self.left, self.length = 0, self.first
