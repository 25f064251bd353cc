"""do_sample=True through `target.generate(assistant_model=drafter)` keeps the target's distribution exactly:
chi-square goodness of fit against the exact processed target probabilities on a tiny vocabulary, with temperature
0.7, top-k and top-p, a drafter far from the target, and in every test a known-wrong sampler run through the same
statistic on the same number of draws that must be rejected (so no test can pass vacuously).

transformers' first generated token comes from the prefill; drafting starts at the second. With `max_new_tokens=3`
every call drafts exactly one position (the room left is what caps it), with 4 two positions."""

import math

import pytest
import torch
import transformers.generation.utils as generation_utils

from angelspec_hf.modeling.candidate_generator import AngelSpecCandidateGenerator
from angelspec_hf.modeling.draft_policy import DraftLengthPolicy
from stats import (ALPHA, PROMPT, VOCAB, ImpossibleSample, assert_power, exact_distribution, goodness_of_fit, marginal,
                   peaked_drafter, report, sequence_fit, single_thread, spread_target, total_variation,
                   vector_distribution)

DRAWS = 800  # every wrong rule below is still rejected at p < 1e-4 (seeded; `pytest -rP` prints the p-values)
PROCESSING = dict(temperature=0.7, top_k=5, top_p=0.9)


@pytest.fixture(scope="module")
def target():
    return spread_target()


def _fit(samples, exact):
    try:
        return sequence_fit(samples, exact)
    except ImpossibleSample:
        return 0.0


def hook_samples(target, drafter, new_tokens, seed, draws=DRAWS, lookups=None):
    """`draws` calls of generate() with the drafter; returns the samples and (rounds, proposed, accepted, rounds whose
    first draft token was accepted); `lookups` (a list) collects each call's n-gram lookup rounds."""
    torch.manual_seed(seed)
    samples, rounds, proposed, accepted, first = [], 0, 0, 0, 0
    with single_thread():
        for _ in range(draws):
            out = target.generate(PROMPT, do_sample=True, max_new_tokens=new_tokens, eos_token_id=None,
                                  pad_token_id=0, assistant_model=drafter, **PROCESSING)
            samples.append(tuple(out[0, PROMPT.shape[1]:].tolist()))
            stats = drafter.last_speculation_stats
            rounds += stats.rounds
            proposed += sum(stats.proposed)
            accepted += sum(stats.accepted)
            first += sum(a > 0 for a in stats.accepted)
            if lookups is not None:
                lookups.append(stats.lookup_rounds)
    return samples, (rounds, proposed, accepted, first)


def _raw_draft_q(monkeypatch):
    """Wrong rule: the drafter samples from its processed distribution, but verification is handed the unprocessed
    logits (q built without temperature / top-k / top-p)."""
    select = AngelSpecCandidateGenerator._select

    def raw(self, logits, j):
        token, _, peak = select(self, logits, j)
        return token, logits.float(), peak

    monkeypatch.setattr(AngelSpecCandidateGenerator, "_select", raw)


