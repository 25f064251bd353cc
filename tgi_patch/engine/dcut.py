"""D-Cut: which draft tokens each engine step verifies, and whether to draft at all (`DCutPolicy`).

Its parts come from `angelspec_hf.policy` (shared with the `generate()` hook's policy): acceptance calibration of
the drafter's confidence per draft position, and of n-gram lookups; the cost model profiled on the model runner;
measured rates and back-off; and the two rules that keep every plan exact for sampled requests (`draft_confidence`,
`plan_acceptance`, injected once by the engine). This module holds what only a batch needs: how wide to draft and
when to stop, where an n-gram lookup replaces a row's block, which prefix of each block to verify (the globally most
likely to be accepted, under a budget the cost model chooses in "auto" mode), and when plain decoding wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from angelspec_hf.policy import (
    AcceptanceCalibrator,
    BackOff,
    CostModel,
    MeasuredRates,
    NgramIndex,
    StepKind,
    plan_acceptance,
)

from . import kernels
from .transfer import upload


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




@dataclass
class LookupChoice:
    """`DCutPolicy.lookup`'s proposals, per decoding row: the draft `tokens [B, K']`, `probs [B, K', V]` (None:
    every row greedy) and `conf [B, K']` widened to the longest lookup, with n-gram lookups in the rows that took
    them (`use [B]` bool; `corpus [B]` bool, None without a corpus: those whose lookup was the corpus's), and how
    many positions each row carries (`lengths [B]`)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    conf: torch.Tensor
    use: torch.Tensor
    lengths: torch.Tensor
    corpus: torch.Tensor | None = None  # [B] bool: of the rows that took a lookup, those that took the corpus's


class DCutPolicy:
    """D-Cut's decisions for one engine, in its verify mode (`parse_verify`): "auto" (budget from the cost model,
    with back-off to plain steps), a fixed token budget, a fixed depth, or every drafted token ("full").

    `load_cost_model()` gives the cost model when it is first needed (profiling the model runner); n-gram lookups
    replace a row's drafted block when `lookup_tokens` > 0, their confidence (matched n-gram length /
    `lookup_max_ngram`) calibrated on its own, and so do lookups in `corpus` (a `CorpusIndex` of the target's earlier
    outputs) where one is set, each row taking the lookup expected to have more tokens accepted.

    Each "auto" step is one of four kinds (`step_kind`), decided before anything is drafted: **draft** (the drafter
    runs; lookups may replace rows), **probe** (the drafter runs for a few rows only, see below), **lookup** (n-gram
    lookups only: no drafter call, so it costs nothing but the tokens verified) or **plain**. The drafter runs only
    while a step planned under the cost model beats a plain one (`drafting_may_pay`): the drafting call, its
    catch-up on the features the rows have pending, and every row's draft planned like the rows of the recent
    drafted steps, at any batch size (`remember`; before any, with the acceptance each draft position has had so far).
    Each kind also backs
    off, at each batch size on its own (`backoff`), to plain steps (for `probe_every` steps, doubling while it keeps
    losing, up to 8x) when the speculative steps measured at this batch size (`MeasuredRates`, with `measure=True`)
    have delivered fewer tokens per second than the plain ones, and the drafter also while the plan says it would
    lose; the step after a pause is a probe. A
    probe after a measured loss drafts every row, to measure again; one after a planned loss drafts only the
    `PROBE_ROWS` rows with the fewest pending features (their verified confidences refresh the plan at the cost of
    a small drafting call). A cost model profiled on an idle machine, or calibration still learning, cannot then make
    batched decoding slower for long. A step that also prefills prompts is planned as its decoding rows alone: the
    prompts' share of the forward is spent whatever is drafted or verified.

    `plan`: the rule every plan reads acceptance through (`plan_acceptance`: exact for sampled requests), given once;
    the engine passes its own (`SpeculativeEngine.plan_acceptance`). The decisions read only past steps, row
    positions and what `plan` allows, so they keep sampling exact."""

    PROBE_ROWS = 4  # rows a probe after a planned loss drafts
    RECENT_ROWS = 256  # drafted rows the plan remembers

    def __init__(self, mode: str, mode_value: int | None, *, cost_model: CostModel | None = None,
                 load_cost_model=None, calibrator: AcceptanceCalibrator | None = None, probe_every: int = 8,
                 lookup_tokens: int = 0, lookup_max_ngram: int = 3, measure: bool = True, plan=plan_acceptance):
        if lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0, got {lookup_tokens}")
        self.mode, self.mode_value, self.plan = mode, mode_value, plan
        self._cost_model, self._load_cost_model = cost_model, load_cost_model
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.lookup_calibrator = AcceptanceCalibrator(prior=0.5)
        # lookups in a corpus of the target's earlier outputs (`angelspec_hf.policy.CorpusIndex`; the engine sets it
        # from its drafter's `lookup_corpus`), their per-token confidences calibrated on their own
        self.corpus = None
        self.corpus_calibrator = AcceptanceCalibrator(prior_weight=2.0, prior_scale=0.8)
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
    def step_kind(self, n_dec: int, width: int, features: int = 0, horizon: int | None = None) -> StepKind:
        """The kind of a step (`DRAFT`, `PROBE`, `LOOKUP` or `PLAIN`) with a step with `n_dec` requests decoding whose drafter would draft
        `width` tokens (0: no drafter) after ingesting `features` padded pending feature positions; `horizon`: the
        tokens those requests have left, on average (None: plenty). Every mode but "auto" drafts whenever it can."""
        if self.mode != "auto":
            return StepKind.DRAFT if width else StepKind.PLAIN
        if self.measured is not None and self.measured.plain_due(n_dec, self.probe_every):
            return StepKind.PLAIN  # a batch size measured speculating but never plain: measure plain, 1 step in probe_every
        drafter = self.backoff("drafter", n_dec)
        if width and self._drafter_allowed(n_dec):
            if self.drafting_may_pay(n_dec, width, features, horizon):
                if not self._drafter_loses(n_dec):
                    drafter.reset()
                return StepKind.DRAFT
            if drafter.probing:
                return StepKind.PROBE if n_dec > self.PROBE_ROWS else StepKind.DRAFT
            drafter.lost()  # planned not to pay: lookups or plain steps, then a probe re-plans it
        if self.uses_lookup:
            losing = self.measured is not None and self.measured.loses(n_dec, StepKind.LOOKUP)
            lookup = self.backoff("lookup", n_dec)
            if lookup.allows(losing):
                if not losing:
                    lookup.reset()
                return StepKind.LOOKUP
        return StepKind.PLAIN

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

    def _drafter_allowed(self, n_dec: int) -> bool:
        return self.backoff("drafter", n_dec).allows(self._drafter_loses(n_dec))

    def _drafter_loses(self, n_dec: int) -> bool:
        """Have drafted steps at this batch size measured slower than the steps taken without the drafter: plain
        ones, and with lookups on, plain and lookup-only steps as they came (`StepKind.UNDRAFTED`: a lookup step is
        taken where some row has a lookup, a plain one where none has; together they are what not drafting
        delivers)?"""
        if self.measured is None:
            return False
        return self.measured.loses(n_dec, StepKind.DRAFT, StepKind.UNDRAFTED if self.uses_lookup else StepKind.PLAIN)

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
            return torch.tensor(self.calibrator.position_rates(width)).cumprod(0)[None]
        recent = self._recent[:, :width]
        return torch.nn.functional.pad(recent, (0, width - recent.shape[1]))

    def observe_step(self, kind, n_pre: int, n_dec: int, decode_tokens: int, seconds: float, fed_tokens: int = 0,
                     draft_seconds: float = 0.0, draft_rows: int = 0, draft_features: int = 0) -> None:
        """A finished step of `kind` (a `StepKind`; a lookup step that verified nothing counts as `PLAIN`) that fed the target `fed_tokens`
        new tokens and spent `draft_seconds` of its `seconds` in a drafting call for `draft_rows` rows that ingested
        `draft_features` padded feature positions: its delivered rate (`MeasuredRates`; not a probe's, which drafted
        for a few rows only) and its costs (the profiled cost model's refinement). Steps that also prefilled are
        skipped: their rates are not comparable and their tokens cost what a prompt's do, not what a decoding step's
        do."""
        if self.measured is None or n_pre:
            return
        if kind != StepKind.PROBE:
            self.measured.observe(kind, n_dec, decode_tokens, seconds)
        if kind in (StepKind.PLAIN, StepKind.LOOKUP):
            self.measured.observe(StepKind.UNDRAFTED, n_dec, decode_tokens, seconds)
        if self._cost_model is not None and self._cost_model.refining:
            self._cost_model.observe_verify(n_dec, fed_tokens, seconds - draft_seconds)
            if draft_rows:
                self._cost_model.observe_draft(draft_rows, draft_features, draft_seconds)

    def draft_width(self, num_draft_tokens: int) -> int:
        if self.mode in ("depth", "budget"):  # no row ever verifies more: do not draft more
            return min(num_draft_tokens, self.mode_value)
        return num_draft_tokens

    def drafting_bound(self, remaining, n_dec: int, sampled):
        """`keep_going` for drafting in "auto" mode (None otherwise): position j + 1 can be worth verifying only while
        some decoding request's planned survival through j is at least `c · n_dec / verify(n_dec, n_dec)` (an
        extra verified token costs c seconds; below that bound it adds fewer tokens per second than a plain step
        makes). remaining `[n_dec]`: tokens each decoding request may still generate; sampled `[n_dec]` (bool).

        The survival is planned as the step is (`self.plan`): how wide the block is drafted decides which positions the
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
            survival = survival * self.width_plan(torch.stack(accepts, 1), sampled)[:, -1]
            return bool(((survival >= bound) & (remaining - 1 > j + 1)).any())

        return keep_going

    def width_plan(self, accept: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """The acceptance the drafting width is planned with (`drafting_bound`): `plan`'s, as every other plan."""
        return self.plan(accept, sampled)

    @property
    def uses_lookup(self) -> bool:
        return bool(self.lookup_tokens) and self.mode != "depth"

    def lookup(self, requests, remaining, sampled, tokens, probs, conf, span: int, drafted=None) -> LookupChoice:
        """Give each decode request the n-gram lookup continuation of its context (the tokens that followed the latest
        earlier occurrence of its last `lookup_max_ngram` or fewer tokens, at most `span`) in place of the drafter's
        block, where the lookup is expected to have more tokens accepted (`LookupChoice`).

        Exact for sampled requests: a seeded one's lookup is verified by exact match against its Gumbel-max token; for
        a rejection-sampled one a lookup is a deterministic proposal (its q is one-hot), and the choice reads only
        what is known before the drafter's first token was drawn (the lookup's own calibrated acceptance, and the
        drafter's as `self.plan` plans it: from its first position's confidence). `drafted [B]` (bool): the rows the
        drafter drafted (None: all); the others carry their lookup or nothing."""
        width, dev = tokens.shape[1], tokens.device
        if torch.is_tensor(remaining):
            remaining = remaining.tolist()
        spans = [max(0, min(span, left - 1)) for left in remaining]
        indexes = [NgramIndex.of(r, self.lookup_max_ngram) for r in requests]
        found = [index.continuation(n) for index, n in zip(indexes, spans)]
        # the corpus's continuation of each context (`CorpusIndex`): tokens and per-token confidences
        in_corpus = None if self.corpus is None else [self.corpus.continuation(index.ids, n) if n else ([], [])
                                                     for index, n in zip(indexes, spans)]
        lengths_host = [len(cont) for cont, _ in found]
        corpus_host = [len(cont) for cont, _ in in_corpus] if in_corpus is not None else []
        wide = max(width, max(lengths_host, default=0), max(corpus_host, default=0))
        # every row's lookup, its length and matched n-gram in one copy to the device
        packed = upload([cont + [0] * (wide - len(cont)) + [len(cont), n] for cont, n in found], dev).reshape(
            len(requests), wide + 2)
        lengths = packed[:, wide]
        own = torch.full_like(lengths, width) if drafted is None else torch.where(drafted, width, 0)
        if not any(lengths_host) and not any(corpus_host):
            none = torch.zeros_like(lengths, dtype=torch.bool)
            return LookupChoice(tokens, probs, conf, none, own, None if in_corpus is None else none)
        l_tokens = packed[:, :wide]
        ar = torch.arange(wide, device=dev)[None, :]
        valid = ar < lengths[:, None]
        matched = packed[:, wide + 1] / self.lookup_max_ngram
        l_conf = torch.where(valid, matched[:, None].expand(-1, wide), torch.zeros((), device=dev))
        l_expected = (torch.cumprod(self.lookup_calibrator(l_conf), 1) * valid).sum(1)
        from_corpus = None
        if in_corpus is not None:  # each row takes the lookup expected to have more tokens accepted
            c_tokens = upload([cont + [0] * (wide - len(cont)) for cont, _ in in_corpus], dev).reshape(len(requests),
                                                                                                      wide)
            c_conf = upload([c + [0.0] * (wide - len(c)) for _, c in in_corpus], dev, torch.float32).reshape(
                len(requests), wide)
            c_lengths = upload(corpus_host, dev)
            c_valid = ar < c_lengths[:, None]
            c_expected = (torch.cumprod(self.corpus_calibrator(c_conf), 1) * c_valid).sum(1)
            from_corpus = (c_lengths > 0) & (c_expected > l_expected)
            l_tokens = torch.where(from_corpus[:, None], c_tokens, l_tokens)
            l_conf = torch.where(from_corpus[:, None], c_conf, l_conf)
            lengths = torch.where(from_corpus, c_lengths, lengths)
            l_expected = torch.maximum(l_expected, c_expected)
        d_expected = torch.zeros(len(requests), device=dev)
        if width:
            d_expected = torch.cumprod(self.plan(self.calibrator(conf), sampled), 1).sum(1)
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
        return LookupChoice(tokens, probs, conf, use, torch.where(use, lengths, own),
                            None if from_corpus is None else use & from_corpus)

    # ---- choosing what to verify -------------------------------------------------------------------------------------
    def acceptance(self, conf, lookup, corpus=None):
        """Calibrated acceptance `[B, K]` of every drafted position (None when nothing was drafted): the drafter's
        calibration, or the lookup's for rows that carry an n-gram lookup, the corpus lookups' for rows that carry
        one (`corpus [B]`)."""
        if conf is None or conf.shape[1] == 0:
            return None
        accept = self.calibrator(conf)
        if lookup is not None:
            accept = torch.where(lookup[:, None], self.lookup_calibrator(conf), accept)
        if corpus is not None:
            accept = torch.where(corpus[:, None], self.corpus_calibrator(conf), accept)
        return accept

    def select(self, accept, num_drafted, n_dec: int, sampled, drafted: bool = True, drafter_rows=None,
               max_extra: int | None = None):
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
            depth, survival, _ = kernels.dcut_select(self.plan(accept, sampled), num_drafted, self.mode_value)
            return depth, survival
        return self._select_auto(accept, num_drafted, n_dec, sampled, drafted, drafter_rows, max_extra)

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

    def _select_auto(self, accept, num_drafted, n_dec, sampled, drafted, drafter_rows, max_extra=None):
        """The budget that maximises expected tokens per second under the cost model, planned with `self.plan`; a sampled
        row verifies every position whose survival clears the plan's lowest chosen survival. A larger `max_extra`
        than the tokens drafted gives the same depths (the selection never passes the valid tokens)."""
        if max_extra is None:
            max_extra = int(num_drafted.sum())
        costs = self.cost_model.step_costs(n_dec, n_dec, max_extra, drafted=drafted, device=accept.device)
        depth, planned, _ = kernels.dcut_select(self.plan(accept, sampled), num_drafted, max_extra, costs, float(n_dec))
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
    def observe(self, conf, depth, num_accepted, drafted_rows, lookup, corpus=None) -> None:
        """Calibrate on the step's outcomes: the rows that drafted (`drafted_rows [B]` bool), each with the calibrator
        of what it verified (the drafter's block, an n-gram lookup where `lookup [B]`, or a corpus lookup where
        `corpus [B]` too)."""
        ngram = None if lookup is None else drafted_rows & lookup & (True if corpus is None else ~corpus)
        for calibrator, chosen in ((self.calibrator, drafted_rows if lookup is None else drafted_rows & ~lookup),
                                   (self.lookup_calibrator, ngram),
                                   (self.corpus_calibrator, None if corpus is None else drafted_rows & corpus)):
            if chosen is not None:  # every row, weighted by `chosen`: nothing is read back
                calibrator.update(conf, depth, num_accepted, chosen)
