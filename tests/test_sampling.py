"""do_sample=True keeps the target's distribution exactly: chi-square goodness of fit against the exact
target probabilities, for speculative and for plain sampling, on a tiny vocabulary."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_drafter, tiny_target

VOCAB, DRAWS = 7, 2400
PROMPT = torch.tensor([[3, 5, 4]])


def exact_distribution(target, steps, temperature=1.0, top_k=None):
    """Exact probability of every continuation of `steps` tokens, after temperature and top-k (as `generate` does)."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=steps):
        ids = torch.cat([PROMPT, torch.tensor([seq])], dim=1)
        with torch.no_grad():
            logits = target(ids).logits[0, PROMPT.shape[1] - 1 : -1].double() / temperature
            if top_k is not None:
                kth = logits.topk(top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            logp = torch.log_softmax(logits, dim=-1)
        probs[seq] = float(torch.exp(sum(logp[i, t] for i, t in enumerate(seq))))
    return probs


def goodness_of_fit(samples, probs, min_expected=5.0):
    """p-value of samples against probs; cells with small expectation are pooled into one."""
    counts = {k: 0 for k in probs}
    for s in samples:
        counts[s] += 1
    big = [k for k in probs if probs[k] * len(samples) >= min_expected]
    observed = [counts[k] for k in big] + [len(samples) - sum(counts[k] for k in big)]
    expected = [probs[k] * len(samples) for k in big] + [len(samples) * (1 - sum(probs[k] for k in big))]
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_target(vocab_size=VOCAB, seed=4, skew=1.5)


@pytest.mark.parametrize("family", ["mtp", "dflash", "dfly"])
def test_speculative_sampling_matches_target_distribution(sampling_target, family):
    target = sampling_target
    drafter = tiny_drafter(family, target, mask_token_id=6) if family != "mtp" else tiny_drafter(family, target)
    steps = 3
    exact = exact_distribution(target, steps)
    torch.manual_seed(1234)
    samples, proposed, accepted = [], 0, 0
    for _ in range(DRAWS):
        out = target.generate(PROMPT, do_sample=True, max_new_tokens=steps, top_k=0, top_p=1.0, temperature=1.0,
                              eos_token_id=None, pad_token_id=0, assistant_model=drafter)
        samples.append(tuple(out[0, PROMPT.shape[1]:].tolist()))
        proposed += sum(drafter.last_speculation_stats.proposed)
        accepted += sum(drafter.last_speculation_stats.accepted)
    # The drafts were really tested: some accepted, some rejected.
    assert 0 < accepted < proposed
    assert goodness_of_fit(samples, exact) > 1e-3


def test_speculative_sampling_with_temperature_and_top_k(sampling_target):
    """With logits processors (temperature 0.7, top-k 4) the output is still exactly the processed target's."""
    target = sampling_target
    drafter = tiny_drafter("dfly", target, mask_token_id=6)
    exact = exact_distribution(target, 2, temperature=0.7, top_k=4)
    assert sum(p == 0 for p in exact.values()) > 0  # truncation really removes continuations
    torch.manual_seed(7)
    samples = []
    for _ in range(DRAWS):
        out = target.generate(PROMPT, do_sample=True, max_new_tokens=2, top_k=4, top_p=1.0, temperature=0.7,
                              eos_token_id=None, pad_token_id=0, assistant_model=drafter)
        samples.append(tuple(out[0, PROMPT.shape[1]:].tolist()))
    assert all(exact[s] > 0 for s in samples)
    assert goodness_of_fit(samples, exact) > 1e-3


def test_plain_sampling_passes_and_a_biased_sampler_fails(sampling_target):
    """The test has power: plain sampling passes, and sampling from a distorted distribution is rejected."""
    target, steps = sampling_target, 2
    exact = exact_distribution(target, steps)
    torch.manual_seed(99)
    ids = PROMPT.expand(DRAWS, -1)
    out = target.generate(ids, do_sample=True, max_new_tokens=steps, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    plain = [tuple(row) for row in out[:, PROMPT.shape[1]:].tolist()]
    assert goodness_of_fit(plain, exact) > 1e-3
    # A small distortion (first tokens of even id 50% more likely; total variation ~0.1) must be rejected.
    keys = list(exact)
    weights = torch.tensor([exact[k] * (1.5 if k[0] % 2 == 0 else 1.0) for k in keys])
    biased = torch.multinomial(weights / weights.sum(), DRAWS, replacement=True, generator=torch.Generator().manual_seed(5))
    assert goodness_of_fit([keys[i] for i in biased], exact) < 1e-3
