"""One request never fails the others: every value a client can send is checked as the float32 the kernels compute
with (or is made harmless there), the sampler turns no input into NaN, and a step that raises for one request is
retried without it — that request alone ends with an error, the others' tokens are those of a clean run."""

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from angelspec_hf.tgi_patch.engine import FINISH_ERROR, GenerationFailed, SamplingParams, SpeculativeEngine, \
    generate_batch, parse_verify
from angelspec_hf.tgi_patch.engine.core import StepKeptError
from angelspec_hf.policy import CostModel
from angelspec_hf.tgi_patch.engine.request import FLOAT32_MAX_FINITE, FLOAT32_MIN_POSITIVE, int64_seed
from angelspec_hf.tgi_patch.engine.sampling import apply_penalties, process_logits, sample_from
from helpers import tiny_drafter, tiny_target

FIXED_COST = CostModel((1.0, 0.05, 0.02), (0.2, 0.01))
V = 99


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V)


@pytest.fixture(scope="module")
def pruned_dfly(target):
    """A DFly drafter whose draft vocabulary is a third of the target's: its logits are -inf elsewhere."""
    drafter = tiny_drafter("dfly", target)
    drafter.set_draft_vocab(list(range(0, V, 3)))
    return drafter


# ---- float32 terms -------------------------------------------------------------------------------------------------
def test_the_bounds_are_the_float32_range():
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    assert f32(FLOAT32_MIN_POSITIVE) > 0 and f32(FLOAT32_MIN_POSITIVE / 2) == 0
    assert math.isfinite(f32(FLOAT32_MAX_FINITE)) and not math.isfinite(f32(FLOAT32_MAX_FINITE * 1.001))
    assert int64_seed(2**64 - 1) == -1 == int64_seed(-1) and int64_seed(2**63) == -(2**63) and int64_seed(5) == 5
    assert int64_seed(2**64 + 5) == 5


@pytest.mark.parametrize("params,needle", [
    (dict(do_sample=True, temperature=1e-46), "temperature"),
    (dict(do_sample=True, temperature=5e-324), "temperature"),
    (dict(do_sample=True, temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=5e-324), "repetition_penalty"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(top_p=1e-46), "top_p"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(presence_penalty=2.0000001), "presence_penalty"),
    (dict(seed=1.5), "seed"),
    (dict(top_k=True), "top_k"),
    (dict(do_sample=1), "do_sample"),
    (dict(repetition_penalty=10**400), "repetition_penalty"),
])
def test_values_that_vanish_or_overflow_in_float32_are_refused(params, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**params).validate()


def test_values_that_survive_float32_are_accepted():
    for params in (dict(do_sample=True, temperature=1e39), dict(do_sample=True, temperature=3.5e38),
                   dict(do_sample=True, temperature=1e-45), dict(repetition_penalty=1e-45), dict(seed=2**64 - 1),
                   dict(repetition_penalty=3.4e38), dict(top_p=1e-45), dict(temperature=5e-324)):  # a greedy request ignores its temperature
        SamplingParams(**params).validate()


def test_the_sampler_is_defined_for_any_logits_and_temperature():
    """Fully masked rows, -inf beside a huge temperature (the pruned draft vocabulary's), +inf and NaN logits: every
    row is a distribution (finite, sums to one) and every draw is a token index."""
    big = torch.tensor(1e39, dtype=torch.float32)  # inf
    logits = torch.randn(6, V)
    logits[0] = -float("inf")  # fully masked
    logits[1, ::2] = -float("inf")  # pruned
    logits[2, 7] = float("inf")
    logits[3, 5] = float("nan")
    logits[4] = float("nan")
    temperature = torch.stack([torch.tensor(1.0), big, torch.tensor(1.0), torch.tensor(1e-45), torch.tensor(0.5), big])
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.3), (5, 1e-45)):
        probs = process_logits(logits, temperature, torch.full((6,), top_k), torch.full((6,), top_p))
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(6))
        assert probs[1, ::2].sum() == 0  # masked tokens stay impossible at any temperature
        if top_k == 0 and top_p == 1.0:
            assert probs[2, 7] == 1.0 and probs[3, 5] == 0  # +inf is the top, NaN is never drawn
            assert torch.allclose(probs[5], torch.full((V,), 1 / V))  # an overflowed temperature: uniform
        for u in (0.0, 0.5, 1 - 2**-24):
            tokens = sample_from(probs, torch.full((6,), u))
            assert ((tokens >= 0) & (tokens < V)).all()
            assert (probs.gather(1, tokens[:, None]) > 0).all()
    assert ((sample_from(torch.zeros(2, V), torch.tensor([0.3, 0.9])) < V)).all()


