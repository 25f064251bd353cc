"""Shared statistics for the distribution tests: exact target distributions on a tiny vocabulary, and a chi-square
goodness of fit that is well defined on every input (no empty, negative or zero-expected cells).

A distribution test is only worth something if it can fail, so every test that uses these helpers also runs a
known-wrong sampler through the same statistic on the same number of draws and asserts that it is rejected
(`assert_power`)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence

import contextlib

import torch
from scipy.stats import chisquare

ALPHA = 1e-3  # a right sampler must give p > ALPHA, a wrong one p < ALPHA
PROMPT = torch.tensor([[3, 5, 4]])


class ImpossibleSample(AssertionError):
    """A sample landed in a cell the exact distribution gives probability zero: no statistic needed, it is wrong."""


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Log-probabilities after temperature, top-k (0: off) and top-p (1: off), in transformers' order and with its
    conventions (top-p keeps the smallest set whose mass reaches top_p, and always the top token), in float64.
    Written independently of the package's `process_logits` on purpose: it is what the tests hold both to."""
    x = logits.double() / temperature
    if top_k:
        kth = x.topk(min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(x, -1), dim=-1, descending=True)
        above = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = above >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


@torch.no_grad()
def exact_distribution(target, steps: int, prompt: torch.Tensor = PROMPT, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `steps` tokens of `prompt` under the target after temperature,
    top-k and top-p (as `generate` and the engine apply them). Enumerates vocab**steps sequences: tiny vocabularies."""
    vocab = target.config.get_text_config().vocab_size
    prompt = prompt.reshape(1, -1)
    n = prompt.shape[1]
    probs: dict[tuple[int, ...], float] = {}
    # one forward per prefix of length steps - 1 gives every position's distribution for all its continuations
    for head in itertools.product(range(vocab), repeat=steps - 1):
        ids = torch.cat([prompt, torch.tensor([head], dtype=torch.long).reshape(1, -1)], dim=1)
        logp = processed_logprobs(target(ids).logits[0, n - 1 :].double(), temperature, top_k, top_p)
        prefix = sum(float(logp[i, t]) for i, t in enumerate(head))
        for last in range(vocab):
            probs[head + (last,)] = float(torch.exp(torch.tensor(prefix) + logp[steps - 1, last]))
    total = sum(probs.values())
    assert abs(total - 1.0) < 1e-6, f"exact distribution sums to {total}"
    return probs


def marginal(probs: Mapping[tuple, float], length: int) -> dict[tuple, float]:
    """The distribution of the first `length` tokens of a joint distribution over token tuples."""
    out: dict[tuple, float] = {}
    for key, p in probs.items():
        out[key[:length]] = out.get(key[:length], 0.0) + p
    return out


def vector_distribution(probs: Sequence[float] | torch.Tensor) -> dict[int, float]:
    """A single position's distribution (a probability vector over a small vocabulary) as cells for
    `goodness_of_fit`: token id -> probability."""
    values = probs.double().tolist() if torch.is_tensor(probs) else [float(p) for p in probs]
    return dict(enumerate(values))


def total_variation(p: Mapping | Sequence | torch.Tensor, q: Mapping | Sequence | torch.Tensor) -> float:
    """Total variation distance between two distributions (dicts over the same cells, or vectors)."""
    if isinstance(p, Mapping):
        keys = set(p) | set(q)
        return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)
    p, q = torch.as_tensor(p, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
    return float(0.5 * (p - q).abs().sum(-1).max())


def _pool(cells: list[tuple[float, int]], min_expected: float) -> list[tuple[float, int]]:
    """Merge (expected, observed) cells, smallest expectation first, until every cell expects >= min_expected
    (or one cell is left)."""
    cells = sorted(cells, key=lambda c: c[0])
    pooled: list[tuple[float, int]] = []
    acc_e, acc_o = 0.0, 0
    for e, o in cells:
        if e >= min_expected and acc_e == 0.0:
            pooled.append((e, o))
            continue
        acc_e, acc_o = acc_e + e, acc_o + o
        if acc_e >= min_expected:
            pooled.append((acc_e, acc_o))
            acc_e, acc_o = 0.0, 0
    if acc_e > 0.0:  # a remainder below the threshold joins the smallest pooled cell
        if pooled:
            e, o = pooled.pop(0)
            pooled.insert(0, (e + acc_e, o + acc_o))
        else:
            pooled.append((acc_e, acc_o))
    return pooled


def goodness_of_fit(samples: Iterable[Hashable], probs: Mapping[Hashable, float], min_expected: float = 5.0) -> float:
    """p-value of a chi-square goodness of fit of `samples` to the exact distribution `probs` (cell -> probability).

    Cells of probability zero are structurally empty and left out, but a sample in one (or in a cell `probs` does
    not list) fails at once (`ImpossibleSample`). Cells expecting fewer than `min_expected` samples are pooled, the
    smallest together, so that no cell is empty, negative or near zero; if a single cell is left the fit is exact
    (p = 1). Expected counts are renormalised over the support so that they sum to the number of samples."""
    counts = Counter(samples)
    n = sum(counts.values())
    if n == 0:
        raise ValueError("no samples")
    outside = {k: c for k, c in counts.items() if probs.get(k, 0.0) <= 0.0}
    if outside:
        raise ImpossibleSample(f"{sum(outside.values())} samples in zero-probability cells, e.g. "
                               f"{sorted(outside.items(), key=lambda kv: -kv[1])[:5]}")
    support = {k: float(p) for k, p in probs.items() if p > 0.0}
    mass = sum(support.values())
    if not 0.999 < mass < 1.001:
        raise ValueError(f"the exact distribution sums to {mass}, not 1")
    cells = _pool([(n * p / mass, counts.get(k, 0)) for k, p in support.items()], min_expected)
    if len(cells) < 2:
        return 1.0
    expected = [e for e, _ in cells]
    observed = [o for _, o in cells]
    scale = n / sum(expected)  # rounding only
    pvalue = float(chisquare(observed, [e * scale for e in expected]).pvalue)
    assert pvalue == pvalue, "chi-square returned NaN"  # cannot happen with the pooling above; loud if it does
    return pvalue


def sequence_fit(samples: Sequence[tuple], probs: Mapping[tuple, float]) -> float:
    """The statistic of the sequence tests: the smallest goodness-of-fit p-value over the prefixes of length 2..L of
    L-token samples (the full joint, and the marginals a speculative step's bias shows in most sharply: the first
    drafted position sits at token 2). Rejecting when it is below ALPHA has size at most (L - 1) * ALPHA."""
    length = len(next(iter(probs)))
    if length == 1:
        return goodness_of_fit(samples, probs)
    return min(goodness_of_fit([s[:n] for s in samples], marginal(probs, n)) for n in range(2, length + 1))


def assert_power(right: float, wrong: Mapping[str, float], alpha: float = ALPHA) -> None:
    """The right rule passes (p > alpha) and every known-wrong rule is rejected (p < alpha) by the same statistic
    on the same number of draws."""
    survivors = {name: p for name, p in wrong.items() if not p < alpha}
    assert right > alpha, f"the right rule is rejected: p = {right:.3g}"
    assert not survivors, f"no power: wrong rules not rejected: {survivors} (right rule p = {right:.3g})"


def report(name: str, right: float | None = None, **wrong: float) -> None:
    """Print the p-values (shown with `pytest -rP` or `-s`): the power figures of a test."""
    parts = ([f"right p={right:.3g}"] if right is not None else []) + [f"{k} p={v:.3g}" for k, v in wrong.items()]
    print(f"[power] {name}: " + ", ".join(parts))


# ---- set-ups where the target p and the drafter q differ strongly -------------------------------------------------
VOCAB = 7


def spread_target(vocab_size: int = VOCAB):
    """conftest's tiny target with its LM head scaled ×10: p is spread (about 0.05..0.35 over 7 tokens), so that
    temperature 0.7 moves it clearly (total variation ~0.14 over two tokens) and top-k / top-p cut real mass."""
    from helpers import tiny_target

    target = tiny_target(vocab_size=vocab_size, seed=4, skew=1.5)
    with torch.no_grad():
        target.lm_head.weight *= 10
    return target


def peaked_drafter(family: str, target, scale: float = -1.5):
    """A random drafter whose final norm weight is scaled: q is sharply peaked (about 0.5..0.9 on one token) on a
    token the target does not favour as much, and the total variation between p and q is ~0.5 (the tests assert it
    through the acceptance rate, which is 1 - TV at the first draft position)."""
    from helpers import tiny_drafter

    extra = {} if family == "mtp" else {"mask_token_id": VOCAB - 1}
    drafter = tiny_drafter(family, target, **extra)
    with torch.no_grad():
        drafter.norm.weight *= scale
    return drafter


@contextlib.contextmanager
def single_thread():
    """Tiny models run several times faster on one intra-op thread, above all on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- known-wrong rules, for the power checks ------------------------------------------------------------------
def correction_from_p(verify):
    """Wrap a `verify(scores, draft, draft_probs, depth, greedy, u_accept, u_sample)` (reference or Triton) into the
    wrong rule that draws the correction after a rejection from p instead of norm(max(p - q, 0))."""
    from angelspec_hf.tgi_patch.engine.sampling import sample_from

    def wrong(scores, draft, draft_probs, depth, greedy, u_accept, u_sample):
        num_accepted, token = verify(scores, draft, draft_probs, depth, greedy, u_accept, u_sample)
        rows = torch.arange(len(num_accepted), device=num_accepted.device)
        fresh = sample_from(scores[rows, num_accepted].float(), u_sample.gather(1, num_accepted[:, None]).squeeze(1))
        rejected = (num_accepted < depth) & ~greedy
        return num_accepted, torch.where(rejected, fresh, token)

    return wrong
