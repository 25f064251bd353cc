"""The batched engine's cost model: seconds of a verification forward over `rows` sequences and `tokens` new tokens,
and of a drafting call, fitted on the model runner's timed dummy steps (`profile_cost_model`), cached per model and
hardware (`load_or_profile`), then refined from the engine's own timed steps."""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .costs import OnlineLeastSquares, QuietWindow, default_cache_dir, hardware_key, profile_cached, write_profile


@dataclass
class CostModel:
    """Seconds per engine step: `verify(rows, tokens)` for a target forward over `rows` sequences and `tokens` new
    tokens in total, and `draft(rows, features)` for one drafting call that first ingests `features` padded target
    feature positions (`rows` × the most any of them has pending: the drafter reads them as one padded batch). Both
    are least-squares fits of measurements: `a + b·rows + c·tokens` and `a + b·rows + d·features`. The ingestion term
    (`ingest`) is what a drafting call costs to catch up after a prompt or after plain steps; without it the catch-up
    is read as the cost of drafting itself.

    A profiled model (`load_or_profile`) is refined from the engine's own timed steps (`refine`, then
    `observe_verify` / `observe_draft`), since real steps (longer contexts, other load) differ from the profile's dummy
    ones: the profile stays as the prior its fit starts from (`OnlineLeastSquares`), and the refined coefficients are
    written back to the cache file every `SAVE_EVERY` observed steps (when `path` is set, and only after steps during
    which other processes left the CPU alone: `QuietWindow` on `device`)."""

    verify_coef: tuple[float, float, float]
    draft_coef: tuple[float, ...] = (0.0, 0.0, 0.0)  # (a, b, d); a 2-tuple (no ingestion term) gets d = 0
    samples: list = field(default_factory=list)
    key: str = ""
    path: Path | None = field(default=None, compare=False, repr=False)  # the cache file it came from (not serialised)
    device: str = field(default="cpu", compare=False, repr=False)  # where its steps run (not serialised)

    SAVE_EVERY = 64
    # The refined price of a verified token never falls below this share of the profile's: at one batch size the fit
    # cannot tell rows from the intercept, and one slow step with few tokens can tilt its slope to zero or below, after
    # which "auto" would verify every drafted token (docs/concepts.md, "The cost model").
    TOKEN_FLOOR = 0.5
    PRIOR_ROWS = (1, 2, 4, 8, 16, 32)  # the prior's design points where the profile has none

    def __post_init__(self):
        self.draft_coef = tuple(float(c) for c in self.draft_coef) + (0.0,) * (3 - len(self.draft_coef))

    def verify(self, rows, tokens):
        a, b, c = self.verify_coef
        return max(a + b * rows + c * tokens, 1e-6)

    def draft(self, rows, features: int = 0) -> float:
        a, b, _ = self.draft_coef
        return max(a + b * rows, 0.0) + self.ingest(features)

    def ingest(self, features: int) -> float:
        """What ingesting `features` padded feature positions adds to a drafting call."""
        return max(self.draft_coef[2], 0.0) * features

    def step_costs(self, rows: int, base_tokens: int, max_extra: int, drafted: bool, device=None) -> torch.Tensor:
        """`[max_extra + 1]`: cost of a step verifying 0..max_extra draft tokens on top of `base_tokens`."""
        extra = torch.arange(max_extra + 1, dtype=torch.float32, device=device)
        a, b, c = self.verify_coef
        cost = (a + b * rows + c * (base_tokens + extra)).clamp(min=1e-6)
        return cost + (self.draft(rows) if drafted else 0.0)

    # ---- refined from real steps -------------------------------------------------------------------------------------
    def refine(self, prior_weight: float = 8.0, decay: float = 0.99, prior_fade: float = 0.95,
               min_prior: float = 0.05) -> None:
        """Start refining from observed steps, the current coefficients as the prior (worth `prior_weight` steps at
        the profile's batch sizes and token counts, fading × `prior_fade` per observed step down to `min_prior` of
        that; observations decay × `decay` per step, so the fit follows the current workload)."""
        points = sorted({(s["rows"], s["rows"] * s["tokens_per_row"]) for s in self.samples}) or [
            (r, r * t) for r in self.PRIOR_ROWS for t in (1, 4)]
        drafts = sorted({(s["rows"], s["rows"] * s.get("draft_features", 1)) for s in self.samples if "draft" in s})
        drafts = drafts or [(r, r * f) for r in self.PRIOR_ROWS for f in (1, 32)]
        fit = {"prior_weight": prior_weight, "decay": decay, "prior_fade": prior_fade, "min_prior": min_prior}
        self._verify_fit = OnlineLeastSquares([[1.0, r, t] for r, t in points],
                                              [self.verify(r, t) for r, t in points], **fit)
        self._draft_fit = OnlineLeastSquares([[1.0, r, f] for r, f in drafts], [self.draft(r, f) for r, f in drafts],
                                             **fit)
        self._observed, self._window = 0, QuietWindow(self.device)
        slope = _verify_line(self.samples)[2]  # the profile's own slope, not a refined one
        self._token_floor = self.TOKEN_FLOOR * max(self.verify_coef[2] if slope is None else slope, 0.0)

    @property
    def refining(self) -> bool:
        return getattr(self, "_verify_fit", None) is not None

    def observe_verify(self, rows: int, tokens: int, seconds: float) -> None:
        """A decode step's target forward and verification over `rows` requests and `tokens` new tokens took
        `seconds` (only while `refining`)."""
        if not self.refining:
            return
        self._verify_fit.add([1.0, float(rows), float(tokens)], seconds)
        a, b, c = self._verify_fit.coef
        self.verify_coef = (a, b, max(c, self._token_floor))
        self._observed += 1
        if self.path is not None and self._observed % self.SAVE_EVERY == 0 and self._window.quiet():
            self.save()

    def observe_draft(self, rows: int, features: int, seconds: float) -> None:
        """A drafting call for `rows` requests that ingested `features` padded feature positions took `seconds` (only
        while `refining`)."""
        if self.refining:
            self._draft_fit.add([1.0, float(rows), float(features)], seconds)
            self.draft_coef = self._draft_fit.coef

    def save(self) -> bool:
        """Write the current coefficients to `path` (atomically); False when not cached or the cache cannot be
        written (a read-only cache keeps its old profile)."""
        return self.path is not None and write_profile(self.path, self.to_dict())

    def to_dict(self) -> dict:
        return {"verify_coef": list(self.verify_coef), "draft_coef": list(self.draft_coef), "samples": self.samples,
                "key": self.key}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if len(data["draft_coef"]) != 3:
            raise ValueError("a profile without the ingestion term is measured again")
        return cls(tuple(data["verify_coef"]), tuple(data["draft_coef"]), data.get("samples", []), data.get("key", ""))



