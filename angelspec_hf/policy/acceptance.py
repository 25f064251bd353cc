"""How likely a draft token is to be accepted, and the two rules that keep planning on it exact for sampled requests.

`AcceptanceCalibrator` maps the drafter's confidence in a draft token (the peak of its distribution there) to the
probability that the target accepts it given that the tokens before it were accepted, per draft position, learned
from verification outcomes. Both policies use it: the batched engine's D-Cut (`tgi_patch/engine/dcut.py`) through
its tensor methods, on the engine's device and without reading anything back; the `generate()` hook's draft-length
policy (`modeling/draft_policy.py`) through its host methods (`rate`, `observe`, `update_round`). The same class,
with a fixed prior, calibrates n-gram lookups (their confidence: matched n-gram length / the longest).
"""

from __future__ import annotations

import torch


def _on(x, device) -> torch.Tensor:
    """`x` as a tensor on `device` (copied only if it is elsewhere)."""
    x = torch.as_tensor(x)
    return x if x.device == torch.device(device) else x.to(device)


class AcceptanceCalibrator:
    """P(draft position j accepted | positions < j accepted) as a function of the drafter's confidence there, binned
    (`num_bins`), one table per draft position (positions past `num_positions - 1` share the last). Each cell starts
    at a prior worth `prior_weight` observations, the bin's centre × `prior_scale` (drafters are usually
    over-confident) or, with `prior`, that constant, and moves to the observed rate. Only tokens whose predecessors
    were all accepted are observations: after a rejection nothing is learned about the rest of the block.

    `position_rates(n)`: the acceptance of each position over every confidence, its prior the rate of the position
    before (`prior_mean` for the first), so a position never drafted is expected to do as well as the last one."""

    TABLES = ("accepted", "trials", "observed", "observed_accepted", "confidence_sum")

    def __init__(self, num_bins: int = 10, prior: float | None = None, prior_weight: float = 4.0,
                 num_positions: int = 8, prior_scale: float = 1.0, prior_mean: float = 0.5):
        self.num_bins, self.num_positions = num_bins, num_positions
        self.prior_weight, self.prior_mean = prior_weight, prior_mean
        centers = (torch.arange(num_bins, dtype=torch.float64) + 0.5) / num_bins
        start = centers * prior_scale if prior is None else torch.full((num_bins,), float(prior), dtype=torch.float64)
        cells = num_positions * num_bins  # flat: position * num_bins + bin
        self.accepted = (start * prior_weight).repeat(num_positions)
        self.trials = torch.full((cells,), prior_weight, dtype=torch.float64)
        self.observed = torch.zeros(cells, dtype=torch.float64)  # real observations (no prior)
        self.observed_accepted = torch.zeros(cells, dtype=torch.float64)
        self.confidence_sum = torch.zeros(cells, dtype=torch.float64)
        self._changed()

    def _changed(self) -> None:
        self._rate: torch.Tensor | None = None  # accepted / trials as float32
        self._host_rates: list[float] | None = None  # the same as Python floats (`rate`)
        self._totals: list[list[float]] | None = None  # `position_totals()` as Python floats

    def to(self, device) -> AcceptanceCalibrator:
        """Keep the tables on `device` (the engine's: updated there in place and read there by every step)."""
        for name in self.TABLES:
            setattr(self, name, getattr(self, name).to(device))
        self._changed()
        return self

    # ---- tensors in, tensors out (the engine) --------------------------------------------------------------------
    def rates(self) -> torch.Tensor:
        """`[num_positions * num_bins]` float32 calibrated acceptance per cell (on the tables' device)."""
        if self._rate is None:
            self._rate = (self.accepted / self.trials).float()
        return self._rate

    def _bins(self, confidence: torch.Tensor) -> torch.Tensor:
        return (confidence.float().nan_to_num(0.0).clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)

    def _cells(self, confidence: torch.Tensor) -> torch.Tensor:
        """Flat cell of every entry of `confidence [..., K]`: its bin at its draft position (the last dimension)."""
        position = torch.arange(confidence.shape[-1], device=confidence.device).clamp(max=self.num_positions - 1)
        return position * self.num_bins + self._bins(confidence)

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probabilities, same shape as `confidence [..., K]` (K: draft positions)."""
        return _on(self.rates(), confidence.device)[self._cells(confidence)]

    def at(self, confidence: torch.Tensor, position: int) -> torch.Tensor:
        """Calibrated acceptance of confidences `[B]` all at draft position `position`."""
        cell = min(position, self.num_positions - 1) * self.num_bins
        return _on(self.rates(), confidence.device)[cell + self._bins(confidence)]

    def update(self, confidence: torch.Tensor, verified: torch.Tensor, num_accepted: torch.Tensor,
               rows: torch.Tensor | None = None) -> None:
        """confidence `[B, K]`; verified `[B]` draft tokens verified per request; num_accepted `[B]` accepted;
        `rows [B]` (bool): the requests to learn from (None: all). In place on the tables' device, without reading
        anything back: every entry is added, weighted 1 where observed and 0 elsewhere."""
        dev = self.trials.device
        confidence, verified, num_accepted = (_on(x, dev) for x in (confidence, verified, num_accepted))
        j = torch.arange(confidence.shape[1], device=dev)[None, :]
        observed = (j < verified[:, None]) & (j <= num_accepted[:, None])  # tested, predecessors all accepted
        if rows is not None:
            observed &= _on(rows, dev)[:, None]
        weight = observed.double().reshape(-1)
        outcome = ((j < num_accepted[:, None]) & observed).double().reshape(-1)
        conf = torch.where(observed, confidence.double(), 0.0).reshape(-1)
        cells = self._cells(confidence).expand_as(confidence).reshape(-1)
        for table, values in ((self.trials, weight), (self.accepted, outcome), (self.observed, weight),
                              (self.observed_accepted, outcome), (self.confidence_sum, conf)):
            table.index_add_(0, cells, values)
        self._changed()

    def position_totals(self) -> torch.Tensor:
        """`[2, num_positions]`: observed acceptances and observations summed per draft position (tables' device)."""
        return torch.stack([self.observed_accepted.reshape(self.num_positions, self.num_bins).sum(1),
                            self.observed.reshape(self.num_positions, self.num_bins).sum(1)])

    def set_position_totals(self, totals: list[list[float]]) -> None:
        """`position_totals()` as the host read them (with a step's results), so `position_rates` reads nothing."""
        self._totals = [list(row) for row in totals]

    # ---- Python floats (the hook, and plans made on the host) ------------------------------------------------------
    def position_rates(self, count: int | None = None) -> list[float]:
        """Acceptance of draft positions 0 .. `count - 1` (default `num_positions`) over every confidence, as Python
        floats: what a round may expect before anything is drafted (see the class docstring for the prior)."""
        if self._totals is None:
            self._totals = self.position_totals().tolist()
        accepted, observed = self._totals
        rates, rate = [], self.prior_mean
        for j in range(self.num_positions if count is None else count):
            if j < self.num_positions:  # past the last position, the last one's rate
                rate = (accepted[j] + self.prior_weight * rate) / (observed[j] + self.prior_weight)
            rates.append(rate)
        return rates

    def _cell(self, position: int, confidence: float) -> int:
        b = min(int(max(confidence, 0.0) * self.num_bins), self.num_bins - 1)
        return min(position, self.num_positions - 1) * self.num_bins + b

    def rate(self, position: int, confidence: float) -> float:
        """Calibrated acceptance of one confidence at one draft position."""
        if self._host_rates is None:
            self._host_rates = self.rates().tolist()
        return self._host_rates[self._cell(position, confidence)]

    def observe(self, position: int, confidence: float, accepted: float) -> None:
        """One trial at `position`: `accepted` is 1 or 0, or the probability of acceptance where it is known exactly
        (a shadow draft's), which counts as that expected outcome."""
        cell = self._cell(position, confidence)
        for table, value in ((self.trials, 1.0), (self.accepted, accepted), (self.observed, 1.0),
                             (self.observed_accepted, accepted), (self.confidence_sum, confidence)):
            table[cell] += value
        self._changed()

    def update_round(self, confidences: list[float], num_accepted: int) -> None:
        """One verified round of one sequence: its drafted positions' confidences and how many were accepted."""
        for j, conf in enumerate(confidences[: num_accepted + 1]):  # after a rejection nothing more is learned
            self.observe(j, conf, float(j < num_accepted))

    # ---- reports ---------------------------------------------------------------------------------------------------
    def _per_bin(self, cells: torch.Tensor) -> torch.Tensor:
        return cells.reshape(self.num_positions, self.num_bins).sum(0)

    def reliability(self) -> list[dict]:
        """Per bin with observations: mean confidence, observed acceptance rate and count (a reliability curve)."""
        observed, accepted, confidence = map(self._per_bin, (self.observed, self.observed_accepted,
                                                            self.confidence_sum))
        rows = []
        for b in range(self.num_bins):
            n = float(observed[b])
            if n:
                rows.append({"confidence": float(confidence[b]) / n, "acceptance": float(accepted[b]) / n,
                             "count": int(n)})
        return rows

    def calibration_error(self) -> dict:
        """Expected calibration error of the raw confidence, and of the calibrated estimate, over observed tokens."""
        n = float(self.observed.sum())
        if not n:
            return {"raw": float("nan"), "calibrated": float("nan"), "observations": 0}
        rate = self.observed_accepted / self.observed.clamp(min=1)
        raw = (self.confidence_sum / self.observed.clamp(min=1) - rate).abs()
        calibrated = (self.accepted / self.trials - rate).abs()
        weights = self.observed / n
        return {"raw": float((weights * raw).sum()), "calibrated": float((weights * calibrated).sum()),
                "observations": int(n)}


# ---- D-Cut, and why it stays exact for sampled requests ------------------------------------------------------------
# A seeded sampled request needs none of what follows: its token at each position is its Gumbel-max draw from p there
# (`sampling.py`), whatever was drafted or verified, so it is planned like a greedy one, with every signal (its
# `ScheduledBatch.sampled` is False). The rest is about unseeded sampled requests, which are rejection-sampled.
# Rejection sampling (Leviathan et al.) emits a token distributed as the target's p at draft position k only if the
# draft token d_k is distributed as q_k *given that position k is verified*. So whether k is verified may depend
# on anything known before d_k is drawn (the drafted prefix d_<k, the drafter's distribution q_k, calibrated
# statistics) but never on d_k or later tokens. The two rules below keep that: the confidence of position k is a
# function of q_k alone (`draft_confidence`), and every plan of a step — how wide the block is drafted
# (`drafting_bound`), the budget "auto" chooses and its threshold, the ranking of a fixed budget, whether an n-gram
# lookup replaces the block — sees a sampled request through its first position only (`plan_acceptance`), since
# the confidences after it follow its drawn tokens; a sampled request then verifies every position whose own
# survival clears the threshold, which reads d_<k alone. Ranking by q(d_k) — the probability of the token actually
# drawn — made verification favour tokens the drafter over-proposes and skewed the output; a drafting
# width read from the sampled confidences let position k's verification follow d_k through the budget (found in
# review). Since no plan reads another request's draws either, requests that share a seed, and with it
# their random streams, cannot steer each other's verification. Greedy requests have no randomness to bias and keep
# every signal. (The engine injects these into `DCutPolicy` once, as `SpeculativeEngine.draft_confidence` /
# `.plan_acceptance`; a subclass may swap a rule, as tests do to prove their power.)

def draft_confidence(probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """D-Cut's confidence `[B]` in a drafted position: the peak of the drafter's distribution `probs [B, V]` there
    (for a greedy row, the probability of its argmax draft `token`; for a sampled row known before drawing)."""
    return probs.max(-1).values


def plan_acceptance(accept: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The acceptance probabilities `[B, K]` every plan of a step reads (the drafting width, "auto"'s budget, a fixed
    budget's ranking, the lookup choice): a rejection-sampled row's (`sampled [B]`) own positions after the first
    depend on its drawn tokens, so it is planned as if every position were as likely as its first."""
    return torch.where(sampled[:, None], accept[:, :1].expand_as(accept), accept)

