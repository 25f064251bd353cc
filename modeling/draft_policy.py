"""How many tokens to draft in a `generate()` round: as many as pay for themselves, possibly none.

A round that drafts `k` tokens costs `draft(k) + step(1 + k)` seconds and yields `1 + accepted` tokens; a plain step
costs `step(1)` and yields one. `DraftLengthPolicy` drafts the next token only while its expected gain per second beats
the round's expected tokens per second so far, and skips drafting altogether (a plain step) when no block is expected
to beat plain decoding — so speculative `generate` is not slower than plain `generate` with a drafter that does not
help, and better drafters turn directly into longer rounds.

* Costs (`RoundCosts`): `step(n) = a + b·n` for a target forward over `n` new tokens with its verification, and
  `draft(k) = c0 + c1·k`. Profiled once per target, drafter, dtype, device and thread count (`profile_round_costs`,
  cached as JSON under `~/.cache/angelspec/cost_models`, like the batched engine's cost model), then refined online
  from the rounds actually timed, and the refined costs are written back to the cache every `SAVE_EVERY` timed
  rounds (a profile taken while the machine was busy heals over later runs instead of lasting forever).
* Acceptance (`PositionCalibrator`): the probability that draft position `j` is accepted given that the positions
  before it were, as a function of the drafter's confidence there (the peak of its distribution), per position,
  learned from the verification outcomes. The confidence is known before the token at `j` is drawn, and every
  decision about position `j + 1` is taken after position `j` was drawn, so sampling stays exact.
* What rounds actually delivered (`MeasuredRates`): tokens per second of drafted and of plain rounds, wall time
  included. When drafted rounds have delivered less, the policy backs off to plain steps whatever the model expects,
  so a wrong cost or acceptance estimate cannot make `generate` slower for long.
* Probes while drafting is off. After `backoff` plain steps (the wait doubling up to `max_backoff`) drafting is
  tried again. When the acceptance model is what says no, the probe is a *shadow draft*: the drafter proposes its
  first token beside a plain step and the target's own distribution there tells how likely that token was to be
  accepted (greedy: whether it is the target's token; sampling: `sum_x min(p(x), q(x))`, the acceptance probability
  of speculative sampling), so position 0 is learned without verifying anything (a verifying step of 2 tokens cost
  up to 1.45 plain steps, with the stock kernels on this project's Intel Xeon; a shadow draft a few hundredths of
  one). The output comes from the
  plain step alone, and the shadow draws no random numbers. When the measured rates are what say no, the probe is a
  drafted round, since only a drafted round can measure them again.

The state lives on the drafter (`drafter.draft_policy`), so what one `generate` call learned serves the next; what
depends on the text (the back-off and the measured rate of drafted rounds) starts afresh with each call.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def hardware_key(model, drafter=None) -> str:
    """Which measured costs apply: the models' configs and dtypes, the device, the CPU threads and the linear kernels
    (a model whose linears read oneDNN-prepacked weights, `angelspec_hf.cpu_kernels`, has costs of its own)."""
    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    parts = [model.config.to_json_string(use_diff=False), str(model.dtype), str(device.type), name,
             str(torch.get_num_threads()), torch.__version__]
    if drafter is not None:
        parts += [drafter.config.to_json_string(use_diff=False), str(drafter.dtype)]
    packed = [m for m in (model, drafter) if m is not None and _prepacked(m)]
    if packed:  # only then, so the keys of stock models (and their cached files) stay as they were
        parts.append("prepacked:" + ",".join("target" if m is model else "drafter" for m in packed))
        if drafter is not None and model in packed and getattr(drafter.config, "draft_vocab_size", None):
            parts.append("pruned draft head prepacked")  # drafting got cheaper: costs measured before do not apply
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def clock(device=None) -> float:
    """`time.perf_counter()` once the work already queued on `device` has run. CUDA and other accelerators run kernels
    asynchronously, so a timer read right after a forward returns measures the launches, not the work, and a cost model
    profiled that way is wrong by orders of magnitude; on the CPU (and for `None`) this is `perf_counter()` itself."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type not in ("cpu", "meta"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            torch.accelerator.synchronize(device)
    return time.perf_counter()


