"""D-Cut's two models: how likely a draft token is to be accepted (online calibration of the drafter's confidence),
and what verifying costs on this hardware (a cost model profiled at start-up and cached per model and machine)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from angelspec_hf.modeling.draft_policy import default_cache_dir, hardware_key  # one key for every cost model


class AcceptanceCalibrator:
    """Maps the drafter's confidence in a draft token (the peak of its distribution there) to the probability that the
    target accepts it given that the tokens before it were accepted, from the verification outcomes seen so far,
    separately for each draft position (the same confidence means less deeper in a block, where the drafter reads its
    own guesses; positions past `num_positions - 1` share the last curve).

    Confidence is binned; each cell's estimate starts at `prior` (weight `prior_weight` observations, so the first
    steps are not extreme) and moves to the empirical rate. Only tokens whose predecessors were all accepted are
    observations: after a rejection nothing is learned about the rest of the block.
    """

    def __init__(self, num_bins: int = 10, prior: float | None = None, prior_weight: float = 4.0,
                 num_positions: int = 8):
        self.num_bins, self.num_positions = num_bins, num_positions
        centers = (torch.arange(num_bins, dtype=torch.float64) + 0.5) / num_bins
        start = centers if prior is None else torch.full((num_bins,), float(prior), dtype=torch.float64)
        cells = num_positions * num_bins  # flat: position * num_bins + bin
        self.accepted = (start * prior_weight).repeat(num_positions)
        self.trials = torch.full((cells,), prior_weight, dtype=torch.float64)
        self.observed = torch.zeros(cells, dtype=torch.float64)  # real observations (no prior)
        self.observed_accepted = torch.zeros(cells, dtype=torch.float64)
        self.confidence_sum = torch.zeros(cells, dtype=torch.float64)

    def _cells(self, confidence: torch.Tensor) -> torch.Tensor:
        """Flat cell of every entry of `confidence [..., K]`: its bin at its draft position (the last dimension)."""
        bins = (confidence.float().clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)
        position = torch.arange(confidence.shape[-1], device=confidence.device).clamp(max=self.num_positions - 1)
        return position * self.num_bins + bins

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probabilities, same shape as `confidence [..., K]` (K: draft positions)."""
        rate = (self.accepted / self.trials).to(confidence.device, torch.float32)
        return rate[self._cells(confidence)]

    def at(self, confidence: torch.Tensor, position: int) -> torch.Tensor:
        """Calibrated acceptance of confidences `[B]` all at draft position `position`."""
        cell = min(position, self.num_positions - 1) * self.num_bins
        bins = (confidence.float().clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)
        return (self.accepted / self.trials).to(confidence.device, torch.float32)[cell + bins]

    def update(self, confidence: torch.Tensor, verified: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """confidence `[B, K]`; verified `[B]` draft tokens verified per request; num_accepted `[B]` accepted."""
        k = confidence.shape[1]
        j = torch.arange(k, device=confidence.device)[None, :]
        observed = (j < verified[:, None]) & (j <= num_accepted[:, None])  # tested, predecessors all accepted
        accepted = j < num_accepted[:, None]
        cells = self._cells(confidence)[observed].cpu()
        outcome = accepted[observed].double().cpu()
        conf = confidence[observed].double().cpu()
        for target, values in ((self.trials, torch.ones_like(outcome)), (self.accepted, outcome),
                               (self.observed, torch.ones_like(outcome)), (self.observed_accepted, outcome),
                               (self.confidence_sum, conf)):
            target.index_add_(0, cells, values)

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


@dataclass
class CostModel:
    """Seconds per engine step: `verify(rows, tokens)` for a target forward over `rows` sequences and `tokens` new
    tokens in total, and `draft(rows)` for one drafting call. Both are least-squares fits of measurements:
    `a + b·rows + c·tokens` and `a + b·rows`."""

    verify_coef: tuple[float, float, float]
    draft_coef: tuple[float, float] = (0.0, 0.0)
    samples: list = field(default_factory=list)
    key: str = ""

    def verify(self, rows, tokens):
        a, b, c = self.verify_coef
        return max(a + b * rows + c * tokens, 1e-6)

    def draft(self, rows) -> float:
        a, b = self.draft_coef
        return max(a + b * rows, 0.0)

    def step_costs(self, rows: int, base_tokens: int, max_extra: int, drafted: bool, device=None) -> torch.Tensor:
        """`[max_extra + 1]`: cost of a step verifying 0..max_extra draft tokens on top of `base_tokens`."""
        extra = torch.arange(max_extra + 1, dtype=torch.float32, device=device)
        a, b, c = self.verify_coef
        cost = (a + b * rows + c * (base_tokens + extra)).clamp(min=1e-6)
        return cost + (self.draft(rows) if drafted else 0.0)

    def to_dict(self) -> dict:
        return {"verify_coef": list(self.verify_coef), "draft_coef": list(self.draft_coef), "samples": self.samples,
                "key": self.key}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(tuple(data["verify_coef"]), tuple(data["draft_coef"]), data.get("samples", []), data.get("key", ""))


def _fit(features: list[list[float]], times: list[float]) -> tuple[float, ...]:
    x = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(x, y).solution[:, 0]
    return tuple(float(c) for c in coef)


def profile_cost_model(engine, rows=(1, 2, 4, 8, 16, 32), tokens_per_row=(1, 2, 4, 8), context=32, repeats=2,
                       time_limit: float = 20.0) -> CostModel:
    """Measure verification (and drafting) steps of `engine`'s models on dummy sequences of `context` tokens, for
    batch sizes up to the engine's maximum, smallest first, stopping after about `time_limit` seconds."""
    rows = [r for r in rows if r <= engine.max_batch_size] or [1]
    verify_x, verify_t, draft_x, draft_t, samples = [], [], [], [], []
    start = time.perf_counter()
    for b in rows:
        if time.perf_counter() - start > time_limit and len(samples) >= 2:
            break
        for sample in engine.time_dummy_steps(b, list(tokens_per_row), context, repeats):
            samples.append(sample)
            verify_x.append([1.0, b, b * sample["tokens_per_row"]])
            verify_t.append(sample["verify"])
            if "draft" in sample:
                draft_x.append([1.0, b])
                draft_t.append(sample["draft"])
    verify_coef = _fit(verify_x, verify_t) if len(verify_t) >= 3 else (statistics.mean(verify_t), 0.0, 0.0)
    draft_coef = _fit(draft_x, draft_t) if len(draft_t) >= 2 else ((draft_t[0] if draft_t else 0.0), 0.0)
    return CostModel(verify_coef, draft_coef, samples)


def load_or_profile(engine, cache_dir=None, **profile_kwargs) -> CostModel:
    """The cached cost model for this engine's models and hardware, profiling (and caching) it when absent."""
    key = hardware_key(engine.target, engine.drafter)
    path = Path(cache_dir or default_cache_dir()) / f"{key}.json"
    if path.is_file():
        try:
            return CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError):
            pass  # a damaged cache file is re-measured
    model = profile_cost_model(engine, **profile_kwargs)
    model.key = key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=1))
    tmp.replace(path)
    return model
