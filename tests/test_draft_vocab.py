"""Pruned draft vocabularies: drafting only over a subset of the target's tokens changes cost, never output — greedy
is identical, sampling keeps the target's distribution (tokens outside the subset are still emitted, by the residual)."""

import pytest
import torch
from stats import ALPHA, exact_distribution, goodness_of_fit, marginal

import angelspec_hf
from angelspec_hf.draft_vocab import choose_draft_vocab, coverage
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine, generate_batch
from helpers import tiny_drafter, tiny_target

SUBSET = list(range(2, 40))


def plain(twin, prompt, n):
    out = twin.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["mtp", "mtp_eagle3", "dflash", "dfly"])
def test_pruned_drafter_is_lossless_drafts_inside_and_round_trips(family, tmp_path):
    target, twin = tiny_target(), tiny_target()
    drafter = tiny_drafter(family, target)
    drafter.set_draft_vocab(SUBSET[::-1] + [5])  # any order, duplicates: stored sorted and unique
    assert drafter.config.draft_vocab_size == len(SUBSET) and drafter.draft_vocab_ids.tolist() == SUBSET
    accepted = 0
    for prompt in ([3, 4, 5, 6], [9, 8, 7, 50, 61, 3], [11]):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == plain(twin, prompt, 24)
        stats = drafter.last_speculation_stats
        assert all(t in SUBSET for block in stats.drafts for t in block) and stats.drafts
        accepted += sum(stats.accepted)
    assert accepted > 0
    # the batched engine drafts through the same pruned head
    prompts = [[3, 4, 5, 6], [9, 8, 7, 50, 61, 3]]
    engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=4)
    assert generate_batch(target, drafter, prompts, max_new_tokens=16, engine=engine) == \
        [plain(twin, p, 16) for p in prompts]
    drafter.save_pretrained(tmp_path)
    loaded = angelspec_hf.load_drafter(tmp_path)
    assert loaded.config.draft_vocab_size == len(SUBSET) and loaded.draft_vocab_ids.tolist() == SUBSET
    logits = loaded.draft_lm_head(target.get_output_embeddings())(torch.randn(2, 32))
    assert torch.isinf(logits[:, [0, 1, 40, 98]]).all() and torch.isfinite(logits[:, SUBSET]).all()
    full = target.get_output_embeddings()(torch.ones(1, 32))
    torch.testing.assert_close(loaded.draft_lm_head(target.get_output_embeddings())(torch.ones(1, 32))[:, SUBSET],
                               full[:, SUBSET])
    drafter.set_draft_vocab(None)
    assert drafter.config.draft_vocab_size is None and drafter.draft_lm_head(target.lm_head) is target.lm_head


def test_pruned_vocabulary_is_refused_where_a_format_cannot_carry_it(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter("dflash", target)
    with pytest.raises(ValueError, match="in \\[0, 99\\)"):
        drafter.set_draft_vocab([3, 120])
    drafter.set_draft_vocab(SUBSET)
    with pytest.raises(ValueError, match="no draft vocabulary map"):
        angelspec_hf.modeling.export_zlab_dflash(drafter, tmp_path)
    with pytest.raises(ValueError, match="speculation_type='dflash'"):  # transformers' path uses the full LM head
        target.generate(torch.tensor([[3, 4]]), max_new_tokens=4, assistant_model=drafter, speculation_type="dflash")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        type(drafter.config)(**(drafter.config.to_dict() | {"draft_vocab_size": 1000}))


def test_choose_draft_vocab_and_coverage():
    from collections import Counter

    counts = Counter({7: 10, 3: 10, 9: 4, 1: 1})
    assert choose_draft_vocab(counts, 2) == [3, 7]  # ties by id
    assert choose_draft_vocab(counts, 3, always=[2]) == [2, 3, 7]  # special tokens always kept
    assert coverage([3, 7], [[3, 3, 9], [7]]) == 0.75
    with pytest.raises(ValueError):
        choose_draft_vocab(counts, 0)


def test_sampling_with_a_pruned_vocabulary_keeps_the_target_distribution():
    """The target puts real mass on tokens the drafter can never propose: they must still come out, at their exact
    rate (the residual max(p - q, 0) carries them). A sampler that only emits draftable tokens is rejected."""
    target = tiny_target(vocab_size=7, seed=4, skew=1.5)
    drafter = tiny_drafter("dfly", target, mask_token_id=6)
    drafter.set_draft_vocab([0, 1, 3, 4])  # 2, 5 and 6 are never drafted
    exact = marginal(exact_distribution(target, 3), 3)
    draws = 3000
    engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=128)
    ids = [engine.add_request([3, 5, 4], SamplingParams(max_new_tokens=3, do_sample=True, temperature=1.0, seed=i,
                                                        stop_token_ids=())) for i in range(draws)]
    outputs = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id].extend(event.token_ids)
    samples = [tuple(outputs[i]) for i in ids]
    assert 0 < engine.stats["accepted"] < engine.stats["verified"]
    assert any(t in (2, 5, 6) for s in samples for t in s[1:])  # undraftable tokens are emitted after drafts
    assert goodness_of_fit(samples, exact) > ALPHA
    # power: the same statistic rejects a sampler that never emits an undraftable token after the first
    allowed = {k: p for k, p in exact.items() if all(t in (0, 1, 3, 4) for t in k[1:])}
    keys = list(allowed)
    weights = torch.tensor([allowed[k] for k in keys])
    wrong = torch.multinomial(weights / weights.sum(), draws, replacement=True, generator=torch.Generator().manual_seed(1))
    assert goodness_of_fit([keys[i] for i in wrong], exact) < ALPHA


