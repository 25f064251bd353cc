"""Repetition / frequency / presence penalties and top_n_tokens in the batched engine: speculative decoding with
penalties equals plain decoding with the same penalties (greedy token for token; sampled in distribution, with a
power check), position by position inside a verified block."""

import itertools
import random

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from angelspec_hf.tgi_patch.engine import verification as engine_module
from angelspec_hf.policy import CostModel
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine
from angelspec_hf.tgi_patch.engine.sampling import apply_penalties
from helpers import tiny_drafter, tiny_target
from stats import (PROMPT, ImpossibleSample, assert_power, peaked_drafter, processed_logprobs, report, sequence_fit,
                   single_thread, spread_target)

FIXED_COST = CostModel((1.0, 0.05, 0.02), (0.2, 0.01))

PENALTIES = dict(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.9)


def penalised_reference(logits, prompt, generated, repetition_penalty=1.0, frequency_penalty=0.0,
                        presence_penalty=0.0):
    """The penalties written the plain way, one position at a time: transformers' own repetition processor over
    prompt + generated, then OpenAI's frequency / presence rule over the generated tokens."""
    ids = torch.tensor([prompt + generated])
    x = RepetitionPenaltyLogitsProcessor(repetition_penalty)(ids, logits.double()[None])[0]
    for token in set(generated):
        x[token] -= frequency_penalty * generated.count(token) + presence_penalty
    return x


@torch.no_grad()
def plain_penalised_greedy(model, prompt, n, eos=2, top_n=0, **penalties):
    """Plain greedy decoding with penalties (full forward every token); also each position's top-n log-probs."""
    generated, tops = [], []
    for _ in range(n):
        logits = model(torch.tensor([prompt + generated])).logits[0, -1]
        x = penalised_reference(logits, prompt, generated, **penalties)
        if top_n:
            values, ids = torch.log_softmax(x, -1).topk(top_n)
            tops.append(list(zip(ids.tolist(), values.tolist())))
        generated.append(int(x.argmax()))
        if generated[-1] == eos:
            break
    return generated, tops


def test_apply_penalties_scores_every_position_with_its_own_prefix():
    torch.manual_seed(0)
    vocab, s = 11, 4
    logits = torch.randn(2, s, vocab) * 3
    prompts, generated = [[1, 2, 3], [4]], [[5, 5, 6], []]
    draft = torch.tensor([[6, 7, 6], [4, 4, 9]])
    seen = torch.zeros(2, vocab, dtype=torch.bool)
    counts = torch.zeros(2, vocab)
    for i in range(2):
        seen[i, prompts[i] + generated[i]] = True
        for t in generated[i]:
            counts[i, t] += 1
    rules = [(1.8, 0.7, 0.9), (0.6, -0.5, 1.2)]
    got = apply_penalties(logits, draft, seen, counts, *(torch.tensor(r) for r in zip(*rules)))
    for i, j in itertools.product(range(2), range(s)):
        r, f, p = rules[i]
        want = penalised_reference(logits[i, j], prompts[i], generated[i] + draft[i, :j].tolist(), r, f, p)
        torch.testing.assert_close(got[i, j].double(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def targets():
    return tiny_target(), tiny_target()


@pytest.mark.parametrize("family,verify", [("mtp", "full"), ("dflash", "depth:3"), ("dfly", 6),
                                           ("dfly", None)])
def test_penalised_greedy_equals_plain_penalised_decoding(targets, family, verify):
    target, twin = targets
    drafter = tiny_drafter(family, target) if verify else None
    prompts = [[3, 5, 4, 5, 3], [7, 7, 7], [9, 8, 7, 6, 5, 4, 3], [11]]
    rules = [PENALTIES, dict(repetition_penalty=1.3), dict(frequency_penalty=1.5), dict(presence_penalty=-0.8)]
    n = 24
    engine = SpeculativeEngine(target, drafter, verify=verify or "full", max_batch_size=4, cost_model=FIXED_COST)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, top_n_tokens=3, **rule))
           for p, rule in zip(prompts, rules)]
    outputs, tops = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id] += event.token_ids
            tops[event.request_id] += event.top_tokens or []
    changed = 0
    for rid, prompt, rule in zip(ids, prompts, rules):
        want, want_tops = plain_penalised_greedy(twin, prompt, n, top_n=3, **rule)
        assert outputs[rid] == want, (rule, prompt)
        assert len(tops[rid]) == len(want)
        for got_top, ref_top, token in zip(tops[rid], want_tops, want):
            assert got_top[0][0] == token and [t for t, _ in got_top] == [t for t, _ in ref_top]
            torch.testing.assert_close(torch.tensor([lp for _, lp in got_top]),
                                       torch.tensor([lp for _, lp in ref_top], dtype=torch.float32),
                                       rtol=1e-4, atol=1e-4)
        changed += want != plain_penalised_greedy(twin, prompt, n)[0]
    assert changed >= 3  # the penalties really changed what greedy decoding says
    if verify:
        assert engine.stats["accepted"] > 0  # draft tokens were accepted under the penalties