def _correction_from_p(monkeypatch):
    """Wrong rule: after a rejection transformers draws the correction from p instead of norm(max(p - q, 0))."""
    right = generation_utils._speculative_sampling

    def wrong(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        valid, n_matches = right(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)
        if n_matches < candidate_length:
            valid = valid.clone()
            valid[0, -1] = torch.multinomial(new_logits[0, n_matches].softmax(-1), 1)[0]
        return valid, n_matches

    monkeypatch.setattr(generation_utils, "_speculative_sampling", wrong)


def _draft_drawn_off_q(monkeypatch):
    """Wrong rule: the hook's draw (`draw_token`) is off by one column (an inverse-CDF draw searching on the wrong
    side), while verification is handed q itself."""
    from angelspec_hf.modeling import candidate_generator

    right = candidate_generator.draw_token
    monkeypatch.setattr(candidate_generator, "draw_token", lambda probs, ids=None: right(probs.roll(1, -1), ids))


WRONG_HOOK_RULES = {"draft q unprocessed": _raw_draft_q, "correction from p": _correction_from_p,
                    "draft drawn off q": _draft_drawn_off_q}


@pytest.mark.parametrize("family,new_tokens,wrong_rule", [("mtp", 3, "draft q unprocessed"),
                                                          ("dflash", 3, "correction from p"),
                                                          ("dfly", 4, "draft q unprocessed"),
                                                          ("dfly-pruned", 3, "draft drawn off q")])
def test_speculative_sampling_is_exact_with_temperature_top_k_top_p(target, family, new_tokens, wrong_rule,
                                                                    monkeypatch):
    """T = 0.7, top-k 5, top-p 0.9 through the hook: every call drafts, drafts are accepted and (mostly) rejected,
    and the output is exactly the processed target's; the wrong rule, and a sampler ignoring temperature, are not.
    `-pruned`: the drafter drafts over 5 of the 7 tokens, so the hook processes and draws on those rows alone."""
    drafter = peaked_drafter(family.removesuffix("-pruned"), target)
    if family.endswith("-pruned"):
        drafter.set_draft_vocab(list(range(VOCAB - 2)))
    exact = exact_distribution(target, new_tokens, **PROCESSING)
    assert sum(p == 0 for p in exact.values()) > 0  # truncation really removes continuations
    assert total_variation(marginal(exact, 2), marginal(exact_distribution(target, 2), 2)) > 0.1  # processing matters
    samples, (rounds, proposed, accepted, first) = hook_samples(target, drafter, new_tokens, seed=1)
    assert proposed >= DRAWS * (new_tokens - 2) and rounds >= DRAWS  # every call drafted
    assert 0 < accepted < proposed
    # acceptance at the first draft position is 1 - TV(p, q): target and drafter are far apart
    assert first / rounds < 0.65
    right = _fit(samples, exact)

    with monkeypatch.context() as patch:
        WRONG_HOOK_RULES[wrong_rule](patch)
        wrong_samples, _ = hook_samples(target, drafter, new_tokens, seed=2)
    wrong = {wrong_rule: _fit(wrong_samples, exact)}
    torch.manual_seed(3)  # a sampler that ignores temperature (T = 1, same top-k / top-p): plain batched sampling
    hot = target.generate(PROMPT.expand(DRAWS, -1), do_sample=True, max_new_tokens=new_tokens, eos_token_id=None,
                          pad_token_id=0, **(PROCESSING | {"temperature": 1.0}))
    wrong["temperature ignored"] = _fit([tuple(r) for r in hot[:, PROMPT.shape[1]:].tolist()], exact)
    report(f"hook {family}, {DRAWS} draws, {proposed} drafted, {accepted} accepted", right, **wrong)
    assert_power(right, wrong)


def test_plain_sampling_passes_and_a_biased_sampler_fails(target):
    """The statistic has power at this sample size: plain sampling passes, and sampling from a distorted
    distribution (first tokens of even id 50% more likely; total variation ~0.1) is rejected."""
    steps, draws = 2, 3000
    exact = exact_distribution(target, steps)
    torch.manual_seed(99)
    out = target.generate(PROMPT.expand(draws, -1), do_sample=True, max_new_tokens=steps, top_k=0, top_p=1.0,
                          eos_token_id=None, pad_token_id=0)
    right = goodness_of_fit([tuple(row) for row in out[:, PROMPT.shape[1]:].tolist()], exact)
    keys = list(exact)
    weights = torch.tensor([exact[k] * (1.5 if k[0] % 2 == 0 else 1.0) for k in keys])
    biased = torch.multinomial(weights / weights.sum(), draws, replacement=True,
                               generator=torch.Generator().manual_seed(5))
    wrong = {"biased sampler": goodness_of_fit([keys[i] for i in biased], exact)}
    report("plain sampling", right, **wrong)
    assert_power(right, wrong)


def test_goodness_of_fit_is_defined_on_every_input():
    """No NaN, no empty or negative cells, whatever the exact distribution looks like."""
    # top-k leaves structural zeros and many tiny cells: pooled, never a zero-expected "rest" cell (the old NaN)
    probs = {(a, b): 0.0 for a in range(5) for b in range(5)}
    probs |= {(0, 0): 0.6, (0, 1): 0.3, (1, 0): 0.05, (1, 1): 0.03, (2, 2): 0.015, (3, 3): 0.005}
    g = torch.Generator().manual_seed(0)
    keys = [k for k, p in probs.items() if p > 0]
    draws = torch.multinomial(torch.tensor([probs[k] for k in keys]), 300, replacement=True, generator=g)
    samples = [keys[i] for i in draws]
    p = goodness_of_fit(samples, probs, min_expected=5.0)
    assert p == p and 0.0 < p <= 1.0
    # a sample where the exact distribution has probability zero fails loudly, whatever the counts
    with pytest.raises(ImpossibleSample):
        goodness_of_fit(samples + [(4, 4)], probs)
    with pytest.raises(ImpossibleSample):
        goodness_of_fit(samples + [(9, 9)], probs)  # a cell not listed at all
    # degenerate: one cell of probability 1 (or everything pooled into one) is an exact fit
    assert goodness_of_fit([(0,)] * 50, {(0,): 1.0, (1,): 0.0}) == 1.0
    assert goodness_of_fit([0, 1, 0], {0: 0.5, 1: 0.5}, min_expected=5.0) == 1.0
    # a single position: a probability vector as cells; a wrong vector is rejected
    vector = torch.tensor([0.5, 0.3, 0.2, 0.0])
    tokens = torch.multinomial(vector, 2000, replacement=True, generator=g).tolist()
    assert goodness_of_fit(tokens, vector_distribution(vector)) > ALPHA
    assert goodness_of_fit(tokens, vector_distribution([0.4, 0.35, 0.25, 0.0])) < ALPHA
    with pytest.raises(ValueError):
        goodness_of_fit(tokens, vector_distribution([0.5, 0.3, 0.1, 0.0]))  # does not sum to 1


def _assert_exact_and_wrong_correction_caught(target, drafter, new_tokens, exact, samples, wrong_seed, monkeypatch,
                                              label):
    """`samples` fit `exact`, and the same drafter under a wrong correction rule (from p) is rejected: power."""
    right = _fit(samples, exact)
    with monkeypatch.context() as patch:
        _correction_from_p(patch)
        wrong_samples, _ = hook_samples(target, drafter, new_tokens, seed=wrong_seed)
    wrong = {"correction from p": _fit(wrong_samples, exact)}
    report(label, right, **wrong)
    assert_power(right, wrong)


def test_cost_aware_draft_length_keeps_sampling_exact(target, monkeypatch):
    """`draft_length="auto"`: how many tokens a round drafts (none, one, two) follows the drafter's confidence, the
    learned acceptance and the timed costs, all known before the token they decide about is drawn, so the output is
    still exactly the processed target's; the same statistic rejects a wrong correction rule under the same policy."""
    from angelspec_hf.modeling.draft_policy import DraftLengthPolicy
    from angelspec_hf.policy import RoundCosts, StepKind

    class LearnedAcceptanceFixedCosts(DraftLengthPolicy):  # timing-independent, so the test is reproducible
        def observe(self, drafted, accepted, draft_seconds, step_seconds, round_seconds=None):
            # rounds "timed" by their outcome, so the measured-rate back-off switches drafting off and on from the
            # draws of earlier rounds, as real timings would
            super().observe(drafted, accepted, None, None, round_seconds=0.05 + 0.002 * drafted)

    new_tokens = 4  # up to two drafted positions per round
    drafter = peaked_drafter("dfly", target)
    drafter.config.draft_length = "auto"
    policy = LearnedAcceptanceFixedCosts(RoundCosts((0.05, 0.001), (0.0, 0.006)), drafter.num_draft_tokens)
    drafter.draft_policy = lambda target, cache_dir=None: policy  # one policy learning across all calls
    exact = exact_distribution(target, new_tokens, **PROCESSING)
    samples, (rounds, proposed, accepted, first) = hook_samples(target, drafter, new_tokens, seed=4)
    assert rounds < proposed < 2 * rounds  # the policy drafted one token in some rounds, two in others
    assert 0 < accepted < proposed
    assert policy.measured.get(StepKind.PLAIN, 1) is not None  # the measured back-off made some rounds plain
    _assert_exact_and_wrong_correction_caught(
        target, drafter, new_tokens, exact, samples, 5, monkeypatch,
        f"hook dfly, draft_length=auto, {DRAWS} draws, {rounds} rounds, {proposed} drafted, {accepted} accepted")


class DraftsEveryRound(DraftLengthPolicy):
    """Timing-independent: every round that is not a lookup drafts, as far as the room allows."""

    def start_round(self, max_tokens):
        return max_tokens > 0

    def keep_drafting(self, confidence, max_tokens):
        return len(self._round) + 1 < max_tokens


def test_ngram_lookup_rounds_keep_sampling_exact(target, monkeypatch):
    """`lookup_tokens`: rounds that verify an n-gram lookup (q one-hot on the looked-up token) beside rounds that
    verify the drafter's block keep the processed target distribution exactly; a wrong correction rule is rejected."""
    from angelspec_hf.policy import RoundCosts

    class EveryOtherLookup(DraftsEveryRound):  # timing-independent: lookups whenever on offer, every other call
        calls = 0

        def lookup_length(self, confidence, available, draft_tokens, repeating=False):
            EveryOtherLookup.calls += 1
            return available if EveryOtherLookup.calls % 2 else 0

    new_tokens = 4  # up to two drafted or looked-up positions per round
    drafter = peaked_drafter("dflash", target)
    drafter.config.draft_length, drafter.config.lookup_tokens, drafter.config.lookup_max_ngram = "auto", 2, 2
    policy = EveryOtherLookup(RoundCosts((0.05, 0.001), (0.0, 0.006)), drafter.num_draft_tokens)
    drafter.draft_policy = lambda target, cache_dir=None: policy
    exact = exact_distribution(target, new_tokens, **PROCESSING)
    lookups = []
    samples, (rounds, proposed, accepted, first) = hook_samples(target, drafter, new_tokens, seed=6, lookups=lookups)
    assert sum(lookups) > DRAWS // 4 and rounds > sum(lookups)  # both kinds of round ran, many times
    assert 0 < accepted < proposed
    _assert_exact_and_wrong_correction_caught(
        target, drafter, new_tokens, exact, samples, 7, monkeypatch,
        f"hook dflash + lookup, {DRAWS} draws, {rounds} rounds ({sum(lookups)} lookups), {proposed} proposed, "
        f"{accepted} accepted")


def test_corpus_lookup_rounds_keep_sampling_exact(target, monkeypatch):
    """Rounds that verify a lookup in a corpus (`drafter.lookup_corpus`, q one-hot on each proposed token, several
    tokens a round) beside rounds that verify the drafter's block keep the processed target distribution exactly;
    a wrong correction rule is rejected. The corpus holds every 4-token sequence over the prompt's last tokens and a
    few more, so a lookup is on offer at every round and its tokens are sometimes accepted, sometimes not."""
    import itertools

    from angelspec_hf.policy import CorpusIndex, RoundCosts

    class EveryOtherCorpusLookup(DraftsEveryRound):  # timing-independent: the corpus's lookup every other call
        calls = 0

        def lookup_length(self, confidence, available, draft_tokens, repeating=False):
            return 0  # no n-gram lookups: every lookup round here is the corpus's

        def lookup_plan(self, confidences, draft_tokens, corpus=False):
            EveryOtherCorpusLookup.calls += 1
            return (len(confidences), float("inf")) if EveryOtherCorpusLookup.calls % 2 else (0, 0.0)

    new_tokens = 4  # up to two drafted or looked-up positions per round
    drafter = peaked_drafter("dfly", target)
    drafter.config.draft_length, drafter.config.lookup_tokens = "auto", 2
    drafter.lookup_corpus = CorpusIndex([[5, 4, a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]
                                        + [[4, 1, 2, 3]] * 3, min_match=1)
    policy = EveryOtherCorpusLookup(RoundCosts((0.05, 0.001), (0.0, 0.006)), drafter.num_draft_tokens)
    drafter.draft_policy = lambda target, cache_dir=None: policy
    exact = exact_distribution(target, new_tokens, **PROCESSING)
    lookups = []
    samples, (rounds, proposed, accepted, first) = hook_samples(target, drafter, new_tokens, seed=8, lookups=lookups)
    corpus_rounds = drafter.last_speculation_stats.corpus_rounds
    assert sum(lookups) > DRAWS // 4 and rounds > sum(lookups)  # both kinds of round ran, many times
    assert corpus_rounds == drafter.last_speculation_stats.lookup_rounds  # (the last call's) all from the corpus
    assert 0 < accepted < proposed
    _assert_exact_and_wrong_correction_caught(
        target, drafter, new_tokens, exact, samples, 9, monkeypatch,
        f"hook dfly + corpus lookups, {DRAWS} draws, {rounds} rounds ({sum(lookups)} lookups), {proposed} proposed, "
        f"{accepted} accepted")


def test_shadow_probes_leave_the_random_stream_alone(target):
    """Probes beside plain steps (shadow drafts) draw no random numbers and change nothing that is sampled: with every
    round a shadow probe, `generate(do_sample=True)` gives, seed for seed, plain sampling's tokens."""
    from test_draft_policy import AlwaysShadow

    drafter = peaked_drafter("dfly", target)
    drafter.config.draft_length = "auto"
    policy = AlwaysShadow(drafter.num_draft_tokens)
    drafter.draft_policy = lambda target, cache_dir=None: policy
    with single_thread():
        for seed in range(6):
            outs = []
            for assistant in (None, drafter):
                torch.manual_seed(seed)
                outs.append(target.generate(PROMPT, do_sample=True, max_new_tokens=8, eos_token_id=None,
                                            pad_token_id=0, assistant_model=assistant, **PROCESSING).tolist())
            assert outs[0] == outs[1], seed
    assert len(policy.shadows) == 6 * 6 and all(0.0 <= a <= 1.0 for _, _, a in policy.shadows)
    assert 0.0 < sum(a for _, _, a in policy.shadows) < len(policy.shadows)


def test_a_shadow_drafts_acceptance_is_speculative_samplings_acceptance_rate():
    """`acceptance_probability(p, q)`, what a shadow probe learns at T > 0, is the rate at which transformers'
    `_speculative_sampling` accepts a token drawn from q against p (Monte Carlo, 20,000 rounds); two wrong rules (the
    chance that the target's own draw equals the draft's, the acceptance ratio at q's mode) are many standard errors
    away on the same draws."""
    from angelspec_hf.modeling.candidate_generator import acceptance_probability

    generator = torch.Generator().manual_seed(3)
    vocab, rounds = 12, 20_000
    for case in range(3):
        p_logits = torch.randn(vocab, generator=generator) * 1.5
        q = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
        draws = torch.multinomial(q, rounds, replacement=True, generator=generator)
        torch.manual_seed(case)
        accepted = 0
        new_logits = torch.stack([p_logits, p_logits])[None]  # the drafted position and the bonus one
        for token in draws.tolist():
            candidate = torch.tensor([[1, token]])
            _, n_matches = generation_utils._speculative_sampling(candidate, q.log()[None, None], 1, new_logits)
            accepted += int(n_matches)
        rate = accepted / rounds
        se = (rate * (1 - rate) / rounds) ** 0.5
        p = torch.softmax(p_logits, -1)
        wrong = {"the target's draw equals the draft's": float((p * q).sum()),
                 "ratio at q's mode": float(torch.clamp(p[q.argmax()] / q.max(), max=1.0))}
        assert abs(acceptance_probability(p_logits, q) - rate) < 4 * se, (case, rate)
        assert all(abs(value - rate) > 10 * se for value in wrong.values()), (case, rate, wrong)


# ---- the engine's seeded draws: Gumbel-max with noise from the counter-based generator ---------------------------
def test_gumbel_noise_is_gumbel_distributed_and_keyed_by_seed_position_and_token():
    """`sampling.gumbel`: finite float32 Gumbel(0, 1) values (Kolmogorov-Smirnov; the same statistic rejects a 5%
    wider scale), each a function of (seed, position, token) alone: computed for one row, for a prefix of the
    vocabulary or beside other rows, the same bits; another position or seed gives unrelated values."""
    from scipy.stats import kstest

    from angelspec_hf.tgi_patch.engine.sampling import gumbel

    seeds = torch.arange(400) * 7919 - 2**62  # negative int64 seeds too (u64 seeds are mapped there)
    positions = torch.arange(400) % 37
    noise = gumbel(seeds, positions, 1000)  # [400, 1000]
    assert noise.dtype == torch.float32 and bool(torch.isfinite(noise).all())
    values = noise.flatten().double().numpy()
    assert kstest(values, "gumbel_r").pvalue > ALPHA
    assert kstest(values * 1.05, "gumbel_r").pvalue < ALPHA
    assert torch.equal(gumbel(seeds[3], positions[3], 1000), noise[3])
    assert torch.equal(gumbel(seeds, positions, 600), noise[:, :600])
    assert torch.equal(gumbel(seeds[:50, None], torch.stack([positions[:50], positions[:50] + 1], 1), 1000)[:, 0],
                       noise[:50])
    for other in (gumbel(seeds, positions + 1, 1000), gumbel(seeds + 1, positions, 1000)):
        assert abs(float(torch.corrcoef(torch.stack([noise.flatten(), other.flatten()]))[0, 1])) < 0.01


def test_gumbel_noise_comes_from_the_generators_uniforms_moved_into_the_open_interval():
    """Each noise value is `-log(-log u)` with u = (k + 1) / (2^24 + 1) for the generator's 24-bit uniform k / 2^24
    of (seed, position, token) (`uniforms` keyed by the (seed, position) key, stream GUMBEL); at both ends of the
    24-bit range it is finite (u = 0 or 1 would give -inf / inf)."""
    from angelspec_hf.tgi_patch.engine import sampling

    seeds, positions, vocab = torch.tensor([5, -3, 2**62]), torch.tensor([0, 9, 123456]), 300
    rows = sampling._key(seeds, positions, sampling.GUMBEL)
    k = (sampling.uniforms(rows[:, None], torch.arange(vocab), sampling.GUMBEL).double() * 2**24).round()
    u = (k + 1) / (2**24 + 1)
    torch.testing.assert_close(sampling.gumbel(seeds, positions, vocab).double(), -torch.log(-torch.log(u)),
                               rtol=1e-5, atol=1e-5)
    ends = sampling._exponential_(torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1]), torch.empty(5))
    assert bool(torch.isfinite(ends).all()) and bool((ends > 0).all()) and bool((ends[1:] < ends[:-1]).all())
    torch.testing.assert_close(ends[[0, -1]].double(), torch.tensor([24 * math.log(2), 2.0**-24], dtype=torch.float64),
                               rtol=1e-4, atol=0)


