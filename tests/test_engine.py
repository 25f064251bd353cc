"""The batched engine (`angelspec_hf.generate_batch`, `SpeculativeEngine`): lossless for every drafter, batch mix,
arrival order and verification budget; exact sampling; D-Cut's selection, calibration and cost model; paged memory."""

import dataclasses
import inspect
import json
import random

import pytest
import torch

from angelspec_hf.tgi_patch.engine.kernels import reference
from angelspec_hf.policy import AcceptanceCalibrator, CostModel, StepKind, load_or_profile
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine, StepTrace, generate_batch
from helpers import tiny_drafter, tiny_target
from stats import (PROMPT, VOCAB, ImpossibleSample, assert_power, correction_from_p, exact_distribution, peaked_drafter,
                   processed_logprobs, report, sequence_fit, single_thread, spread_target)

FIXED_COST = CostModel((1.0, 0.05, 0.02), (0.2, 0.01))  # tests that do not exercise profiling



def _drafts(policy, n_dec: int, width: int = 4) -> bool:
    """Does the policy run the drafter at a step of `n_dec` decoding rows (a cost model under which drafting pays)?"""
    return policy.step_kind(n_dec, width).drafts


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


@pytest.mark.parametrize("family", ["mtp", "dfly"])
def test_auto_mode_stops_drafting_where_no_position_could_be_verified(targets, family):
    """An extra verified token costing 45% of a step: with acceptance 0.5 per position, positions past the second
    cannot pay (survival 0.25 < 0.45 / 1.5), so they are not drafted (DFly's AR head / MTP's chain stop there), and
    the output stays plain greedy."""
    target, twin = targets
    drafter = tiny_drafter(family, target)
    costly = CostModel((1.0, 0.05, 0.45), (0.01, 0.0))
    engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=2, cost_model=costly,
                               calibrator=AcceptanceCalibrator(prior=0.5, prior_weight=1e6))
    prompt = [5, 7, 9, 11]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=30))
    tokens, drafted = [], []
    while engine.has_work():
        for event in engine.step():
            tokens += event.token_ids
        if engine.last_step is not None and engine.last_step.choice == "speculative":
            drafted.append(len(engine.last_step.draft_tokens[0]))
    assert tokens == plain_greedy(twin, prompt, 30)
    assert rid == 0 and drafted and max(drafted) == 2 < drafter.num_draft_tokens


def test_measured_rates_back_off_when_speculation_delivers_less_than_plain():
    """The cost model may promise more than a machine delivers: speculative steps measured slower than plain ones at a
    batch size start a back-off (doubling while they keep losing), other batch sizes are judged on their own, and a
    batch size without a plain measurement takes one plain step in `probe_every` to get one."""
    from angelspec_hf.tgi_patch.engine.dcut import DCutPolicy

    policy = DCutPolicy("auto", None, cost_model=FIXED_COST, probe_every=4)
    assert all(_drafts(policy, 16) for _ in range(10))  # nothing measured yet: the plan decides
    policy.observe_step(StepKind.DRAFT, 0, 16, decode_tokens=20, seconds=1.0)
    assert [_drafts(policy, 16) for _ in range(8)] == [True, True, True, False] * 2  # plain measured 1 in 4
    policy.observe_step(StepKind.DRAFT, 2, 16, decode_tokens=1, seconds=1.0)  # a step that also prefilled: not comparable
    policy.observe_step(StepKind.PLAIN, 0, 16, decode_tokens=16, seconds=0.5)  # plain: 32 tok/s > speculative 20
    assert all(_drafts(policy, 16) for _ in range(10))  # one speculative step is not yet evidence
    for _ in range(policy.measured.min_steps - 1):
        policy.observe_step(StepKind.DRAFT, 0, 16, decode_tokens=20, seconds=1.0)  # every one 20 tok/s: no spread
    assert [_drafts(policy, 16) for _ in range(5)] == [False] * 4 + [True]  # backed off for probe_every steps
    assert [_drafts(policy, 16) for _ in range(9)] == [False] * 8 + [True]  # still losing: twice as long
    assert _drafts(policy, 1)  # another batch size is measured apart
    for _ in range(20):  # speculation now delivers more (a better drafter, a quieter machine)
        policy.observe_step(StepKind.DRAFT, 0, 16, decode_tokens=60, seconds=1.0)
    assert all(_drafts(policy, 16) for _ in range(10))
    off = DCutPolicy("auto", None, cost_model=FIXED_COST, measure=False)
    off.observe_step(StepKind.DRAFT, 0, 16, decode_tokens=1, seconds=1.0)
    off.observe_step(StepKind.PLAIN, 0, 16, decode_tokens=16, seconds=0.5)
    assert all(_drafts(off, 16) for _ in range(10))


def test_with_lookups_the_drafter_is_measured_against_what_steps_without_it_deliver():
    """With n-gram lookups on, a step without the drafter is a lookup step (some row has a lookup) or a plain one:
    drafted steps that beat plain ones but lose to those steps taken together start a back-off; without lookups the
    same drafted steps keep drafting. The two kinds are pooled as they came, so a lookup step's luck (it is taken
    only where a lookup exists) does not count alone."""
    from angelspec_hf.tgi_patch.engine.dcut import DCutPolicy

    def measured(lookup_tokens):
        policy = DCutPolicy("auto", None, cost_model=FIXED_COST, lookup_tokens=lookup_tokens, probe_every=4)
        for i in range(6):
            policy.observe_step(StepKind.DRAFT, 0, 32, decode_tokens=40 + i % 2, seconds=0.3)  # ~135 tok/s
            policy.observe_step(StepKind.PLAIN, 0, 32, decode_tokens=32, seconds=0.25)  # 128 tok/s
            policy.observe_step(StepKind.LOOKUP, 0, 32, decode_tokens=45 + i % 2, seconds=0.2)  # ~230 tok/s
        return policy

    assert measured(4)._drafter_loses(32) and not measured(0)._drafter_loses(32)
    backing_off = measured(4)
    assert [_drafts(backing_off, 32) for _ in range(5)] == [False] * 4 + [True]  # a pause, then a probe
    lucky = measured(4)  # lookup steps alone would win, but lately they are rare next to plain ones
    for _ in range(30):
        lucky.observe_step(StepKind.PLAIN, 0, 32, decode_tokens=32, seconds=0.25)
    assert lucky.measured.loses(32, StepKind.DRAFT, StepKind.LOOKUP) and not lucky._drafter_loses(32)


def test_slow_drafting_is_measured_and_mostly_skipped(targets):
    """End to end: with drafting made 30 ms slower than this machine's tiny-model steps, the cost model (which knows
    nothing of it) keeps planning speculation, the measured rates turn most steps plain, and output stays exact."""
    import time

    target, twin = targets
    drafter = tiny_drafter("dfly", target)
    engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model=FIXED_COST)
    draft = engine.runner.draft

    def slow_draft(*args, **kwargs):
        time.sleep(0.03)
        return draft(*args, **kwargs)

    engine.runner.draft = slow_draft
    prompts = [[5, 17, 33, 8], [9, 9, 4], [40, 41, 42, 43, 44], [7]]
    outputs = generate_batch_with(engine, prompts, 40)
    assert outputs == [plain_greedy(twin, p, 40) for p in prompts]
    assert engine.stats["speculative_steps"] / engine.stats["steps"] < 0.5, engine.stats


def _run_to_end(engine) -> dict[int, list[int]]:
    """Step `engine` until it has no work: every request's generated tokens by request id."""
    outputs = {}
    while engine.has_work():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    return outputs


def generate_batch_with(engine, prompts, max_new_tokens):
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    outputs = _run_to_end(engine)
    return [outputs.get(i, []) for i in ids]


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


