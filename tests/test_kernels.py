"""Triton kernels against their torch references on awkward and ragged shapes. On CPU they run under Triton's
interpreter (`TRITON_INTERPRET=1`, set in conftest.py before anything imports triton); on a GPU natively."""

import pytest
import torch

from angelspec_hf.tgi_patch.engine.kernels import reference
from angelspec_hf.tgi_patch.engine.kernels import triton_kernels as tk  # (needs the `kernels` extra: triton)
from angelspec_hf.tgi_patch.engine.sampling import process_logits, sample_from
from stats import (ImpossibleSample, assert_power, correction_from_p, goodness_of_fit, processed_logprobs, report,
                   total_variation)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("batch,k", [(1, 1), (3, 7), (5, 4), (6, 3)])
@pytest.mark.parametrize("with_cost", [False, True])
def test_dcut_select_matches_reference(batch, k, with_cost):
    g = torch.Generator().manual_seed(batch * 31 + k)
    for trial in range(3):
        accept = torch.rand(batch, k, generator=g)
        accept[accept < 0.1] = accept[0, 0]  # ties across rows
        drafted = torch.randint(0, k + 1, (batch,), generator=g)
        budget = int(torch.randint(0, batch * k + 2, (1,), generator=g))
        cost = None
        if with_cost:
            per_token = [0.0, 0.05, 0.3, 2.0][trial % 4]
            cost = 1.0 + per_token * torch.arange(batch * k + 1, dtype=torch.float32)
        args = (accept.to(DEVICE), drafted.to(DEVICE), budget, None if cost is None else cost.to(DEVICE), 1.5)
        depth, survival, chosen = tk.dcut_select(*args)
        ref_depth, ref_survival, ref_chosen = reference.dcut_select(*args)
        torch.testing.assert_close(survival, ref_survival)
        assert depth.tolist() == ref_depth.tolist() and int(chosen) == int(ref_chosen)


@pytest.mark.parametrize("batch,k,vocab", [(1, 0, 5), (2, 1, 33), (4, 3, 300), (3, 5, 2100)])
def test_verify_matches_reference(batch, k, vocab):
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 3
    greedy = torch.tensor([i % 2 == 0 for i in range(batch)])
    probs = process_logits(logits.reshape(-1, vocab), torch.full((batch * (k + 1),), 0.9),
                           torch.full((batch * (k + 1),), 0), torch.full((batch * (k + 1),), 1.0))
    scores = torch.where(greedy[:, None, None], logits, probs.reshape(logits.shape))
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 3 + logits[:, :k], -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k) if k else \
        torch.zeros(batch, 0, dtype=torch.long)
    if k:  # greedy rows: make some drafts equal the target's argmax so acceptance runs deep
        draft[0] = logits[0, :k].argmax(-1)
    depth = torch.randint(0, k + 1, (batch,), generator=g)
    u_accept, u_sample = torch.rand(batch, k, generator=g), torch.rand(batch, k + 1, generator=g)
    args = [t.to(DEVICE) for t in (scores, draft, q, depth, greedy, u_accept, u_sample)]
    n_acc, token = tk.verify(*args)
    ref_n, ref_token = reference.verify(*args)
    assert n_acc.tolist() == ref_n.tolist() and token.tolist() == ref_token.tolist()
    assert all(0 <= n <= d for n, d in zip(n_acc.tolist(), depth.tolist()))


def test_verify_greedy_only_without_draft_probs():
    logits = torch.randn(3, 4, 50)
    draft = logits[:, :3].argmax(-1)
    draft[1, 1] = (draft[1, 1] + 1) % 50
    depth = torch.tensor([3, 3, 1])
    greedy = torch.ones(3, dtype=torch.bool)
    args = [t.to(DEVICE) for t in (logits, draft)] + [None] + [t.to(DEVICE) for t in (depth, greedy,
                                                                                       torch.rand(3, 3), torch.rand(3, 4))]
    n_acc, token = tk.verify(*args)
    assert n_acc.tolist() == [3, 1, 1]
    assert token.tolist() == [int(logits[0, 3].argmax()), int(logits[1, 1].argmax()), int(logits[2, 1].argmax())]
    assert (n_acc.tolist(), token.tolist()) == tuple(x.tolist() for x in reference.verify(*args))


def test_engine_gives_the_same_tokens_through_the_kernels(monkeypatch):
    """The engine dispatching to the kernels (forced here; automatic on CUDA) generates exactly what it generates
    with the torch references: greedy, seeded sampling (Gumbel-max scores through the greedy rule) and unseeded
    sampling (rejection sampling), D-Cut budget and full blocks."""
    import random

    from angelspec_hf.tgi_patch.engine import generate_batch
    from helpers import tiny_drafter, tiny_target

    target = tiny_target()
    drafter = tiny_drafter("dfly", target)
    prompts = [[5, 6, 7], [9] * 11, [4, 3]]
    runs = {}
    for force in ("", "1"):
        monkeypatch.setenv("ANGELSPEC_FORCE_TRITON", force)
        runs[force] = []
        for verify in ("full", 4):
            for kw in ({}, {"do_sample": True, "seed": 3, "top_k": 30}, {"do_sample": True, "top_k": 30}):
                random.seed(0)  # the streams the engine draws for unseeded requests
                runs[force].append(generate_batch(target, drafter, prompts, max_new_tokens=10, verify=verify, **kw))
    assert runs["1"] == runs[""]


