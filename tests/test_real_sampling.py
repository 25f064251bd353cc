"""Exact sampling on the real embedded target (SmolLM2-135M-Instruct) at T = 0.7, through the batched engine.

The first generated token comes from the prefill (plain sampling); the second is the first speculative one: drafted
by the shipped MTP drafter, verified (by rejection sampling for unseeded requests, by exact match against the
target's Gumbel-max draw for seeded ones) and either accepted or replaced by the target's token. So many requests of
one prompt each generate (t1, t2), and t2 is tested against the exact target distribution p(t2 | prompt, t1) at
T = 0.7 (one target forward per frequent t1), with every group's chi-square summed into one statistic. The
statistic's power is checked on the same contexts: samples of the drafter's q, and of p at T = 1, must be rejected.
Draws: DRAWS per case (unseeded with "full" and with a D-Cut budget that verifies about half of the drafts, seeded
with the budget). A seeded request also gives its plain sampling tokens on this target, alone and in a batch.
"""

import collections
import random

import pytest
import torch
from scipy.stats import chi2

import angelspec_hf
from angelspec_hf.shipped import shipped_or_untrained
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine
from helpers import cores_per_worker

pytestmark = pytest.mark.real_model

PROMPT = "Dear John,\n"  # t1 is "\n" ~70% of the time; t2 is spread over many tokens; drafts are accepted ~20%
TEMPERATURE = 0.7
DRAWS = 384  # per verification mode
BATCH = 384
MIN_GROUP = 40  # t1 values drawn at least this often are tested
ALPHA = 1e-3


@pytest.fixture(scope="module")
def real():
    torch.set_num_threads(cores_per_worker())
    target, tokenizer = angelspec_hf.load_default_target()
    drafter, trained = shipped_or_untrained("mtp", target)
    assert trained, "the shipped MTP drafter is missing"
    return target, drafter, tokenizer(PROMPT).input_ids


def pooled_chisquare(groups, min_expected=5.0):
    """p-value of one chi-square summed over groups `(counts: Counter token -> n, probs [V] float64)`. Within a
    group, tokens expected fewer than `min_expected` times are pooled into one cell (grown from the smallest cells
    until it expects at least `min_expected`), so no cell expects zero; a group left with one cell adds nothing."""
    stat, dof = 0.0, 0
    for counts, probs in groups:
        n = sum(counts.values())
        expected = probs * n
        big = [int(t) for t in torch.argsort(expected, descending=True) if expected[t] >= min_expected]
        rest = n - float(expected[big].sum()) if big else float(n)
        while big and rest < min_expected:
            rest += float(expected[big.pop()])
        cells = [(counts.get(t, 0), float(expected[t])) for t in big]
        cells.append((n - sum(counts.get(t, 0) for t in big), rest))
        if len(cells) < 2:
            continue
        assert all(e > 0 for _, e in cells)
        stat += sum((o - e) ** 2 / e for o, e in cells)
        dof += len(cells) - 1
    assert dof > 0
    return float(chi2.sf(stat, dof))