def test_gumbel_max_draws_are_exact_and_independent_across_positions():
    """`argmax(log p + G)` over many seeds is distributed as p (zeros never drawn); the draws of one seed at two
    positions are independent (their joint law is p x p); the same statistics reject a slightly shifted p (total
    variation 0.03) and the draw of position t repeated at t + 1."""
    from angelspec_hf.tgi_patch.engine.sampling import gumbel_scores

    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    n = 20_000
    seeds = torch.arange(n) * 3 + 11
    first = gumbel_scores(p.expand(n, -1), seeds, torch.full((n,), 5)).argmax(-1).tolist()
    second = gumbel_scores(p.expand(n, -1), seeds, torch.full((n,), 6)).argmax(-1).tolist()
    assert goodness_of_fit(first, vector_distribution(p)) > ALPHA
    shifted = torch.tensor([0.37, 0.25, 0.15, 0.1, 0.06, 0.07, 0.0])
    assert goodness_of_fit(first, vector_distribution(shifted)) < ALPHA
    product = {(a, b): float(p[a] * p[b]) for a in range(len(p)) for b in range(len(p))}
    assert goodness_of_fit(list(zip(first, second)), product) > ALPHA
    assert goodness_of_fit(list(zip(first, first)), product, min_expected=5) < ALPHA
