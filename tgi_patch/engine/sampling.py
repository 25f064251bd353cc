"""A request's distribution and its random draws, for a whole batch with no per-row loop: penalties, then
temperature / top-k / top-p as per-row tensors (transformers' and TGI's order), and random numbers from a
counter-based generator keyed by (request seed, token position, stream): a request's random numbers depend on its
seed alone, never on which other requests share the batch. How a sampled request's tokens are drawn from them:

- **Seeded** (`Request.coupled`; drafter-invariant coupling, Daliri, Musco & Suresh 2024): the token at generated
  position t is the Gumbel-max draw `argmax_v(log p_t(v) + G_t(v))` from the request's processed distribution p_t
  there, G_t(v) i.i.d. Gumbel(0, 1) keyed by (seed, t, v) (`gumbel`, stream GUMBEL; computed as the exponential
  race `argmax_v p_t(v) / E_t(v)`, E = exp(-G): `gumbel_scores`). That is an exact draw from p_t
  and a function of (seed, t, the tokens before t) alone: the tokens plain sampling gives with that seed, alone, in
  any batch, beside a twin with the same seed, in every verify mode, with or without drafts and n-gram lookups (up to
  the target's floating-point noise across batch shapes, as for greedy). The drafter draws from the same noise
  (`argmax_v(log q_t(v) + G_t(v))`, so it often agrees) and every proposal is verified by exact match against the
  target's draw, as a greedy one is; no D-Cut decision can bias it.
- **Unseeded**: exact rejection sampling (Leviathan et al.), whose acceptance 1 - TV(p, q) is above the coupling's:
  drafts drawn from q by inverse CDF (stream DRAFT), accepted with probability min(1, p/q) (ACCEPT), else a correction
  from norm(max(p - q, 0)) (RESAMPLE). Its tokens depend on which positions were verified drafts, which under a shared
  budget, or with lookups, follows the batch; the engine draws it a random seed, so there is nothing to reproduce. A
  position's DRAFT number is drawn again when a later step drafts that position again (its earlier draft was not
  verified): harmless only because an unverified draft leaves no trace in what any step decides (no plan reads such
  a request's drawn tokens: `angelspec_hf/policy/acceptance.py`, above `draft_confidence`); keep it that way.

Penalties (applied to the target's logits before temperature / top-k / top-p, as in transformers and TGI):
- `repetition_penalty` r (transformers' / TGI's rule, over prompt + generated tokens): a token already seen has its
  logit divided by r when positive, multiplied by r when negative; 1 = off.
- `frequency_penalty` f and `presence_penalty` p (OpenAI's rule, as vLLM applies it, over generated tokens only):
  `logit -= f * count + p * (count > 0)`; 0 = off.

A speculative step scores several positions of a request at once: position j follows the request's tokens *and* the
draft tokens `d_0 .. d_{j-1}`, so each position is penalised with the counts of its own prefix. Verification then
compares (greedy, seeded) or rejection-samples against exactly the distribution plain decoding with the same
penalties would use at that position; the drafter's proposals are unpenalised, which costs acceptance but never
exactness.
"""

from __future__ import annotations

import torch

from .transfer import upload

# streams of the counter-based generator (at most 4: the stream is the low two bits of a position's key)
DRAFT, ACCEPT, RESAMPLE, GUMBEL = 0, 1, 2, 3

_MASK = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31, 40)}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (logical shifts emulated; multiplication wraps)."""
    x = x ^ ((x >> 30) & _MASK[30])
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & _MASK[27])
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & _MASK[31])


def _key(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The generator's 64-bit key (int64) of each (seed, position) on `stream`; `seeds` broadcasts against
    `positions`."""
    return _mix(seeds.long() * -7046029254386353131 + _mix(positions.long() * 4 + stream))  # golden-ratio odd constant


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """U[0, 1) float32 (24 bits), one per `positions` entry; `seeds` broadcasts against `positions` (int64)."""
    return ((_key(seeds, positions, stream) >> 40) & ((1 << 24) - 1)).float() / float(1 << 24)