def test_penalties_stay_finite_at_the_extremes():
    logits = torch.tensor([[[5.0, -3.0, 0.0, 2.0]]])
    seen = torch.tensor([[True, True, False, False]])
    counts = torch.zeros(1, 4)
    for r in (1e-45, 3.4e38):
        out = apply_penalties(logits, torch.zeros(1, 0, dtype=torch.long), seen, counts, torch.tensor([r]),
                              torch.zeros(1), torch.zeros(1))
        assert torch.isfinite(out).all() and torch.isfinite(torch.log_softmax(out, -1)).all()
    tiny = apply_penalties(logits, torch.zeros(1, 0, dtype=torch.long), seen, counts, torch.tensor([1e-45]),
                           torch.zeros(1), torch.zeros(1))
    assert tiny[0, 0].argmax() == 0  # r < 1 rewards a seen positive logit (transformers' rule), no inf


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([5e-324, 1e-46, 1e-39, 3.5e38, 1e39, 0.0, -0.0, 1.0, 2.0, -2.0]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(temperature=_floats, top_p=_floats, repetition=_floats, frequency=_floats, presence=_floats,
       top_k=st.sampled_from([0, 1, 3, 2**62]), do_sample=st.booleans(), seed=st.integers(0, 2**64 - 1),
       verify=st.sampled_from(["full", "auto", 3, "depth:2"]))
def test_any_accepted_request_generates_and_none_fails_another(target, pruned_dfly, temperature, top_p, repetition,
                                                               frequency, presence, top_k, do_sample, seed, verify):
    """Hypothesis over the whole parameter space, on a DFly drafter with a pruned vocabulary: a request either is
    refused with `ValueError` or generates valid tokens with finite log-probabilities — and a greedy neighbour's tokens
    are those of a clean run."""
    params = SamplingParams(max_new_tokens=6, do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, repetition_penalty=repetition, frequency_penalty=frequency,
                            presence_penalty=presence)
    engine = SpeculativeEngine(target, pruned_dfly, verify=verify, max_batch_size=4, cost_model=FIXED_COST)
    try:
        rid = engine.add_request([5, 9, 11, 4], params)
    except ValueError:
        return
    neighbour = engine.add_request([7, 3, 8], SamplingParams(max_new_tokens=6))
    tokens, logprobs, errors = {rid: [], neighbour: []}, [], []
    for events in engine.steps():
        for e in events:
            tokens[e.request_id] += e.token_ids
            if e.request_id == rid:
                logprobs += e.logprobs
            errors += [e.error] if e.error else []
    assert not errors
    assert len(tokens[rid]) >= 1 and all(0 <= t < V for t in tokens[rid])
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in logprobs)
    assert tokens[neighbour] == _greedy_alone(target, pruned_dfly, [7, 3, 8], 6)


_GREEDY_CACHE = {}


def _greedy_alone(target, drafter, prompt, n):
    key = (tuple(prompt), n)
    if key not in _GREEDY_CACHE:
        _GREEDY_CACHE[key] = generate_batch(target, drafter, [prompt], max_new_tokens=n, verify="full")[0]
    return _GREEDY_CACHE[key]


# ---- fault isolation inside a step ---------------------------------------------------------------------------------
BAD = 0.123456  # the temperature that marks the request faults are injected into