# ---- the verify rule's output law, with power --------------------------------------------------------------------
# One draft position per row (depth 1), p and q far apart, temperature 0.7 applied by `process_logits`; the exact law
# of what verify returns is known in closed form: the first token x is accepted with probability min(p0(x), q(x))
# and then followed by a bonus y ~ p1, or x is a correction with probability max(p0(x) - q(x), 0).
V_SMALL, TEMPERATURE = 6, 0.7
TARGET_LOGITS = torch.tensor([[1.4, 1.0, 0.6, 0.3, 0.0, -0.4], [0.0, 0.9, 0.2, 1.3, -0.3, 0.5]])  # positions 0, 1
DRAFT_LOGITS = torch.tensor([2.6, -0.5, 0.4, -1.0, 0.1, -0.8])  # peaked on the target's favourite token 0


def _single_position_inputs(rows, temperature=TEMPERATURE, seed=0):
    g = torch.Generator().manual_seed(seed)
    ones = torch.ones(2 * rows)
    logits = TARGET_LOGITS.repeat(rows, 1)
    scores = process_logits(logits, temperature * ones, 0 * ones.long(), ones).reshape(rows, 2, V_SMALL)
    q = process_logits(DRAFT_LOGITS.repeat(rows, 1), temperature * ones[:rows], 0 * ones[:rows].long(),
                       ones[:rows])[:, None]
    draft = torch.multinomial(q[:, 0], 1, replacement=True, generator=g)
    depth = torch.ones(rows, dtype=torch.long)
    greedy = torch.zeros(rows, dtype=torch.bool)
    return [scores, draft, q, depth, greedy, torch.rand(rows, 1, generator=g), torch.rand(rows, 2, generator=g)]


def _exact_verify_law(temperature=TEMPERATURE):
    """Cells (x, 1, y): draft x accepted, bonus y; (x, 0, -1): x drawn as the correction. From the float64 softmax
    of the logits (independent of `process_logits`)."""
    p0, p1 = (processed_logprobs(TARGET_LOGITS, temperature).exp()).tolist()
    q = processed_logprobs(DRAFT_LOGITS, temperature).exp().tolist()
    law = {(x, 1, y): min(p0[x], q[x]) * p1[y] for x in range(V_SMALL) for y in range(V_SMALL)}
    law |= {(x, 0, -1): max(p0[x] - q[x], 0.0) for x in range(V_SMALL)}
    return law


def _outcomes(args, num_accepted, token):
    draft = args[1][:, 0]
    return [(int(d), 1, int(t)) if n else (int(t), 0, -1)
            for d, n, t in zip(draft.tolist(), num_accepted.tolist(), token.tolist())]


def _fit(args, verify):
    try:
        return goodness_of_fit(_outcomes(args, *verify(*args)), _exact_verify_law())
    except ImpossibleSample:
        return 0.0  # a sample in a cell of probability zero: rejected outright


def _textbook_verify(accept="p/q", correction="residual", bonus="p"):
    """Leviathan et al. for one draft position written out plainly, with switches for known-wrong variants."""

    def verify(scores, draft, q, depth, greedy, u_accept, u_sample):
        p0, p1, q0, d = scores[:, 0].float(), scores[:, 1].float(), q[:, 0].float(), draft[:, 0]
        p_d, q_d = p0.gather(1, d[:, None])[:, 0], q0.gather(1, d[:, None])[:, 0]
        accepted = u_accept[:, 0] * q_d < p_d if accept == "p/q" else u_accept[:, 0] * p_d < q_d
        residual = (p0 - q0).clamp(min=0)
        fix = sample_from(residual if correction == "residual" else p0, u_sample[:, 0])
        extra = sample_from(p1 if bonus == "p" else (p1 - q0).clamp(min=0), u_sample[:, 1])
        return accepted.long(), torch.where(accepted, extra, fix)

    return verify


WRONG_VERIFY_RULES = {
    "correction from p": lambda impl: correction_from_p(impl),
    "accept min(1, q/p)": lambda impl: _textbook_verify(accept="q/p"),
    "bonus from the residual": lambda impl: _textbook_verify(bonus="residual"),
}


