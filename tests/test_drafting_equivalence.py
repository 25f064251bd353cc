"""The batched engine drafts what the batch-1 `generate()` hook drafts; τ is counted right; KV pages are accounted for.

Lossless mistakes in drafting (a draft cache cropped one entry short, a feature paired with the wrong next token) keep
the output exact and only lower τ, so output tests cannot see them. Here the engine's drafts — tokens, the drafter's
probability of each, and with sampling the whole processed draft distribution — are compared round by round with the
hook's for the same context, alone and inside a batch of other requests; accepted counts are checked against a count
made by hand from the target's own greedy output; and the paged pools are checked against their free lists.
"""

import random

import pytest
import torch

from angelspec_hf.modeling import candidate_generator
from angelspec_hf.modeling.candidate_generator import AngelSpecCandidateGenerator
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine, generate_batch
from angelspec_hf.tgi_patch.engine.paged import PagedKVPool
from helpers import tiny_drafter, tiny_target

FAMILIES = ["mtp", "mtp_eagle3", "dflash", "dfly"]
# prompts on which the tiny random drafters of every family get drafts accepted, several tokens at a time (one longer
# than a KV page); lengths chosen so that the last rounds have less room than a block
PROMPTS = [[27], [67], [40, 93, 18, 73, 45, 72, 29, 80], [8, 79, 15, 92, 53],
           [92, 48, 13, 44, 81, 17, 65, 78, 83, 45, 27, 34, 5],
           [23, 4, 4, 77, 12, 30, 5, 88, 14, 2, 19, 40, 7, 66, 3, 21, 50]]
NEW_TOKENS = [24, 30, 25, 28, 20, 30]


@pytest.fixture(scope="module")
def targets():
    # the engine switches its target to ragged attention; the hook's twin keeps eager attention
    return tiny_target(), tiny_target()


def _drafter(family, target):
    # draft_stop_threshold=0: the hook drafts whole blocks, as the engine does
    return tiny_drafter(family, target, draft_stop_threshold=0.0)


def plain_greedy(twin, prompt, n):
    out = twin.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hook_rounds(twin, drafter, prompt, n):
    """Greedy `generate(assistant_model=drafter)`: the new tokens, and per round `(context, drafts, probs)` with the
    context rebuilt from the output and the hook's accepted counts."""
    out = twin.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                        assistant_model=drafter)
    seq, stats = out[0].tolist(), drafter.last_speculation_stats
    assert len(stats.drafts) == len(stats.draft_probs) == len(stats.proposed) == len(stats.accepted)
    assert [len(d) for d in stats.drafts] == stats.proposed == [len(p) for p in stats.draft_probs]
    rounds, length = [], len(prompt) + 1  # the prefill gives the first token
    for drafts, probs, accepted in zip(stats.drafts, stats.draft_probs, stats.accepted):
        rounds.append((tuple(seq[:length]), drafts, probs))
        length += accepted + 1
    return seq[len(prompt):], rounds


