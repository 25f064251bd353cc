"""Per-request drafter choice: send each request to the drafter expected to accept more.

`DrafterRouter` holds several drafters for one target (e.g. MTP for chat, DFly for code and math) and is passed to
`generate(assistant_model=router)` like a drafter. Each request is classified by domain from its whole prompt
(the decoded input ids, code / math / chat by simple lexical cues), and the router picks the drafter with the highest estimate of τ for that
domain: a prior (`prefer`) until it has seen enough requests, then the running mean of the τ each drafter actually
achieved there (updated after every request from the drafter's own statistics).
"""

from __future__ import annotations

import re
from collections import defaultdict

_CODE = re.compile(
    r"```|\bdef |\bclass |\breturn\b|\bfunction\b|\bpython\b|\bjava(script)?\b|\bc\+\+|\bsql\b|\bcode\b|\bprogram\b|"
    r"\bimplement\b|\bscript\b|\bcompile|\bregex\b|\bhtml\b|\bapi\b|[{};]\s*$", re.IGNORECASE | re.MULTILINE)
_MATH = re.compile(
    r"\d+\s*[-+*/x×÷^=]\s*\d+|\bhow (many|much)\b|\bcalculate\b|\bsolve\b|\bequation\b|\bpercent|\$\s?\d|"
    r"\bsum\b|\btotal\b|\baverage\b|\bprobability\b", re.IGNORECASE)


def classify_domain(text: str) -> str:
    """'code', 'math' or 'chat' for a prompt."""
    code, math = len(_CODE.findall(text)), len(_MATH.findall(text))
    if code and code >= math:
        return "code"
    if math:
        return "math"
    return "chat"


class DrafterRouter:
    """Route each `generate(assistant_model=router)` call to one of `drafters` (name → drafter).

    prefer: domain → drafter name used until `min_observations` requests of that domain have been seen per drafter.
    """

    def __init__(self, drafters: dict, tokenizer, prefer: dict | None = None, min_observations: int = 3):
        if not drafters:
            raise ValueError("DrafterRouter needs at least one drafter")
        self.drafters, self.tokenizer = dict(drafters), tokenizer
        names = list(self.drafters)
        default = {"code": "dfly", "math": "dfly", "chat": "mtp"}
        self.prefer = {d: (prefer or {}).get(d, default[d] if default[d] in self.drafters else names[0])
                       for d in ("code", "math", "chat")}
        self.min_observations = min_observations
        self.observed = defaultdict(list)  # (domain, name) → τ per request
        self.choices = []  # (domain, name) per request, in order
        self._pending = None

    def estimate(self, domain: str, name: str) -> float | None:
        taus = self.observed[(domain, name)]
        return sum(taus) / len(taus) if len(taus) >= self.min_observations else None

    def choose(self, domain: str) -> str:
        estimates = {n: self.estimate(domain, n) for n in self.drafters}
        known = {n: e for n, e in estimates.items() if e is not None}
        unexplored = [n for n, e in estimates.items() if e is None and n != self.prefer[domain]]
        if self.estimate(domain, self.prefer[domain]) is None:
            return self.prefer[domain]
        if unexplored and len(self.choices) % 5 == 4:  # now and then, try an alternative to learn its τ
            return unexplored[0]
        return max(known, key=known.get)

    def _record_previous(self) -> None:
        if self._pending is not None:
            domain, name = self._pending
            stats = self.drafters[name].last_speculation_stats
            if stats is not None and stats.rounds:
                self.observed[(domain, name)].append(stats.mean_accepted_length)
            self._pending = None

    @property
    def last_speculation_stats(self):
        """Statistics of the most recent request (from the drafter it went to)."""
        return self.drafters[self.choices[-1][1]].last_speculation_stats if self.choices else None

    @property
    def config(self):  # transformers' mode validation reads the assistant's config
        return next(iter(self.drafters.values())).config

    @property
    def device(self):
        return next(iter(self.drafters.values())).device

    # ---- the drafter interface the generate() hook uses -----------------------------------------------------------
    def check_target(self, target) -> None:
        for drafter in self.drafters.values():
            drafter.check_target(target)

    supports_transformers_dflash = False

    def get_candidate_generator(self, target, input_ids, generation_config, logits_processor=None):
        self._record_previous()
        domain = classify_domain(self.tokenizer.decode(input_ids[0], skip_special_tokens=True))
        name = self.choose(domain)
        self.choices.append((domain, name))
        self._pending = (domain, name)
        return self.drafters[name].get_candidate_generator(target, input_ids, generation_config, logits_processor)

    def finish(self) -> None:
        """Fold the last request's outcome into the estimates (called automatically on the next request)."""
        self._record_previous()