class FaultySampling(SpeculativeEngine):
    """Processing the sampling distribution fails whenever the marked request is among the rows."""

    def _process(self, logits, requests, span):
        if any(r.params.do_sample and r.params.temperature == BAD for r in requests):
            raise RuntimeError("injected sampling fault")
        return super()._process(logits, requests, span)


class FaultyDrafting(SpeculativeEngine):
    """Drafting fails midway (after the drafter ingested its pending features, at its first drafted position)
    whenever it drafts for the marked request."""

    def _draft(self, batch, rows=None):
        dec = batch.requests[batch.num_prefill:]
        chosen = dec if rows is None else [dec[i] for i in rows.tolist()]
        self.marked = any(r.params.do_sample and r.params.temperature == BAD for r in chosen)
        return super()._draft(batch, rows)

    def draft_confidence(self, probs, token):
        if self.marked:
            raise RuntimeError("injected drafting fault")
        return super().draft_confidence(probs, token)


def _workload(seed=0):
    """Greedy and seeded sampled requests of varied prompts and lengths (sampled ones verified at a fixed depth
    without lookups below, where a seeded request's tokens depend on its seed alone)."""
    rng = random.Random(seed)
    work = []
    for i in range(7):
        prompt = [rng.randrange(3, V) for _ in range(rng.randrange(2, 12))]
        sampled = i % 3 == 2
        work.append((prompt, SamplingParams(max_new_tokens=rng.randrange(4, 14), do_sample=sampled,
                                            temperature=0.9, seed=100 + i if sampled else None)))
    return work


def _run(engine, work, bad=None, corrupt=None):
    ids = [engine.add_request(p, SamplingParams(**vars(params))) for p, params in work]
    bad_id = engine.add_request(*bad) if bad is not None else None
    if corrupt is not None:
        corrupt(engine.scheduler.requests[bad_id])
    out, errors, finished = {i: [] for i in ids}, {}, set()
    for events in engine.steps():
        for e in events:
            out.setdefault(e.request_id, []).extend(e.token_ids)
            if e.error is not None:
                assert e.finished and e.finish_reason == FINISH_ERROR
                errors[e.request_id] = e.error
            if e.finished:
                assert e.request_id not in finished
                finished.add(e.request_id)
    assert engine.pool.tokens_allocated == 0 and not engine.has_work()
    return [out[i] for i in ids], errors, bad_id


def _bad_penalties(request):
    request.penalties.seen = request.penalties.seen[:-1]  # a corrupted statistics vector: the penalty step raises


def _bad_update(request):
    def fail(tokens):
        raise RuntimeError("injected fault while keeping tokens")
    request.penalties.add = fail


@pytest.mark.parametrize("family", ["dfly", "mtp"])
@pytest.mark.parametrize("fault", ["sampling", "drafting", "penalties", "update"])
def test_a_fault_in_one_request_fails_it_alone(target, family, fault):
    drafter = tiny_drafter(family, target)
    work = _workload()
    kwargs = dict(verify="depth:3", max_batch_size=8, cost_model=FIXED_COST, lookup_tokens=0)
    clean, errors, _ = _run(SpeculativeEngine(target, drafter, **kwargs), work)
    assert not errors
    cls = {"sampling": FaultySampling, "drafting": FaultyDrafting}.get(fault, SpeculativeEngine)
    marked = SamplingParams(max_new_tokens=10, do_sample=True, temperature=BAD, seed=7)
    penalised = SamplingParams(max_new_tokens=10, repetition_penalty=1.3)
    bad = ([4, 4, 9], marked if fault in ("sampling", "drafting") else penalised)
    corrupt = {"penalties": _bad_penalties, "update": _bad_update}.get(fault)
    engine = cls(target, drafter, **kwargs)
    outputs, errors, bad_id = _run(engine, work, bad, corrupt)
    assert list(errors) == [bad_id]
    assert "injected" in errors[bad_id] if fault != "penalties" else "RuntimeError" in errors[bad_id]
    assert outputs == clean  # the others: token for token what they produced without the faulty request
    # the engine serves on
    later, errors, _ = _run(engine, work[:2])
    assert not errors and later == clean[:2]