def sample_two_tokens(target, drafter, prompt, verify, seed0, seeded):
    """`DRAWS` requests through the engine, with seeds seed0 + i (`seeded`) or none (their streams drawn from `random`
    seeded with seed0); returns the (t1, t2) pairs, the drafter's q of the first draft position per t1, and per
    speculative row of each step (verified, accepted)."""
    engine = SpeculativeEngine(target, drafter, verify=verify, max_batch_size=BATCH)
    draft_q, calls = {}, []
    original = engine.batch_drafter.draft

    def draft(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(result)
        return result

    engine.batch_drafter.draft = draft
    params = dict(max_new_tokens=3, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, stop_token_ids=())
    random.seed(seed0)
    ids = [engine.add_request(prompt, SamplingParams(seed=seed0 + i if seeded else None, **params))
           for i in range(DRAWS)]
    outputs, rows = {i: [] for i in ids}, []
    while engine.has_work():
        calls.clear()
        events = engine.step()
        trace = engine.last_step
        if trace is not None and calls:
            _, q, _ = calls[0]
            decoding = [i for i, p in enumerate(trace.prefill) if p == 0]
            for row, i in enumerate(decoding):
                rid = trace.request_ids[i]
                draft_q.setdefault(outputs[rid][0], q[row, 0].double())
                rows.append((trace.verified[i], trace.accepted[i]))
        for event in events:
            outputs[event.request_id].extend(event.token_ids)
        for rid, tokens in outputs.items():  # the third token is not tested: stop each request after its second
            if len(tokens) >= 2:
                engine.cancel(rid)
    pairs = [tuple(outputs[i][:2]) for i in ids]
    assert all(len(p) == 2 for p in pairs)
    assert not engine.has_work()
    engine.pool.check_accounting(idle=True)
    return pairs, draft_q, rows


@torch.no_grad()
def next_token_probs(target, ids, temperature):
    logits = target(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits / temperature, -1)


@pytest.mark.parametrize("verify,seeded", [("full", False), (DRAWS // 4, False), (DRAWS // 4, True)],
                         ids=["full-unseeded", "budget-unseeded", "budget-seeded"])
def test_first_speculative_token_has_the_target_distribution(real, verify, seeded):
    target, drafter, prompt = real
    pairs, draft_q, rows = sample_two_tokens(target, drafter, prompt, verify, 1000 if verify == "full" else 5000,
                                             seeded)
    verified = [a for v, a in rows if v]
    assert len(rows) == DRAWS  # one speculative step per request (its second token)
    assert 0.05 < sum(verified) / len(verified) < 0.95  # drafts both accepted and rejected
    if verify != "full":  # the budget really cut: some requests verified their draft, some did not
        assert 0 < len(verified) < len(rows)

    by_t1 = collections.defaultdict(collections.Counter)
    for t1, t2 in pairs:
        by_t1[t1][t2] += 1
    tested = {t1: counts for t1, counts in by_t1.items() if sum(counts.values()) >= MIN_GROUP}
    assert sum(sum(c.values()) for c in tested.values()) >= 0.6 * DRAWS
    exact = {t1: next_token_probs(target, prompt + [t1], TEMPERATURE) for t1 in tested}
    assert pooled_chisquare([(tested[t1], exact[t1]) for t1 in tested]) > ALPHA

    # power: on the same contexts and group sizes, samples of the drafter's q and of p at T = 1 are rejected
    generator = torch.Generator().manual_seed(0)

    def resample(probs_of):
        groups = []
        for t1, counts in tested.items():
            draws = torch.multinomial(probs_of(t1).float(), sum(counts.values()), replacement=True,
                                      generator=generator)
            groups.append((collections.Counter(draws.tolist()), exact[t1]))
        return pooled_chisquare(groups)

    assert resample(lambda t1: draft_q[t1]) < ALPHA
    assert resample(lambda t1: next_token_probs(target, prompt + [t1], 1.0)) < ALPHA


@torch.no_grad()
def test_a_seeded_request_gives_its_plain_sampling_tokens_on_the_real_target(real):
    """Seeded requests at T = 0.7 / top-p 0.95: their tokens from plain decoding (no drafter, no lookups) again under
    a D-Cut budget with lookups, alone and in a batch of 8 other requests of mixed kinds beside a twin."""
    target, drafter, prompt = real
    rng = random.Random(3)
    subjects = [SamplingParams(max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.95, seed=seed,
                               stop_token_ids=()) for seed in (11, 2**63 + 5)]  # a u64 seed too
    others = [(prompt + [rng.randrange(100, 40_000) for _ in range(rng.randrange(1, 6))],
               SamplingParams(max_new_tokens=rng.randrange(8, 30), do_sample=i % 2 == 1, temperature=0.9,
                              seed=rng.randrange(1 << 30) if i % 4 == 1 else None, repetition_penalty=1.1 + i % 3 / 10,
                              stop_token_ids=())) for i in range(8)]

    def run(drafter, verify, requests, lookups):
        engine = SpeculativeEngine(target, drafter, verify=verify, max_batch_size=16, lookup_tokens=lookups)
        ids = [engine.add_request(p, params) for p, params in requests]
        outputs = {i: [] for i in ids}
        for events in engine.steps():
            for event in events:
                outputs[event.request_id].extend(event.token_ids)
        return [outputs[i] for i in ids], engine.stats

    for params in subjects:
        (plain,), _ = run(None, "full", [(prompt, params)], 0)
        (alone,), _ = run(drafter, 6, [(prompt, params)], 3)
        crowd, stats = run(drafter, 6, others[:4] + [(prompt, params)] + others[4:] + [(prompt, params)], 3)
        assert len(plain) == 24 and alone == plain and crowd[4] == crowd[-1] == plain, (params.seed, plain, alone)
        assert 0 < stats["accepted"] < stats["verified"] < stats["drafted"], stats