def test_calibrator_learns_each_draft_position_separately():
    cal = AcceptanceCalibrator(num_bins=4, prior_weight=1.0, num_positions=2)
    conf = torch.full((400, 3), 0.9)
    accepted = torch.where(torch.arange(400) % 2 == 0, 3, 1)  # position 0 always accepted, later ones half the time
    cal.update(conf, torch.full((400,), 3), accepted)
    rates = cal(torch.full((1, 3), 0.9))[0].tolist()
    # position 0: 400 of 400 accepted; positions 1 and 2 share the last curve: 200 of 400 and 200 of 200 (position 2
    # is observed only after an accepted position 1)
    assert abs(rates[0] - 1.0) < 0.01 and abs(rates[1] - 400 / 600) < 0.01 and rates[2] == rates[1]
    assert sum(row["count"] for row in cal.reliability()) == 400 + 400 + 200


def test_a_refined_cost_model_never_prices_a_verified_token_below_half_its_profile():
    """At one batch size a slow step with few tokens (the first decode step after a burst's prefill) tilts the fitted
    token slope below zero, and "auto" then verified almost everything drafted; the slope is floored at half the
    profile's."""
    samples = [{"rows": r, "tokens_per_row": t, "verify": 0.05 + 0.002 * r + 0.001 * r * t}
               for r in (1, 8, 32) for t in (1, 8)]

    def refined(floor):
        model = CostModel((0.05, 0.002, 0.001), (0.0, 0.0), samples)
        model.TOKEN_FLOOR = floor
        model.refine()
        for _ in range(40):  # 32 rows: slow with few tokens, fast with many (a slope the fit must not follow)
            model.observe_verify(32, 40, 0.6)
            model.observe_verify(32, 240, 0.15)
        return model.verify_coef[2]

    assert refined(CostModel.TOKEN_FLOOR) == pytest.approx(0.0005)
    assert refined(-1e9) < 0  # the data alone would say so


def test_cost_model_is_profiled_once_and_cached(targets, tmp_path):
    target, _ = targets
    drafter = tiny_drafter("dflash", target)
    engine = SpeculativeEngine(target, drafter, verify=0, max_batch_size=4)
    model = load_or_profile(engine.runner, tmp_path, time_limit=5.0)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == model.key
    assert {s["rows"] for s in model.samples} == {1, 2, 4} and model.verify(4, 8) > 0 and model.draft(4) > 0
    assert load_or_profile(engine.runner, tmp_path).to_dict() == model.to_dict()  # second call reads the file
    auto = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model_cache=tmp_path)
    assert auto.cost_model.to_dict() == model.to_dict()


def test_a_profiled_cost_model_is_refined_from_the_steps_timed(targets, tmp_path):
    """A stale profile (every step priced at 10 s, a drafting call at 5 s: what a profile taken on a busy machine
    looks like, magnified) heals from the engine's own timed steps and is written back to its cache file; a cost model
    passed in is used as it is (tests and benchmarks that fix the costs keep them)."""
    target, twin = targets
    drafter = tiny_drafter("dflash", target)
    model = load_or_profile(SpeculativeEngine(target, drafter, verify=0, max_batch_size=4).runner, tmp_path,
                            time_limit=5.0)
    stale = dataclasses.replace(model, verify_coef=(10.0, 0.0, 0.0), draft_coef=(5.0, 0.0), path=None)
    model.path.write_text(json.dumps(stale.to_dict()))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    fixed = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model=stale)
    generate_batch(target, drafter, prompts, max_new_tokens=48, engine=fixed)
    assert not fixed.cost_model.refining and fixed.cost_model.verify_coef == (10.0, 0.0, 0.0)
    auto = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model_cache=tmp_path)
    assert auto.cost_model.refining and auto.cost_model.verify(3, 3) > 9.9
    auto.cost_model.SAVE_EVERY = 16
    out = generate_batch(target, drafter, prompts, max_new_tokens=48, engine=auto)
    assert out == [plain_greedy(twin, p, 48) for p in prompts]
    assert auto.cost_model.verify(3, 3) < 0.5  # a tiny model's step takes milliseconds
    assert auto.stats["speculative_steps"] > 0 and auto.cost_model.draft(3) < 5.0
    saved = CostModel.from_dict(json.loads(model.path.read_text()))
    assert saved.verify(3, 3) < 1.0 and saved.samples == model.samples


def test_the_engine_reads_its_timers_after_the_device_has_worked(targets, tmp_path, monkeypatch):
    """Every timed region (a profiled forward or drafting call, a step, a step's drafting call) starts and ends with
    `clock` on the engine's device, which waits for queued kernels on an accelerator (a no-op on this CPU)."""
    from angelspec_hf.tgi_patch.engine import core, model_runner

    target, _ = targets
    drafter = tiny_drafter("dfly", target)
    engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=2, cost_model=FIXED_COST)
    seen = []

    def clock(device=None):
        seen.append(device)
        return len(seen) * 1e-3

    monkeypatch.setattr(model_runner, "clock", clock)
    monkeypatch.setattr(core, "clock", clock)
    profile = load_or_profile(engine.runner, tmp_path, rows=(1, 2), time_limit=5.0)
    timed = sum(1 + ("draft" in sample) for sample in profile.samples)
    assert len(seen) >= 2 * timed and all(d == engine.device for d in seen)
    seen.clear()
    generate_batch(target, drafter, [[5, 6, 7], [8, 9]], max_new_tokens=6, engine=engine)
    drafted = engine.stats["speculative_steps"]
    assert drafted > 0 and len(seen) == 2 * engine.stats["steps"] + 2 * drafted
    assert all(d == engine.device for d in seen)


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


# ---- exact sampling in every verify mode, with power --------------------------------------------------------------
# The target's p is spread and the drafter's q sharply peaked elsewhere (total variation ~0.5, asserted through the
# acceptance rate), so verification really decides what is emitted. Each case runs the engine, then the same requests
# (same random streams) through engines with a known-wrong rule, and checks the same statistic on the same number of
# draws: the right engine passes, every wrong one is rejected. These requests have no seed, so they are
# rejection-sampled (the engine's seeds for them come from `random`, seeded by `run_sampled`); seeded requests, whose
# tokens are Gumbel-max draws, have their own cases further down. (Planning "auto" from the real later keys is not among them: with
# the linear CostModel the best budget never looks past a position, so that rule is lossless there; it is caught by
# test_auto_selection_of_a_sampled_position_ignores_its_later_positions under GPU-like tiled costs.)
class OldConfidenceEngine(SpeculativeEngine):
    """The rule: D-Cut ranks a sampled position by q of the token actually drafted there."""

    def draft_confidence(self, probs, token):
        return probs.gather(1, token[:, None]).squeeze(1)


class PlanFromRealKeysEngine(SpeculativeEngine):
    """"auto" plans the step with the sampled rows' real later acceptance probabilities (they depend on the tokens
    drafted before them)."""

    def plan_acceptance(self, accept, sampled):
        return accept


class WidthFromRealKeysEngine(SpeculativeEngine):
    """"auto" drafts as wide as the sampled rows' real later acceptance says (it depends on the drawn tokens), while
    planning the verification right: an earlier engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy.width_plan = lambda accept, sampled: accept


class IgnoresTemperatureEngine(SpeculativeEngine):
    """Processes target and drafter logits as if every request asked for temperature 1."""

    def _process(self, logits, requests, span):
        at_one = [dataclasses.replace(r, params=dataclasses.replace(r.params, temperature=1.0)) for r in requests]
        return super()._process(logits, at_one, span)


class RawDraftQEngine(SpeculativeEngine):
    """Draws each draft token from the processed drafter distribution (temperature, top-k, top-p) but hands
    verification the unprocessed softmax as q."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        draft = self.batch_drafter.draft
        signature = inspect.signature(draft)

        def raw_draft(*a, **kw):
            bound = signature.bind(*a, **kw)
            select = bound.arguments["select"]

            def raw_select(logits, j):
                token, probs, conf = select(logits, j)
                return token, None if probs is None else torch.softmax(logits.float(), -1), conf

            bound.arguments["select"] = raw_select
            return draft(*bound.args, **bound.kwargs)

        self.batch_drafter.draft = raw_draft


