"""Repetition, frequency and presence penalties on the target's logits, for every verified position of a step.

The rules (applied before temperature / top-k / top-p, as in transformers and TGI):
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
