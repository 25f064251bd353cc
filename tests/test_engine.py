"""The batched engine (`angelspec_hf.generate_batch`, `SpeculativeEngine`): lossless for every drafter, batch mix,
arrival order and verification budget; exact sampling; D-Cut's selection, calibration and cost model; paged memory."""

import json
import random

import pytest
import torch
from test_sampling import PROMPT, VOCAB, exact_distribution, goodness_of_fit

from angelspec_hf.tgi_patch import reference
from angelspec_hf.tgi_patch.dcut import AcceptanceCalibrator, CostModel, load_or_profile
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine, generate_batch
from conftest import tiny_drafter, tiny_target

FIXED_COST = CostModel((1.0, 0.05, 0.02), (0.2, 0.01))  # tests that do not exercise profiling


def plain_greedy(reference_target, prompt, max_new_tokens, eos=2):
    out = reference_target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def targets():
    # the engine switches its target to ragged attention; the reference twin keeps eager attention
    return tiny_target(), tiny_target()


@pytest.mark.parametrize("family", ["mtp", "dflash", "dfly"])
def test_greedy_equals_plain_decoding_for_any_mix(targets, family):
    target, twin = targets
    drafter = tiny_drafter(family, target)
    rng = random.Random(family)
    accepted = 0
    for trial, verify in enumerate(["full", "depth:1", "depth:3", 0, 2, 7, "auto"]):
        prompts = [[rng.randrange(3, 99) for _ in range(rng.randrange(1, 24))] for _ in range(rng.randrange(1, 9))]
        lengths = [rng.randrange(1, 20) for _ in prompts]
        engine = SpeculativeEngine(target, drafter, verify=verify, max_batch_size=rng.choice([1, 3, 8]),
                                   cost_model=FIXED_COST)
        ids, outputs = [], {}
        for prompt, n in zip(prompts, lengths):  # requests arrive while others are running
            ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=n)))
            if rng.random() < 0.5:
                for event in engine.step():
                    outputs.setdefault(event.request_id, []).extend(event.token_ids)
        while engine.has_work():
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.token_ids)
        for rid, prompt, n in zip(ids, prompts, lengths):
            assert outputs[rid] == plain_greedy(twin, prompt, n), (verify, prompt)
        accepted += engine.stats["accepted"]
        assert engine.pool.tokens_allocated == 0  # every page given back
    assert accepted > 0  # drafts were really accepted along the way


def test_budget_zero_is_plain_decoding_and_budgets_are_respected(targets):
    target, _ = targets
    drafter = tiny_drafter("dfly", target)
    engine = SpeculativeEngine(target, drafter, verify=3, max_batch_size=8)
    for i in range(6):
        engine.add_request([5 + i, 7, 9], SamplingParams(max_new_tokens=12))
    while engine.has_work():
        engine.step()
        trace = engine.last_step
        assert trace.verified_tokens <= 3
        assert trace.verified_tokens + trace.pruned_tokens == trace.drafted_tokens
    out, engine0 = generate_batch(target, drafter, [[5, 7, 9]], max_new_tokens=8, verify=0, return_engine=True)
    assert engine0.stats["verified"] == 0 and engine0.stats["mean_accepted_length"] == 1.0


def test_dcut_selects_the_most_likely_prefixes():
    accept = torch.tensor([[0.9, 0.9, 0.9, 0.1], [0.5, 0.9, 0.9, 0.9], [0.95, 0.2, 0.9, 0.9]])
    drafted = torch.tensor([4, 4, 3])
    depth, survival, chosen = reference.dcut_select(accept, drafted, budget=5)
    torch.testing.assert_close(survival[0, :3], torch.tensor([0.9, 0.81, 0.729]))
    assert survival[2, 3] == 0  # beyond the drafted tokens
    # top-5 survivals: .95 (r2), .9 .81 .729 (r0), .5 (r1)
    assert depth.tolist() == [3, 1, 1] and int(chosen) == 5
    # with a cost per verified token, the best rate can be to verify nothing (plain decoding)
    expensive = 1.0 + 10.0 * torch.arange(12, dtype=torch.float32)
    depth, _, chosen = reference.dcut_select(accept, drafted, 11, expensive, base_gain=3.0)
    assert int(chosen) == 0 and depth.tolist() == [0, 0, 0]
    cheap = 1.0 + 0.0001 * torch.arange(12, dtype=torch.float32)
    depth, _, chosen = reference.dcut_select(accept, drafted, 11, cheap, base_gain=3.0)
    assert int(chosen) == 11 and depth.tolist() == [4, 4, 3]


def test_calibrator_learns_acceptance_and_reports_reliability():
    cal = AcceptanceCalibrator(num_bins=4, prior_weight=1.0)
    conf = torch.full((200, 2), 0.9)  # the drafter is over-confident: only 30% of first tokens are accepted
    accepted = (torch.arange(200) % 10 < 3).long()
    cal.update(conf, torch.full((200,), 1), accepted)  # one token verified per request: 200 observations
    assert abs(float(cal(torch.tensor([0.9]))) - 0.3) < 0.02
    curve = cal.reliability()
    assert len(curve) == 1 and curve[0]["count"] == 200 and abs(curve[0]["acceptance"] - 0.3) < 1e-9
    error = cal.calibration_error()
    assert abs(error["raw"] - 0.6) < 1e-6 and error["calibrated"] < 0.02


