"""Torch reference implementations of the hot steps of a batched speculative step: D-Cut selection, verification of
a ragged batch (greedy or rejection sampling), greedy verification straight from the packed logits, and the packed
target's attention over the paged KV store. The Triton
versions are in `triton_kernels.py`, with the same signatures and outputs; the dispatch in `kernels/__init__.py` runs
them on CUDA and these everywhere else. These define the results the kernels are tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from angelspec_hf.modeling.drafter_utils import additive_mask

from ..sampling import sample_from
from ..transfer import upload


def dcut_select(accept_prob, num_drafted, budget: int, step_cost=None, base_gain: float = 0.0):
    """D-Cut: choose which draft tokens of a ragged batch to verify.

    accept_prob `[B, K]`: calibrated probability that draft token j is accepted given tokens < j were;
    num_drafted `[B]`: valid draft tokens per request (the rest of each row is ignored);
    budget: at most this many draft tokens in total;
    step_cost `[B * K + 1]` (optional): predicted cost of a step that verifies M draft tokens; with it the number of
    tokens M is chosen to maximise `(base_gain + expected accepted tokens) / step_cost[M]` (M = 0 included: plain
    decoding), without it M = min(budget, valid tokens).

    A token's survival is the product of acceptance probabilities up to it; the M tokens with the highest survival
    are verified. Survival never grows along a row, so each request verifies a prefix of its block: its depth.
    Returns `depth [B]` (int64), `survival [B, K]` (float32) and `M` (int64 scalar tensor).
    """
    batch, k = accept_prob.shape
    valid = torch.arange(k, device=accept_prob.device)[None, :] < num_drafted[:, None]
    survival = torch.where(valid, torch.cumprod(accept_prob.float(), dim=1), torch.zeros((), device=valid.device))
    order = torch.sort(torch.where(valid, survival, -1.0).reshape(-1), descending=True, stable=True).indices
    n, dev = batch * k, accept_prob.device
    limit = valid.sum().clamp(max=int(budget))  # on the device: nothing is read back
    if step_cost is not None:
        gains = torch.cat([survival.new_zeros(1), survival.reshape(-1)[order].cumsum(0)]) + base_gain  # [n + 1]
        cost = step_cost.float()[: n + 1]
        cost = torch.cat([cost, cost.new_ones(n + 1 - len(cost))])  # past `limit`: never chosen
        ratio = torch.where(torch.arange(n + 1, device=dev) <= limit, gains / cost, -float("inf"))
        chosen = torch.argmax(ratio)
    else:
        chosen = limit
    # the `chosen` best positions: ranks below it, scattered back to their places
    selected = torch.zeros(n, dtype=torch.bool, device=dev).scatter(0, order, torch.arange(n, device=dev) < chosen)
    depth = selected.reshape(batch, k).sum(1)
    return depth, survival, chosen.long()


def verify(scores, draft, draft_probs, depth, greedy, u_accept, u_sample):
    """Verify each request's first `depth` draft tokens against the target, in one call for the ragged batch.

    scores `[B, K + 1, V]`: row j scores the token after draft j - 1 (row 0 after the anchor): for greedy rows, scores
    whose argmax is the target's token (raw logits; a seeded sampled request's Gumbel-max scores, `gumbel_scores`), for
    sampled ones processed target probabilities; draft `[B, K]`; draft_probs `[B, K, V]` (the drafter's processed
    probabilities; only read for sampled rows, may be None when all are greedy); depth `[B]`; greedy `[B]` bool;
    u_accept `[B, K]`, u_sample `[B, K + 1]`: uniforms in [0, 1).

    Greedy: accept while the draft equals the target's argmax; the next token is the target's argmax after the last
    accepted one. Sampling (Leviathan et al.): accept draft j when `u * q(d) < p(d)`; at the first rejection sample
    from `norm(max(p - q, 0))`, and after a fully accepted prefix sample the bonus token from `p`.
    Returns `num_accepted [B]` and `next_token [B]` (int64).
    """
    batch, k = draft.shape
    ar = torch.arange(k, device=draft.device)[None, :]
    in_depth = ar < depth[:, None]
    target_top = scores.argmax(-1)  # [B, K + 1]
    match = draft == target_top[:, :k]
    if draft_probs is not None:  # (greedy rows keep their match: no read of `greedy` decides anything here)
        p_d = scores[:, :k].gather(-1, draft[..., None]).squeeze(-1).float()
        q_d = draft_probs.gather(-1, draft[..., None]).squeeze(-1).float()
        match = torch.where(greedy[:, None], match, u_accept.float() * q_d < p_d)
    num_accepted = torch.cumprod((match & in_depth).long(), dim=1).sum(1)
    next_token = target_top.gather(1, num_accepted[:, None]).squeeze(1)
    # every row draws (greedy rows discard theirs below): a branch on `greedy` would read it back
    rows = torch.arange(batch, device=draft.device)
    p = scores[rows, num_accepted].float()  # [B, V]
    rejected = num_accepted < depth
    if draft_probs is not None and k > 0:
        q = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()
        residual = (p - q).clamp(min=0)
        use_residual = rejected & (residual.sum(-1) > 0)
        p = torch.where(use_residual[:, None], residual, p)
    sampled = sample_from(p, u_sample.gather(1, num_accepted[:, None]).squeeze(1))
    next_token = torch.where(greedy, next_token, sampled)
    return num_accepted, next_token



def verify_greedy(logits, positions, draft, depth, depth_host: list[int] | None = None):
    """Greedy verification of each row's first `depth [B]` draft tokens `draft [B, K]` (int64) against the packed
    target logits `logits [P, V]` (any float dtype, read as float32), row b's verified positions at `positions [B,
    span]` (column j: the token after draft j - 1; `span <= K + 1`; columns past the row's depth are not read).

    A row accepts drafts while each equals the argmax (the first maximum, as `torch.argmax`) of the logits at its
    position and it is within the row's depth; the next token is the argmax at the position after the accepted ones.
    Only the B + sum(depth) tested positions are read. `depth_host`: `depth` as a host list (else read here), which
    says which rows those are (the kernel needs no host copy).

    Returns `num_accepted [B]`, `next_token [B]`, `emitted [B, span]` (int64: the accepted drafts, the next token at
    column `num_accepted`, then the rest of `draft` and 0 in the last column) and `logprobs [B, span]` (float32: the
    log-softmax of the emitted token at columns up to `num_accepted`, 0.0 after).
    """
    rows, span = positions.shape
    dev = logits.device
    if depth_host is None:
        depth_host = depth.tolist()
    ar = torch.arange(span, device=dev)[None, :]
    # the tested positions (row, column) of every row, from the host's depths: one copy, no mask to count
    tested = upload([[r for r, d in enumerate(depth_host) for _ in range(d + 1)],
                     [j for d in depth_host for j in range(d + 1)]], dev)
    tested_logits = logits[positions[tested[0], tested[1]]].float()  # [tested, V]
    top = torch.zeros(rows, span, dtype=torch.long, device=dev)
    top[tested[0], tested[1]] = tested_logits.argmax(-1)
    top = top.gather(1, torch.minimum(ar, depth[:, None]).expand(rows, span))  # padding repeats the last
    draft_v = draft[:, : span - 1]
    match = (draft_v == top[:, : span - 1]) & (ar[:, : span - 1] < depth[:, None])
    num_accepted = torch.cumprod(match.long(), dim=1).sum(1)
    next_token = top.gather(1, num_accepted[:, None]).squeeze(1)
    emitted = torch.cat([draft_v, draft_v.new_zeros(rows, 1)], 1)
    emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
    # log-probabilities of the emitted tokens: at every tested position (the kept ones are among them), the rest 0
    log_probs = torch.log_softmax(tested_logits, -1)
    logprobs = torch.zeros(rows, span, dtype=torch.float32, device=dev)
    logprobs[tested[0], tested[1]] = log_probs.gather(-1, emitted[tested[0], tested[1]][:, None]).squeeze(-1)
    logprobs = torch.where(ar <= num_accepted[:, None], logprobs, 0.0)
    return num_accepted, next_token, emitted, logprobs


@dataclass
class AttentionGroup:
    """Sequences of a packed step that attend together, padded to their longest new-token count."""

    tokens: torch.Tensor  # [t] packed indices of their new tokens
    row: torch.Tensor  # [t] each token's sequence within the group
    col: torch.Tensor  # [t] and its column (0: the sequence's first new token)
    num_rows: int
    n_max: int
    gather_index: torch.Tensor  # [rows, kv_max] pool slots of each sequence's keys
    mask: torch.Tensor  # additive [rows, 1, n_max, kv_max]


def slot_index(page_table, page_size: int, slots, positions, valid):
    """Flat pool indices of `positions` (any shape, first dim = sequences) of sequences `slots` (rows of
    `page_table`, pages of `page_size` tokens); invalid positions → the dummy slot 0."""
    table = page_table[slots]
    shape = positions.shape
    pos = positions.reshape(shape[0], -1).clamp(min=0)
    pages = table.gather(1, (pos // page_size).clamp(max=table.shape[1] - 1))
    index = (pages * page_size + pos % page_size).reshape(shape)
    return torch.where(valid, index, torch.zeros_like(index))


def attention_groups(page_table, slots, held, new, page_size: int, held_host: list[int], new_host: list[int],
                     dtype, causal: bool = True) -> list[AttentionGroup]:
    """The sequences of a packed step grouped by `new` rounded up to a power of two (1 | 2 | 3-4 | 5-8 ...: padding
    within a group stays under 2x), with the pool slots of each sequence's keys (`page_table [S, W]` row `slots[b]`,
    pages of `page_size`) and the additive mask of its new tokens (causal; with `causal=False` each sees all its
    sequence's keys): what `paged_attention` gathers and masks with. `held`, `new` `[B]` on the device, the same as host lists `held_host`, `new_host` (every shape comes from
    these: nothing is read back)."""
    dev = slots.device
    bucket = [max(n - 1, 0).bit_length() for n in new_host]
    groups = []
    for b in sorted(set(bucket)):
        rows_host = [r for r, rb in enumerate(bucket) if rb == b]
        tokens_host, row_host, col_host, start, rank = [], [], [], 0, 0
        for r, n in enumerate(new_host):  # packed order: row-major
            if bucket[r] == b:
                tokens_host += range(start, start + n)
                row_host += [rank] * n  # the row's index within the group
                col_host += range(n)
                rank += 1
            start += n
        rows = upload(rows_host, dev)
        kv_max = max(held_host[r] + new_host[r] for r in rows_host)
        n_max = max(new_host[r] for r in rows_host)
        key_pos = torch.arange(kv_max, device=dev)
        key_valid = key_pos[None, :] < (held + new)[rows, None]  # [rows, kv_max]
        gather_index = slot_index(page_table, page_size, slots[rows], key_pos.expand(len(rows_host), -1), key_valid)
        query_pos = held[rows, None] + torch.arange(n_max, device=dev)[None, :]
        allowed = key_valid[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None] if causal else True)
        groups.append(AttentionGroup(upload(tokens_host, dev), upload(row_host, dev), upload(col_host, dev),
                                     len(rows_host), n_max, gather_index, additive_mask(allowed[:, None], dtype)))
    return groups


def paged_attention(query, key_cache, value_cache, page_table, slots, held, new, starts, scaling, page_size: int,
                    held_host: list[int], new_host: list[int], groups=None, causal: bool = True):
    """Causal attention of a packed ragged batch over a paged KV store, for one layer.

    query `[T, H, D]`: the new tokens of sequences `0..B-1` back to back (sequence b's at `starts[b]` onwards, `T =
    sum(new)`); key_cache / value_cache `[num_slots, Hkv, D]` (H a multiple of Hkv; query head h reads KV head
    `h // (H / Hkv)`), already holding every sequence's new keys/values; sequence b's token at pool position p sits
    in slot `page_table[slots[b], p // page_size] * page_size + p % page_size`. Sequence b holds `held[b]` tokens
    before this step and adds `new[b]` (`[B]` int64, on the device; `held_host` / `new_host`: the same on the host):
    its new token c, at position `held[b] + c`, attends to its keys `0 .. held[b] + c`, with logits scaled by
    `scaling` (None: `D ** -0.5`). With `causal=False` every new token of sequence b attends to all its keys `0 ..
    held[b] + new[b] - 1` (a drafter's block, denoised at once).

    Returns `[T, H, D]` in the query's dtype. This reference gathers each group of sequences' keys/values into a
    padded tensor and runs SDPA with an additive mask (`attention_groups`; `groups`: that list, or a function of the
    dtype returning it, such as `RaggedStep.groups`, which builds it once per step, built with the same `causal`; built
    here when None); the
    kernel reads the pool through the page table and needs neither `groups` nor a gathered copy."""
    if groups is None:
        groups = attention_groups(page_table, slots, held, new, page_size, held_host, new_host, query.dtype, causal)
    elif callable(groups):
        groups = groups(query.dtype)
    out = torch.empty_like(query)
    for group in groups:
        keys = key_cache[group.gather_index].transpose(1, 2).to(query.dtype)  # [rows, Hkv, kv_max, D]
        values = value_cache[group.gather_index].transpose(1, 2).to(query.dtype)
        q = query.new_zeros(group.num_rows, group.n_max, *query.shape[1:])
        q[group.row, group.col] = query[group.tokens]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=group.mask, scale=scaling,
            enable_gqa=keys.shape[1] != q.shape[2],
        )  # [rows, H, n_max, D]
        out[group.tokens] = o.transpose(1, 2)[group.row, group.col]
    return out