WRONG_ENGINES = {"old D-Cut confidence q(drafted)": OldConfidenceEngine, "plan from real keys": PlanFromRealKeysEngine,
                 "temperature ignored": IgnoresTemperatureEngine, "draft q unprocessed": RawDraftQEngine,
                 "correction from p": SpeculativeEngine}  # the last with reference.verify patched
# verification is marginal under this cost: D-Cut verifies some drafted positions and prunes others
MARGINAL_COST = CostModel((1.0, 0.05, 0.08), (0.0, 0.0))
GREEDY_PROMPT = [6, 6, 2]

SAMPLING_CASES = {
    # id: (family, verify, engine options, sampling params, max_new_tokens, draws, wrong rules to reject)
    "full-T1": ("mtp", "full", {}, dict(temperature=1.0), 4, 4000, ["correction from p"]),
    "full-T0.7-topk-topp": ("dfly", "full", {}, dict(temperature=0.7, top_k=5, top_p=0.9), 3, 4000,
                            ["correction from p", "temperature ignored", "draft q unprocessed"]),
    "auto-T1": ("mtp", "auto", {"cost_model": MARGINAL_COST}, dict(temperature=1.0), 3, 6000,
                ["old D-Cut confidence q(drafted)", "correction from p"]),
    "auto-T0.7-topk": ("mtp", "auto", {"cost_model": MARGINAL_COST}, dict(temperature=0.7, top_k=5), 3, 6000,
                       ["old D-Cut confidence q(drafted)", "temperature ignored"]),
    "budget16-T0.7": ("mtp", 16, {}, dict(temperature=0.7), 3, 5000,
                      ["old D-Cut confidence q(drafted)", "temperature ignored"]),
    "budget24-T1-topp": ("mtp", 24, {}, dict(temperature=1.0, top_p=0.9), 4, 6000,
                         ["old D-Cut confidence q(drafted)", "correction from p"]),
    "depth:1-T0.7-topp": ("mtp", "depth:1", {}, dict(temperature=0.7, top_p=0.9), 3, 4000,
                          ["correction from p", "temperature ignored"]),
    "depth:2-T0.7": ("dfly", "depth:2", {}, dict(temperature=0.7), 4, 4000,
                     ["correction from p", "draft q unprocessed"]),
}


@pytest.fixture(scope="module")
def spread():
    return spread_target()


def run_sampled(target, drafter, draws, params, max_new_tokens, *, verify, engine_cls=SpeculativeEngine,
                max_batch_size=64, seeded=False, prompt=PROMPT, **engine_kwargs):
    """`draws` sampled requests of `prompt`, a greedy neighbour after every 4th; returns the sampled outputs, the
    greedy neighbours' outputs and the engine. `seeded`: False, no seed (rejection sampling; `random` is seeded first,
    so every run draws the same streams); True, request i has seed i (Gumbel-max draws); "mixed": seed i for even i,
    none for odd i."""
    engine_kwargs.setdefault("cost_model", FIXED_COST)
    engine = engine_cls(target, drafter, verify=verify, max_batch_size=max_batch_size, **engine_kwargs)
    prompt = prompt[0].tolist() if torch.is_tensor(prompt) else list(prompt)
    random.seed(draws)
    ids, greedy = [], []
    for i in range(draws):
        seed = i if seeded is True or seeded == "mixed" and i % 2 == 0 else None
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, do_sample=True, seed=seed,
                                                             stop_token_ids=(), **params)))
        if i % 4 == 0:
            greedy.append(engine.add_request(GREEDY_PROMPT, SamplingParams(max_new_tokens=3, stop_token_ids=())))
    outputs = _run_to_end(engine)
    return [tuple(outputs[i]) for i in ids], [outputs[i] for i in greedy], engine


def _fit(samples, exact):
    try:
        return sequence_fit(samples, exact)
    except ImpossibleSample:
        return 0.0


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_is_exact_in_every_verify_mode_with_power(spread, case, monkeypatch):
    family, verify, options, params, new_tokens, draws, wrong_rules = SAMPLING_CASES[case]
    target = spread
    drafter = peaked_drafter(family, target)
    exact = exact_distribution(target, new_tokens, temperature=params.get("temperature", 1.0),
                               top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0))
    with single_thread():
        samples, greedy, engine = run_sampled(target, drafter, draws, params, new_tokens, verify=verify, **options)
        stats = engine.stats
        # drafts were verified, some accepted and many rejected: p and q are far apart (acceptance = 1 - TV)
        assert 0 < stats["accepted"] < 0.75 * stats["verified"]
        if verify == "auto" or isinstance(verify, int):  # D-Cut really chose: it verified some, not all
            assert 0 < stats["verified"] < stats["drafted"]
        assert all(g == greedy[0] for g in greedy)  # greedy neighbours are deterministic whatever the batch
        right = _fit(samples, exact)
        wrong = {}
        for name in wrong_rules:
            with monkeypatch.context() as patch:
                if name == "correction from p":
                    patch.setattr(reference, "verify", correction_from_p(reference.verify))
                bad, _, _ = run_sampled(target, drafter, draws, params, new_tokens, verify=verify,
                                        engine_cls=WRONG_ENGINES[name], **options)
            wrong[name] = _fit(bad, exact)
    report(f"engine {case}: {draws} draws, verified {stats['verified']}/{stats['drafted']} drafted, accepted "
           f"{stats['accepted']}", right, **wrong)
    assert_power(right, wrong)


def test_verification_sees_the_processed_drafter_distribution(spread, monkeypatch):
    """The q handed to verification is the drafter's distribution after the request's temperature, top-k and top-p
    (drafting from, and reporting, the raw softmax is lossless but not what was asked for; reporting one and drawing
    from the other is caught by the distribution tests)."""
    drafter = peaked_drafter("mtp", spread)
    seen = []
    verify = reference.verify

    def spy(scores, draft, draft_probs, depth, greedy, u_accept, u_sample):
        if draft_probs is not None and draft_probs.shape[1]:
            rows = ~greedy & (depth > 0)
            seen.append(draft_probs[rows, 0].clone())
        return verify(scores, draft, draft_probs, depth, greedy, u_accept, u_sample)

    monkeypatch.setattr(reference, "verify", spy)

    def q_rows(**params):
        seen.clear()
        run_sampled(spread, drafter, 48, params, 3, verify="full")
        return torch.cat(seen)

    raw = q_rows()
    assert bool(((raw > 0).sum(-1) == raw.shape[-1]).all()) and float(raw.max(-1).values.min()) < 0.9
    assert bool(((q_rows(top_k=2) > 0).sum(-1) <= 2).all())
    assert float(q_rows(temperature=0.05).max(-1).values.min()) > 0.99
    assert bool(((q_rows(top_p=0.6) > 0).sum(-1) < raw.shape[-1]).all())


def test_draft_confidence_does_not_look_at_the_drafted_token():
    """D-Cut's confidence in a sampled position is known before its token is drawn."""
    engine = SpeculativeEngine.__new__(SpeculativeEngine)  # the rule needs no model
    probs = torch.softmax(torch.randn(64, 7, generator=torch.Generator().manual_seed(0)) * 2, -1)
    confidences = {tuple(engine.draft_confidence(probs, torch.full((64,), t)).tolist()) for t in range(7)}
    assert len(confidences) == 1
    wrong = OldConfidenceEngine.__new__(OldConfidenceEngine)
    assert len({tuple(wrong.draft_confidence(probs, torch.full((64,), t)).tolist()) for t in range(7)}) == 7