def test_reference_verify_keeps_the_target_distribution_with_power():
    """20,000 rows in one call of the torch reference: the exact law of (token, accepted, bonus) at T = 0.7 passes;
    each known-wrong rule, and the right rule fed T = 1 probabilities (temperature ignored), is rejected."""
    rows = 20_000
    args = _single_position_inputs(rows)
    p0 = processed_logprobs(TARGET_LOGITS[0], TEMPERATURE).exp()
    q = processed_logprobs(DRAFT_LOGITS, TEMPERATURE).exp()
    assert total_variation(p0, q) > 0.3  # p and q differ strongly: rejections are common
    n_acc, token = reference.verify(*args)
    assert (n_acc.tolist(), token.tolist()) == tuple(x.tolist() for x in _textbook_verify()(*args))
    right = _fit(args, reference.verify)
    wrong = {name: _fit(args, make(reference.verify)) for name, make in WRONG_VERIFY_RULES.items()}
    wrong["temperature ignored"] = _fit(_single_position_inputs(rows, temperature=1.0), reference.verify)
    report("reference verify, 20k rows, T=0.7", right, **wrong)
    assert_power(right, wrong)


def test_triton_verify_keeps_the_target_distribution_with_power():
    """The Triton kernel on the same law (a small grid: under the CPU interpreter each row is a program)."""
    rows = 400 if DEVICE == "cpu" else 20_000

    def triton_verify(*args):  # CPU tensors in and out; the kernel runs on DEVICE
        return tuple(x.cpu() for x in tk.verify(*[t.to(DEVICE) for t in args]))

    args = _single_position_inputs(rows, seed=1)
    n_acc, token = triton_verify(*args)
    ref_n, ref_token = (x.cpu() for x in reference.verify(*[t.to(DEVICE) for t in args]))
    differ = int(((n_acc != ref_n) | (token != ref_token)).sum())
    assert differ <= (0 if DEVICE == "cpu" else rows // 2000)  # on a GPU a float sum may round differently, rarely
    ran = lambda *_: (n_acc, token)  # noqa: E731  (the kernel's outputs on these inputs, computed once)
    right = _fit(args, ran)
    wrong = {"correction from p": _fit(args, correction_from_p(ran)),
             "temperature ignored": _fit(_single_position_inputs(rows, temperature=1.0, seed=1), triton_verify)}
    report(f"triton verify, {rows} rows, T=0.7", right, **wrong)
    assert_power(right, wrong)


def test_verify_sampled_rows_without_draft_probs_match_reference():
    """No draft probabilities (`draft_probs=None`) with sampled rows in the batch: the kernel accepts by the same rule
    as the reference (draft == the target's argmax) and samples the next token from p, never reading a q it lacks."""
    g = torch.Generator().manual_seed(5)
    batch, k, vocab = 5, 3, 40
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 3
    greedy = torch.tensor([True, False, False, False, True])
    scores = torch.where(greedy[:, None, None], logits, torch.softmax(logits, -1))
    draft = logits[:, :k].argmax(-1)
    draft[2, 1] = (draft[2, 1] + 1) % vocab  # a sampled row whose second draft is not the argmax
    depth = torch.tensor([3, 3, 3, 1, 2])
    args = [t.to(DEVICE) for t in (scores, draft)] + [None] + [
        t.to(DEVICE) for t in (depth, greedy, torch.rand(batch, k, generator=g), torch.rand(batch, k + 1, generator=g))]
    n_acc, token = tk.verify(*args)
    ref_n, ref_token = reference.verify(*args)
    assert ref_n.tolist() == [3, 3, 1, 1, 2]
    assert n_acc.tolist() == ref_n.tolist() and token.tolist() == ref_token.tolist()


def test_a_draw_never_lands_on_a_zero_probability_token():
    """Inverse-CDF sampling at the top of the unit interval (u × total reaching the total, which rounding can do in
    the kernel's blocked sums): both samplers fall back to the last token of positive weight, not the vocabulary's
    last token, which here has probability zero — in the bonus draw from p and in the correction from max(p - q, 0)."""
    batch, vocab = 3, 300  # more than one block of the kernel's vocabulary loop
    p = torch.zeros(batch, 2, vocab)
    p[:, :, [3, 7, 150]] = torch.tensor([0.5, 0.25, 0.25])
    p[1, :, 150] = 0.0  # row 1's last positive token is 7
    p[1, :, 3] = 0.75
    q = torch.zeros(batch, 1, vocab)
    q[:, 0, 3] = 1.0  # residual max(p - q, 0) keeps 7 and 150 (7 alone in row 1)
    draft = torch.full((batch, 1), 3)
    depth = torch.tensor([0, 1, 1])  # row 0: bonus from p; rows 1, 2: draft 3 rejected (u * q(3) >= p(3))
    greedy = torch.zeros(batch, dtype=torch.bool)
    u_accept, u_sample = torch.ones(batch, 1), torch.ones(batch, 2)
    args = [t.to(DEVICE) for t in (p, draft, q, depth, greedy, u_accept, u_sample)]
    assert sample_from(p[:, 0], torch.ones(batch)).tolist() == [150, 7, 150]
    for verify in (reference.verify, tk.verify):
        n_acc, token = verify(*args)
        assert n_acc.tolist() == [0, 0, 0] and token.tolist() == [150, 7, 150], verify.__module__