class EngineRecorder:
    """Runs an engine to the end and records, per request and per speculative step, the context the draft was made
    for, the drafted tokens the step verified, the drafter's probability of each (D-Cut's raw confidence for greedy
    rows) and the processed draft distributions (sampled rows), and the accepted count."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        drafter = engine.batch_drafter
        original = drafter.draft

        def draft(*args, **kwargs):
            result = original(*args, **kwargs)
            self.calls.append(result)
            return result

        drafter.draft = draft
        self.prompts, self.outputs, self.rounds = {}, {}, {}

    def add(self, prompt, params):
        rid = self.engine.add_request(prompt, params)
        self.prompts[rid], self.outputs[rid], self.rounds[rid] = list(prompt), [], []
        return rid

    def step(self):
        self.calls.clear()
        events = self.engine.step()
        trace = self.engine.last_step
        if trace is not None and trace.choice == "speculative":
            assert len(self.calls) == 1
            tokens, probs, conf = self.calls[0]
            decoding = [i for i, p in enumerate(trace.prefill) if p == 0]
            assert len(decoding) == tokens.shape[0]
            for row, i in enumerate(decoding):
                rid, verified = trace.request_ids[i], trace.verified[i]
                assert trace.draft_tokens[i] == tokens[row].tolist()
                context = tuple(self.prompts[rid] + self.outputs[rid])
                q = None if probs is None else probs[row]
                self.rounds[rid].append((context, tokens[row].tolist(), conf[row].tolist(), q, verified,
                                         trace.accepted[i]))
        for event in events:
            self.outputs[event.request_id].extend(event.token_ids)
        return events

    def run(self):
        while self.engine.has_work():
            self.step()


def _compare_greedy(recorder, rid, hook_out, hook):
    assert recorder.outputs[rid] == hook_out
    engine = [(ctx, tokens[:v], conf[:v]) for ctx, tokens, conf, _, v, _ in recorder.rounds[rid] if v]
    assert [(c, t) for c, t, _ in engine] == [(c, t) for c, t, _ in hook], "the engine drafted other tokens"
    for (_, _, conf), (_, _, probs) in zip(engine, hook):
        torch.testing.assert_close(torch.tensor(conf), torch.tensor(probs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_drafts_what_the_hook_drafts(targets, family):
    """verify="full", greedy: round by round, the same drafted tokens and draft probabilities as the batch-1 hook,
    for each request alone and inside a batch of other (greedy and sampled) requests joining while it runs."""
    target, twin = targets
    drafter = _drafter(family, target)
    hook = [hook_rounds(twin, drafter, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    advances = [len(b) - len(a) for _, r in hook for (a, _, _), (b, _, _) in zip(r, r[1:])]
    assert len(advances) > 60 and max(advances) >= 3  # several tokens accepted in one round, now and then
    for (out, rounds), prompt in zip(hook, PROMPTS):
        assert out == plain_greedy(twin, prompt, len(out))

    for prompt, n, (out, rounds) in zip(PROMPTS, NEW_TOKENS, hook):  # alone
        recorder = EngineRecorder(SpeculativeEngine(target, drafter, verify="full", max_batch_size=1))
        rid = recorder.add(prompt, SamplingParams(max_new_tokens=n, stop_token_ids=()))
        recorder.run()
        _compare_greedy(recorder, rid, out, rounds)

    rng = random.Random(family)  # in a crowd: neighbours come and go, some of them sampled
    recorder = EngineRecorder(SpeculativeEngine(target, drafter, verify="full", max_batch_size=4))
    ids = []
    for prompt, n in zip(PROMPTS, NEW_TOKENS):
        for _ in range(2):
            noise = [rng.randrange(3, 99) for _ in range(rng.randrange(1, 30))]
            recorder.add(noise, SamplingParams(max_new_tokens=rng.randrange(1, 25), stop_token_ids=(),
                                               do_sample=rng.random() < 0.5, seed=rng.randrange(1 << 30),
                                               temperature=0.9))
        ids.append(recorder.add(prompt, SamplingParams(max_new_tokens=n, stop_token_ids=())))
        recorder.step()
    recorder.run()
    for rid, (out, rounds) in zip(ids, hook):
        _compare_greedy(recorder, rid, out, rounds)


def _hook_draft_distribution(twin, drafter, context, forced, sampling, monkeypatch):
    """The hook's processed draft distributions `[K, V]` for `context`, when its sampler draws the tokens `forced`.

    Runs the real sampled `generate(assistant_model=drafter)` from `context[:-1]`: the prefill's draw is forced to
    `context[-1]`, then the K draws of the first drafting round to `forced`, so the hook drafts after exactly this
    context and drafted prefix; every later draw (verification) is left random."""
    queue = [context[-1], *forced]
    real, real_draw = torch.multinomial, candidate_generator.draw_token

    def multinomial(probs, num_samples, *args, **kwargs):  # transformers' draws: the prefill's first
        if queue and probs.shape[0] == 1 and num_samples == 1:
            return torch.tensor([[queue.pop(0)]], device=probs.device)
        return real(probs, num_samples, *args, **kwargs)

    def draw_token(probs, ids=None):  # the hook's draft draws
        if queue and probs.shape[0] == 1:
            return torch.tensor([queue.pop(0)], device=probs.device)
        return real_draw(probs, ids)

    seen = []
    get_candidates = AngelSpecCandidateGenerator.get_candidates

    def record(self, *args, **kwargs):
        candidates, logits = get_candidates(self, *args, **kwargs)
        if logits is not None:
            seen.append(logits)
        return candidates, logits

    with monkeypatch.context() as m:
        m.setattr(torch, "multinomial", multinomial)
        m.setattr(candidate_generator, "draw_token", draw_token)
        m.setattr(AngelSpecCandidateGenerator, "get_candidates", record)
        twin.generate(torch.tensor([context[:-1]]), max_new_tokens=len(forced) + 2, do_sample=True,
                      eos_token_id=None, pad_token_id=0, assistant_model=drafter, **sampling)
    assert not queue and seen, "the hook did not draw the forced tokens"
    assert drafter.last_speculation_stats.drafts[0] == list(forced)
    return torch.softmax(seen[0][0].float(), -1)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_draft_distribution_equals_the_hooks(targets, family, monkeypatch):
    """do_sample: for each sampled request and step of the engine, its draft distribution q at every drafted
    position equals the hook's processed q for the same context and the same drafted prefix (temperature, top-k,
    top-p included); the random draws themselves differ and are not compared."""
    target, twin = targets
    drafter = _drafter(family, target)
    configs = [dict(temperature=0.7, top_k=0, top_p=1.0), dict(temperature=1.3, top_k=12, top_p=0.85)]
    recorder = EngineRecorder(SpeculativeEngine(target, drafter, verify="full", max_batch_size=8))
    sampled = []
    for i, prompt in enumerate(PROMPTS[:3]):
        for j, config in enumerate(configs):
            params = SamplingParams(max_new_tokens=8, do_sample=True, seed=100 * i + j, stop_token_ids=(), **config)
            sampled.append((recorder.add(prompt, params), config))
        recorder.add(prompt, SamplingParams(max_new_tokens=6, stop_token_ids=()))  # a greedy neighbour
    recorder.run()
    compared = truncated = 0
    for rid, config in sampled:
        for context, tokens, conf, q, _, _ in recorder.rounds[rid][:2]:
            hook_q = _hook_draft_distribution(twin, drafter, context, tokens, config, monkeypatch)
            assert q is not None and hook_q.shape == q.shape
            torch.testing.assert_close(q.float(), hook_q, rtol=1e-4, atol=1e-5)
            # D-Cut's confidence of a sampled position is known before its token is drawn: the peak of q
            torch.testing.assert_close(torch.tensor(conf), q.max(-1).values.float(), rtol=1e-5, atol=1e-6)
            compared += 1
            truncated += int((q == 0).any())
    assert compared >= 10 and truncated > 0  # top-k / top-p really removed tokens in some


def _leading_matches(drafts, truth):
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_accepted_counts_match_a_hand_count(targets, family):
    """Per round, the accepted count in the hook's `SpeculationStats` and in the engine's step traces equals the
    number of leading draft tokens equal to the target's own greedy continuation, and τ follows from that count."""
    target, twin = targets
    drafter = _drafter(family, target)
    total_hand = 0
    for prompt, n in zip(PROMPTS, NEW_TOKENS):
        truth = prompt + plain_greedy(twin, prompt, n)
        twin.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                      assistant_model=drafter)
        stats = drafter.last_speculation_stats
        length, hand = len(prompt) + 1, []
        for drafts in stats.drafts:  # the context of each round follows from the hand count alone
            hand.append(_leading_matches(drafts, truth[length:]))
            length += hand[-1] + 1
        assert len(prompt) + n - 1 <= length <= len(prompt) + n  # (a last step with no room to draft is plain)
        assert stats.accepted == hand
        assert stats.mean_accepted_length == pytest.approx((sum(hand) + len(hand)) / len(hand))
        total_hand += sum(hand)
    assert total_hand > 0

    for verify in ["full", 2]:
        recorder = EngineRecorder(SpeculativeEngine(target, drafter, verify=verify, max_batch_size=3))
        truths = {}
        for prompt, n in zip(PROMPTS, NEW_TOKENS):
            rid = recorder.add(prompt, SamplingParams(max_new_tokens=n, stop_token_ids=()))
            truths[rid] = prompt + plain_greedy(twin, prompt, n)
        rounds = accepted = 0
        while recorder.engine.has_work():
            before = {rid: len(recorder.prompts[rid]) + len(recorder.outputs[rid]) for rid in truths}
            recorder.step()
            trace = recorder.engine.last_step
            for i, rid in enumerate(trace.request_ids):
                if trace.prefill[i]:
                    continue
                drafts = trace.draft_tokens[i][: trace.verified[i]]
                hand = _leading_matches(drafts, truths[rid][before[rid]:])
                assert trace.accepted[i] == hand, (verify, rid)
                rounds, accepted = rounds + 1, accepted + hand
        stats = recorder.engine.stats
        assert (stats["accepted"], stats["decode_row_steps"]) == (accepted, rounds)
        assert stats["mean_accepted_length"] == pytest.approx((accepted + rounds) / rounds)
        assert accepted > 0
        for rid in truths:
            assert recorder.prompts[rid] + recorder.outputs[rid] == truths[rid]


