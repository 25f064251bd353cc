"""A request's distribution and its random draws, for a whole batch with no per-row loop: penalties, then
temperature / top-k / top-p as per-row tensors (transformers' and TGI's order), and random numbers from a
counter-based generator keyed by (request seed, token position, stream). A request's random numbers therefore depend
on its seed alone, never on which other requests share the batch. Its tokens do too wherever how many draft tokens
each step verifies does not depend on the batch (`verify="full"` or a fixed depth); under a shared budget ("auto", or
a fixed budget) that number follows the batch and D-Cut's calibrated, timed choices, and a position is then either a
verified draft token or drawn from p, so one seed may give other tokens in another batch, always distributed as the
target's. A position's DRAFT number is drawn again when a later step drafts that position again (its earlier draft
was not verified): harmless only because an unverified draft leaves no trace in what any step decides (no plan reads
a sampled request's drawn tokens: `dcut.py`, above `draft_confidence`); keep it that way.

Penalties (applied to the target's logits before temperature / top-k / top-p, as in transformers and TGI):
- `repetition_penalty` r (transformers' / TGI's rule, over prompt + generated tokens): a token already seen has its
  logit divided by r when positive, multiplied by r when negative; 1 = off.
- `frequency_penalty` f and `presence_penalty` p (OpenAI's rule, as vLLM applies it, over generated tokens only):
  `logit -= f * count + p * (count > 0)`; 0 = off.

A speculative step scores several positions of a request at once: position j follows the request's tokens *and* the
draft tokens `d_0 .. d_{j-1}`, so each position is penalised with the counts of its own prefix. Verification then
compares (greedy) or rejection-samples against exactly the distribution plain decoding with the same penalties would
use at that position; the drafter's proposals are unpenalised, which costs acceptance but never exactness.
"""

from __future__ import annotations

import torch

# streams of the counter-based generator
DRAFT, ACCEPT, RESAMPLE = 0, 1, 2

_MASK = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31, 40)}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (logical shifts emulated; multiplication wraps)."""
    x = x ^ ((x >> 30) & _MASK[30])
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & _MASK[27])
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & _MASK[31])


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """U[0, 1) float32, one per `positions` entry; `seeds` broadcasts against `positions` (int64)."""
    key = _mix(seeds.long() * -7046029254386353131 + _mix(positions.long() * 4 + stream))  # golden-ratio odd constant
    return ((key >> 40) & ((1 << 24) - 1)).float() / float(1 << 24)


def process_logits(logits, temperature, top_k, top_p) -> torch.Tensor:
    """Sampling probabilities `[N, V]` from logits `[N, V]` with per-row temperature `[N]` (> 0), top-k `[N]`
    (0 = off) and top-p `[N]` (1 = off), applied in transformers' order (temperature, top-k, top-p)."""
    x = logits.float()
    # shifted so the top logit is 0 before dividing: a tiny temperature then gives -inf / 0 (the argmax), not inf - inf
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None].float()
    if bool((top_k > 0).any()):
        k = top_k.clamp(min=1, max=x.shape[-1])
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        kth = torch.where((top_k > 0)[:, None], kth, torch.full_like(kth, -float("inf")))
        x = x.masked_fill(x < kth, -float("inf"))
    if bool((top_p < 1).any()):
        probs, order = torch.sort(torch.softmax(x, dim=-1), dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = (before >= top_p[:, None].float()) & (torch.arange(x.shape[-1], device=x.device) > 0)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, -float("inf"))
    return torch.softmax(x, dim=-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of `probs` (unnormalised is fine) with uniforms `u` (same leading shape): the
    first token whose cumulative mass exceeds u × total. Where rounding leaves none (u × total reaching the total),
    the token at which the cumulative mass reaches its total — its weight is positive — never a token after it, which
    the row gives probability zero (two binary searches per row; no pass over the vocabulary)."""
    cdf = probs.float().cumsum(-1)
    total = cdf[..., -1:]
    index = torch.searchsorted(cdf, u.float().unsqueeze(-1) * total, right=True)
    return torch.where(index < cdf.shape[-1], index, torch.searchsorted(cdf, total)).squeeze(-1)


class PenaltyState:
    """One request's token statistics: `seen [V]` (prompt + generated) and `counts [V]` (generated only)."""

    def __init__(self, prompt: list[int], vocab_size: int, device):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def add(self, tokens: list[int]) -> None:
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.seen.device)
            self.seen[ids] = True
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=ids.device))


def apply_penalties(logits: torch.Tensor, draft: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalised float32 logits `[P, S, V]` for P requests scored at S consecutive positions.

    logits `[P, S, V]`; draft `[P, >= S-1]`: position j follows `draft[:, :j]`; seen / counts `[P, V]`: each request's
    statistics before position 0; repetition / frequency / presence `[P]`.
    """
    p, s, v = logits.shape
    drafted = torch.zeros(p, s, v, device=logits.device)
    if s > 1:  # one-hot of d_{j-1} at position j, summed along the block: the draft prefix's counts at every position
        drafted[:, 1:].scatter_(2, draft[:, : s - 1, None], 1.0)
        drafted = drafted.cumsum(1)
    count = counts[:, None] + drafted
    x = logits.float()
    r = repetition.float()[:, None, None]
    x = torch.where(seen[:, None] | (drafted > 0), torch.where(x < 0, x * r, x / r), x)
    return x - frequency.float()[:, None, None] * count - presence.float()[:, None, None] * (count > 0).float()
