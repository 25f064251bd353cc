"""`benchmarks/policy_replay.py`: a recorded output replayed under whole blocks makes exactly the rounds the
`generate()` hook makes (every draft length, lookup and acceptance), so what the replay says of a policy is about that
policy's rounds; the cost-aware policy and the oracle account for every generated token."""

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import tiny_drafter

spec = importlib.util.spec_from_file_location("policy_replay",
                                              Path(__file__).parents[1] / "benchmarks/policy_replay.py")
policy_replay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(policy_replay)

COSTS = {"step": [0.040 + 0.001 * n for n in range(11)], "draft": [0.005 + 0.0013 * k for k in range(1, 8)]}


def _prompts(seed=11, count=4):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):  # prompts that repeat a motif, so lookups are on offer and some are accepted
        motif = torch.randint(3, 99, (1, int(torch.randint(2, 6, (1,), generator=gen))), generator=gen)
        yield motif.repeat(1, 4)


# the tiny random drafter's confidences are 0.01-0.02: these cut its blocks after one, two or three tokens by turns
@pytest.mark.parametrize("threshold", [0.0, 0.015, 0.0003])
def test_whole_blocks_replayed_make_the_hooks_rounds(target, threshold):
    drafter = tiny_drafter("dfly", target, draft_stop_threshold=threshold, lookup_tokens=6, lookup_max_ngram=2)
    target.generation_config.eos_token_id = None  # every output runs to its length, in both
    lookups, lengths = 0, set()
    for ids in _prompts():
        trace = policy_replay.record_prompt(target, drafter, ids, 24)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
        assert out.shape[1] - ids.shape[1] == trace["generated"] == 24
        stats = drafter.last_speculation_stats
        result = policy_replay.replay(trace, policy_replay.WholeBlocks(threshold, max_ngram=2), COSTS, max_ngram=2)
        verifying = [(k, accepted) for kind, k, accepted in result["rounds"] if kind != "plain"]
        assert verifying == list(zip(stats.proposed, stats.accepted))
        kinds = [kind for kind, *_ in result["rounds"]]
        assert kinds.count("lookup") == stats.lookup_rounds
        lookups += stats.lookup_rounds
        lengths |= {k for kind, k, _ in result["rounds"] if kind == "draft"}
    assert lookups and lengths  # both kinds of rounds were compared
    assert len(lengths) > 1 if threshold else lengths == {drafter.num_draft_tokens}  # the cut was exercised


def test_every_policy_accounts_for_every_token(target):
    from angelspec_hf.policy import CorpusIndex

    drafter = tiny_drafter("dfly", target, lookup_tokens=6, lookup_max_ngram=2)
    target.generation_config.eos_token_id = None
    prompts = list(_prompts(count=2))
    drafter.lookup_corpus = CorpusIndex([target.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()
                                         for ids in prompts])
    traces = [policy_replay.record_prompt(target, drafter, ids, 24) for ids in prompts]
    assert all(t["corpus"] for t in traces)
    seconds = {}
    for variant in policy_replay.VARIANTS:
        results = policy_replay.replay_all(traces, COSTS, variant, 0.0, 0.05, 0, drafter.num_draft_tokens)
        for trace, result in zip(traces, results):
            assert sum(1 + accepted for _, _, accepted in result["rounds"]) == trace["generated"] - 1
            assert all(accepted <= k for _, k, accepted in result["rounds"])
        seconds[variant] = sum(r["seconds"] for r in results)
        if variant == "oracle":  # it verifies only what the target accepts, and no round of it is slower than plain
            assert all(accepted == k for result in results for _, k, accepted in result["rounds"])
    assert "corpus" in policy_replay.summary(policy_replay.replay_all(traces, COSTS, "corpus", 0.0, 0.05, 0,
                                                                      drafter.num_draft_tokens))
    plain = sum(r["plain_seconds"] for r in results)
    assert seconds["oracle"] <= plain + 1e-9
    assert policy_replay.summary(results)["forwards"] == sum(len(r["rounds"]) for r in results)
