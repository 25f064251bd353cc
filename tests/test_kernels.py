"""Triton kernels against their torch references on awkward and ragged shapes. On CPU they run under Triton's
interpreter (`TRITON_INTERPRET=1`, set in conftest.py before anything imports triton); on a GPU natively."""

import pytest
import torch

from angelspec_hf.tgi_patch import reference
from angelspec_hf.tgi_patch import triton_kernels as tk  # (needs the `kernels` extra: triton)
from angelspec_hf.tgi_patch.sampling import process_logits

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
    with the torch references: greedy and seeded sampling, D-Cut budget and full blocks."""
    from angelspec_hf.tgi_patch.engine import generate_batch
    from conftest import tiny_drafter, tiny_target

    target = tiny_target()
    drafter = tiny_drafter("dfly", target)
    prompts = [[5, 6, 7], [9] * 11, [4, 3]]
    runs = {}
    for force in ("", "1"):
        monkeypatch.setenv("ANGELSPEC_FORCE_TRITON", force)
        runs[force] = [generate_batch(target, drafter, prompts, max_new_tokens=10, verify=verify, **kw)
                       for verify in ("full", 4) for kw in ({}, {"do_sample": True, "seed": 3, "top_k": 30})]
    assert runs["1"] == runs[""]