def test_a_fault_every_request_causes_fails_each_and_the_engine_recovers(target):
    class Broken(SpeculativeEngine):
        broken = True

        def _process(self, logits, requests, span):
            if self.broken:
                raise RuntimeError("injected global fault")
            return super()._process(logits, requests, span)

    engine = Broken(target, None, verify="full", max_batch_size=8, cost_model=FIXED_COST)
    sampled = [([3 + i, 5], SamplingParams(max_new_tokens=5, do_sample=True, seed=i)) for i in range(5)]
    outputs, errors, _ = _run(engine, sampled)
    assert len(errors) == 5 and all("injected global fault" in e for e in errors.values())
    assert all(o == [] for o in outputs)
    engine.broken = False
    outputs, errors, _ = _run(engine, sampled)
    assert not errors and all(len(o) == 5 for o in outputs)


def test_isolation_off_raises_and_generate_batch_reports_the_failed_prompt(target):
    engine = FaultySampling(target, None, verify="full", max_batch_size=4, cost_model=FIXED_COST,
                            isolate_faults=False)
    engine.add_request([3, 4], SamplingParams(max_new_tokens=3, do_sample=True, temperature=BAD, seed=1))
    with pytest.raises(RuntimeError, match="injected sampling fault"):
        engine.step()
    engine = FaultySampling(target, None, verify="full", max_batch_size=4, cost_model=FIXED_COST)
    with pytest.raises(GenerationFailed, match="prompt 1: RuntimeError: injected sampling fault") as failure:
        _generate_with_one_bad(engine)
    assert failure.value.failed == [1]
    assert len(failure.value.outputs[0]) == 4 and failure.value.outputs[1] == [] and len(failure.value.outputs[2]) == 4


def _generate_with_one_bad(engine):
    """`generate_batch` over three greedy prompts on `engine`, the second one's parameters swapped for the marked
    (failing) ones as it is added."""
    original = engine.add_request
    calls = []

    def add(prompt, params):
        calls.append(prompt)
        if len(calls) == 2:
            params = SamplingParams(**(vars(params) | {"do_sample": True, "temperature": BAD, "seed": 9}))
        return original(prompt, params)

    engine.add_request = add
    return generate_batch(engine.target, None, [[3, 4], [5, 6], [7, 8]], max_new_tokens=4, engine=engine)


def test_verify_accepts_every_documented_form():
    assert parse_verify("budget:16") == ("budget", 16) == parse_verify("16") == parse_verify(16)
    assert parse_verify("depth:3") == ("depth", 3)
    for bad in ("budget:", "budget:-1", "depth:x", "٣", True, -1):
        with pytest.raises(ValueError):
            parse_verify(bad)


def test_a_failure_after_the_step_kept_its_tokens_is_not_retried(target):
    """A fault while recording a step whose requests have advanced propagates (`StepKeptError`) instead of being
    retried, which would advance them twice; stepping on afterwards gives the clean run's tokens."""
    class FailingRecord(SpeculativeEngine):
        fail_at = 2

        def _record(self, *args, **kwargs):
            self.fail_at -= 1
            if self.fail_at == 0:
                raise RuntimeError("injected fault after the tokens were kept")
            return super()._record(*args, **kwargs)

    drafter = tiny_drafter("dfly", target)
    work = [([5, 9, 11, 4], SamplingParams(max_new_tokens=12)), ([7, 3], SamplingParams(max_new_tokens=9))]
    clean, _, _ = _run(SpeculativeEngine(target, drafter, verify="full", cost_model=FIXED_COST), work)
    engine = FailingRecord(target, drafter, verify="full", cost_model=FIXED_COST)
    ids = [engine.add_request(p, SamplingParams(**vars(params))) for p, params in work]
    requests = [engine.scheduler.requests[i] for i in ids]
    raised = 0
    while engine.has_work():
        try:
            engine.step()
        except StepKeptError:
            raised += 1
    assert raised == 1
    # the failed step's tokens were kept once (not advanced twice) and the requests ran on to the clean run's end
    assert [r.generated for r in requests] == clean