def test_the_budget_is_filled_from_prompt_tokens_after_response_tokens():
    from collections import Counter

    assert choose_draft_vocab(Counter({7: 3}), 3, always=[2], fill=Counter({9: 5, 7: 9, 4: 1})) == [2, 7, 9]


@pytest.mark.parametrize("pruned", [True, False])
def test_greedy_select_reads_the_draft_rows_and_picks_what_the_full_vocabulary_argmax_picks(pruned):
    """The hook's greedy `_select` without logits processors works on the pruned head's rows only: the same token
    (the first of tied maxima, as an argmax over the full vocabulary picks) and the same peak probability."""
    from transformers import GenerationConfig, LogitsProcessorList

    target = tiny_target()
    drafter = tiny_drafter("dfly", target)
    if pruned:
        drafter.set_draft_vocab(SUBSET)
    prompt = torch.tensor([[3, 4, 5, 6]])
    generator = drafter.get_candidate_generator(target, prompt, GenerationConfig(do_sample=False, max_length=16),
                                                LogitsProcessorList())
    head = generator.target_lm_head
    with torch.no_grad():
        rows = [head(row[None]) for row in torch.randn(5, 32)]
    tied = rows[0].clone()
    tied[0, SUBSET[7]] = tied[0, SUBSET[3]] = tied.max() + 1.0  # two maxima: the first (smaller id) is chosen
    for logits in [*rows, tied]:
        generator._prefix = prompt
        token, q, peak = generator._select(logits, 0)
        assert token.tolist() == logits.argmax(-1).tolist()
        torch.testing.assert_close(peak, torch.softmax(logits, -1).amax(-1))
        assert q is logits and generator._prefix[0, -1] == token[0]
    assert tied.argmax(-1).item() == SUBSET[3]


def test_sampled_select_on_the_draft_rows_gives_the_full_vocabularys_processed_distribution():
    """Sampling through a pruned head with temperature / top-k / top-p / min-p: `_select` processes only the draft
    vocabulary's rows, and returns exactly the q that processing the full-vocabulary logits gives; its draws follow
    q (zero outside it). A processor that reads token ids (repetition penalty) takes the full-vocabulary path."""
    from transformers import (GenerationConfig, LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    target = tiny_target()
    drafter = tiny_drafter("dfly", target)
    drafter.set_draft_vocab(SUBSET)
    prompt = torch.tensor([[3, 4, 5, 6]])
    head = drafter.draft_lm_head(target.get_output_embeddings())
    with torch.no_grad():
        logits = head(torch.randn(1, 32) * 4)
    chains = [[TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)],
              [TopKLogitsWarper(50)], [MinPLogitsWarper(0.1)], [RepetitionPenaltyLogitsProcessor(1.5)], []]
    for chain in chains:
        processors = LogitsProcessorList(chain)
        generator = drafter.get_candidate_generator(target, prompt, GenerationConfig(do_sample=True, max_length=16),
                                                    processors)
        assert (generator._draft_ids is not None) == all(not isinstance(p, RepetitionPenaltyLogitsProcessor)
                                                         for p in chain)
        expected = processors(prompt, logits.clone())
        counts = torch.zeros(logits.shape[-1])
        torch.manual_seed(0)
        for _ in range(400):
            generator._prefix, generator._round_probs = prompt, []
            token, q, peak = generator._select(logits, 0)
            torch.testing.assert_close(q, expected)
            p = torch.softmax(expected, -1)
            torch.testing.assert_close(peak, p.amax(-1))
            torch.testing.assert_close(torch.tensor(generator._round_probs[0]), p[0, token[0]])
            counts[token[0]] += 1
        assert (counts[p[0] == 0] == 0).all() and (counts > 0).sum() > 1
        assert abs(counts / 400 - p[0]).max() < 0.1


def test_engine_greedy_selection_on_the_draft_columns_equals_the_full_vocabulary_one():
    """The batched engine's all-greedy draft choice given a pruned head's ids reads only those columns: the same
    tokens (ties to the smaller id) and the same D-Cut confidences as over the whole vocabulary."""
    from angelspec_hf.policy import draft_confidence
    from angelspec_hf.tgi_patch.engine import verification
    from angelspec_hf.tgi_patch.engine.request import Request

    ids = torch.tensor(SUBSET)
    g = torch.Generator().manual_seed(0)
    logits = torch.full((12, 100), float("-inf"))
    logits[:, ids] = torch.randn(12, len(SUBSET), generator=g) * 3
    logits[0, [SUBSET[9], SUBSET[4]]] = logits[0].max() + 1.0  # a tie: the smaller id wins
    requests = [Request(i, [1, 2], SamplingParams(max_new_tokens=8), 1000 + i, frozenset()) for i in range(12)]
    full = verification.draft_selector(requests, logits.device, verification.process_requests, draft_confidence)
    rows = verification.draft_selector(requests, logits.device, verification.process_requests, draft_confidence, ids)
    token, q, confidence = rows(logits, 0)
    expected_token, expected_q, expected_confidence = full(logits, 0)
    assert token.tolist() == expected_token.tolist() == logits.argmax(-1).tolist() and token[0] == SUBSET[4]
    assert q is None and expected_q is None
    torch.testing.assert_close(confidence, expected_confidence)