# ---- page accounting -------------------------------------------------------------------------------------------------
def _check_pools(engine, idle=False):
    engine.pool.check_accounting(idle=idle)
    engine.batch_drafter.pool.check_accounting(idle=idle)


@pytest.mark.parametrize("family", FAMILIES)
def test_pages_return_to_the_free_list(targets, family):
    """While requests run, every page but page 0 is owned by one slot or free, never both; after they finish or are
    cancelled (running or still waiting), every page is back in the free list exactly once — target and drafter."""
    target, _ = targets
    drafter = _drafter(family, target)
    rng = random.Random(family)
    for verify in ["full", 3]:
        engine = SpeculativeEngine(target, drafter, verify=verify, max_batch_size=3)
        ids = []
        for i in range(9):
            prompt = [rng.randrange(3, 99) for _ in range(rng.choice([1, 15, 16, 17, 33, 40]))]
            params = SamplingParams(max_new_tokens=rng.randrange(1, 40), stop_token_ids=(), do_sample=i % 3 == 0,
                                    seed=i)
            ids.append(engine.add_request(prompt, params))
        steps = most_pages = 0
        while engine.has_work():
            if steps in (2, 5):
                engine.cancel(ids[steps])  # one running, one still waiting or just admitted
                engine.cancel(ids[-1] if steps == 2 else ids[1])
            engine.step()
            _check_pools(engine)
            steps, most_pages = steps + 1, max(most_pages, max(engine.pool.num_pages))
        _check_pools(engine, idle=True)
        assert engine.pool.num_free_pages == engine.pool.total_pages - 1
        assert most_pages >= 3  # sequences crossed page boundaries


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_pages_are_never_read_before_they_are_written(targets, family, monkeypatch):
    """The KV pools are allocated uninitialised (`torch.empty`; only the reserved page 0 is zeroed), so no output may
    depend on what a page held before a key was written to it. Every other page of the target's and the drafter's
    pools is poisoned with NaN, and so is every page a pool grows by: greedy outputs still equal plain decoding's,
    with pools sized up front by `kv_cache_tokens` (they never grow) and with pools of one page that grow."""
    target, _ = targets
    drafter = _drafter(family, target)
    grow = PagedKVPool._grow

    def poisoned_grow(pool, min_free):
        old = pool.k.shape[1]
        grow(pool, min_free)
        pool.k[:, old:], pool.v[:, old:] = float("nan"), float("nan")

    monkeypatch.setattr(PagedKVPool, "_grow", poisoned_grow)
    reference = generate_batch(target, None, PROMPTS, max_new_tokens=20, verify=0, max_batch_size=3)
    for kv_cache_tokens, grows in ((4096, False), (16, True)):
        engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=3, kv_cache_tokens=kv_cache_tokens)
        pools = (engine.pool, engine.batch_drafter.pool)
        for pool in pools:
            assert not pool.k[:, : pool.page_size].any() and not pool.v[:, : pool.page_size].any()  # page 0: zeros
            pool.k[:, pool.page_size:], pool.v[:, pool.page_size:] = float("nan"), float("nan")
        pages = [pool.total_pages for pool in pools]
        outputs = generate_batch(target, drafter, PROMPTS, max_new_tokens=20, engine=engine)
        assert outputs == reference, kv_cache_tokens
        assert [pool.total_pages > n for pool, n in zip(pools, pages)] == [grows, grows]
        assert engine.stats["accepted"] > 0  # drafts were verified against the poisoned pools