class TiledCost(CostModel):
    """Verification priced in tiles of `tile` tokens, as on a GPU: a step verifying 1..tile draft tokens costs the
    same. Gains are not concave in the budget any more, so a plan may look ahead along a row."""

    def __init__(self, tile, per_tile):
        super().__init__((1.0, 0.0, 0.0), (0.0, 0.0))
        self.tile, self.per_tile = tile, per_tile

    def step_costs(self, rows, base_tokens, max_extra, drafted, device=None):
        extra = torch.arange(max_extra + 1, dtype=torch.float32, device=device)
        return self.verify(rows, base_tokens) + self.per_tile * torch.ceil(extra / self.tile)


def _drafted(engine, conf, limit, sampled):
    """How many positions each row carries `[B]` when the drafter stops where "auto" stops it (`drafting_bound`,
    asked after each position as drafting asks it) and each row at its own `limit` (its request's end)."""
    keep_going = engine.policy.drafting_bound(limit + 1, len(limit), sampled)
    width = conf.shape[1]
    if keep_going is not None:
        width = next((j + 1 for j in range(width) if not keep_going(conf[:, j], j)), width)
    return limit.clamp(max=width)


def _selection_looks_ahead(target, engine_cls, cost, verify="auto", trials=300):
    """How often, over random batches, changing only the confidences of a sampled row's positions after k (they
    depend on the token drafted at k) changed whether that row verifies k, or changed what another sampled row
    verifies (requests with one seed share random streams, so their draws are alike). The drafting width is
    recomputed from the changed confidences, as the engine would have drafted. Exactness needs 0."""
    engine = engine_cls(target, None, verify=verify, cost_model=cost)
    g = torch.Generator().manual_seed(1)
    changed = 0
    for _ in range(trials):
        rows, k = int(torch.randint(1, 6, (1,), generator=g)), 5
        conf = torch.rand(rows, k, generator=g)
        limit = torch.randint(1, k + 1, (rows,), generator=g)
        sampled = torch.rand(rows, generator=g) < 0.7

        def depth(c):
            return engine._select(engine._acceptance(c, None), _drafted(engine, c, limit, sampled), rows,
                                  StepTrace(), sampled)

        before = depth(conf)
        i, j = int(torch.randint(0, rows, (1,), generator=g)), int(torch.randint(0, k - 1, (1,), generator=g))
        if not bool(sampled[i]):
            continue
        other = conf.clone()
        other[i, j + 1 :] = torch.rand(k - j - 1, generator=g)
        after = depth(other)
        others = sampled.clone()
        others[i] = False
        changed += int((before[i] > j) != (after[i] > j) or bool((before != after)[others].any()))
    return changed


@pytest.mark.parametrize("cost", ["linear", "tiled"])
def test_auto_selection_of_a_sampled_position_ignores_its_later_positions(targets, cost):
    """Whether D-Cut verifies a sampled row's position k may not depend on the confidences of its positions after k,
    nor may what other sampled rows verify. Planning with the real later keys (`PlanFromRealKeysEngine`) is caught
    under a fixed budget with either cost (the ranking shares the budget between rows, which lets requests with one
    seed steer each other), and in "auto" with tiled, GPU-like costs (with a linear cost the best budget
    cannot look ahead along a row). The drafting width's part: `test_auto_drafts_a_sampled_row_as_wide_as_its_plan`."""
    model = MARGINAL_COST if cost == "linear" else TiledCost(tile=4, per_tile=0.6)
    target = targets[0]
    assert _selection_looks_ahead(target, SpeculativeEngine, model) == 0
    assert _selection_looks_ahead(target, SpeculativeEngine, model, verify=3) == 0
    assert _selection_looks_ahead(target, PlanFromRealKeysEngine, model, verify=3) > 0  # the check has power
    if cost == "tiled":
        assert _selection_looks_ahead(target, PlanFromRealKeysEngine, model) > 0


def test_auto_drafts_a_sampled_row_as_wide_as_its_plan(targets):
    """How wide "auto" drafts may not follow a sampled row's confidences after its first position: the width sets
    the budget and with it which of the row's positions are verified (found in review). One sampled row
    with confidences 0.75, 0.45, x, ...: drafted by its real confidences the block stops after 3 positions when x is
    low and runs on when x is high, and its position 1 (survival 0.34) is verified only in the second case, i.e.
    depending on the token drawn at position 1, which x follows. Planned from its first position, the width and the
    verification of position 1 are the same for every x."""
    conf_after = (0.02, 0.3, 0.6, 0.95)

    def verifies_position_1(engine_cls, x):
        engine = engine_cls(targets[0], None, verify="auto", cost_model=MARGINAL_COST)
        conf = torch.tensor([[0.75, 0.45, x, 0.95, 0.95, 0.95, 0.95]])
        limit, sampled = torch.tensor([7]), torch.tensor([True])
        drafted = _drafted(engine, conf, limit, sampled)
        depth = engine._select(engine._acceptance(conf, None), drafted, 1, StepTrace(), sampled)
        return int(drafted[0]), bool(depth[0] > 1)

    right = {verifies_position_1(SpeculativeEngine, x) for x in conf_after}
    wrong = {verifies_position_1(WidthFromRealKeysEngine, x) for x in conf_after}
    assert len(right) == 1, right
    assert len({verified for _, verified in wrong}) == 2, wrong  # the check has power


# ---- a seeded request reproduces: its tokens are its own Gumbel-max draws (sampling.py) ----------------------------
# A seeded sampled request's token at position t is argmax(log p_t + G_t) with noise keyed by (seed, t, token): plain
# sampling's token with that seed, whatever the drafter proposed, which positions D-Cut verified, which lookups were
# taken and who else is in the batch. Checked token for token against plain sampling written the plain way, for
# every verify mode, lookups on and off; its law is checked further down.
SEEDED = {  # the seeded requests that must reproduce, by name: prompt, sampling parameters
    "T0.8-topk-topp": ([5, 7, 9, 11, 5, 7, 9], dict(temperature=0.8, top_k=20, top_p=0.95)),
    "T1": ([40, 41, 42, 40, 41], dict(temperature=1.0)),
    "penalised": ([20, 21, 22, 20, 21], dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4,
                                              presence_penalty=0.2)),
}
SEEDS = (0, 7, 2**40 + 3)
SEEDED_TOKENS = 14


def seeded_params(seed, **params):
    return SamplingParams(max_new_tokens=SEEDED_TOKENS, do_sample=True, seed=seed, stop_token_ids=(), **params)


@torch.no_grad()
def plain_gumbel_max(model, prompt, seed, n, temperature=1.0, top_k=0, top_p=1.0, **penalties):
    """Plain sampling with a seed, written the plain way: a full forward per token, the distribution processed in
    float64 (`penalised_reference`, then `stats.processed_logprobs`), the token `argmax(log p + G)` with the noise of
    (seed, position)."""
    from angelspec_hf.tgi_patch.engine.sampling import gumbel
    from test_penalties import penalised_reference

    generated = []
    for t in range(n):
        logits = model(torch.tensor([prompt + generated])).logits[0, -1]
        x = penalised_reference(logits, prompt, generated, **penalties)
        logp = processed_logprobs(x[None], temperature, top_k, top_p)[0]
        noise = gumbel(torch.tensor(seed), torch.tensor(t), logp.shape[-1]).double()
        generated.append(int((logp + noise).argmax()))
    return generated


