"""The engine's sampler: where each request's sampling parameters meet the models' logits, for the whole batch.

* Drafting (`draft_selector`): each draft token is the drafter's argmax for a greedy request; for a sampled one, a
  draw from the drafter's distribution processed with the request's temperature / top-k / top-p (its q): the
  Gumbel-max draw with the request's own noise when it is seeded, an inverse-CDF draw from its random stream when
  not (`sampling.py`); D-Cut's confidence comes with it.
* Verification (`verify_drafts`; `verify_forward` picks `verify_greedy` for plain greedy batches): the target's
  logits at every verified position, penalised position by position, processed like the drafter's for sampled
  requests, decide in one call for the ragged batch (`kernels.verify`: greedy acceptance, or exact rejection sampling;
  the spec is `kernels/reference.py`) how many drafts each request keeps and the token after them; a seeded request
  takes the greedy rule on its Gumbel-max scores (`sampling.gumbel_scores`), whose argmax is its token. With the
  log-probability of every emitted token and, where asked for, the most likely tokens at each position.

The distributions and random numbers themselves are `sampling.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .sampling import (ACCEPT, DRAFT, RESAMPLE, apply_penalties, gumbel_scores, process_logits, sample_from,
                       uniforms)


def process_requests(logits, requests, span: int) -> torch.Tensor:
    """Sampling probabilities `[N, V]` of `logits [N, V]` holding `span` consecutive rows per request, each processed
    with its request's temperature, top-k and top-p (a greedy request's at temperature 1)."""
    temperature = torch.tensor([r.params.temperature if r.params.do_sample else 1.0 for r in requests],
                               device=logits.device).repeat_interleave(span)
    top_k = torch.tensor([r.params.top_k for r in requests], device=logits.device).repeat_interleave(span)
    top_p = torch.tensor([r.params.top_p for r in requests], device=logits.device).repeat_interleave(span)
    return process_logits(logits, temperature, top_k, top_p)


def penalise(raw, draft, requests):
    """`raw [B, span, V]` with each penalised request's rows penalised position by position (`apply_penalties`)."""
    rows = [i for i, r in enumerate(requests) if r.penalties is not None]
    if not rows:
        return raw
    sub = [requests[i] for i in rows]
    index = torch.tensor(rows, device=raw.device)

    def per_request(name):
        return torch.tensor([getattr(r.params, name) for r in sub], device=raw.device)

    raw = raw.float().clone()
    raw[index] = apply_penalties(raw[index], draft[index], torch.stack([r.penalties.seen for r in sub]),
                                 torch.stack([r.penalties.counts for r in sub]), per_request("repetition_penalty"),
                                 per_request("frequency_penalty"), per_request("presence_penalty"))
    return raw


def draft_selector(requests, device, process, confidence):
    """`select(logits [B, V], j)` for `BatchDrafter.draft` over `requests`: draft token j of each request (its
    argmax when greedy, else a draw from q = `process(logits, requests, 1)` at its position j: the Gumbel-max draw
    with its noise when seeded, coupled to the target's draw there, an inverse-CDF draw with its seed's stream when
    not), that q (None when every request is greedy) and D-Cut's `confidence(probs, token)` there."""
    greedy = torch.tensor([not r.params.do_sample for r in requests], device=device)
    all_greedy = bool(greedy.all())
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=device)
    gen_pos = torch.tensor([len(r.generated) for r in requests], device=device)
    coupled = [i for i, r in enumerate(requests) if r.coupled]
    coupled = torch.tensor(coupled, dtype=torch.long, device=device) if coupled else None

    def select(logits, j):
        if all_greedy:
            probs = torch.softmax(logits.float(), -1)
            token = probs.argmax(-1)
            return token, None, confidence(probs, token)
        probs = process(logits, requests, 1)
        sampled = sample_from(probs, uniforms(seeds, gen_pos + j, DRAFT))
        if coupled is not None:  # seeded rows: the Gumbel-max draw from q with the noise of position j
            sampled[coupled] = gumbel_scores(probs[coupled], seeds[coupled], gen_pos[coupled] + j).argmax(-1)
        token = torch.where(greedy, logits.argmax(-1), sampled)
        greedy_probs = torch.softmax(logits.float(), -1)
        conf = torch.where(greedy, confidence(greedy_probs, token), confidence(probs, token))
        return token, probs, conf

    return select


@dataclass
class Verified:
    num_accepted: torch.Tensor  # [B] draft tokens accepted per request
    next_token: torch.Tensor  # [B] the token after them (correction or bonus)
    emitted: torch.Tensor  # [B, span] the accepted drafts, then the next token (the rest: padding)
    logprobs: torch.Tensor  # [B, span] log-probability of each emitted token under the (penalised) target logits
    top: list | None  # `top_tokens`


