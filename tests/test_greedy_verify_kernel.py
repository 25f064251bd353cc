"""The fused greedy-verification kernel (`triton_kernels.verify_greedy`) against its torch reference
(`reference.verify_greedy`), field by field, and the engine's greedy steps running through it. On CPU the kernel runs
under Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest.py before anything imports triton) and the dispatch
takes it when `ANGELSPEC_FORCE_TRITON=1`; on a GPU it runs natively."""

import pytest
import torch

from angelspec_hf.tgi_patch.engine import kernels, verification
from angelspec_hf.tgi_patch.engine.kernels import reference
from angelspec_hf.tgi_patch.engine.kernels import triton_kernels as tk  # (needs the `kernels` extra: triton)
from angelspec_hf.tgi_patch.engine.model_runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = -float("inf")


def _case(vocab, depth, k, dtype, seed, prefill_rows=()):
    """Packed logits `[P, V]` of `dtype`, `positions [B, span]`, drafts `[B, k]` and depths for the ragged batch of
    `depth`: each row's drafts agree with the target's argmax for a random number of positions, then differ; exact
    ties (the first maximum is the argmax), -inf entries and a row whose first vocabulary block is all -inf."""
    g = torch.Generator().manual_seed(seed)
    depth = torch.tensor(depth)
    new = 1 + depth
    for row in prefill_rows:  # a prefilling row: several prompt tokens, nothing verified (depth 0)
        new[row] = 7
    positions = torch.tensor(ModelRunner._positions_host(new.tolist(), depth.tolist()))
    logits = (torch.randn(int(new.sum()), vocab, generator=g) * 3).to(dtype).float()
    logits[torch.rand(logits.shape, generator=g) < 0.1] = NEG_INF  # -inf entries (never a whole row)
    rows = logits.shape[0]
    # exact ties: a maximum repeated later in the row (within a block, and across the kernel's 1024-wide blocks)
    for r in range(0, rows, 2):
        a, b = sorted(torch.randperm(vocab, generator=g)[:2].tolist())
        if r % 4 == 0 and vocab > 1100:
            a, b = a % 1000, 1024 + b % (vocab - 1024)
        logits[r, a] = logits[r, b] = logits[r].max() + 1
    logits[1, : min(vocab - 1, 1024)] = NEG_INF  # a row whose first block is all -inf
    logits[1, -1] = 0.5
    logits = logits.to(dtype)  # (the values are bf16's: the ties stay ties)
    top = logits.argmax(-1)  # [P] torch's argmax: the first maximum
    span = positions.shape[1]
    draft = torch.randint(0, vocab, (len(depth), k), generator=g)
    for r, d in enumerate(depth.tolist()):
        agree = int(torch.randint(0, d + 1, (1,), generator=g))
        if r == len(depth) - 1:
            agree = d  # the last row accepts its whole depth
        draft[r, :agree] = top[positions[r, :agree]]
        if agree == d < k:  # the draft past the depth equals the argmax there: not verified, so not accepted
            draft[r, d] = top[positions[r, d]]
        if agree < min(d, span - 1):
            # the next draft differs from the argmax: on a tied row, it is the later of the tied maxima
            wrong = positions[r, agree]
            tied = (logits[wrong] == logits[wrong].max()).nonzero().flatten()
            draft[r, agree] = tied[-1] if len(tied) > 1 else (top[wrong] + 1) % vocab
    return logits, positions, draft, depth


def _assert_same(got, want):
    n_acc, token, emitted, logprobs = got
    ref_n, ref_token, ref_emitted, ref_logprobs = want
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(n_acc.cpu(), ref_n.cpu()) and torch.equal(token.cpu(), ref_token.cpu())
    assert torch.equal(emitted.cpu(), ref_emitted.cpu())
    torch.testing.assert_close(logprobs.cpu(), ref_logprobs.cpu(), atol=1e-5, rtol=0, equal_nan=True)
    beyond = torch.arange(logprobs.shape[1])[None, :] > ref_n.cpu()[:, None]
    assert (logprobs.cpu()[beyond] == 0).all()  # exact zeros past the next token