@pytest.fixture(scope="module")
def seeded_reference(targets):
    """Every (name, seed) of SEEDED: its plain sampling tokens (on the eager twin)."""
    return {(name, seed): plain_gumbel_max(targets[1], prompt, seed, SEEDED_TOKENS, **params)
            for name, (prompt, params) in SEEDED.items() for seed in SEEDS}


def neighbours(rng, count=14):
    """`count` requests of every other kind: greedy, greedy penalised with top tokens, sampled with other seeds (one
    of them a subject's seed on another prompt), penalised, unseeded; some with repeating prompts (lookups)."""
    out = []
    for i in range(count):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randrange(1, 10))]
        prompt = prompt * 2 if i % 3 == 0 else prompt
        params = dict(max_new_tokens=rng.randrange(4, 24), stop_token_ids=())
        kind = i % 6
        if kind == 1:
            params |= dict(do_sample=True, seed=rng.randrange(1 << 30), temperature=0.9)
        elif kind == 2:
            params |= dict(do_sample=True, temperature=1.1, top_k=10)  # unseeded: rejection-sampled
        elif kind == 3:
            params |= dict(do_sample=True, seed=rng.randrange(1 << 30), repetition_penalty=1.2, presence_penalty=0.5)
        elif kind == 4:
            params |= dict(repetition_penalty=1.5, top_n_tokens=3)
        elif kind == 5:
            params |= dict(do_sample=True, seed=SEEDS[1], temperature=0.8)
        out.append((prompt, SamplingParams(**params)))
    return out


def test_plain_seeded_sampling_in_the_engine_is_the_gumbel_max_draw(targets, seeded_reference):
    """Without a drafter or lookups (plain decoding) the engine's seeded tokens are the plain Gumbel-max draws."""
    with single_thread():
        for (name, seed), expected in seeded_reference.items():
            prompt, params = SEEDED[name]
            engine = SpeculativeEngine(targets[0], None, verify="full", lookup_tokens=0)
            rid = engine.add_request(prompt, seeded_params(seed, **params))
            assert _run_to_end(engine)[rid] == expected, (name, seed)


@pytest.mark.parametrize("lookups", [0, 3], ids=["no-lookups", "lookups"])
@pytest.mark.parametrize("verify", ["full", "auto", 5, "7", "depth:2"])
def test_a_seeded_request_gives_the_same_tokens_alone_in_a_crowd_and_beside_a_twin(targets, seeded_reference, verify,
                                                                                   lookups):
    """Each seeded request of SEEDED (three seeds each) gives its plain sampling tokens alone, and in a crowd of 14
    other requests of every kind (arriving before and after it) beside a twin with its seed: every verify mode,
    lookups on and off. Under rejection sampling it matched in none to a few of these cases (the tokens followed
    which positions were verified drafts)."""
    target = targets[0]
    drafter = tiny_drafter("mtp", target)

    def engine():  # drafting priced at nothing, so that "auto" drafts and cuts (rates not measured: reproducible)
        return SpeculativeEngine(target, drafter, verify=verify, cost_model=CostModel((1.0, 0.05, 0.02), (0.0, 0.0)),
                                 max_batch_size=40, lookup_tokens=lookups, measure_rates=False)

    with single_thread():
        alone = {}
        for name, seed in seeded_reference:
            prompt, params = SEEDED[name]
            solo = engine()
            rid = solo.add_request(prompt, seeded_params(seed, **params))
            alone[name, seed] = _run_to_end(solo)[rid]
        crowd, others = engine(), neighbours(random.Random(f"{verify}/{lookups}"))
        for prompt, params in others[:7]:
            crowd.add_request(prompt, params)
        crowd.step()
        crowd.step()  # the seeded requests arrive while others decode
        ids = {}
        for name, seed in seeded_reference:
            prompt, params = SEEDED[name]
            ids[name, seed] = [crowd.add_request(prompt, seeded_params(seed, **params)) for _ in range(2)]
        for prompt, params in others[7:]:
            crowd.add_request(prompt, params)
        outputs = _run_to_end(crowd)
    for key, expected in seeded_reference.items():
        assert [outputs[i] for i in ids[key]] == [alone[key], alone[key]], ("crowd and twin", key)
        assert alone[key] == expected, ("plain sampling", key)
    stats = crowd.stats
    assert 0 < stats["accepted"] < stats["verified"], stats  # drafts were accepted and rejected: not vacuous
    if verify in ("auto", 5, "7"):
        assert stats["verified"] < stats["drafted"], stats  # the budget cut
    if lookups and verify != "depth:2":  # a fixed depth takes no lookups
        assert stats["lookup_rows"] > 0, stats


