"""The `generate()` hook's costs at batch 1: `step(n)` seconds for a target forward over `n` new tokens with its
verification, `draft(k)` seconds for the drafter proposing `k` tokens. Profiled once per target, drafter, dtype,
device and thread count (`load_or_profile_round_costs`), then refined from the rounds actually timed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .costs import LinearFit, clock, default_cache_dir, hardware_key, profile_cached, write_profile


class StepCost:
    """Seconds of a target step over `n` new tokens. A plain step (`n = 1`) and a verifying one (`n >= 2`) are
    different regimes on a CPU: a one-token forward runs its linears as matrix-vector products, a multi-token one as
    small GEMMs, which can cost more for the same weights; one line through both would put the plain step at a
    verifying round's cost (or the other way round). So each regime learns from its own rounds: an exponentially
    weighted mean for `n = 1` and a `LinearFit` for `n >= 2`, both starting from the profile. The profile's plain cost
    fades with every round, either kind, so that the first plain round after a long drafted stretch replaces a stale
    profile; and a plain step is never costed above a verifying one of two tokens.

    With a profiled `table` (seconds for n = 1 .. len(table)), every n it covers keeps its own exponentially weighted
    mean, started from the table's value, and the line serves only longer steps: a multi-token forward's cost need
    not be a line in n (on a CPU, a GEMM kernel may change at some row count; with `--linear-kernels mkl` a step of
    6-12 tokens costs what one of 6 does), and a line fitted to the short rounds a policy mostly runs would price the
    long ones it never tries far above what they cost.

    A round timed at more than `OUTLIER_RATIO` times what it is expected to cost (its estimate, and at least the plain
    step's and, past one token, the line's) counts as that much: a CPU shared with other work stalls now and then, and
    one stalled round taken at face value doubled a cell for dozens of rounds (cells of 3, 5 and 8 tokens at 2.1-2.4
    plain steps where the forwards cost 1.1-1.3 on a 2-core Xeon), and a cell priced that high is seldom chosen, so
    seldom corrected. A cost that really rises is followed all the same, in steps of up to that ratio; one that falls,
    at once."""

    OUTLIER_RATIO = 1.5

    def __init__(self, a: float, b: float, prior_span: float, plain: float | None = None, prior_weight: float = 4.0,
                 decay: float = 0.99, prior_fade: float = 0.9, table=None):
        self.line = LinearFit(a, b, prior_span=prior_span, prior_weight=prior_weight, decay=decay,
                              prior_fade=prior_fade)
        self.decay, self.prior_fade = decay, prior_fade
        self._prior = torch.tensor([prior_weight, prior_weight * (a + b if plain is None else plain)],
                                   dtype=torch.float64)
        self._data = torch.zeros(2, dtype=torch.float64)
        # n -> [prior weight, prior weight x seconds, data weight, data weight x seconds]
        self._cells = {n: [prior_weight, prior_weight * float(t), 0.0, 0.0]
                       for n, t in enumerate(table or (), start=1) if n >= 2}

    def add(self, n: float, y: float) -> None:
        # the ceiling: a ratio of what this step is expected to cost, and at least of a plain step (and of the line
        # for n >= 2), so that a profile priced far too low is still corrected
        expected = self.plain if n <= 1 else max(self(n), self.line(n), self.plain)
        y = min(float(y), self.OUTLIER_RATIO * expected)
        self._prior = self._prior * self.prior_fade
        if n <= 1:
            self._data = self._data * self.decay + torch.tensor([1.0, float(y)], dtype=torch.float64)
            return
        self.line.add(n, y)
        cell = self._cells.get(int(n))
        if cell is not None:
            cell[0], cell[1] = cell[0] * self.prior_fade, cell[1] * self.prior_fade
            cell[2], cell[3] = cell[2] * self.decay + 1.0, cell[3] * self.decay + float(y)

    @property
    def plain(self) -> float:
        weight, total = (self._data + self._prior).tolist()
        return total / weight

    @property
    def coef(self) -> tuple[float, float]:
        return self.line.coef

    @property
    def table(self) -> list[float] | None:
        """The present estimates for n = 1 .. the profiled table's length (None without a table)."""
        if not self._cells:
            return None
        return [self(n) for n in range(1, max(self._cells) + 1)]

    def __call__(self, n: float) -> float:
        if n <= 1:
            return max(min(self.plain, self(2)), 1e-6)
        cell = self._cells.get(int(n))
        if cell is None:
            return self.line(n)
        return max((cell[1] + cell[3]) / (cell[0] + cell[2]), 1e-6)


