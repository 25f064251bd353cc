"""Per-request sampling for a batch, with no per-row loop: temperature / top-k / top-p as tensors, and random numbers
from a counter-based generator keyed by (request seed, token position, stream). A request's samples therefore depend
on its seed alone, never on which other requests share the batch or on how many draft tokens a step verified."""

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
    """Inverse-CDF draw from each row of `probs` (unnormalised is fine) with uniforms `u` (same leading shape)."""
    cdf = probs.float().cumsum(-1)
    target = (u.float() * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