def test_kv_cache_tokens_must_be_positive(targets):
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        SpeculativeEngine(targets[0], None, verify=0, kv_cache_tokens=0)


def test_pool_accounting_check_catches_leaks_and_double_frees():
    pool = PagedKVPool(1, 1, 2, torch.float32, "cpu", max_seqs=3, page_size=4, num_pages=4)
    pool.reserve(torch.tensor([0, 2]), torch.tensor([9, 3]))  # 3 + 1 pages: the pool grows
    pool.lengths[torch.tensor([0, 2])] = torch.tensor([9, 3])
    pool.check_accounting()
    assert pool.total_pages - 1 == pool.num_free_pages + sum(pool.num_pages)
    with pytest.raises(AssertionError, match="while idle"):
        pool.check_accounting(idle=True)
    pool.release(0)
    pool.release(2)
    pool.check_accounting(idle=True)

    pool.reserve(torch.tensor([1]), torch.tensor([5]))
    leaked = pool.free_pages.pop()  # a page neither owned nor free
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_accounting()
    pool.free_pages.append(leaked)
    pool.free_pages.append(pool.free_pages[0])  # freed twice
    with pytest.raises(AssertionError, match="free twice"):
        pool.check_accounting()
    pool.free_pages.pop()
    pool.free_pages.append(int(pool.page_table[1, 0]))  # owned and free
    with pytest.raises(AssertionError, match="both owned and free"):
        pool.check_accounting()
    pool.free_pages.pop()
    pool.lengths[1] = 9  # more tokens than its pages hold
    with pytest.raises(AssertionError, match="holds 9 tokens"):
        pool.check_accounting()