def _fit(features: list[list[float]], times: list[float]) -> tuple[float, ...]:
    x = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(x, y).solution[:, 0]
    return tuple(float(c) for c in coef)


def _verify_line(samples: list[dict]) -> tuple:
    """`(a, b, c)` of `a + b·rows + c·tokens` fitted on profile samples (`rows`, `tokens_per_row`, `verify` seconds);
    `(None, None, None)` with fewer than 3."""
    timed = [s for s in samples if "verify" in s]
    if len(timed) < 3:
        return None, None, None
    return _fit([[1.0, s["rows"], s["rows"] * s["tokens_per_row"]] for s in timed], [s["verify"] for s in timed])


def profile_cost_model(runner, rows=(1, 2, 4, 8, 16, 32), tokens_per_row=(1, 2, 4, 8), context=32, repeats=2,
                       time_limit: float = 20.0, draft_features=(1, 128)) -> CostModel:
    """Measure verification (and drafting) steps of a model runner's models (`runner.time_dummy_steps`) on dummy
    sequences of `context` tokens, for batch sizes up to `runner.max_batch_size`, smallest first, stopping after about
    `time_limit` seconds; drafting calls after each of `draft_features` pending features per row."""
    rows = [r for r in rows if r <= runner.max_batch_size] or [1]
    draft_x, draft_t, samples = [], [], []
    start = time.perf_counter()
    for b in rows:
        if time.perf_counter() - start > time_limit and len({s["rows"] for s in samples}) >= 2:
            break
        for sample in runner.time_dummy_steps(b, list(tokens_per_row), context, repeats, draft_features):
            samples.append(sample)
            if "draft" in sample:
                draft_x.append([1.0, b, b * sample["draft_features"]])
                draft_t.append(sample["draft"])
    verify_coef = _verify_line(samples)
    if verify_coef[2] is None:  # too few samples for a line: their mean
        verify_coef = (statistics.mean(s["verify"] for s in samples), 0.0, 0.0)
    if len({x[1] for x in draft_x}) >= 2:  # rows and features both varied
        draft_coef = _fit(draft_x, draft_t)
    elif draft_x:  # one batch size: its cost, and the slope in features
        a, d = _fit([[1.0, x[2]] for x in draft_x], draft_t) if len({x[2] for x in draft_x}) >= 2 else (draft_t[0], 0)
        draft_coef = (a, 0.0, d)
    else:
        draft_coef = (0.0, 0.0, 0.0)
    return CostModel(verify_coef, draft_coef, samples)


def load_or_profile(runner, cache_dir=None, **profile_kwargs) -> CostModel:
    """The cached cost model for a model runner's models (`runner.target`, `runner.drafter`) and this hardware, else
    profiled now (and cached when the machine was quiet: `costs.profile_cached`). `runner`: a `ModelRunner` (an
    engine's is `engine.runner`)."""
    key = hardware_key(runner.target, runner.drafter)
    if getattr(runner, "attention_kind", None):  # the engine's attention path, where not the reference (its costs)
        key = hashlib.sha256(f"{key}\nattention:{runner.attention_kind}".encode()).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / f"{key}.json"

    def measure() -> CostModel:
        model = profile_cost_model(runner, **profile_kwargs)
        model.key = key
        return model

    model, cached = profile_cached(path, CostModel.from_dict, measure, runner.device, CostModel.to_dict)
    model.path, model.device = (path if cached else None), str(runner.device)
    return model