def test_penalties_and_top_n_are_validated(targets):
    target, _ = targets
    engine = SpeculativeEngine(target, None, verify="full", cost_model=FIXED_COST)
    for bad in [dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")), dict(frequency_penalty=2.5),
                dict(presence_penalty=float("-inf")), dict(top_n_tokens=-1), dict(top_n_tokens=1.5)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            engine.add_request([3, 4], SamplingParams(**bad))


# ---- sampling ----------------------------------------------------------------------------------------------------
SAMPLED = dict(repetition_penalty=2.5, frequency_penalty=1.0, presence_penalty=1.5)


@torch.no_grad()
def exact_penalised(target, steps, temperature):
    """Probability of every continuation of PROMPT under the target with SAMPLED penalties and temperature."""
    vocab, prompt = target.config.vocab_size, PROMPT[0].tolist()
    probs = {}
    for seq in itertools.product(range(vocab), repeat=steps):
        logits = target(torch.tensor([prompt + list(seq[:-1])])).logits[0, len(prompt) - 1:]
        logp = 0.0
        for j, token in enumerate(seq):
            x = penalised_reference(logits[j], prompt, list(seq[:j]), **SAMPLED)
            logp += float(processed_logprobs(x[None], temperature)[0, token])
        probs[seq] = float(torch.tensor(logp).exp())
    assert abs(sum(probs.values()) - 1) < 1e-6
    return probs


def sample_penalised(target, drafter, draws, steps, temperature, seeded):
    """`draws` penalised sampled requests of PROMPT: seeded (seed i: Gumbel-max draws) or not (rejection sampling,
    the engine's streams drawn from `random`, seeded first)."""
    engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=64, cost_model=FIXED_COST)
    random.seed(draws)
    ids = [engine.add_request(PROMPT[0].tolist(), SamplingParams(
        max_new_tokens=steps, do_sample=True, seed=i if seeded else None, temperature=temperature, stop_token_ids=(),
        **SAMPLED)) for i in range(draws)]
    outputs = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id] += event.token_ids
    return [tuple(outputs[i]) for i in ids], engine.stats


def fit(samples, exact):
    try:
        return sequence_fit(samples, exact)
    except ImpossibleSample:
        return 0.0


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_penalised_sampling_is_exact_with_power(monkeypatch, seeded):
    target = spread_target()
    drafter = peaked_drafter("dfly", target)
    steps, temperature, draws = 3, 0.8, 4000
    exact = exact_penalised(target, steps, temperature)
    real = apply_penalties

    def block_prefix_ignored(logits, draft, *rest):  # every position penalised as if it followed no draft token
        return torch.cat([real(logits[:, j : j + 1], draft, *rest) for j in range(logits.shape[1])], 1)

    with single_thread():
        samples, stats = sample_penalised(target, drafter, draws, steps, temperature, seeded)
        assert stats["accepted"] > 0.1 * stats["verified"]  # blocks were accepted, so positions j >= 1 were used
        right = fit(samples, exact)
        monkeypatch.setattr(engine_module, "apply_penalties", block_prefix_ignored)
        wrong = fit(sample_penalised(target, drafter, draws, steps, temperature, seeded)[0], exact)
    report(f"penalised sampling ({'seeded' if seeded else 'unseeded'}): {draws} draws, accepted {stats['accepted']}/{stats['verified']}", right,
           **{"draft prefix ignored": wrong})
    assert_power(right, {"draft prefix ignored": wrong})