def test_pending_features_follow_the_live_requests(targets):
    """Steps that do not draft keep the target features the drafter will read, without copying the ones kept before
    (one chunk per step); a finished or cancelled request's features are dropped, so memory follows the live
    requests (at most twice their pending rows) and an idle engine holds none. Output stays plain greedy."""
    from angelspec_hf.policy import CostModel

    target, twin = targets
    drafter = _drafter("dfly", target)
    never_pays = CostModel((0.01, 0.0, 0.001), (100.0, 0.0))  # a drafting call costs 100 s: plain but for probes
    engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=3, lookup_tokens=0,
                               cost_model=never_pays, measure_rates=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 99) for _ in range(rng.randrange(1, 30))] for _ in range(7)]
    lengths = [rng.randrange(1, 20) for _ in prompts]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, stop_token_ids=())) for p, n in zip(prompts, lengths)]
    outputs, steps, runner = {i: [] for i in ids}, 0, engine.runner
    while engine.has_work():
        if steps == 3:
            engine.cancel(ids[1])
        for event in engine.step():
            outputs[event.request_id].extend(event.token_ids)
        steps += 1
        held = sum(len(chunk[0]) for chunk in runner._pending)
        live = int(runner._live.sum())
        assert live == len(runner._pending_rows()[0]) and held <= 2 * live, (held, live)
    assert engine.totals["speculative_steps"] <= 2 and steps > 10  # mostly plain (the back-off's probes draft)
    assert sum(len(chunk[0]) for chunk in runner._pending) == 0  # idle: nothing kept
    for rid, prompt, n in zip(ids, prompts, lengths):
        if rid != ids[1]:
            assert outputs[rid] == plain_greedy(twin, prompt, n)


def test_a_probe_drafts_for_a_few_rows_and_the_others_keep_their_features(targets):
    """A probe (D-Cut re-planning a drafter it backed off from) drafts for a few rows of the batch only; the other
    rows keep their pending target features, so when drafting pays again and every row is drafted for, each drafts
    exactly what a fresh engine drafts after ingesting that row's whole context at once. Output stays plain greedy."""
    from angelspec_hf.policy import CostModel

    target, twin = targets
    drafter = _drafter("dfly", target)
    never_pays = CostModel((0.01, 0.0, 0.001), (100.0, 0.0))  # a drafting call costs 100 s: plain but for probes
    engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=6, lookup_tokens=0,
                               cost_model=never_pays, measure_rates=False, probe_every=2)
    engine.policy.PROBE_ROWS = 2
    drafted = {"probe": [], "draft": []}  # per kind: (decoding rows, [(context, drafted tokens) per drafted row])
    propose = engine._propose

    def recording(batch):
        proposal = propose(batch)
        if proposal.drafted:
            rows = proposal.drafter_rows.nonzero().flatten().tolist()
            drafted[proposal.kind].append((batch.num_decode, [
                (tuple(batch.requests[r].prompt + batch.requests[r].generated), proposal.tokens[r].tolist())
                for r in rows]))
        return proposal

    engine._propose = recording
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, stop_token_ids=()))
           for p, n in zip(PROMPTS, NEW_TOKENS)]
    outputs, steps = {i: [] for i in ids}, 0
    while engine.has_work():
        if steps == 14:  # drafting pays from now on: every row is drafted for, after its features kept so far
            engine.policy._cost_model = CostModel((1.0, 0.05, 1e-4), (0.0, 0.0))
        for event in engine.step():
            outputs[event.request_id].extend(event.token_ids)
        steps += 1
    for rid, prompt, n in zip(ids, PROMPTS, NEW_TOKENS):
        assert outputs[rid] == plain_greedy(twin, prompt, n)
    probes, full = drafted["probe"], drafted["draft"]
    assert len(probes) >= 2 and all(len(rows) == 2 < n_dec for n_dec, rows in probes)
    probed = {context[:3] for _, rows in probes for context, _ in rows}
    assert full and any(context[:3] not in probed for context, _ in full[0][1])  # rows the probes skipped
    for context, tokens in [row for _, rows in probes + full[:3] for row in rows]:
        fresh = SpeculativeEngine(target, drafter, verify="full", max_batch_size=1, lookup_tokens=0)
        fresh.add_request(list(context[:-1]), SamplingParams(max_new_tokens=len(tokens) + 2, stop_token_ids=()))
        assert [e.token_ids for e in fresh.step()] == [[context[-1]]]  # the prefill emits the anchor
        fresh.step()
        assert fresh.last_step.draft_tokens[0][: len(tokens)] == tokens, context