@dataclass
class RoundCosts:
    """Seconds: `step(n) = a + b·n` (target forward + verification over n new tokens), `draft(k) = c0 + c1·k`;
    `plain_step`, when known, a plain step's own cost (else the line's value at 1: see `StepCost`). `path`: the cache
    file refined costs are written back to (None: not cached). `step_table`, when profiled: seconds of a step over
    n = 1 .. len(step_table) new tokens, measured one by one (`StepCost` prices those n from it)."""

    step_coef: tuple[float, float]
    draft_coef: tuple[float, float]
    key: str = ""
    path: Path | None = field(default=None, compare=False)
    plain_step: float | None = None
    step_table: tuple[float, ...] | None = None

    def to_dict(self) -> dict:
        data = {"step_coef": list(self.step_coef), "draft_coef": list(self.draft_coef), "key": self.key}
        if self.step_table is not None:
            data["step_table"] = list(self.step_table)
        return data | ({"plain_step": self.plain_step} if self.plain_step is not None else {})

    @classmethod
    def from_dict(cls, data: dict) -> RoundCosts:
        plain, table = data.get("plain_step"), data.get("step_table")
        return cls(tuple(data["step_coef"]), tuple(data["draft_coef"]), data.get("key", ""),
                   plain_step=None if plain is None else float(plain),
                   step_table=None if table is None else tuple(float(t) for t in table))

    def save(self) -> bool:
        """Write to `path` (atomically); False when not cached or the cache cannot be written."""
        return self.path is not None and write_profile(self.path, self.to_dict())


@torch.no_grad()
def profile_round_costs(target, drafter, context: int = 64, repeats: int = 3) -> RoundCosts:
    """Time batch-1 target forwards over every n = 1 .. `max(K, lookup_tokens) + 1` new tokens after a
    `context`-token prefix (`step_table`; the line through n = 1 and `K + 1`), and the drafter proposing 1 and `K`
    tokens from that context."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    vocab = target.config.get_text_config().vocab_size
    k = drafter.num_draft_tokens
    longest = max(k, int(getattr(drafter.config, "lookup_tokens", 0) or 0)) + 1
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, context + longest), generator=generator).to(device)
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
    table = [statistics.median(timed_step(n) for _ in range(repeats)) for n in range(1, longest + 1)]
    step = [table[0], table[k]]
    draft = [statistics.median(timed_draft(n) for _ in range(repeats)) for n in (1, k)]
    b = max(step[1] - step[0], 0.0) / max(k, 1)
    c1 = max(draft[1] - draft[0], 0.0) / max(k - 1, 1)
    return RoundCosts((step[0] - b, b), (max(draft[0] - c1, 0.0), c1), step_table=tuple(table))


def load_or_profile_round_costs(target, drafter, cache_dir=None) -> RoundCosts:
    """The cached round costs for these models on this hardware, else profiled now (and cached when the machine was
    quiet: `costs.profile_cached`)."""
    key = hardware_key(target, drafter)
    path = Path(cache_dir or default_cache_dir()) / f"hook-{key}.json"

    def parse(data: dict) -> RoundCosts:
        if "step_table" not in data:  # profiled before steps were timed size by size: measured again
            raise KeyError("step_table")
        return RoundCosts.from_dict(data)

    def measure() -> RoundCosts:
        costs = profile_round_costs(target, drafter)
        costs.key = key
        return costs

    costs, cached = profile_cached(path, parse, measure, next(target.parameters()).device,
                                   RoundCosts.to_dict)
    costs.path = path if cached else None
    return costs