def test_cost_model_is_profiled_once_and_cached(targets, tmp_path):
    target, _ = targets
    drafter = tiny_drafter("dflash", target)
    engine = SpeculativeEngine(target, drafter, verify=0, max_batch_size=4)
    model = load_or_profile(engine, tmp_path, time_limit=5.0)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == model.key
    assert {s["rows"] for s in model.samples} == {1, 2, 4} and model.verify(4, 8) > 0 and model.draft(4) > 0
    assert load_or_profile(engine, tmp_path).to_dict() == model.to_dict()  # second call reads the file
    auto = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model_cache=tmp_path)
    assert auto.cost_model.to_dict() == model.to_dict()


def test_memory_follows_tokens_held(targets):
    target, _ = targets
    engine = SpeculativeEngine(target, None, verify=0, max_batch_size=8)
    engine.add_request(list(range(3, 40)), SamplingParams(max_new_tokens=4))
    for _ in range(7):
        engine.add_request([4, 5], SamplingParams(max_new_tokens=4))
    engine.step()
    pages = engine.pool.page_size
    assert engine.pool.tokens_allocated == pages * ((37 + pages - 1) // pages + 7)  # not 8 × the longest


def test_cancel_frees_the_slot_and_bad_input_is_refused(targets):
    target, _ = targets
    engine = SpeculativeEngine(target, tiny_drafter("mtp", target), verify="full", max_batch_size=2)
    a = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=50))
    engine.step()
    engine.cancel(a)
    events = engine.step()
    assert any(e.request_id == a and e.finished and e.finish_reason == "cancelled" for e in events)
    assert engine.num_running == 0 and engine.pool.tokens_allocated == 0
    for bad in [SamplingParams(max_new_tokens=0), SamplingParams(do_sample=True, temperature=0.0),
                SamplingParams(top_p=1.5), SamplingParams(top_k=-1)]:
        with pytest.raises(ValueError):
            engine.add_request([5], bad)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 1000], SamplingParams())
    with pytest.raises(ValueError, match="maximum length"):
        engine.add_request([5], SamplingParams(max_new_tokens=10_000))
    with pytest.raises(ValueError, match="verify"):
        SpeculativeEngine(target, None, verify="sometimes")
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeEngine(target, tiny_drafter("dfly", tiny_target(vocab_size=50)))


def test_eos_and_events(targets):
    target, twin = targets
    drafter = tiny_drafter("dfly", target)
    prompt = [3, 4, 5, 6]
    expected = plain_greedy(twin, prompt, 30, eos=None)
    stop = expected[5]
    engine = SpeculativeEngine(target, drafter, verify="full")
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)))
    events = []
    while engine.has_work():
        events += engine.step()
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == expected[: expected.index(stop) + 1]
    assert events[-1].finished and events[-1].finish_reason == "eos_token" and events[-1].request_id == rid
    assert all(len(e.token_ids) == len(e.logprobs) == len(e.from_draft) for e in events)
    assert all(lp <= 0 for e in events for lp in e.logprobs)
    assert not events[0].from_draft[0]  # the first token comes from the prefill


@pytest.mark.parametrize("family", ["mtp", "dfly"])
def test_sampling_keeps_the_target_distribution(family):
    target = tiny_target(vocab_size=VOCAB, seed=4, skew=1.5)
    exact = exact_distribution(target, 3)
    extra = {} if family == "mtp" else {"mask_token_id": 6}
    drafter = tiny_drafter(family, target, **extra)
    engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=32)
    prompt = PROMPT[0].tolist()
    ids = []
    for i in range(2400):
        params = SamplingParams(max_new_tokens=3, do_sample=True, seed=10_000 + i, stop_token_ids=())
        ids.append(engine.add_request(prompt, params))
        if i % 3 == 0:  # greedy neighbours in the same batch
            engine.add_request([3, 3], SamplingParams(max_new_tokens=2, stop_token_ids=()))
    outputs = {}
    while engine.has_work():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    samples = [tuple(outputs[i]) for i in ids]
    assert 0 < engine.stats["accepted"] < engine.stats["verified"]
    assert goodness_of_fit(samples, exact) > 1e-3


def test_seeded_sampling_does_not_depend_on_the_batch(targets):
    target, _ = targets
    drafter = tiny_drafter("dflash", target)
    params = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    alone = generate_batch(target, drafter, [[5, 6, 7]], seed=7, verify="full", **params)[0]
    crowd = generate_batch(target, drafter, [[5, 6, 7], [8, 9], [10] * 9], seed=7, verify=2, **params)[0]
    assert alone == crowd
