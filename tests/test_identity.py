"""`identity.IdentityJudge`: what the benches call a precision tie in bf16, and that fp32 excuses nothing. On the
embedded target in bf16 (CPU), plain batched decoding of the EVAL prompts at concurrency 64 parts from its own run at
concurrency 1, and speculative decoding from either, only where the target's two best logits lie within the rounding
of its bf16 forward; the real-model test below finds such a position and judges it, a clear divergence and fp32."""

import pytest
import torch

import angelspec_hf
from angelspec_hf.bench_batch import identity_label
from angelspec_hf.identity import IdentityJudge, first_divergence
from angelspec_hf.prompts import chat_ids, load_eval_prompts


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([], [4]) == 0


def test_an_fp32_target_is_never_excused(target):
    judge = IdentityJudge(target)  # the tiny fp32 target
    assert judge([5, 6], [7, 8], [7, 8]) == {"identical": True, "tie": False}
    verdict = judge([5, 6], [7, 8], [7, 9])
    assert (verdict["identical"], verdict["tie"], verdict["position"], verdict["margin"]) == (False, False, 1, None)
    assert judge._fp32 is None  # no float32 copy made for an fp32 target


def test_the_labels_and_what_fails():
    tie = {"identical": False, "tie": True, "position": 1, "tokens": (2, 3), "margin": 0.01, "noise": 0.1}
    assert identity_label({"identical": True, "ties": [], "divergent": []}) == "yes"
    assert identity_label({"identical": False, "ties": [tie, tie], "divergent": []}) == "ties only (2)"
    assert identity_label({"identical": False, "ties": [tie], "divergent": [dict(tie, tie=False)]}) == "NO"


@pytest.mark.real_model
def test_a_bf16_tie_is_told_from_a_divergence_on_the_real_target():
    target, tokenizer = angelspec_hf.load_default_target(dtype=torch.bfloat16)
    prompt = chat_ids(tokenizer, load_eval_prompts("mt_bench", 4)[2])
    ids = torch.tensor([prompt])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    judge = IdentityJudge(target)
    reference = judge._reference_model()
    assert reference.dtype == torch.float32 and next(target.parameters()).dtype == torch.bfloat16
    # the position of plain's output where the float32 copy's two best tokens are closest
    margins = []
    with torch.no_grad():
        for j in range(len(plain)):
            top = reference(input_ids=torch.tensor([prompt + plain[:j]])).logits[0, -1].float().topk(60)
            margins.append((float(top.values[0] - top.values[1]), j, top.indices.tolist()))
    margin, j, ranked = min(margins)
    assert margin < 0.02, margins  # this prompt has a near-tie among its first tokens (0.002 at token 1)
    other_best = ranked[1] if ranked[0] == plain[j] else ranked[0]
    verdict = judge(prompt, plain, plain[:j] + [other_best])
    assert verdict["tie"] and verdict["position"] == j and verdict["margin"] <= 4 * verdict["noise"], verdict
    far = judge(prompt, plain, plain[:j] + [ranked[59]])  # a token the target ranks 60th there
    assert not far["tie"] and not far["identical"] and far["margin"] > 4 * far["noise"], far
    assert not judge(prompt, plain, plain[:j])["tie"]  # an output that stops early is a divergence
    fp32 = IdentityJudge(target.float())
    assert not fp32(prompt, plain, plain[:j] + [other_best])["tie"]