def _mix_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`_mix` in place on int64 `x`, with `scratch` (same shape) for the shifted copies: no allocation."""
    for shift, factor in ((30, -4658895280553007687), (27, -7723592293110705685), (31, None)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        x ^= scratch.bitwise_and_(_MASK[shift])
        if factor is not None:
            x *= factor
    return x


# 1 / (2^24 + 1) as float32 (2^-24 - 2^-48): times 2^24 it is 1 - 2^-24 < 1 in float32 (a division by 2^24 + 1, which
# float32 rounds to 2^24, would give 1, and E = inf, for k = 0)
_INV_2_24_PLUS_1 = float(torch.tensor(1 / ((1 << 24) + 1), dtype=torch.float32))


def _exponential_(k: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Exp(1) values into float32 `out` from the generator's 24-bit uniforms k / 2^24 (int64 `k`, overwritten):
    `E = -log u` with u = (k + 1) / (2^24 + 1), in the open interval (0, 1), computed as `-log1p(-(1 - u))` so that
    it stays exact enough, and positive, in float32 where u is near 1: E in [5.96e-8, 16.64], never 0 or inf."""
    out.copy_(k.neg_().add_(1 << 24)).mul_(_INV_2_24_PLUS_1)  # 1 - u = (2^24 - k) / (2^24 + 1), below 1
    return out.neg_().log1p_().neg_()


_CPU_BLOCK = 1 << 18  # values per block on CPU: they stay in cache, where whole tensors do not