CASES = {  # vocabulary, depth per row, draft width
    "depth 0 and K": (37, [0, 5, 2, 0, 5], 5),
    "long beside none": (300, [0, 0, 9, 0, 0, 0], 9),
    "two blocks": (2100, [3, 1, 0, 3], 4),
    "wide drafts": (1100, [2, 0, 1], 7),  # the drafter drafted 7, D-Cut verifies at most 2: span 3
    "all depth 0": (50, [0, 0, 0], 4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name, dtype):
    vocab, depth, k = CASES[name]
    logits, positions, draft, depth = _case(vocab, depth, k, dtype, seed=vocab + k, prefill_rows=[0])
    args = [t.to(DEVICE) for t in (logits, positions, draft, depth)]
    got = tk.verify_greedy(*args)
    want = reference.verify_greedy(*args)
    _assert_same(got, want)
    # the cases are not trivial: drafts were accepted, and rejected where depth allowed more
    n_acc = want[0].tolist()
    assert n_acc[-1] == int(depth[-1]) and (int(depth.max()) == 0 or max(n_acc) > 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference_natively_on_cuda(dtype):
    """The GPU playbook's `pytest -m gpu` run: every case above, compiled for the device rather than interpreted."""
    assert DEVICE == "cuda"
    for name in sorted(CASES):
        test_kernel_matches_reference(name, dtype)


def test_ties_take_the_first_maximum_and_reject_a_later_one():
    """A draft equal to a tied maximum that is not the first is rejected, and the next token is the first one, across
    the kernel's vocabulary blocks as within one; a row whose values are all -inf but one still normalises."""
    vocab = 2100
    logits = torch.full((6, vocab), -1.0)
    logits[0, [7, 1500]] = 4.0  # row 0, position 0: tied across blocks, the first drafted (accepted)
    logits[1, [7, 9]] = 4.0  # row 0, position 1: tied within a block, the second drafted (rejected)
    logits[2, [2000, 2050]] = 4.0  # row 1, position 0: tied in the last, partial block, the first drafted
    logits[3, :] = NEG_INF  # row 1, position 1 (its next token): one finite entry
    logits[3, 1030] = -2.0
    logits[4, [3, 4]] = 4.0  # row 2, position 0 (depth 0: its next token)
    logits[5] = torch.randn(vocab)  # row 0, position 2: never reached
    positions = torch.tensor([[0, 1, 5], [2, 3, 3], [4, 4, 4]])
    draft = torch.tensor([[7, 9], [2000, 5], [3, 0]])
    depth = torch.tensor([2, 1, 0])
    args = [t.to(DEVICE) for t in (logits, positions, draft, depth)]
    for impl in (tk.verify_greedy, reference.verify_greedy):
        n_acc, token, emitted, logprobs = impl(*args)
        assert n_acc.tolist() == [1, 1, 0] and token.tolist() == [7, 1030, 3], impl.__module__
        assert emitted.tolist() == [[7, 7, 0], [2000, 1030, 0], [3, 0, 0]]
        assert logprobs[1, 1].item() == pytest.approx(0.0, abs=1e-6)
        assert logprobs[0, 0].item() == pytest.approx(-torch.logsumexp(logits[0] - 4.0, 0).item(), abs=1e-5)
    _assert_same(tk.verify_greedy(*args), reference.verify_greedy(*args))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_nan_and_inf_logits_give_what_torch_gives():
    """Logits a broken forward can produce: torch's argmax takes the first NaN (NaN orders above every number) and the
    first +inf, and their rows' log-probabilities are NaN; the kernel returns the same tokens and NaNs."""
    vocab = 1500
    logits = torch.randn(6, vocab)
    logits[0, [40, 1200]] = float("nan")  # row 0, position 0: a NaN after a larger number
    logits[0, 30] = 50.0
    logits[1, [1100, 1300]] = float("inf")  # row 1, position 0: two +inf, the first is the argmax
    logits[2, 1400] = float("nan")  # row 1, position 1: a NaN in the last block only
    logits[3, 5] = float("inf")  # row 2, position 0: +inf before a NaN in a later block
    logits[3, 1050] = float("nan")
    positions = torch.tensor([[0, 0], [1, 2], [3, 3]])
    draft = torch.tensor([[40], [1100], [5]])
    depth = torch.tensor([1, 1, 1])
    args = [t.to(DEVICE) for t in (logits, positions, draft, depth)]
    got, want = tk.verify_greedy(*args), reference.verify_greedy(*args)
    assert want[0].tolist() == [1, 1, 0] and want[1].tolist() == [40, 1400, 1050]
    _assert_same(got, want)
    assert got[3][:, 0].isnan().all()


def test_no_draft_at_all():
    """With no draft tokens (`K = 0`) every row verifies position 0 only: its next token and that token's
    log-probability."""
    logits, positions, _, depth = _case(64, [0, 0], 0, torch.float32, seed=4, prefill_rows=[1])
    args = [t.to(DEVICE) for t in (logits, positions, torch.zeros(2, 0, dtype=torch.long), depth)]
    _assert_same(tk.verify_greedy(*args), reference.verify_greedy(*args))


def test_dispatch_takes_the_kernel_when_forced_and_checks_the_draft_width(monkeypatch):
    """`verification.verify_greedy` runs the kernel under `ANGELSPEC_FORCE_TRITON=1` and the reference without; both
    give the same `Verified`. Fewer drafts than the positions verify is a clear error on both paths."""
    from helpers import count_calls

    calls = count_calls(monkeypatch, kernel=(tk, "verify_greedy"), reference=(reference, "verify_greedy"))
    logits, positions, draft, depth = _case(300, [2, 0, 4], 4, torch.float32, seed=5)
    args = [t.to(DEVICE) for t in (logits, positions, draft, depth)]
    results = {}
    for force in ("", "1"):
        monkeypatch.setenv("ANGELSPEC_FORCE_TRITON", force)
        results[force] = verification.verify_greedy(*args)
    if DEVICE == "cpu":
        assert calls == {"kernel": 1, "reference": 1}
    fields = ("num_accepted", "next_token", "emitted", "logprobs")
    _assert_same(*([getattr(results[f], name) for name in fields] for f in ("1", "")))
    assert results["1"].top is None and results["1"].top_candidates is None
    for force in ("", "1"):
        monkeypatch.setenv("ANGELSPEC_FORCE_TRITON", force)
        with pytest.raises(ValueError, match="at least 4 draft tokens"):
            kernels.verify_greedy(args[0], args[1], args[2][:, :3], args[3])


@pytest.mark.parametrize("verify", ["full", 4])
def test_engine_greedy_steps_run_the_kernel_and_stay_plain_greedy(monkeypatch, verify):
    """The engine on the Triton path (forced here; automatic on CUDA): every greedy verification is one call of the
    kernel, never the reference, and the output is the target's own greedy output, with drafts accepted."""
    from angelspec_hf.tgi_patch.engine import generate_batch
    from helpers import count_calls, tiny_drafter, tiny_target

    monkeypatch.setenv("ANGELSPEC_FORCE_TRITON", "1")
    calls = count_calls(monkeypatch, kernel=(tk, "verify_greedy"), reference=(reference, "verify_greedy"))
    # the engine switches its target's attention; the twin keeps eager attention
    target, twin = tiny_target().to(DEVICE), tiny_target().to(DEVICE)
    drafter = tiny_drafter("dfly", target).to(DEVICE)
    prompts = [[5, 6, 7], [9] * 11, [4, 3], [3, 4, 5, 3, 4]]
    outputs, engine = generate_batch(target, drafter, prompts, max_new_tokens=12, verify=verify, return_engine=True)
    assert calls["kernel"] > 0 and calls["reference"] == 0
    assert engine.stats["accepted"] > 0
    for prompt, out in zip(prompts, outputs):
        plain = twin.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=12, do_sample=False, eos_token_id=2,
                              pad_token_id=0)
        assert out == plain[0, len(prompt):].tolist()