def test_a_seeded_draft_is_coupled_to_the_targets_draw():
    """A seeded request's draft at position t is the Gumbel-max draw from q with the noise of the target's draw at
    t: where q equals the target's p every draft is accepted (as rejection sampling accepts it, and greedy), and the
    token after them is the target's Gumbel-max draw. Drawn with other noise, a draft would match about sum(p^2)."""
    from angelspec_hf.tgi_patch.engine import verification
    from angelspec_hf.policy import draft_confidence
    from angelspec_hf.tgi_patch.engine.request import Request
    from angelspec_hf.tgi_patch.engine.sampling import gumbel_scores

    g = torch.Generator().manual_seed(0)
    rows, vocab, span = 96, 50, 5
    logits = torch.randn(rows, span, vocab, generator=g) * 1.5  # position j's p and q alike: no draft prefix read
    kinds = [dict(do_sample=True, seed=11), dict(do_sample=True), dict(do_sample=False)]
    processing = [dict(temperature=0.8), dict(temperature=1.3, top_k=12), dict(temperature=0.6, top_p=0.8)]
    requests = []
    for i in range(rows):
        params = SamplingParams(max_new_tokens=64, **kinds[i % 3], **processing[i // 3 % 3])
        requests.append(Request(i, [1, 2], params, 1000 + i // 9, frozenset(), generated=[3] * (i % 7)))
    select = verification.draft_selector(requests, logits.device, verification.process_requests, draft_confidence)
    drafted = [select(logits[:, j], j) for j in range(span - 1)]
    draft = torch.stack([token for token, _, _ in drafted], 1)
    q = torch.stack([probs for _, probs, _ in drafted], 1)
    verified = verification.verify_drafts(logits, draft, q, torch.full((rows,), span - 1), requests)
    assert verified.num_accepted.tolist() == [span - 1] * rows
    seeded = torch.tensor([r.coupled for r in requests])
    p_last = verification.process_requests(logits[:, -1], requests, 1)
    positions = torch.tensor([len(r.generated) + span - 1 for r in requests])
    expected = gumbel_scores(p_last, torch.tensor([r.seed for r in requests]), positions).argmax(-1)
    assert torch.equal(verified.next_token[seeded], expected[seeded])


# The seeded requests' law: the same statistic and set-up as the rejection-sampled cases above (p spread, q peaked
# elsewhere), for the drafter's blocks under a D-Cut budget, n-gram lookups, and a batch that mixes seeded and unseeded
# requests (both laws checked). Known-wrong rules on the same draws: the noise of position 0 used at every position
# (the draws of one request are then not independent), and a slightly shifted law: each temperature 10% higher
# (total variation 0.03-0.04 over the first two tokens, 0.04-0.05 over three, in these cases).
SEEDED_SAMPLING_CASES = {
    # id: (family, verify, engine options, sampling params, max_new_tokens, draws, prompt, seeded)
    "drafter-auto-T0.7-topk": ("mtp", "auto", {"cost_model": MARGINAL_COST}, dict(temperature=0.7, top_k=5), 3, 4000,
                               PROMPT, True),
    "drafter-budget16-T0.7-topp": ("dfly", 16, {}, dict(temperature=0.7, top_p=0.9), 4, 4000, PROMPT, True),
    "lookups-full-T0.7": ("dfly", "full", {"lookup_tokens": 3}, dict(temperature=0.7), 3, 4000, [3, 5, 4, 3, 5],
                          True),
    "mixed-budget16-lookups-T0.7": ("mtp", 16, {"lookup_tokens": 3}, dict(temperature=0.7), 3, 6000, [3, 5, 4, 3, 5],
                                    "mixed"),
}


class WarmerEngine(SpeculativeEngine):
    """Processes target and drafter logits at 1.1 times each request's temperature."""

    def _process(self, logits, requests, span):
        warmer = [dataclasses.replace(r, params=dataclasses.replace(r.params, temperature=1.1 * r.params.temperature))
                  for r in requests]
        return super()._process(logits, warmer, span)


def _noise_of_position_0_everywhere(patch):
    from angelspec_hf.tgi_patch.engine import verification

    real = verification.gumbel_scores
    patch.setattr(verification, "gumbel_scores", lambda probs, seeds, positions: real(probs, seeds, positions * 0))


@pytest.mark.parametrize("case", list(SEEDED_SAMPLING_CASES))
def test_seeded_sampling_is_exact_with_power(spread, case, monkeypatch):
    family, verify, options, params, new_tokens, draws, prompt, seeded = SEEDED_SAMPLING_CASES[case]
    drafter = peaked_drafter(family, spread)
    exact = exact_distribution(spread, new_tokens, prompt=torch.as_tensor(prompt).reshape(1, -1),
                               temperature=params.get("temperature", 1.0), top_k=params.get("top_k", 0),
                               top_p=params.get("top_p", 1.0))

    def sample(engine_cls=SpeculativeEngine):
        """The seeded requests' outputs and the unseeded ones' (a mixed batch; else None), and the engine."""
        samples, greedy, engine = run_sampled(spread, drafter, draws, params, new_tokens, verify=verify,
                                              engine_cls=engine_cls, seeded=seeded, prompt=prompt, **options)
        assert all(g == greedy[0] for g in greedy)  # greedy neighbours are deterministic whatever the batch
        return (samples[0::2], samples[1::2], engine) if seeded == "mixed" else (samples, None, engine)

    with single_thread():
        mine, theirs, engine = sample()
        stats = engine.stats
        assert 0 < stats["accepted"] < 0.75 * stats["verified"], stats  # accepted and (often) rejected
        if verify != "full":
            assert 0 < stats["verified"] < stats["drafted"], stats  # D-Cut really chose
        if options.get("lookup_tokens"):
            assert stats["lookup_rows"] > 0.1 * draws, stats
        right = _fit(mine, exact)
        wrong = {"temperature 10% high": _fit(sample(WarmerEngine)[0], exact)}
        with monkeypatch.context() as patch:
            _noise_of_position_0_everywhere(patch)
            wrong["noise of position 0 everywhere"] = _fit(sample()[0], exact)
        if theirs is not None:  # the unseeded neighbours keep their law too
            with monkeypatch.context() as patch:
                patch.setattr(reference, "verify", correction_from_p(reference.verify))
                theirs_wrong = {"correction from p (unseeded rows)": _fit(sample()[1], exact)}
    report(f"engine seeded {case}: {len(mine)} seeded draws, verified {stats['verified']}/{stats['drafted']} drafted, "
           f"accepted {stats['accepted']}, {stats['lookup_rows']} lookup rows", right, **wrong)
    assert_power(right, wrong)
    if theirs is not None:
        theirs_right = _fit(theirs, exact)
        report(f"engine seeded {case}: {len(theirs)} unseeded draws", theirs_right, **theirs_wrong)
        assert_power(theirs_right, theirs_wrong)


# ---- n-gram lookup proposals in the engine -------------------------------------------------------------------------
REPEATING = [[5, 7, 9, 11, 5, 7, 9, 11, 5, 7], [20, 21, 22, 20, 21], [30, 31, 30, 31, 30, 31, 30], [40, 41, 42]]


def greedy_with_lookups(target, drafter, verify, prompts, max_new_tokens=20):
    """Every prompt's greedy output through an engine with lookups of up to 4 tokens, and the engine's stats."""
    engine = SpeculativeEngine(target, drafter, verify=verify, max_batch_size=4, cost_model=MARGINAL_COST,
                               lookup_tokens=4)
    outputs, ids = {}, [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    while engine.has_work():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    return [outputs[rid] for rid in ids], engine.stats


@pytest.mark.parametrize("family,verify", [("mtp", "full"), ("dflash", 6), ("dfly", "auto")])
def test_lookup_proposals_keep_greedy_output(targets, family, verify):
    target, twin = targets
    outputs, stats = greedy_with_lookups(target, tiny_drafter(family, target), verify, REPEATING)
    assert outputs == [plain_greedy(twin, prompt, 20) for prompt in REPEATING]
    assert stats["lookup_rows"] > 0 and stats["accepted"] > 0


class LookupWithDrafterQEngine(SpeculativeEngine):
    """Verifies a lookup row against the drafter's distribution instead of the lookup's one-hot q."""

    def _lookup(self, requests, remaining, sampled, tokens, probs, conf, drafted=None):
        found = super()._lookup(requests, remaining, sampled, tokens, probs, conf, drafted)
        if probs is not None and found.probs is not None:
            width = probs.shape[1]
            found.probs[:, :width] = torch.where(found.use[:, None, None], probs, found.probs[:, :width])
        return found


def sample_repeated(engine, prompt, steps, draws, temperature=0.8):
    """`draws` unseeded (rejection-sampled) requests of `prompt` through `engine`, their streams drawn from `random`
    seeded first: their outputs, and the engine's stats."""
    random.seed(draws)
    ids = [engine.add_request(prompt, SamplingParams(max_new_tokens=steps, do_sample=True, temperature=temperature,
                                                     stop_token_ids=())) for i in range(draws)]
    outputs = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id] += event.token_ids
    return [tuple(outputs[i]) for i in ids], engine.stats


def assert_lookups_keep_sampling_exact(target, drafter, prompt, rows: str, setup=lambda engine: None,
                                       steps=3, draws=4000, verify="full"):
    """`draws` rejection-sampled requests of `prompt` (temperature 0.8) through an engine with lookups (`setup` run
    on it first) fit the target's exact distribution, with more than a fifth of them verifying a lookup (the stats'
    `rows`), while the same engine verifying lookup rows against the drafter's q is rejected."""
    exact = exact_distribution(target, steps, prompt=torch.tensor([prompt]), temperature=0.8)

    def sample(engine_cls):
        engine = engine_cls(target, drafter, verify=verify, max_batch_size=64, cost_model=FIXED_COST, lookup_tokens=3)
        setup(engine)
        return sample_repeated(engine, prompt, steps, draws)

    with single_thread():
        samples, stats = sample(SpeculativeEngine)
        assert stats[rows] > 0.2 * draws and stats["accepted"] > 0
        right = _fit(samples, exact)
        wrong = {"lookup verified with the drafter's q": _fit(sample(LookupWithDrafterQEngine)[0], exact)}
    report(f"engine {rows}: {draws} draws, {stats[rows]} {rows}, accepted {stats['accepted']}/{stats['verified']}",
           right, **wrong)
    assert_power(right, wrong)


def test_lookup_proposals_keep_sampling_exact_with_power(spread):
    assert_lookups_keep_sampling_exact(spread, peaked_drafter("dfly", spread), [3, 5, 4, 3, 5], "lookup_rows")


# ---- corpus lookups in the engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("family,verify", [("mtp", "full"), ("dflash", 6), ("dfly", "auto")])
def test_corpus_lookups_keep_greedy_output(targets, family, verify):
    """A drafter with a `lookup_corpus` (the target's own greedy replies: the first 8 tokens of some, others whole):
    rows take corpus lookups, and every output is still plain greedy decoding's."""
    from angelspec_hf.policy import CorpusIndex

    target, twin = targets
    prompts = [[9, 14, 23], [31, 8, 17, 4], [50, 61], [70, 3, 88, 12]]
    replies = [plain_greedy(twin, p, 20) for p in prompts]
    drafter = tiny_drafter(family, target)
    drafter.lookup_corpus = CorpusIndex([r[:8] for r in replies[:2]] + replies[2:])
    outputs, stats = greedy_with_lookups(target, drafter, verify, prompts)
    assert outputs == replies
    assert stats["corpus_rows"] > 0 and stats["accepted"] > 0


@pytest.mark.parametrize("verify", ["full", "auto"])
def test_a_corpus_growing_with_the_replies_served_keeps_greedy_output(targets, verify):
    """`corpus_window_tokens`: each finished request's prompt tail and reply join the lookup corpus
    (`GrowingCorpus`, no corpus of the drafter's own here), so the same prompts sent again take corpus lookups of
    their earlier replies and have more accepted, every output still plain greedy decoding's."""
    from angelspec_hf.policy import GrowingCorpus

    target, twin = targets
    prompts = [[9, 14, 23], [31, 8, 17, 4], [50, 61], [70, 3, 88, 12]]
    replies = [plain_greedy(twin, p, 20) for p in prompts]
    engine = SpeculativeEngine(target, tiny_drafter("dfly", target), verify=verify, max_batch_size=4,
                               cost_model=MARGINAL_COST, lookup_tokens=4, corpus_window_tokens=64)
    assert isinstance(engine.policy.corpus, GrowingCorpus) and engine.policy.corpus.base is None
    passes = []
    for _ in range(2):
        before = dict(engine.stats)
        outputs, ids = {}, [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
        while engine.has_work():
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.token_ids)
        assert [outputs[rid] for rid in ids] == replies
        passes.append({k: engine.stats[k] - before.get(k, 0) for k in ("corpus_rows", "accepted")})
    assert engine.policy.corpus.added == 8 and len(engine.policy.corpus) <= 64
    assert passes[1]["corpus_rows"] > 0 and passes[1]["accepted"] > passes[0]["accepted"]
    # a rejection-sampled reply is not added (its random numbers are keyed by a seed drawn from `random`, which a
    # caller reseeding it hands on); a seeded one, whose tokens its seed fixes whatever is proposed, is
    for params in (SamplingParams(max_new_tokens=6, do_sample=True), SamplingParams(max_new_tokens=6, do_sample=True,
                                                                                    seed=3)):
        engine.add_request(prompts[0], params)
        while engine.has_work():
            engine.step()
    assert engine.policy.corpus.added == 9
    off = SpeculativeEngine(target, tiny_drafter("dfly", target), verify=verify, lookup_tokens=0,
                            corpus_window_tokens=64)
    assert off.policy.corpus is None  # lookups off: no corpus to grow


@pytest.mark.parametrize("verify", ["full", "auto"])
def test_corpus_lookups_keep_sampling_exact_with_power(spread, verify):
    """Rejection-sampled rows that take a corpus lookup (q one-hot on each proposed token) keep the target's
    distribution; verified against the drafter's q instead, they are rejected."""
    import itertools

    from angelspec_hf.policy import CorpusIndex

    drafter = peaked_drafter("dfly", spread)
    # after the prompt's "6 1", every pair of tokens: a lookup is on offer at each step, its path the most frequent
    drafter.lookup_corpus = CorpusIndex([[6, 1, a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]
                                        + [[1, 2, 3]] * 4, min_match=1)

    def corpus_first(engine):  # corpus lookups planned as near certain and the drafter's blocks as hopeless,
        # whatever they achieve: rows take the corpus's lookup wherever there is one
        engine.policy.corpus_calibrator = AcceptanceCalibrator(prior=0.99, prior_weight=1e12).to(engine.device)
        engine.policy.calibrator = AcceptanceCalibrator(prior=0.01, prior_weight=1e12).to(engine.device)

    assert_lookups_keep_sampling_exact(spread, drafter, [3, 5, 4, 6, 1], "corpus_rows", corpus_first, verify=verify)


# ---- lookup-only steps: n-gram proposals verified without running the drafter ---------------------------------------
CHEAP_VERIFY = CostModel((1.0, 0.05, 0.001), (0.0, 0.0))  # every lookup token is worth verifying


def test_step_kind_runs_the_drafter_only_where_a_drafted_step_can_pay():
    """Before drafting, "auto" plans a step with the acceptance each position has had, or like the rows of recent
    drafted steps once there are some: where that plan loses to a plain step (drafting, or catching up on the pending
    features, costs too much), the drafter does not run; lookups (free to propose) or plain steps are taken, and after
    a pause one probe drafts (for a few rows of a big batch) so that the plan can re-open it."""
    from angelspec_hf.tgi_patch.engine.dcut import DCutPolicy

    cheap_draft = CostModel((1.0, 0.05, 0.02), (0.0, 0.0))
    costly_draft = CostModel((1.0, 0.05, 0.02), (5.0, 0.0))
    assert DCutPolicy("auto", None, cost_model=cheap_draft, measure=False).step_kind(4, width=7) == "draft"
    with_lookup = DCutPolicy("auto", None, cost_model=costly_draft, lookup_tokens=4, probe_every=4, measure=False)
    assert [with_lookup.step_kind(4, width=7) for _ in range(6)] == ["lookup"] * 5 + ["draft"]
    without = DCutPolicy("auto", None, cost_model=costly_draft, probe_every=4, measure=False)
    assert [without.step_kind(4, width=7) for _ in range(6)] == ["plain"] * 5 + ["draft"]
    assert without.step_kind(4, width=0) == "plain"  # no drafter, no lookups
    big = DCutPolicy("auto", None, cost_model=costly_draft, probe_every=4, measure=False)  # 16 rows: probes draft 4
    assert [big.step_kind(16, width=7) for _ in range(6)] == ["plain"] * 5 + ["probe"]
    assert big.probe_rows(torch.tensor([9, 3, 7, 3, 1, 8]), torch.tensor([5, 5, 5, 5, 1, 5])).tolist() == [1, 2, 3, 5]
    # the rows of recent drafted steps decide once there are some (at any batch size)
    sure = DCutPolicy("auto", None, cost_model=costly_draft, measure=False)
    sure.remember(torch.ones(3, 7))
    assert sure.step_kind(4, width=7) == "draft"
    hopeless = DCutPolicy("auto", None, cost_model=cheap_draft, lookup_tokens=4, measure=False)
    hopeless.remember(torch.full((3, 7), 0.01))
    assert hopeless.step_kind(4, width=7) == "lookup"
    # catching up: a drafting call that first ingests many pending features is planned with their cost
    ingesting = CostModel((1.0, 0.05, 0.02), (0.0, 0.0, 0.01))
    assert DCutPolicy("auto", None, cost_model=ingesting, measure=False).step_kind(4, 7, features=4) == "draft"
    assert DCutPolicy("auto", None, cost_model=ingesting, measure=False).step_kind(4, 7, 4000) == "plain"
    # ... spread over the steps it opens, or over the tokens the rows have left where fewer (a burst's tail)
    assert DCutPolicy("auto", None, cost_model=ingesting, measure=False).step_kind(4, 7, 400) == "draft"
    assert DCutPolicy("auto", None, cost_model=ingesting, measure=False).step_kind(4, 7, 400, horizon=2) == "plain"
    for mode, value in (("full", None), ("depth", 2), ("budget", 8)):  # fixed modes draft whenever they can
        assert DCutPolicy(mode, value, cost_model=costly_draft).step_kind(4, width=7) == "draft"
    # a pause is kept per batch size: drafting planned to lose at 32 rows pauses there, not at the 4 rows of a tail
    per_row = DCutPolicy("auto", None, cost_model=CostModel((1.0, 0.05, 0.02), (0.0, 1.0)), probe_every=4,
                         measure=False)
    per_row.remember(torch.ones(3, 7))
    assert [per_row.step_kind(n, width=7) for n in (32, 4, 32, 4)] == ["plain", "draft", "plain", "draft"]


def test_a_step_that_prefills_is_planned_as_its_decoding_rows(targets):
    """A prompt prefilled beside a decoding request makes the step slower, not a draft token cheaper: where drafting
    would not pay for the decoding row alone, it does not run in the step that also prefills a long prompt (planned
    against the whole step, it did: 0.14 tokens/s plain against 0.22 drafted under this cost model)."""
    target, _ = targets
    cost = CostModel((1.0, 0.05, 0.1), (3.0, 0.0))  # a 60-token prompt is 6 of the step's 7.2 seconds
    engine = SpeculativeEngine(target, tiny_drafter("dfly", target), verify="auto", max_batch_size=4,
                               cost_model=cost, measure_rates=False)
    engine.policy.remember(torch.full((3, 7), 0.2))
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=20))
    engine.step()  # prefill
    engine.add_request([3 + i % 4 for i in range(60)], SamplingParams(max_new_tokens=4))
    engine.step()
    trace = engine.last_step
    assert trace.prefill[0] == 60 and trace.choice == "plain", (trace.prefill, trace.choice)
    sure = SpeculativeEngine(target, tiny_drafter("dfly", target), verify="auto", max_batch_size=4, cost_model=cost,
                             measure_rates=False)  # the same step with drafts that would pay: it drafts
    sure.policy.remember(torch.ones(3, 7))
    sure.add_request([5, 6, 7], SamplingParams(max_new_tokens=20))
    sure.step()
    sure.add_request([3 + i % 4 for i in range(60)], SamplingParams(max_new_tokens=4))
    sure.step()
    assert sure.last_step.prefill[0] == 60 and sure.last_step.choice == "speculative"


def test_lookup_steps_keep_greedy_output(targets):
    """Lookup-only steps, without a drafter and with one whose drafting never pays: the output is plain greedy
    decoding's, lookups were verified, and the costly drafter ran in a few probes at most."""
    target, twin = targets
    costly = CostModel((1.0, 0.05, 0.001), (50.0, 0.0))
    for drafter, cost in ((None, CHEAP_VERIFY), (tiny_drafter("dfly", target), costly)):
        engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model=cost, lookup_tokens=4,
                                   measure_rates=False)
        outputs = generate_batch_with(engine, REPEATING, 24)
        assert outputs == [plain_greedy(twin, p, 24) for p in REPEATING]
        stats = engine.stats
        assert stats["lookup_steps"] > 0 and stats["accepted"] > 0, stats
        assert stats["speculative_steps"] <= 0.15 * stats["steps"], stats


def test_lookup_steps_keep_sampling_exact_with_power(spread, monkeypatch):
    prompt, steps, draws = [3, 5, 4, 3, 5], 3, 4000
    target = spread
    exact = exact_distribution(target, steps, prompt=torch.tensor([prompt]), temperature=0.8)

    def sample(engine_cls):
        engine = engine_cls(target, None, verify="auto", max_batch_size=64, cost_model=CHEAP_VERIFY, lookup_tokens=3,
                            measure_rates=False)
        return sample_repeated(engine, prompt, steps, draws)

    with single_thread():
        samples, stats = sample(SpeculativeEngine)
        assert stats["lookup_steps"] > 0 and stats["lookup_rows"] > 0.2 * draws and stats["accepted"] > 0, stats
        right = _fit(samples, exact)
        with monkeypatch.context() as patch:  # a rejected lookup token drawn again: p, not p without it
            patch.setattr(reference, "verify", correction_from_p(reference.verify))
            wrong = {"correction from p": _fit(sample(SpeculativeEngine)[0], exact)}
    report(f"engine lookup steps: {draws} draws, {stats['lookup_rows']} lookup rows, accepted {stats['accepted']}/"
           f"{stats['verified']}", right, **wrong)
    assert_power(right, wrong)


def test_packed_attention_groups_sequences_by_new_token_count():
    """A prompt prefilled beside decoding rows pads only its own group: rows are grouped by new-token count rounded
    up to a power of two, every packed token lands in exactly one group, in its own row and column."""
    from angelspec_hf.tgi_patch.engine.paged import PagedKVPool, RaggedStep

    pool = PagedKVPool(1, 1, 4, torch.float32, torch.device("cpu"), 8)
    slots = torch.arange(6)
    pool.lengths[slots] = torch.tensor([5, 9, 0, 3, 7, 0])
    new = torch.tensor([1, 1, 9, 3, 1, 40])
    step = RaggedStep.build(pool, slots, new, packed=True)
    groups = step.groups(torch.float32)
    assert sorted((g.num_rows, g.n_max) for g in groups) == [(1, 3), (1, 9), (1, 40), (3, 1)]
    tokens = torch.cat([g.tokens for g in groups]).sort().values
    assert tokens.tolist() == list(range(int(new.sum())))
    for g in groups:
        assert g.n_max <= 2 * max(1, int(new[step.token_row[g.tokens]].min()))
        assert (step.token_col[g.tokens] == g.col).all()
        assert g.mask.shape == (g.num_rows, 1, g.n_max, g.gather_index.shape[1])


def test_greedy_verification_on_packed_logits_equals_the_padded_path():
    """`verify_greedy` reads only the verified and emitted rows of the packed logits; it must give what
    `verify_drafts` gives on the `[B, span, V]` copy: accepted counts, next tokens, emitted tokens and their
    log-probabilities (where they are emitted)."""
    from angelspec_hf.tgi_patch.engine import verification
    from angelspec_hf.tgi_patch.engine.model_runner import ModelRunner
    from angelspec_hf.tgi_patch.engine.request import Request

    gen = torch.Generator().manual_seed(0)
    vocab, depth = 50, torch.tensor([0, 3, 1, 0, 5, 2])
    new = 1 + depth
    new[0] = 7  # a prefilling row: seven prompt tokens, nothing verified
    logits = torch.randn(int(new.sum()), vocab, generator=gen)
    positions = ModelRunner._positions(new, depth)
    scored = logits[positions]
    draft = torch.randint(0, vocab, (6, 6), generator=gen)
    agree = torch.tensor([0, 2, 1, 0, 5, 1])  # each row's drafts match the target's argmax this far
    for row, n in enumerate(agree.tolist()):
        draft[row, :n] = scored[row, :n].argmax(-1)
        if n < positions.shape[1]:
            draft[row, n] = (scored[row, n].argmax() + 1) % vocab  # and not at the next
    requests = [Request(i, [1, 2], SamplingParams(max_new_tokens=9), 0, frozenset()) for i in range(6)]
    padded = verification.verify_drafts(scored, draft, None, depth, requests)
    packed = verification.verify_greedy(logits, positions, draft, depth)
    assert packed.num_accepted.tolist() == padded.num_accepted.tolist() == torch.minimum(agree, depth).tolist()
    assert packed.next_token.tolist() == padded.next_token.tolist()
    for row, n in enumerate(packed.num_accepted.tolist()):
        assert packed.emitted[row, : n + 1].tolist() == padded.emitted[row, : n + 1].tolist()
        torch.testing.assert_close(packed.logprobs[row, : n + 1], padded.logprobs[row, : n + 1])
