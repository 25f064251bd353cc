"""Greedy identity between two decodings of one target: exact in fp32, and up to precision ties in bf16 / fp16.

Speculation keeps the target's own greedy tokens, but "the target's own" depends on how its forward is batched once
the weights are in bf16 or fp16: a verification forward over several tokens, or a batch of 64 sequences, sums in
another order than a one-token step, and where the target's two best logits lie within that rounding the argmax
flips. Plain batched decoding is not invariant to this either: on the embedded target in bf16 (CPU), plain decoding
of the same 64 requests at concurrency 64 and at concurrency 1 parts on 2 of them, both times at such a tie. So in
reduced precision an identity check must tell a tie from a real divergence, and in fp32 it must not excuse anything.

`IdentityJudge` does that. Two greedy outputs that agree token for token are identical. Otherwise, at the first
position where they part (a: the reference's token, b: the other's), it runs the shared prefix through the target as
loaded and through a float32 copy of the same weights, and calls the divergence a **precision tie** when the float32
margin |z32[a] - z32[b]| is at most four times the rounding noise of the low-precision logits there, the root mean
square of z - z32 over the whole vocabulary: two forwards that each carry noise of that size cannot order the two
tokens. (The noise measured this way, on the embedded target in bf16: 0.05-0.14 at the positions where speculative
and plain decoding parted, whose float32 margins were 0.002-0.22; the two tokens' own errors vary from 0.004 to 0.16,
too noisy to judge by.) Anything else (a clear margin, one output a strict prefix of the other, or any difference in
fp32) is a divergence, which the benches fail on. fp32 stays exact, so a bug that moves the logits a little is still
caught there: the GPU playbook benches both. After a tie the two decodings continue from different tokens, so
nothing after it is compared."""

from __future__ import annotations

import copy

import torch

REDUCED_PRECISION = (torch.bfloat16, torch.float16)
TIE_NOISES = 4.0  # a tie: a float32 margin within this many RMS rounding errors of the low-precision logits


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first index where the two token lists differ (or where one ends first), None when equal."""
    for j, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return j
    return None if len(reference) == len(other) else min(len(reference), len(other))


def identity_label(identical: bool, ties: int, divergent: int) -> str:
    """How the benches show a method's greedy outputs against plain decoding's: `yes`, `ties only (n)` (parted at n
    precision ties, nowhere else) or `NO`."""
    if identical:
        return "yes"
    return f"ties only ({ties})" if not divergent else "NO"


class IdentityJudge:
    """`judge(prompt, reference, other)` for greedy outputs (token lists, new tokens only) of `target`: a dict with
    `identical` (token for token), `tie` (parted only at a precision tie), and at a divergence its `position`, the two
    `tokens`, the float32 `margin` and the low-precision logits' rounding `noise` (None where not measured). The float32 copy is made
    the first time a reduced-precision divergence is judged, and never for an fp32 target."""

    def __init__(self, target):
        self.target = target
        self._fp32 = None

    def _reference_model(self):
        if self._fp32 is None:
            model = copy.deepcopy(self.target).float()
            for module in model.modules():  # no hook the original carries (forward counters, timers) fires here
                module._forward_hooks.clear()
                module._forward_pre_hooks.clear()
            self._fp32 = model.eval()
        return self._fp32

    @torch.no_grad()
    def __call__(self, prompt: list[int], reference: list[int], other: list[int]) -> dict:
        j = first_divergence(reference, other)
        if j is None:
            return {"identical": True, "tie": False}
        verdict = {"identical": False, "tie": False, "position": j, "tokens": None, "margin": None, "noise": None}
        if j >= min(len(reference), len(other)) or self.target.dtype not in REDUCED_PRECISION:
            return verdict  # one output stops early, or fp32: no precision to excuse it
        a, b = reference[j], other[j]
        ids = torch.tensor([list(prompt) + list(reference[:j])], device=self.target.device)
        low = self.target(input_ids=ids).logits[0, -1].float()
        full = self._reference_model()(input_ids=ids).logits[0, -1].float()
        margin = float((full[a] - full[b]).abs())
        noise = float((low - full).pow(2).mean().sqrt())
        verdict.update(tokens=(a, b), margin=margin, noise=noise, tie=margin <= TIE_NOISES * noise)
        return verdict