def _exponentials(rows: torch.Tensor, vocab_size: int, probs: torch.Tensor | None = None) -> torch.Tensor:
    """For row keys `rows [N]` (int64, `_key(seed, position, GUMBEL)`): E `[N, V]` float32, i.i.d. Exp(1), E[i, v]
    from the generator's uniform `uniforms(rows[i], v, GUMBEL)` (`_exponential_`); or, with `probs [N, V]`,
    `probs / E`. In place, in blocks of rows on CPU (one block elsewhere)."""
    n, dev = rows.shape[0], rows.device
    base = rows.long() * -7046029254386353131
    tokens = _mix(torch.arange(vocab_size, device=dev) * 4 + GUMBEL)  # [V]: what `uniforms` adds per token
    out = torch.empty(n, vocab_size, dtype=torch.float32, device=dev)
    block = max(1, _CPU_BLOCK // max(1, vocab_size)) if dev.type == "cpu" else max(1, n)
    x = torch.empty(min(block, n), vocab_size, dtype=torch.long, device=dev)
    scratch = torch.empty_like(x)
    for start in range(0, n, block):
        stop = min(start + block, n)
        key = torch.add(base[start:stop, None], tokens, out=x[: stop - start])
        _mix_(key, scratch[: stop - start])
        key >>= 40
        e = _exponential_(key.bitwise_and_((1 << 24) - 1), out[start:stop])
        if probs is not None:
            torch.div(probs[start:stop].float(), e, out=e)
    return out


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise `[..., V]` (float32) for each (seed, position) of `seeds` / `positions` (broadcast to
    `[...]`), one value per token v: `-log E` with E = -log u (`_exponential_`), u the generator's 24-bit uniform
    keyed by (seed, position, v) on stream GUMBEL (the (seed, position) key seeds a stream over token ids), moved into
    the open interval (0, 1) so that every value is finite. The noise of a (seed, position) is the same whatever else
    is computed beside it."""
    rows = _key(seeds, positions, GUMBEL)
    return _exponentials(rows.reshape(-1), vocab_size).log_().neg_().reshape(*rows.shape, vocab_size)


def gumbel_scores(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Scores `[..., V]` (float32) of distributions `probs [..., V]` (zeros allowed) under the noise of each (seed,
    position) (broadcast to `probs.shape[:-1]`): `p / E` (an exponential race), whose argmax is the Gumbel-max draw
    `argmax(log p + G)` with `G = -log E` = `gumbel(seeds, positions, V)`: an exact draw from each row, and the same
    token for the same (seed, position, probs) wherever it is computed; a seeded request's draws (module docstring).
    V hashes per row, vectorised (on CPU in cache-sized blocks of rows)."""
    rows = _key(seeds, positions, GUMBEL).expand(probs.shape[:-1]).reshape(-1)
    v = probs.shape[-1]
    return _exponentials(rows, v, probs.reshape(-1, v)).reshape(probs.shape)


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits that no temperature turns into NaN: NaN is -inf (never drawn), +inf the largest float32 (the
    top), and a row with nothing above -inf (fully masked) all zeros (uniform) — so every row keeps a finite
    maximum, and any distribution built from it sums to one."""
    x = torch.nan_to_num(logits.float(), nan=-float("inf"), posinf=torch.finfo(torch.float32).max,
                         neginf=-float("inf"))
    return x.masked_fill(~(x > -float("inf")).any(-1, keepdim=True), 0.0)


def process_logits(logits, temperature, top_k, top_p, any_top_k: bool | None = None,
                   any_top_p: bool | None = None) -> torch.Tensor:
    """Sampling probabilities `[N, V]` from logits `[N, V]` with per-row temperature `[N]` (> 0), top-k `[N]`
    (0 = off) and top-p `[N]` (1 = off), applied in transformers' order (temperature, top-k, top-p). Defined for any
    input: logits through `finite_logits`, temperatures clamped to the normal float32 range (one that overflowed
    float32 samples as its largest value: uniformly over the tokens with finite logits), so no row is ever NaN.
    `any_top_k` / `any_top_p`: whether some row uses top-k / top-p, where the caller knows it (else read from the
    tensors)."""
    x = finite_logits(logits)
    finfo = torch.finfo(torch.float32)
    t = torch.nan_to_num(temperature.float(), nan=1.0).clamp(min=finfo.tiny, max=finfo.max)
    # shifted so the top logit is 0 before dividing: a tiny temperature then gives -inf / 0 (the argmax), not inf - inf
    x = (x - x.max(dim=-1, keepdim=True).values) / t[:, None]
    if any_top_k if any_top_k is not None else bool((top_k > 0).any()):
        k = top_k.clamp(min=1, max=x.shape[-1])
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        kth = torch.where((top_k > 0)[:, None], kth, torch.full_like(kth, -float("inf")))
        x = x.masked_fill(x < kth, -float("inf"))
    if any_top_p if any_top_p is not None else bool((top_p < 1).any()):
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
    the row gives probability zero (two binary searches per row; no pass over the vocabulary). Always an index in
    [0, V): a row without positive mass (all zeros, or NaN) gives its first token rather than V."""
    cdf = probs.float().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    index = torch.searchsorted(cdf, u.float().unsqueeze(-1) * total, right=True)
    index = torch.where(index < cdf.shape[-1], index, torch.searchsorted(cdf, total))
    return index.clamp(max=cdf.shape[-1] - 1).squeeze(-1)


class PenaltyState:
    """One request's token statistics: `seen [V]` (prompt + generated) and `counts [V]` (generated only)."""

    def __init__(self, prompt: list[int], vocab_size: int, device):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def add(self, tokens: list[int]) -> None:
        if tokens:
            ids = upload(tokens, self.seen.device)
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
    r = repetition.float().clamp(min=torch.finfo(torch.float32).tiny)[:, None, None]  # a denormal could flush to 0
    x = torch.where(seen[:, None] | (drafted > 0), torch.where(x < 0, x * r, x / r), x)
    x = x - frequency.float()[:, None, None] * count - presence.float()[:, None, None] * (count > 0).float()
    # a tiny repetition penalty divides a positive logit past float32 (inf), a huge one multiplies a negative one
    # below it: kept at the largest finite magnitudes, so the ordering stays and no log-softmax turns NaN
    finfo = torch.finfo(torch.float32)
    return x.clamp(min=finfo.min, max=finfo.max)
