"""D-Cut: which draft tokens each step verifies, and whether to draft at all.

Two models: how likely a draft token is to be accepted (`AcceptanceCalibrator`, online calibration of the drafter's
confidence, per draft position), and what verifying costs on this hardware (`CostModel`, profiled at start-up on the
model runner's dummy steps and cached per model and machine). `DCutPolicy` uses them each step: how wide to draft and
when to stop, where an n-gram lookup replaces the drafter's block, which prefix of each block to verify (the globally
most likely to be accepted, under a budget the cost model chooses in "auto" mode), and when plain decoding wins, after
which drafting backs off exponentially. `draft_confidence` and `plan_acceptance` are the two rules that keep this
exact for sampled requests (explained above them).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from angelspec_hf.modeling.draft_policy import (  # one key for every cost model, one measured-rate rule
    MeasuredRates,
    OnlineLeastSquares,
    default_cache_dir,
    hardware_key,
)

from . import kernels
from .ngram import NgramIndex
from .transfer import upload


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
        self._rate: torch.Tensor | None = None  # accepted / trials as float32, until the next update
        self._position_rates: list[float] | None = None  # `position_rates()`, until the next update

    TABLES = ("accepted", "trials", "observed", "observed_accepted", "confidence_sum")

    def to(self, device) -> AcceptanceCalibrator:
        """Keep the tables on `device` (the engine's: they are updated there in place, and read there by every
        step, so no step copies them between host and device)."""
        for name in self.TABLES:
            setattr(self, name, getattr(self, name).to(device))
        self._rate = None
        return self

    def rates(self) -> torch.Tensor:
        """`[num_positions * num_bins]` float32 calibrated acceptance per cell (on the tables' device)."""
        if self._rate is None:
            self._rate = (self.accepted / self.trials).float()
        return self._rate

    def _cells(self, confidence: torch.Tensor) -> torch.Tensor:
        """Flat cell of every entry of `confidence [..., K]`: its bin at its draft position (the last dimension)."""
        bins = (confidence.float().nan_to_num(0.0).clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)
        position = torch.arange(confidence.shape[-1], device=confidence.device).clamp(max=self.num_positions - 1)
        return position * self.num_bins + bins

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probabilities, same shape as `confidence [..., K]` (K: draft positions)."""
        return _on(self.rates(), confidence.device)[self._cells(confidence)]

    def at(self, confidence: torch.Tensor, position: int) -> torch.Tensor:
        """Calibrated acceptance of confidences `[B]` all at draft position `position`."""
        cell = min(position, self.num_positions - 1) * self.num_bins
        bins = (confidence.float().nan_to_num(0.0).clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)
        return _on(self.rates(), confidence.device)[cell + bins]

    def update(self, confidence: torch.Tensor, verified: torch.Tensor, num_accepted: torch.Tensor,
               rows: torch.Tensor | None = None) -> None:
        """confidence `[B, K]`; verified `[B]` draft tokens verified per request; num_accepted `[B]` accepted;
        `rows [B]` (bool): the requests to learn from (None: all). In place on the tables' device, without reading
        anything back: every entry is added, weighted 1 where observed and 0 elsewhere."""
        dev = self.trials.device
        confidence, verified, num_accepted = (_on(x, dev) for x in (confidence, verified, num_accepted))
        k = confidence.shape[1]
        j = torch.arange(k, device=dev)[None, :]
        observed = (j < verified[:, None]) & (j <= num_accepted[:, None])  # tested, predecessors all accepted
        if rows is not None:
            observed &= _on(rows, dev)[:, None]
        weight = observed.double().reshape(-1)
        outcome = ((j < num_accepted[:, None]) & observed).double().reshape(-1)
        conf = torch.where(observed, confidence.double(), 0.0).reshape(-1)
        cells = self._cells(confidence).expand_as(confidence).reshape(-1)
        for target, values in ((self.trials, weight), (self.accepted, outcome), (self.observed, weight),
                               (self.observed_accepted, outcome), (self.confidence_sum, conf)):
            target.index_add_(0, cells, values)
        self._rate, self._position_rates = None, None

    def position_totals(self) -> torch.Tensor:
        """`[2, num_positions]`: accepted and trials summed per draft position (on the tables' device)."""
        return torch.stack([self.accepted.reshape(self.num_positions, self.num_bins).sum(1),
                            self.trials.reshape(self.num_positions, self.num_bins).sum(1)])

    def set_position_totals(self, totals: list[list[float]]) -> None:
        """`position_totals()` as the host read them (with a step's results), so `position_rates` needs no read."""
        self._position_rates = [a / t for a, t in zip(*totals)]

    def position_rates(self) -> list[float]:
        """Acceptance per draft position over every confidence (the prior included), as Python floats: what a step
        may expect before anything is drafted."""
        if self._position_rates is None:
            accepted, trials = self.position_totals()
            self._position_rates = (accepted / trials).tolist()
        return list(self._position_rates)

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
    tokens in total, and `draft(rows, features)` for one drafting call that first ingests `features` padded target
    feature positions (`rows` × the most any of them has pending: the drafter reads them as one padded batch). Both
    are least-squares fits of measurements: `a + b·rows + c·tokens` and `a + b·rows + d·features`.

    The ingestion term is what a drafting call costs to catch up: after a prompt, or after plain steps, every row
    has tokens the drafter has not read (measured on this project's 2-core Xeon with the shipped DFly: a call for 32
    rows took 68 ms after 1 pending feature each and 267 ms after 256). Without it the catch-up was read as the
    cost of drafting itself, and a model refined at 32 requests priced every drafting call at 144 ms.

    A profiled model (`load_or_profile`) is then refined from the engine's own timed steps (`refine`, then
    `observe_verify` / `observe_draft`): the profile times dummy sequences of 32 tokens on an idle machine, up to the
    batch sizes its time limit reaches, and real steps differ (measured on this project's CPU: a plain step of 32
    requests with 100-250-token contexts took 0.23 s where the profile's line said 0.13 s, and a drafting call for one
    request 19 ms where it said 36 ms). The profile stays as the prior its fit starts from (`OnlineLeastSquares`), and
    the refined coefficients are written back to the cache file every `SAVE_EVERY` observed steps."""

    verify_coef: tuple[float, float, float]
    draft_coef: tuple[float, ...] = (0.0, 0.0, 0.0)  # (a, b, d); a 2-tuple (no ingestion term) gets d = 0
    samples: list = field(default_factory=list)
    key: str = ""
    path: Path | None = field(default=None, compare=False, repr=False)  # the cache file it came from (not serialised)

    SAVE_EVERY = 64
    # The refined price of a verified token never falls below this share of the profile's: at one batch size the fit
    # cannot tell rows from the intercept, and a slow step with few tokens (the first decode step after a burst's
    # prefill took 665-727 ms against about 130-150) tilted its slope towards zero or below, after which "auto"
    # verified 145-209 draft tokens in one step at 32 requests (this project's Xeon; 18 accepted). Floored, 77.
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
        self._observed = 0
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
        if self.path is not None and self._observed % self.SAVE_EVERY == 0:
            self.save()

    def observe_draft(self, rows: int, features: int, seconds: float) -> None:
        """A drafting call for `rows` requests that ingested `features` padded feature positions took `seconds` (only
        while `refining`)."""
        if self.refining:
            self._draft_fit.add([1.0, float(rows), float(features)], seconds)
            self.draft_coef = self._draft_fit.coef

    def save(self) -> None:
        """Write the current coefficients to `path` (atomically; a read-only cache keeps the old profile)."""
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=1))
            tmp.replace(self.path)
        except OSError:
            pass

    def to_dict(self) -> dict:
        return {"verify_coef": list(self.verify_coef), "draft_coef": list(self.draft_coef), "samples": self.samples,
                "key": self.key}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(tuple(data["verify_coef"]), tuple(data["draft_coef"]), data.get("samples", []), data.get("key", ""))


def _on(x, device) -> torch.Tensor:
    """`x` as a tensor on `device` (copied only if it is elsewhere)."""
    x = torch.as_tensor(x)
    return x if x.device == torch.device(device) else x.to(device)


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
    """The cached cost model for a model runner's models (`runner.target`, `runner.drafter`) and this hardware,
    profiling (and caching) it when absent. `runner`: a `ModelRunner` (an engine's is `engine.runner`)."""
    key = hardware_key(runner.target, runner.drafter)
    path = Path(cache_dir or default_cache_dir()) / f"{key}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if len(data["draft_coef"]) == 3:  # an older cache (no ingestion term) is re-measured
                model = CostModel.from_dict(data)
                model.path = path
                return model
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is re-measured
    model = profile_cost_model(runner, **profile_kwargs)
    model.key, model.path = key, path
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save()
    return model


def parse_verify(verify) -> tuple[str, int | None]:
    """`"auto"` → D-Cut with the cost model; an int, `"N"` or `"budget:N"` → fixed budget of N draft tokens per step;
    `"depth:K"` → every request verifies up to K draft tokens; `"full"` → the whole block (plain speculative
    decoding)."""
    if verify == "auto" or verify == "full":
        return verify, None
    if isinstance(verify, int) and not isinstance(verify, bool) and verify >= 0:
        return "budget", verify
    if isinstance(verify, str):
        for prefix, mode in (("depth:", "depth"), ("budget:", "budget"), ("", "budget")):
            value = verify[len(prefix):]
            if verify.startswith(prefix) and value.isascii() and value.isdigit():
                return mode, int(value)
    raise ValueError(f"verify must be 'auto', 'full', an integer budget >= 0, 'budget:N' or 'depth:K', got {verify!r}")


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
# every signal. (`SpeculativeEngine.draft_confidence` / `.plan_acceptance` call these; a subclass may swap a rule,
# as tests do.)

def draft_confidence(probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """D-Cut's confidence `[B]` in a drafted position: the peak of the drafter's distribution `probs [B, V]` there
    (for a greedy row, the probability of its argmax draft `token`; for a sampled row known before drawing)."""
    return probs.max(-1).values


def plan_acceptance(accept: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The acceptance probabilities `[B, K]` every plan of a step reads (the drafting width, "auto"'s budget, a fixed
    budget's ranking, the lookup choice): a rejection-sampled row's (`sampled [B]`) own positions after the first
    depend on its drawn tokens, so it is planned as if every position were as likely as its first."""
    return torch.where(sampled[:, None], accept[:, :1].expand_as(accept), accept)


class BackOff:
    """Skip an option for a while after it lost: `first` steps, doubling while it keeps losing (up to `cap`); the step
    after a pause tries it again (a probe, which re-measures it)."""

    def __init__(self, first: int, cap: int):
        self.first, self.cap = first, cap
        self.left, self.length, self.probe = 0, first, False
        self.probing = False  # the last `allows` was a probe

    def allows(self, losing: bool) -> bool:
        """May the option be taken this step? `losing`: has it measured worse than plain (starts a pause)."""
        self.probing = False
        if self.left > 0:
            self.left -= 1
            self.probe = self.left == 0
            return False
        if self.probe:
            self.probe, self.probing = False, True
            return True
        if losing:
            self.lost()
            self.left -= 1  # this step is the pause's first
            return False
        return True

    def lost(self) -> None:
        self.left = self.length
        self.length = min(2 * self.length, self.cap)

    def reset(self) -> None:
        self.length = self.first


LOOKUP = "lookup"  # the measured kind of a step that verified n-gram lookups without running the drafter
PROBE = "probe"  # a step whose drafter ran for a few rows only (`DCutPolicy.step_kind`): its rate is not measured
UNDRAFTED = "undrafted"  # the measured kind of every plain or lookup-only step, pooled as they came


class DCutPolicy:
    """D-Cut's decisions for one engine, in its verify mode (`parse_verify`): "auto" (budget from the cost model,
    with back-off to plain steps), a fixed token budget, a fixed depth, or every drafted token ("full").

    `load_cost_model()` gives the cost model when it is first needed (profiling the model runner); n-gram lookups
    replace a row's drafted block when `lookup_tokens` > 0, their confidence (matched n-gram length /
    `lookup_max_ngram`) calibrated on its own.

    Each "auto" step is one of four kinds (`step_kind`), decided before anything is drafted: **draft** (the drafter
    runs; lookups may replace rows), **probe** (the drafter runs for a few rows only, see below), **lookup** (n-gram
    lookups only: no drafter call, so it costs nothing but the tokens verified) or **plain**. The drafter runs only
    while a step planned under the cost model beats a plain one (`drafting_may_pay`): the drafting call, its
    catch-up on the features the rows have pending, and every row's draft planned like the rows of the recent
    drafted steps, at any batch size (`remember`; before any, with the acceptance each draft position has had so far).
    On this project's 2-core Xeon a drafting call is not paid back from about 16 requests up. Each kind also backs
    off, at each batch size on its own (`backoff`), to plain steps (for `probe_every` steps, doubling while it keeps
    losing, up to 8x) when the speculative steps measured at this batch size (`MeasuredRates`, with `measure=True`)
    have delivered fewer tokens per second than the plain ones, and the drafter also while the plan says it would
    lose; the step after a pause is a probe. A
    probe after a measured loss drafts every row, to measure again; one after a planned loss drafts only the
    `PROBE_ROWS` rows with the fewest pending features (their verified confidences refresh the plan at the cost of
    a small drafting call, where a full one at 32 requests cost two plain steps). A cost model profiled on an idle
    machine, or calibration still learning, cannot then make batched decoding slower for long. A step that also
    prefills prompts is planned as its decoding rows alone: the prompts' share of the forward is spent whatever is
    drafted or verified, and pricing draft tokens against the whole, slower step made them look cheap (with clients
    sending several requests each, the steps that prefilled a new request were the ones that drafted). The decisions
    read only past steps and row positions, so they keep sampling exact."""

    PROBE_ROWS = 4  # rows a probe after a planned loss drafts
    RECENT_ROWS = 256  # drafted rows the plan remembers

    def __init__(self, mode: str, mode_value: int | None, *, cost_model: CostModel | None = None,
                 load_cost_model=None, calibrator: AcceptanceCalibrator | None = None, probe_every: int = 8,
                 lookup_tokens: int = 0, lookup_max_ngram: int = 3, measure: bool = True):
        if lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0, got {lookup_tokens}")
        self.mode, self.mode_value = mode, mode_value
        self._cost_model, self._load_cost_model = cost_model, load_cost_model
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.lookup_calibrator = AcceptanceCalibrator(prior=0.5)
        self.lookup_tokens, self.lookup_max_ngram = lookup_tokens, lookup_max_ngram
        self.probe_every = probe_every
        self._backoffs: dict[tuple[str, int], BackOff] = {}  # ("drafter" | "lookup", batch-size bucket)
        self.measured = MeasuredRates() if measure else None
        self._recent: torch.Tensor | None = None  # [M, K] planned survival of the last drafted rows (`remember`)
        # the last "auto" selection's planned survival `[B, K]` and its drafter's rows `[B]`, on the device: the
        # engine remembers them from its step's one read (`remember_plan`), else they are read when next needed
        self.last_plan: tuple[torch.Tensor, torch.Tensor] | None = None

    def backoff(self, option: str, n_dec: int) -> BackOff:
        """The back-off of `option` ("drafter" or "lookup") at the batch size of `n_dec` decoding rows (the buckets of
        `MeasuredRates`): a loss at 32 requests pauses drafting there, not at the 4 a burst's tail leaves, where the
        plan and the rates are those of 4 rows."""
        key = (option, MeasuredRates.bucket(n_dec))
        if key not in self._backoffs:
            self._backoffs[key] = BackOff(self.probe_every, 8 * self.probe_every)
        return self._backoffs[key]

    @property
    def cost_model(self) -> CostModel:
        """The cost model given, else the profiled one, which (with `measure=True`) is refined from the steps timed."""
        if self._cost_model is None:
            self._cost_model = self._load_cost_model()
            if self.measured is not None:
                self._cost_model.refine()
        return self._cost_model

    # ---- before drafting ---------------------------------------------------------------------------------------------
    def step_kind(self, n_dec: int, width: int, features: int = 0, horizon: int | None = None) -> str:
        """"draft", "probe", "lookup" or "plain" for a step with `n_dec` requests decoding whose drafter would draft
        `width` tokens (0: no drafter) after ingesting `features` padded pending feature positions; `horizon`: the
        tokens those requests have left, on average (None: plenty). Every mode but "auto" drafts whenever it can."""
        if self.mode != "auto":
            return "draft" if width else "plain"
        if self.measured is not None and self.measured.plain_due(n_dec, self.probe_every):
            return "plain"  # a batch size measured speculating but never plain: measure plain, 1 step in probe_every
        drafter = self.backoff("drafter", n_dec)
        if width and self._drafter_allowed(n_dec):
            if self.drafting_may_pay(n_dec, width, features, horizon):
                if not self._drafter_loses(n_dec):
                    drafter.reset()
                return "draft"
            if drafter.probing:
                return "probe" if n_dec > self.PROBE_ROWS else "draft"
            drafter.lost()  # planned not to pay: lookups or plain steps, then a probe re-plans it
        if self.uses_lookup:
            losing = self.measured is not None and self.measured.loses(n_dec, LOOKUP)
            lookup = self.backoff("lookup", n_dec)
            if lookup.allows(losing):
                if not losing:
                    lookup.reset()
                return "lookup"
        return "plain"

    def probe_rows(self, pending: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        """The decoding rows a probe drafts (indices, ascending): of those with a token left to draft (`remaining
        [n_dec]` > 1), the `PROBE_ROWS` with the fewest pending features `[n_dec]` (the cheapest to catch up; ties by
        row). Tensors in, a tensor out; host lists in (as the engine has them), a list out."""
        if not torch.is_tensor(pending):
            top = max(pending, default=0) + 1
            key = [p + (r <= 1) * top for p, r in zip(pending, remaining)]
            return sorted(sorted(range(len(key)), key=key.__getitem__)[: self.PROBE_ROWS])
        key = pending + (remaining <= 1).long() * (int(pending.max()) + 1)
        order = torch.sort(key, stable=True).indices[: self.PROBE_ROWS]
        return order.sort().values

    def should_draft(self, n_dec: int) -> bool:
        """The drafter's gate alone: False while backing off (a plain step is taken instead; "auto" mode only), and
        when the speculative steps measured at this batch size have delivered fewer tokens per second than plain ones
        (which starts a back-off; the step after one drafts, to re-measure). A batch size with speculative
        measurements but no plain one takes a plain step in `probe_every` to measure it."""
        if self.mode != "auto":
            return True
        if self.measured is not None and self.measured.plain_due(n_dec, self.probe_every):
            return False
        return self._drafter_allowed(n_dec)

    def _drafter_allowed(self, n_dec: int) -> bool:
        return self.backoff("drafter", n_dec).allows(self._drafter_loses(n_dec))

    def _drafter_loses(self, n_dec: int) -> bool:
        """Have drafted steps at this batch size measured slower than the steps taken without the drafter: plain
        ones, and with lookups on, plain and lookup-only steps as they came (`UNDRAFTED`: a lookup step is taken where
        some row has a lookup, a plain one where none has; together they are what not drafting delivers; in one run
        of 32 requests on this project's Xeon, drafted steps delivered 133 tokens/s, lookup steps 223 and plain ones
        189)?"""
        if self.measured is None:
            return False
        return self.measured.loses(n_dec, True, UNDRAFTED if self.uses_lookup else MeasuredRates.PLAIN)

    def drafting_may_pay(self, n_dec: int, width: int, features: int = 0, horizon: int | None = None) -> bool:
        """Could a drafted step beat a plain one? Planned before drafting under the cost model: the drafting call for
        the `n_dec` decoding rows plus its catch-up (ingesting `features` padded pending feature positions, shared by
        the `probe_every` drafted steps it opens, or by the `horizon` tokens the rows have left on average where that
        is fewer: after that the drafter has only each step's accepted tokens to read), and every row's draft planned
        like the recently drafted rows (`remember`), D-Cut verifying the tokens most likely to be accepted first;
        before any, every row planned with the acceptance each draft position has had so far
        (`AcceptanceCalibrator.position_rates`, its prior until observed). Any number of verified tokens beating a
        plain step says yes."""
        cost = self.cost_model
        survival = self._recent_survival(width)
        per_row = survival.reshape(-1).sort(descending=True).values.double()
        m = survival.shape[0]
        gain = n_dec * (1 + per_row.cumsum(0) / m)  # after the best 1, 2, ... tokens of every m remembered rows
        extra = n_dec * torch.arange(1, len(per_row) + 1, dtype=torch.float64) / m
        a, b, c = cost.verify_coef
        seconds = ((a + b * n_dec + c * (n_dec + extra)).clamp(min=1e-6) + cost.draft(n_dec)
                   + cost.ingest(features) / max(1, min(self.probe_every, horizon or self.probe_every)))
        plain = n_dec / cost.verify(n_dec, n_dec)
        return bool((gain / seconds > plain).any())

    def remember(self, survival: torch.Tensor) -> None:
        """Keep the planned survival `[n, K]` of drafted rows (the last `RECENT_ROWS`) for `drafting_may_pay`."""
        survival = survival.detach().float().cpu()
        if self._recent is not None:
            k = max(self._recent.shape[1], survival.shape[1])
            pad = lambda x: torch.nn.functional.pad(x, (0, k - x.shape[1]))  # noqa: E731
            survival = torch.cat([pad(self._recent), pad(survival)])
        self._recent = survival[-self.RECENT_ROWS:]

    def remember_plan(self, planned: list[list[float]] | None = None, rows: list[bool] | None = None) -> None:
        """`remember` the drafter's rows of `last_plan`, given as host lists (`planned [B][K]`, `rows [B]`; None:
        read them from the device)."""
        if self.last_plan is None:
            return
        if planned is None:
            planned, rows = (x.tolist() for x in self.last_plan)
        self.last_plan = None
        chosen = [p for p, r in zip(planned, rows) if r]
        if chosen:
            self.remember(torch.tensor(chosen, dtype=torch.float32))

    def _recent_survival(self, width: int) -> torch.Tensor:
        """`[M, width]`: the remembered rows, or one row of the position rates' survival while there are none."""
        self.remember_plan()
        if self._recent is None or not len(self._recent):
            rates = self.calibrator.position_rates()
            return torch.tensor([rates[min(d, len(rates) - 1)] for d in range(width)]).cumprod(0)[None]
        recent = self._recent[:, :width]
        return torch.nn.functional.pad(recent, (0, width - recent.shape[1]))

    def observe_step(self, kind, n_pre: int, n_dec: int, decode_tokens: int, seconds: float, fed_tokens: int = 0,
                     draft_seconds: float = 0.0, draft_rows: int = 0, draft_features: int = 0) -> None:
        """A finished step of `kind` (True drafted, `PROBE`, `LOOKUP`, False plain) that fed the target `fed_tokens`
        new tokens and spent `draft_seconds` of its `seconds` in a drafting call for `draft_rows` rows that ingested
        `draft_features` padded feature positions: its delivered rate (`MeasuredRates`; not a probe's, which drafted
        for a few rows only) and its costs (the profiled cost model's refinement). Steps that also prefilled are
        skipped: their rates are not comparable and their tokens cost what a prompt's do, not what a decoding step's
        do."""
        if self.measured is None or n_pre:
            return
        if kind != PROBE:
            self.measured.observe(kind, n_dec, decode_tokens, seconds)
        if kind is False or kind == LOOKUP:
            self.measured.observe(UNDRAFTED, n_dec, decode_tokens, seconds)
        if self._cost_model is not None and self._cost_model.refining:
            self._cost_model.observe_verify(n_dec, fed_tokens, seconds - draft_seconds)
            if draft_rows:
                self._cost_model.observe_draft(draft_rows, draft_features, draft_seconds)

    def draft_width(self, num_draft_tokens: int) -> int:
        if self.mode in ("depth", "budget"):  # no row ever verifies more: do not draft more
            return min(num_draft_tokens, self.mode_value)
        return num_draft_tokens

    def drafting_bound(self, remaining, n_dec: int, sampled, plan=plan_acceptance):
        """`keep_going` for drafting in "auto" mode (None otherwise): position j + 1 can be worth verifying only while
        some decoding request's planned survival through j is at least `c · n_dec / verify(n_dec, n_dec)` (an
        extra verified token costs c seconds; below that bound it adds fewer tokens per second than a plain step
        makes). remaining `[n_dec]`: tokens each decoding request may still generate; sampled `[n_dec]` (bool).

        The survival is planned as the step is (`plan`): how wide the block is drafted decides which positions the
        step can verify, so for a sampled request it may not read the confidences after its first position (they
        depend on its drawn tokens, for the families that draft left to right: MTP's chained steps, DFly's AR head)."""
        if self.mode != "auto":
            return None
        cost = self.cost_model
        bound = cost.verify_coef[2] * n_dec / cost.verify(n_dec, n_dec)
        survival = torch.ones(len(remaining), device=remaining.device)
        accepts = []

        def keep_going(conf, j):
            nonlocal survival
            accepts.append(self.calibrator.at(conf, j))
            survival = survival * plan(torch.stack(accepts, 1), sampled)[:, -1]
            return bool(((survival >= bound) & (remaining - 1 > j + 1)).any())

        return keep_going

    @property
    def uses_lookup(self) -> bool:
        return bool(self.lookup_tokens) and self.mode != "depth"

    def lookup(self, requests, remaining, sampled, tokens, probs, conf, span: int, plan=plan_acceptance,
               drafted=None):
        """Give each decode request the n-gram lookup continuation of its context (the tokens that followed the latest
        earlier occurrence of its last `lookup_max_ngram` or fewer tokens, at most `span`) in place of the drafter's
        block, where the lookup is expected to have more tokens accepted. Returns the new `tokens, probs, conf`, which
        rows took a lookup `[B]` and how many positions each row carries `[B]`.

        Exact for sampled requests: a seeded one's lookup is verified by exact match against its Gumbel-max token; for
        a rejection-sampled one a lookup is a deterministic proposal (its q is one-hot), and the choice reads only
        what is known before the drafter's first token was drawn (the lookup's own calibrated acceptance, and the
        drafter's as `plan` plans it: from its first position's confidence). `drafted [B]` (bool): the rows the
        drafter drafted (None: all); the others carry their lookup or nothing."""
        width, dev = tokens.shape[1], tokens.device
        if torch.is_tensor(remaining):
            remaining = remaining.tolist()
        found = [NgramIndex.of(r, self.lookup_max_ngram).continuation(max(0, min(span, left - 1)))
                 for r, left in zip(requests, remaining)]
        lengths_host = [len(cont) for cont, _ in found]
        wide = max(width, max(lengths_host, default=0))
        # every row's lookup, its length and matched n-gram in one copy to the device
        packed = upload([cont + [0] * (wide - len(cont)) + [len(cont), n] for cont, n in found], dev).reshape(
            len(requests), wide + 2)
        lengths = packed[:, wide]
        own = torch.full_like(lengths, width) if drafted is None else torch.where(drafted, width, 0)
        if not any(lengths_host):
            return tokens, probs, conf, torch.zeros_like(lengths, dtype=torch.bool), own
        l_tokens = packed[:, :wide]
        valid = torch.arange(wide, device=dev)[None, :] < lengths[:, None]
        matched = packed[:, wide + 1] / self.lookup_max_ngram
        l_conf = torch.where(valid, matched[:, None].expand(-1, wide), torch.zeros((), device=dev))
        l_expected = (torch.cumprod(self.lookup_calibrator(l_conf), 1) * valid).sum(1)
        d_expected = torch.zeros(len(requests), device=dev)
        if width:
            d_expected = torch.cumprod(plan(self.calibrator(conf), sampled), 1).sum(1)
        if drafted is not None:
            d_expected = torch.where(drafted, d_expected, torch.zeros_like(d_expected))
        use = (lengths > 0) & (l_expected > d_expected)

        def widen(x):
            return torch.cat([x, x.new_zeros(x.shape[0], wide - width, *x.shape[2:])], 1)

        tokens = torch.where(use[:, None], l_tokens, widen(tokens))
        conf = torch.where(use[:, None], l_conf, widen(conf))
        if probs is not None:
            one_hot = torch.zeros_like(widen(probs)).scatter_(2, l_tokens[..., None], 1.0)
            probs = torch.where(use[:, None, None], one_hot, widen(probs))
        return tokens, probs, conf, use, torch.where(use, lengths, own)

    # ---- choosing what to verify -------------------------------------------------------------------------------------
    def acceptance(self, conf, lookup):
        """Calibrated acceptance `[B, K]` of every drafted position (None when nothing was drafted): the drafter's
        calibration, or the lookup's for rows that carry an n-gram lookup."""
        if conf is None or conf.shape[1] == 0:
            return None
        accept = self.calibrator(conf)
        if lookup is not None:
            accept = torch.where(lookup[:, None], self.lookup_calibrator(conf), accept)
        return accept

    def select(self, accept, num_drafted, n_dec: int, sampled, plan=plan_acceptance, drafted: bool = True,
               drafter_rows=None, max_extra: int | None = None):
        """How many draft tokens each row verifies, `depth [B]`, and every position's survival `[B, K]`, for a step
        with `n_dec` rows decoding;
        `drafted`: the drafter ran (False: a lookup step, whose proposals cost nothing to make); `drafter_rows [B]`
        (bool): rows carrying the drafter's whole block, which "auto" remembers for its next plans (`last_plan`);
        `max_extra`: a bound on `num_drafted.sum()` known to the host (None: it is read)."""
        if self.mode == "depth":
            return num_drafted.clamp(max=self.mode_value), torch.cumprod(accept, 1)
        if self.mode == "full":
            return num_drafted.clone(), torch.cumprod(accept, 1)
        if self.mode == "budget":  # sampled rows ranked as planned: their later keys follow their own draws
            depth, survival, _ = kernels.dcut_select(plan(accept, sampled), num_drafted, self.mode_value)
            return depth, survival
        return self._select_auto(accept, num_drafted, n_dec, sampled, plan, drafted, drafter_rows, max_extra)

    def depth_on_host(self, num_drafted: list[int] | None, has_accept: bool = True) -> list[int] | None:
        """`select`'s depths where they follow from the host's `num_drafted` alone ("full", "depth"; nothing
        proposed), else None (a budget, and "auto", choose on the device)."""
        if num_drafted is None:
            return None
        if not has_accept:
            return [0] * len(num_drafted)
        if self.mode == "depth":
            return [min(n, self.mode_value) for n in num_drafted]
        if self.mode == "full":
            return list(num_drafted)
        return None

    def _select_auto(self, accept, num_drafted, n_dec, sampled, plan, drafted, drafter_rows, max_extra=None):
        """The budget that maximises expected tokens per second under the cost model, planned with `plan`; a sampled
        row verifies every position whose survival clears the plan's lowest chosen survival. A larger `max_extra`
        than the tokens drafted gives the same depths (the selection never passes the valid tokens)."""
        if max_extra is None:
            max_extra = int(num_drafted.sum())
        costs = self.cost_model.step_costs(n_dec, n_dec, max_extra, drafted=drafted, device=accept.device)
        depth, planned, _ = kernels.dcut_select(plan(accept, sampled), num_drafted, max_extra, costs, float(n_dec))
        ar = torch.arange(accept.shape[1], device=accept.device)[None, :]
        valid = ar < num_drafted[:, None]
        survival = torch.where(valid, torch.cumprod(accept.float(), 1), torch.zeros((), device=valid.device))
        # sampled rows: every position whose survival clears the plan's lowest chosen survival (none: +inf)
        threshold = torch.where(ar < depth[:, None], planned, torch.full_like(planned, float("inf"))).amin()
        depth = torch.where(sampled, ((survival >= threshold) & valid).sum(1), depth)
        self.remember_plan()  # an earlier plan nobody took up
        if drafted and drafter_rows is not None:
            self.last_plan = (planned, drafter_rows)
        return depth, survival

    # ---- after verification ------------------------------------------------------------------------------------------
    def observe(self, conf, depth, num_accepted, drafted_rows, lookup) -> None:
        """Calibrate on the step's outcomes: the rows that drafted (`drafted_rows [B]` bool), each with the calibrator
        of what it verified (the drafter's block, or an n-gram lookup where `lookup [B]`)."""
        for calibrator, chosen in ((self.calibrator, drafted_rows if lookup is None else drafted_rows & ~lookup),
                                   (self.lookup_calibrator, None if lookup is None else drafted_rows & lookup)):
            if chosen is not None:  # every row, weighted by `chosen`: nothing is read back
                calibrator.update(conf, depth, num_accepted, chosen)