def verify_drafts(raw, draft, draft_probs, depth, requests, process=process_requests) -> Verified:
    """Verify each request's first `depth [B]` draft tokens `draft [B, K]` (q: `draft_probs [B, K, V]`, read for the
    rejection-sampled requests only, or None when there are none) against the target's logits `raw [B, span, V]` at
    its verified positions (row j: the token after draft j - 1), with `process` the per-request processing of
    `process_requests`'s signature. A seeded sampled request is verified by the greedy rule on its Gumbel-max scores
    (`sampling.gumbel_scores` of p) at each position up to its depth: its token there is their argmax."""
    span, dev = raw.shape[1], raw.device
    ar = torch.arange(span, device=dev)[None, :]
    raw = penalise(raw, draft, requests)
    exact_match = torch.tensor([not r.params.do_sample or r.coupled for r in requests], device=dev)
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=dev)
    gen_pos = torch.tensor([len(r.generated) for r in requests], device=dev)[:, None] + ar
    scores = raw
    if any(r.params.do_sample for r in requests):
        probs = process(raw.reshape(-1, raw.shape[-1]), requests, span).reshape(raw.shape)
        scores = torch.where(exact_match[:, None, None], raw, probs)
        if any(r.coupled for r in requests):  # each seeded row's positions up to its depth (the rest are not read)
            coupled = torch.tensor([r.coupled for r in requests], device=dev)
            rows = coupled[:, None] & (ar <= depth[:, None])  # [B, span]
            scores[rows] = gumbel_scores(probs[rows], seeds[:, None].expand(-1, span)[rows], gen_pos[rows])
    draft_v = draft[:, : span - 1]
    q = draft_probs[:, : span - 1] if draft_probs is not None else None
    num_accepted, next_token = kernels.verify(
        scores, draft_v, q, depth, exact_match, uniforms(seeds[:, None], gen_pos[:, : span - 1], ACCEPT),
        uniforms(seeds[:, None], gen_pos, RESAMPLE),
    )
    emitted = torch.cat([draft_v, draft_v.new_zeros(len(requests), 1)], 1)
    emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
    log_probs = torch.log_softmax(raw.float(), -1)
    logprobs = log_probs.gather(-1, emitted[..., None]).squeeze(-1)
    return Verified(num_accepted, next_token, emitted, logprobs, top_tokens(log_probs, requests))


def verify_forward(forward, draft, draft_probs, depth, requests, process=process_requests) -> Verified:
    """`verify_drafts` on a packed forward (`model_runner.PackedForward`). A batch of greedy requests without
    penalties or top tokens takes `verify_greedy`, which reads only the logits of the positions each row verifies and
    emits; the others get the `[B, span, V]` copy of the logits (every row padded to the batch's deepest)."""
    if draft_probs is None and not any(r.params.do_sample or r.penalties is not None or r.params.top_n_tokens
                                       for r in requests):
        return verify_greedy(forward.logits, forward.positions, draft, depth)
    return verify_drafts(forward.scored, draft, draft_probs, depth, requests, process)


def verify_greedy(logits, positions, draft, depth) -> Verified:
    """Greedy verification of `depth [B]` draft tokens `draft [B, K]` against `logits [P, V]` at their rows
    `positions [B, span]` (as `verify_drafts` with `raw = logits[positions]` and every request greedy, the same
    tokens), reading the B + verified rows it needs instead of B x span: with one request verifying a 10-token lookup
    beside 31 that verify none, the padded copy and its log-softmax took 85 ms of a 320 ms step on this CPU."""
    rows, span = positions.shape
    ar = torch.arange(span, device=logits.device)[None, :]
    tested = ar <= depth[:, None]
    top = torch.zeros(rows, span, dtype=torch.long, device=logits.device)
    top[tested] = logits[positions[tested]].argmax(-1)
    top = top.gather(1, torch.minimum(ar, depth[:, None]).expand(rows, span))  # padding repeats the last
    draft_v = draft[:, : span - 1]
    match = (draft_v == top[:, : span - 1]) & (ar[:, : span - 1] < depth[:, None])
    num_accepted = torch.cumprod(match.long(), dim=1).sum(1)
    next_token = top.gather(1, num_accepted[:, None]).squeeze(1)
    emitted = torch.cat([draft_v, draft_v.new_zeros(rows, 1)], 1)
    emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
    kept = ar <= num_accepted[:, None]
    logprobs = torch.zeros(rows, span, device=logits.device)
    log_probs = torch.log_softmax(logits[positions[kept]].float(), -1)
    logprobs[kept] = log_probs.gather(-1, emitted[kept][:, None]).squeeze(-1)
    return Verified(num_accepted, next_token, emitted, logprobs, None)


def top_tokens(log_probs, requests):
    """`[B][span]` lists of (id, logprob) of the n most likely tokens for requests asking for them, else None."""
    n = max(r.params.top_n_tokens for r in requests)
    if n == 0:
        return None
    values, ids = log_probs.topk(min(n, log_probs.shape[-1]), dim=-1)
    return [[list(zip(i[: r.params.top_n_tokens], v[: r.params.top_n_tokens])) for i, v in zip(ii, vv)]
            if r.params.top_n_tokens else None for r, ii, vv in zip(requests, ids.tolist(), values.tolist())]