def packed_linear(module) -> bool:
    """Whether `module` is a linear layer reading oneDNN-prepacked weights (`angelspec_hf.cpu_kernels.PrepackedLinear`,
    not imported here: an exported drafter folder carries no library code)."""
    return bool(getattr(module, "packed_for_cpu", False) and getattr(module, "enabled", True))


def _prepacked(model) -> bool:
    return any(packed_linear(m) for m in model.modules())


def default_cache_dir() -> Path:
    """Where measured cost models are cached: `$ANGELSPEC_COST_MODELS`, else `$ANGELSPEC_CACHE/cost_models` (default
    `~/.cache/angelspec/cost_models`). The tests point the first at a folder of their own, so a profile timed while
    they load the machine is never what a later run on it reads."""
    if os.environ.get("ANGELSPEC_COST_MODELS"):
        return Path(os.environ["ANGELSPEC_COST_MODELS"])
    return Path(os.environ.get("ANGELSPEC_CACHE", Path.home() / ".cache" / "angelspec")) / "cost_models"


class OnlineLeastSquares:
    """`y ≈ features · coef` by exponentially weighted least squares (× `decay` per observation: recent ones count
    most), started from prior pseudo-observations (`prior_x` rows with values `prior_y`, worth `prior_weight`
    observations in all) whose weight fades × `prior_fade` per observation down to `min_prior` of it. Early
    observations then never give wild coefficients, a stale prior does not linger, and directions the data never vary
    along (e.g. every step of a batch at one size) keep the prior's slope as long as `min_prior` > 0."""

    def __init__(self, prior_x, prior_y, prior_weight: float = 4.0, decay: float = 0.99, prior_fade: float = 0.9,
                 min_prior: float = 0.0):
        x = torch.tensor(prior_x, dtype=torch.float64)
        y = torch.tensor(prior_y, dtype=torch.float64)
        w = prior_weight / len(x)
        self.prior_xx, self.prior_xy = w * x.T @ x, w * x.T @ y
        self.xx, self.xy = torch.zeros_like(self.prior_xx), torch.zeros_like(self.prior_xy)
        self.decay, self.prior_fade, self.min_prior = decay, prior_fade, min_prior
        self.prior_scale, self.count = 1.0, 0

    def add(self, x, y: float) -> None:
        x = torch.tensor(x, dtype=torch.float64)
        self.xx = self.xx * self.decay + torch.outer(x, x)
        self.xy = self.xy * self.decay + x * float(y)
        self.prior_scale = max(self.prior_scale * self.prior_fade, self.min_prior)
        self.count += 1

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(XᵀWX, XᵀWy)` of the data and the prior together."""
        return self.xx + self.prior_scale * self.prior_xx, self.xy + self.prior_scale * self.prior_xy

    @property
    def coef(self) -> tuple[float, ...]:
        xx, xy = self.moments()
        return tuple(torch.linalg.lstsq(xx, xy[:, None]).solution[:, 0].tolist())


class LinearFit(OnlineLeastSquares):
    """`y ≈ a + b·x` (`OnlineLeastSquares` of the features `(1, x)`), its prior a line through x = 1 and x =
    `prior_span`; the slope is never negative (a cost never falls with more tokens)."""

    def __init__(self, a: float, b: float, prior_weight: float = 4.0, prior_span: float = 8.0, decay: float = 0.99,
                 prior_fade: float = 0.9):
        super().__init__([[1.0, 1.0], [1.0, prior_span]], [a + b, a + b * prior_span], prior_weight, decay,
                         prior_fade)

    def add(self, x: float, y: float) -> None:
        super().add([1.0, float(x)], y)

    @property
    def coef(self) -> tuple[float, float]:
        xx, xy = self.moments()
        (n, sx), (_, sxx) = xx.tolist()
        sy, sxy = xy.tolist()
        det = n * sxx - sx * sx
        b = (n * sxy - sx * sy) / det if det > 1e-12 else 0.0
        b = max(b, 0.0)
        return (sy - b * sx) / n, b

    def __call__(self, x: float) -> float:
        a, b = self.coef
        return max(a + b * x, 1e-6)


class StepCost:
    """Seconds of a target step over `n` new tokens. A plain step (`n = 1`) and a verifying one (`n >= 2`) are
    different regimes on a CPU: with the stock kernels a one-token forward runs its linears as MKL matrix-vector
    products and a multi-token one as small GEMMs, which cost more for the same weights (measured: verifying 2-6 tokens
    cost 1.45 plain steps on this project's machine, flat in n; 1.1 with oneDNN-prepacked weights). One line through both bends to fit them: with mostly plain rounds its slope comes from a few probes and
    overstates verification; with mostly drafted rounds it puts the plain step at a drafted round's cost. So each
    regime learns from its own rounds: an exponentially weighted mean for `n = 1` and a `LinearFit` for `n >= 2`,
    both starting from the profile (its line, whose value at 1 is the measured plain forward). The profile's plain cost
    fades with every round, either kind, so that the first plain round after a long drafted stretch replaces a stale
    profile (one taken on a busy machine once kept a policy drafting at 0.75x: it never took the plain step that would
    have corrected it); and a plain step is never costed above a verifying one of two tokens."""

    def __init__(self, a: float, b: float, prior_span: float, plain: float | None = None, prior_weight: float = 4.0,
                 decay: float = 0.99, prior_fade: float = 0.9):
        self.line = LinearFit(a, b, prior_span=prior_span, prior_weight=prior_weight, decay=decay,
                              prior_fade=prior_fade)
        self.decay, self.prior_fade = decay, prior_fade
        self._prior = torch.tensor([prior_weight, prior_weight * (a + b if plain is None else plain)],
                                   dtype=torch.float64)
        self._data = torch.zeros(2, dtype=torch.float64)

    def add(self, n: float, y: float) -> None:
        self._prior = self._prior * self.prior_fade
        if n <= 1:
            self._data = self._data * self.decay + torch.tensor([1.0, float(y)], dtype=torch.float64)
        else:
            self.line.add(n, y)

    @property
    def plain(self) -> float:
        weight, total = (self._data + self._prior).tolist()
        return total / weight

    @property
    def coef(self) -> tuple[float, float]:
        return self.line.coef

    def __call__(self, n: float) -> float:
        return max(min(self.plain, self.line(2)), 1e-6) if n <= 1 else self.line(n)


@dataclass
class RoundCosts:
    """Seconds: `step(n) = a + b·n` (target forward + verification over n new tokens), `draft(k) = c0 + c1·k`;
    `plain_step`, when known, a plain step's own cost (else the line's value at 1: see `StepCost`)."""

    step_coef: tuple[float, float]
    draft_coef: tuple[float, float]
    key: str = ""
    path: Path | None = field(default=None, compare=False)  # the cache file it came from (not serialised)
    plain_step: float | None = None

    def to_dict(self) -> dict:
        data = {"step_coef": list(self.step_coef), "draft_coef": list(self.draft_coef), "key": self.key}
        return data | ({"plain_step": self.plain_step} if self.plain_step is not None else {})

    @classmethod
    def from_dict(cls, data: dict) -> RoundCosts:
        plain = data.get("plain_step")
        return cls(tuple(data["step_coef"]), tuple(data["draft_coef"]), data.get("key", ""),
                   plain_step=None if plain is None else float(plain))


@torch.no_grad()
def profile_round_costs(target, drafter, context: int = 64, repeats: int = 3) -> RoundCosts:
    """Time batch-1 target forwards over 1 and `K + 1` new tokens after a `context`-token prefix, and the drafter
    proposing 1 and `K` tokens from that context."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    vocab = target.config.get_text_config().vocab_size
    k = drafter.num_draft_tokens
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, context + k + 1), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    out = target(input_ids=ids[:, :context], cache=cache, use_cache=True, output_hidden_states=layers)
    features = torch.cat([out.hidden_states[i] for i in layers], -1)

    def timed_step(n):
        start = clock(device)
        target(input_ids=ids[:, context : context + n], cache=cache, use_cache=True, output_hidden_states=layers)
        seconds = clock(device) - start
        cache.crop(-n)
        return seconds

    def timed_draft(n):
        state = drafter.new_draft_state()

        def select(logits, j):
            return logits.argmax(-1), logits.float(), None

        start = clock(drafter.device)
        drafter.propose(state, features.to(drafter.device), ids[:, : context + 1].to(drafter.device), n,
                        target.get_input_embeddings(), drafter.draft_lm_head(target.get_output_embeddings()), select)
        return clock(drafter.device) - start

    timed_step(1), timed_draft(1)  # warm-up
    step = [statistics.median(timed_step(n) for _ in range(repeats)) for n in (1, k + 1)]
    draft = [statistics.median(timed_draft(n) for _ in range(repeats)) for n in (1, k)]
    b = max(step[1] - step[0], 0.0) / max(k, 1)
    c1 = max(draft[1] - draft[0], 0.0) / max(k - 1, 1)
    return RoundCosts((step[0] - b, b), (max(draft[0] - c1, 0.0), c1))


def save_round_costs(costs: RoundCosts) -> None:
    """Write `costs` to `costs.path` atomically (a concurrent reader sees the old file or the new one)."""
    costs.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = costs.path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(costs.to_dict(), indent=1))
    tmp.replace(costs.path)


def load_or_profile_round_costs(target, drafter, cache_dir=None) -> RoundCosts:
    """The cached round costs for these models on this hardware, profiled (and cached) when absent."""
    key = hardware_key(target, drafter)
    path = Path(cache_dir or default_cache_dir()) / f"hook-{key}.json"
    if path.is_file():
        try:
            costs = RoundCosts.from_dict(json.loads(path.read_text()))
            costs.path = path
            return costs
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is measured again
    costs = profile_round_costs(target, drafter)
    costs.key, costs.path = key, path
    save_round_costs(costs)
    return costs


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
    """Decode tokens per second that plain and speculative steps (or `generate()` rounds) have actually delivered, per
    batch size (rows decoding, in power-of-two buckets; the hook is batch 1), over steps without prefill. The cost model
    plans a step; these say whether such plans have paid on this machine, under its present load, with every overhead
    the model does not see. The batched engine and the `generate()` hook both back off to plain steps by them.

    A step's kind is `False` (plain), `True` (drafted) or any other label (the engine's `"lookup"`: n-gram proposals
    verified without running the drafter); each kind is compared with plain steps.

    A rate is total tokens over total seconds, each step weighted `decay ** age` (age counted in steps of its own
    kind), with the standard error of that ratio estimate. A kind *loses* only when plain steps beat it by more than
    `z` standard errors: a speculative round yields anything from 1 to block + 1 tokens, so its delivered rate is
    noisy, and a moving average of per-step rates (what this class kept before) fell below the plain rate by chance
    often enough to start back-offs that the next probes, each moving the average a fifth of the way, could not lift
    before the wait doubled again (12 held-out TRAIN code/math prompts, greedy, 128 tokens, 2 threads: the shipped DFly
    cost-aware drafted in 53% of rounds and ran at 1.38x plain `generate` where whole blocks ran at 1.55x; with this
    rule it drafted in 99% of rounds, at 1.56x). A kind that loses every step by the same margin (a drafter never
    accepted) has no spread and is found out after `min_steps`."""

    PLAIN = False

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

    def loses(self, n_dec: int, kind=True, against=PLAIN) -> bool:
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


class PositionCalibrator:
    """P(draft position j accepted | positions < j accepted), binned by the drafter's confidence, one table per
    position. Each cell starts at a prior (`prior_weight` pseudo-observations at the bin's confidence, scaled by
    `prior_scale`: drafters are usually over-confident) and moves to the observed rate."""

    def __init__(self, num_positions: int, num_bins: int = 10, prior_weight: float = 2.0, prior_scale: float = 0.7,
                 prior_mean: float = 0.5):
        self.num_bins = num_bins
        centers = (torch.arange(num_bins, dtype=torch.float64) + 0.5) / num_bins
        self.trials = torch.full((num_positions, num_bins), prior_weight, dtype=torch.float64)
        self.accepted = (prior_scale * centers).expand(num_positions, -1) * prior_weight
        # per position, over all confidences (observations only; `mean` adds the prior)
        self.prior_mean, self.prior_weight = prior_mean, prior_weight
        self.position_trials = torch.zeros(num_positions, dtype=torch.float64)
        self.position_accepted = torch.zeros(num_positions, dtype=torch.float64)

    def _bin(self, confidence: float) -> int:
        return min(int(max(confidence, 0.0) * self.num_bins), self.num_bins - 1)

    def __call__(self, position: int, confidence: float) -> float:
        j, b = min(position, self.trials.shape[0] - 1), self._bin(confidence)
        return float(self.accepted[j, b] / self.trials[j, b])

    def mean(self, position: int) -> float:
        """Acceptance rate at `position` over every confidence seen. Its prior is the rate of the position before
        (`prior_mean` for the first), so a position never drafted yet is expected to do as well as the last one."""
        return self.means(position + 1)[-1]

    def means(self, count: int) -> list[float]:
        """`[mean(0), ..., mean(count - 1)]` in one pass over the positions (in Python floats: the hook asks every
        round, and per-element tensor reads made that a millisecond)."""
        trials, accepted = self.position_trials.tolist(), self.position_accepted.tolist()
        rates, rate = [], self.prior_mean
        for j in range(count):
            if j < len(trials):  # past the last position, the last one's rate
                rate = (accepted[j] + self.prior_weight * rate) / (trials[j] + self.prior_weight)
            rates.append(rate)
        return rates

    def update(self, confidences: list[float], num_accepted: int) -> None:
        """One verified round: the drafted positions' confidences and how many were accepted."""
        for j, conf in enumerate(confidences[: num_accepted + 1]):  # after a rejection nothing more is learned
            self.observe(j, conf, float(j < num_accepted))

    def observe(self, position: int, confidence: float, accepted: float) -> None:
        """One trial at `position`: `accepted` is 1 or 0, or the probability of acceptance where it is known exactly
        (a shadow draft's), which counts as that expected outcome."""
        j, b = min(position, self.trials.shape[0] - 1), self._bin(confidence)
        self.trials[j, b] += 1
        self.accepted[j, b] += accepted
        self.position_trials[j] += 1
        self.position_accepted[j] += accepted


class DraftLengthPolicy:
    """Per-round draft length for the batch-1 hook (see the module docstring)."""

    SAVE_EVERY = 32  # timed rounds between write-backs of the refined costs to the cache file

    def __init__(self, costs: RoundCosts, max_tokens: int, probe_every: int = 4, max_backoff: int = 64,
                 measure: bool = True, shadow_probes: bool = True):
        self.step = StepCost(*costs.step_coef, prior_span=max_tokens + 1, plain=costs.plain_step)
        self.draft = LinearFit(*costs.draft_coef, prior_span=max_tokens)
        self.costs_key, self.costs_path, self._timed = costs.key, costs.path, 0
        self.calibrator = PositionCalibrator(max_tokens)
        # lookups: acceptance per position by matched n-gram length (as a fraction of the longest), a cautious prior
        self.lookups = PositionCalibrator(max(max_tokens, 16), prior_scale=0.5)
        self.max_tokens = max_tokens
        self.probe_every, self.max_backoff = probe_every, max_backoff
        self.backoff, self.plain_left, self.probe_due = probe_every, 0, False
        # shadow_due: this round's plain step is a probe; the hook drafts one token beside it (`observe_shadow`)
        self.shadow_probes, self.shadow_due = shadow_probes, False
        # what drafted and plain rounds have actually delivered, wall time included (None: `measure=False`)
        self.measured = MeasuredRates() if measure else None
        self._round: list[float] = []
        self._survival = self._expected = 1.0

    def new_sequence(self) -> None:
        """A new `generate()` call. What drafting earns depends on the text (a code prompt after a chat one), so the
        back-off and the measured rate of drafted rounds start afresh; the costs, the acceptance calibration and the
        rate of plain rounds (properties of the machine and the drafter) carry over. Carried over, a back-off earned
        on chat kept the next call's code prompt at plain steps for up to `max_backoff` rounds: its few probes could
        not lift the drafted rate that chat had measured above the plain one before the wait doubled again.

        A call that starts while drafting is off (a back-off under way, or its probe still due) starts with that probe:
        otherwise calls shorter than the wait never probe, and acceptance learned from a few unlucky rounds would keep
        every later call plain for good."""
        backing_off = self.plain_left > 0 or self.probe_due
        self.plain_left, self.probe_due, self.backoff = 0, backing_off, self.probe_every
        if self.measured is not None:
            self.measured.forget(True)

    # ---- the decisions -----------------------------------------------------------------------------------------
    def expected_rate(self, k: int) -> float:
        """Expected tokens per second of a round drafting `k` tokens, from the mean acceptance per position."""
        return self.expected_rates(k)[k]

    def expected_rates(self, max_tokens: int) -> list[float]:
        """`expected_rate(k)` for k = 0 .. `max_tokens` (0: a plain step), in one pass over the positions."""
        rates, survival, tokens = [1.0 / self.step(1)], 1.0, 1.0
        for k, mean in enumerate(self.calibrator.means(max_tokens), start=1):
            survival *= mean
            tokens += survival
            rates.append(tokens / (self.draft(k) + self.step(1 + k)))
        return rates

    def start_round(self, max_tokens: int) -> bool:
        """Draft this round? No when no block length is expected to beat a plain step, or when drafted rounds have
        actually delivered fewer tokens per second than plain ones (`measured`: the model's costs and acceptance can
        both be off, e.g. on a prompt unlike the ones acceptance was learned on). After such a verdict drafting is
        retried (a probe) after `backoff` plain steps, the wait doubling while drafting keeps losing. While only
        drafted rounds have been measured, one round in `probe_every` is plain, to measure that too."""
        self._round, self._survival, self._expected = [], 1.0, 1.0
        self.shadow_due = False
        if max_tokens < 1:
            return False
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        if self.probe_due:  # a probe keeps the acceptance estimates current while drafting does not pay
            self.probe_due = False
            if self.shadow_probes and not self.expected_to_pay(max_tokens):
                self.shadow_due = True  # the model says no: learn position 0 beside a plain step
                self._back_off()
                return False
            return True
        if self.measured is not None and self.measured.plain_due(1, self.probe_every):
            return False
        if self.expected_to_pay(max_tokens) and not self.measured_loss():
            self.backoff = self.probe_every
            return True
        self._back_off()
        return False

    def _back_off(self) -> None:
        """Plain steps for the present wait, a probe after them, and the next wait twice as long."""
        self.plain_left, self.probe_due = self.backoff - 1, True
        self.backoff = min(2 * self.backoff, self.max_backoff)

    def expected_to_pay(self, max_tokens: int) -> bool:
        """Is some block of up to `max_tokens` expected to deliver more tokens per second than a plain step?"""
        rates = self.expected_rates(max_tokens)
        return max(rates[1:]) > rates[0]

    def measured_loss(self) -> bool:
        """Have drafted rounds delivered fewer tokens per second than plain ones, as measured?"""
        return self.measured is not None and self.measured.loses(1)

    def best_rate(self, max_tokens: int) -> float:
        """Expected tokens per second of the best of a plain step and a drafted round of up to `max_tokens`."""
        return max(self.expected_rates(max_tokens))

    def lookup_length(self, confidence: float, available: int, draft_tokens: int) -> int:
        """How many tokens of an n-gram lookup continuation (`available`, matched with `confidence` = matched length
        / longest) to verify this round: the length with the best expected tokens per second (lookups cost no
        drafting), or 0 when a drafted round or a plain step is expected to do better. Decided from the context and
        past rounds only, never from the draws the verification makes."""
        best_k, best, survival, tokens = 0, self.best_rate(draft_tokens), 1.0, 1.0
        for k in range(1, available + 1):
            survival *= self.lookups(k - 1, confidence)
            tokens += survival
            rate = tokens / self.step(1 + k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def keep_drafting(self, confidence: float, max_tokens: int) -> bool:
        """After drafting one more position with `confidence` (the peak of the drafter's distribution there): is the
        next position worth drafting and verifying?"""
        j = len(self._round)
        self._round.append(confidence)
        self._survival *= self.calibrator(j, confidence)
        self._expected += self._survival
        k = j + 1
        if k >= max_tokens:
            return False
        cost = self.draft(k) + self.step(1 + k)
        marginal_cost = self.draft(k + 1) + self.step(2 + k) - cost
        marginal_gain = self._survival * self.calibrator.mean(k)
        return marginal_gain * cost > self._expected * marginal_cost

    # ---- what happened -------------------------------------------------------------------------------------------
    def observe_lookup(self, confidence: float, proposed: int, accepted: int, step_seconds: float | None) -> None:
        self.lookups.update([confidence] * proposed, accepted)
        if step_seconds is not None:
            self.step.add(1 + proposed, step_seconds)
            self._timed_round()

    def _timed_round(self) -> None:
        self._timed += 1
        if self.costs_path is not None and self._timed % self.SAVE_EVERY == 0:
            try:
                save_round_costs(RoundCosts(self.step.coef, self.draft.coef, self.costs_key, self.costs_path,
                                            plain_step=self.step.plain))
            except OSError:
                pass  # the cache is an optimisation: a read-only one keeps the old profile

    def observe_shadow(self, confidence: float, accepted: float, draft_seconds: float | None) -> None:
        """A shadow draft's outcome: the drafter's confidence at position 0 and the probability, known exactly from the
        target's distribution at the plain step beside it, that its token would have been accepted. When drafting is
        now expected to pay (and the measured rates do not say otherwise), the back-off ends: the next round drafts."""
        self.calibrator.observe(0, confidence, accepted)
        if draft_seconds is not None:
            self.draft.add(1, draft_seconds)
        if self.expected_to_pay(self.max_tokens) and not self.measured_loss():
            self.plain_left, self.probe_due, self.backoff = 0, False, self.probe_every

    def observe(self, drafted: int, accepted: int, draft_seconds: float | None, step_seconds: float | None,
                round_seconds: float | None = None) -> None:
        """A verified round (or a plain step, `drafted = 0`): `draft_seconds` drafting, `step_seconds` the target
        forward with verification, `round_seconds` the whole round's wall time (None: not timed, e.g. after prefill)."""
        if round_seconds is not None and self.measured is not None:
            self.measured.observe(drafted > 0, 1, 1 + accepted, round_seconds)
        if drafted:
            self.calibrator.update(self._round[:drafted], accepted)
            if draft_seconds is not None:
                self.draft.add(drafted, draft_seconds)
        if step_seconds is not None:
            self.step.add(1 + drafted, step_seconds)
            self._timed_round()
