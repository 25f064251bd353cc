"""The engine's sampler: where each request's sampling parameters meet the models' logits, for the whole batch.

* Drafting (`draft_selector`): each draft token is the drafter's argmax for a greedy request; for a sampled one, a
  draw from the drafter's distribution processed with the request's temperature / top-k / top-p (its q): the
  Gumbel-max draw with the request's own noise when it is seeded, an inverse-CDF draw from its random stream when
  not (`sampling.py`); D-Cut's confidence comes with it.
* Verification (`verify_drafts`; `verify_forward` picks `verify_greedy`, one kernel launch on CUDA, for plain
  greedy batches): the target's logits at every verified position, penalised position by position, processed like
  the drafter's for sampled requests, decide in one call for the ragged batch (`kernels.verify`: greedy acceptance,
  or exact rejection sampling; the spec is `kernels/reference.py`) how many drafts each request keeps and the token
  after them; a seeded request takes the greedy rule on its Gumbel-max scores (`sampling.gumbel_scores`), whose
  argmax is its token. With the log-probability of every emitted token and, where asked for, the most likely tokens
  at each position.

The distributions and random numbers themselves are `sampling.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .transfer import upload
from .sampling import (ACCEPT, DRAFT, RESAMPLE, apply_penalties, gumbel_scores, process_logits, sample_from,
                       uniforms)


def process_requests(logits, requests, span: int) -> torch.Tensor:
    """Sampling probabilities `[N, V]` of `logits [N, V]` holding `span` consecutive rows per request, each processed
    with its request's temperature, top-k and top-p (a greedy request's at temperature 1)."""
    temperature, top_k, top_p, any_top_k, any_top_p = request_params(requests, logits.device)
    return process_logits(logits, temperature.repeat_interleave(span), top_k.repeat_interleave(span),
                          top_p.repeat_interleave(span), any_top_k, any_top_p)


_PARAMS: dict = {}  # id(requests) -> (requests, their ids, device, params): the last few lists asked for


def request_params(requests, device) -> tuple:
    """`(temperature [n] float32, top_k [n] int64, top_p [n] float32, any top-k, any top-p)` of `requests` (a
    greedy request's temperature is 1) on `device`: one copy to the device, kept while the same list of requests is
    asked again (every drafting position of a step asks for the same)."""
    key, ids = id(requests), tuple(id(r) for r in requests)
    cached = _PARAMS.get(key)
    if cached is not None and cached[0] is requests and cached[1] == ids and cached[2] == device:
        return cached[3]
    # one float64 copy: the float32 of a float is the float32 of its float64; top-k is clamped to the vocabulary
    # where it is used, so capping it at 2**52 (exact in float64) changes nothing
    packed = upload([[r.params.temperature if r.params.do_sample else 1.0 for r in requests],
                     [min(r.params.top_k, 1 << 52) for r in requests], [r.params.top_p for r in requests]],
                    device, torch.float64)
    params = (packed[0].float(), packed[1].long(), packed[2].float(), any(r.params.top_k > 0 for r in requests),
              any(r.params.top_p < 1 for r in requests))
    if len(_PARAMS) >= 8:
        _PARAMS.clear()
    _PARAMS[key] = (requests, ids, device, params)
    return params


def request_ints(requests, device) -> torch.Tensor:
    """`[5, n]` int64 on `device`, one copy: each request's seed, tokens generated so far, whether it is verified by
    exact match (greedy, or seeded: `Request.coupled`), whether it is seeded and whether it is greedy."""
    return upload([[r.seed for r in requests], [len(r.generated) for r in requests],
                   [not r.params.do_sample or r.coupled for r in requests], [r.coupled for r in requests],
                   [not r.params.do_sample for r in requests]], device)


def penalise(raw, draft, requests):
    """`raw [B, span, V]` with each penalised request's rows penalised position by position (`apply_penalties`)."""
    rows = [i for i, r in enumerate(requests) if r.penalties is not None]
    if not rows:
        return raw
    sub = [requests[i] for i in rows]
    # one copy: the rows, then each penalty (their float32 is their float64's)
    packed = upload([rows] + [[getattr(r.params, name) for r in sub]
                              for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")],
                    raw.device, torch.float64)
    index = packed[0].long()
    raw = raw.float().clone()
    raw[index] = apply_penalties(raw[index], draft[index], torch.stack([r.penalties.seen for r in sub]),
                                 torch.stack([r.penalties.counts for r in sub]), packed[1].float(),
                                 packed[2].float(), packed[3].float())
    return raw


def draft_selector(requests, device, process, confidence, draft_ids=None):
    """`select(logits [B, V], j)` for `BatchDrafter.draft` over `requests`: draft token j of each request (its
    argmax when greedy, else a draw from q = `process(logits, requests, 1)` at its position j: the Gumbel-max draw
    with its noise when seeded, coupled to the target's draw there, an inverse-CDF draw with its seed's stream when
    not), that q (None when every request is greedy) and D-Cut's `confidence(probs, token)` there.

    `draft_ids` `[D]` (sorted): the target ids of a pruned draft head's columns (`PrunedLMHead.ids`; its logits are
    -inf elsewhere). When every request is greedy, the choice then reads those columns alone, and `confidence` gets
    the distribution over them with each row's argmax column: the same tokens and confidences as over the whole
    vocabulary (ties go to the smaller id either way) at a fraction of the cost (`benchmarks/draft_choice.py`: a
    batch of 32 on a 2-core CPU, 1.0 ms a position against 4.2 ms over 49k tokens)."""
    all_greedy = not any(r.params.do_sample for r in requests)
    seeds, gen_pos, _, _, greedy = request_ints(requests, device)
    greedy = greedy.bool()
    coupled = [i for i, r in enumerate(requests) if r.coupled]
    coupled = upload(coupled, device) if coupled else None

    def select(logits, j):
        if all_greedy:
            rows = logits if draft_ids is None else logits.index_select(-1, draft_ids)
            probs = torch.softmax(rows.float(), -1)
            column = probs.argmax(-1)
            token = column if draft_ids is None else draft_ids[column]
            return token, None, confidence(probs, column)
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
    top: list | None  # `top_tokens` (None: see `top_candidates`)
    top_candidates: tuple | None = None  # `(values, ids)` `[B, span, n]` of `top_candidates`, not yet read


def verify_drafts(raw, draft, draft_probs, depth, requests, process=process_requests,
                  depth_host: list[int] | None = None) -> Verified:
    """Verify each request's first `depth [B]` draft tokens `draft [B, K]` (q: `draft_probs [B, K, V]`, read for the
    rejection-sampled requests only, or None when there are none) against the target's logits `raw [B, span, V]` at
    its verified positions (row j: the token after draft j - 1), with `process` the per-request processing of
    `process_requests`'s signature. A seeded sampled request is verified by the greedy rule on its Gumbel-max scores
    (`sampling.gumbel_scores` of p) at each position up to its depth: its token there is their argmax. `depth_host`:
    `depth` as a host list, which says where those positions are without reading the device (else read)."""
    span, dev = raw.shape[1], raw.device
    ar = torch.arange(span, device=dev)[None, :]
    raw = penalise(raw, draft, requests)
    seeds, gen_pos, exact_match, coupled, _ = request_ints(requests, dev)
    exact_match, coupled = exact_match.bool(), coupled.bool()
    gen_pos = gen_pos[:, None] + ar
    scores = raw
    if any(r.params.do_sample for r in requests):
        probs = process(raw.reshape(-1, raw.shape[-1]), requests, span).reshape(raw.shape)
        scores = torch.where(exact_match[:, None, None], raw, probs)
        if any(r.coupled for r in requests):  # each seeded row's positions up to its depth (the rest are not read)
            if depth_host is None:
                depth_host = depth.tolist()
            at = upload([[b for b, r in enumerate(requests) if r.coupled for _ in range(depth_host[b] + 1)],
                         [j for b, r in enumerate(requests) if r.coupled for j in range(depth_host[b] + 1)]], dev)
            scores[at[0], at[1]] = gumbel_scores(probs[at[0], at[1]], seeds[at[0]], gen_pos[at[0], at[1]])
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
    return Verified(num_accepted, next_token, emitted, logprobs, None, top_candidates(log_probs, requests))


def verify_forward(forward, draft, draft_probs, depth, requests, process=process_requests) -> Verified:
    """`verify_drafts` on a packed forward (`model_runner.PackedForward`). A batch of greedy requests without
    penalties or top tokens takes `verify_greedy`, which reads only the logits of the positions each row verifies and
    emits; the others get the `[B, span, V]` copy of the logits (every row padded to the batch's deepest). The depths
    are known to the host from the forward's shape."""
    depth_host = [0] * forward.num_prefill + [n - 1 for n in forward.step.new_host[forward.num_prefill:]]
    if draft_probs is None and not any(r.params.do_sample or r.penalties is not None or r.params.top_n_tokens
                                       for r in requests):
        return verify_greedy(forward.logits, forward.positions, draft, depth, depth_host)
    return verify_drafts(forward.scored, draft, draft_probs, depth, requests, process, depth_host)


def verify_greedy(logits, positions, draft, depth, depth_host: list[int] | None = None) -> Verified:
    """Greedy verification of `depth [B]` draft tokens `draft [B, K]` against `logits [P, V]` at their rows
    `positions [B, span]` (as `verify_drafts` with `raw = logits[positions]` and every request greedy, the same
    tokens), reading only the B + verified rows it needs instead of B x span (one request verifying a long lookup
    beside many that verify none would otherwise copy and normalise a padded block for every row). It runs
    `kernels.verify_greedy`: one Triton launch on CUDA, which reads nothing back to the host, its torch reference
    elsewhere. `depth_host`: `depth` as a host list (else read, by the reference only), which says which rows the
    reference reads."""
    return Verified(*kernels.verify_greedy(logits, positions, draft, depth, depth_host), None)


def top_candidates(log_probs, requests) -> tuple | None:
    """`(values, ids)` `[B, span, n]` of the n most likely tokens (n: the most any request asks for), or None."""
    n = max(r.params.top_n_tokens for r in requests)
    if n == 0:
        return None
    return log_probs.topk(min(n, log_probs.shape[-1]), dim=-1)


def top_lists(values: list, ids: list, requests) -> list:
    """`[B][span]` lists of (id, logprob) of each request's own n most likely tokens (host lists of
    `top_candidates`), None for a request that asks for none."""
    return [[list(zip(i[: r.params.top_n_tokens], v[: r.params.top_n_tokens])) for i, v in zip(ii, vv)]
            if r.params.top_n_tokens else None for r, ii, vv in zip(requests, ids, values)]


def top_tokens(log_probs, requests):
    """`[B][span]` lists of (id, logprob) of the n most likely tokens for requests asking for them, else None."""
    top = top_candidates(log_probs, requests)
    return None if top is None else top_lists(top[0].tolist(), top[1].tolist(), requests)
