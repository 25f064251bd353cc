"""Triton kernels for the engine's hot steps; `reference.py` holds the torch versions (same signatures and outputs)
that run on CPU and define what these compute. Dispatch is in `kernels/__init__.py`.

* `dcut_select`: one program for the whole ragged batch — survival products along each block, a global sort of
  (survival, position) keys, expected-gain prefix sums, the budget that maximises gain per unit of predicted cost, and
  each request's depth.
* `verify`: one program per request — greedy acceptance against the argmax of its scores (a greedy request's logits,
  a seeded sampled request's Gumbel-max scores), or exact rejection sampling, then the correction / bonus token by
  inverse-CDF sampling over the vocabulary in blocks.
* `verify_greedy`: one program per request, straight from the packed logits — it walks the request's verified
  positions, each in one pass over the vocabulary in blocks (argmax, running maximum and sum of exponentials), until
  the first draft that differs from the argmax, and writes the accepted count, the next token, the emitted tokens and
  their log-probabilities: a greedy batch's whole verification in one launch.
* `paged_attention`: attention over the paged KV store for one layer — the packed target's causal attention, or a
  drafter's block that every row of it sees whole (`causal=False`) — one program per (sequence, KV head, tile of
  query rows), a row being one (new token, query head sharing that KV head) pair, so the heads of a GQA group read
  each key block once; keys and values are read straight from the pool through the page table, in blocks of 64 (32
  for fp32 heads wider than 128), with an online softmax in fp32 (no padded copy of the cache). It compiles once per
  (dtype, causal or not, query tile of 16 | 32 | 64 rows, head-dim tile): batch, lengths and token counts are runtime values.
  On a GPU whose blocks get less shared memory than a tile needs (99 KiB on sm_86 / sm_89, where fp32 tiles of
  128-wide heads need up to 113 KiB) the launch fails before it runs and the next smaller tile is taken, once per
  shape (`paged_attention_tiles`).

`scripts/gpu/compile_kernels.py` compiles every kernel for a GPU architecture without a GPU, through these wrappers,
and checks each against the shared memory a block may have (`tests/test_kernel_compile.py`: sm_90 and sm_86).

Shapes that change from step to step are runtime arguments or rounded up to a power of two, so each kernel compiles
once per bucket rather than once per step shape: the draft width `K` is a runtime stride (`dcut_select` unrolls over
`K_PAD`, its next power of two, masking the rest), the batch and the `batch × K` keys are padded to powers of two,
`verify` compiles once per (has draft probabilities, vocabulary block) and `verify_greedy` once per vocabulary block
(its step-dependent sizes are exempt from Triton's specialisation on their values)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources


@triton.jit
def _dcut_select_kernel(accept_ptr, drafted_ptr, cost_ptr, survival_ptr, depth_ptr, chosen_ptr, batch, budget,
                        base_gain, K, K_PAD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_COST: tl.constexpr):
    rows = tl.arange(0, BLOCK_B)
    row_ok = rows < batch
    drafted = tl.load(drafted_ptr + rows, mask=row_ok, other=0)
    running = tl.full([BLOCK_B], 1.0, tl.float32)
    for j in tl.static_range(K_PAD):  # survival: the running product along each block (K of the K_PAD columns)
        ok = row_ok & ((rows * 0 + j) < K)  # a block mask (column j exists)
        a = tl.load(accept_ptr + rows * K + j, mask=ok, other=0.0).to(tl.float32)
        running = running * a
        tl.store(survival_ptr + rows * K + j, tl.where(j < drafted, running, 0.0), mask=ok)
    tl.debug_barrier()

    n = batch * K
    idx = tl.arange(0, BLOCK_N)
    in_range = idx < n
    valid = in_range & ((idx % K) < tl.load(drafted_ptr + idx // K, mask=in_range, other=0))
    s = tl.load(survival_ptr + idx, mask=in_range, other=0.0)
    # keys: survival bits (monotone for s >= 0) then lower positions first; invalid entries sort last
    key = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_N - idx).to(tl.int64)
    key = tl.where(valid, key, -1)
    ordered = tl.sort(key, descending=True)
    num_valid = tl.sum(valid.to(tl.int32), axis=0)
    limit = tl.minimum(budget, num_valid)
    if HAS_COST:
        values = tl.where(ordered >= 0, (ordered >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
        gains = base_gain + tl.cumsum(values, axis=0)  # gain of verifying the top idx + 1 tokens
        cost = tl.load(cost_ptr + idx + 1, mask=idx < limit, other=1.0)
        objective = tl.where(idx < limit, gains / cost, -float("inf"))
        best = tl.max(objective, axis=0)
        best_m = tl.argmax(objective, axis=0) + 1
        plain = base_gain / tl.load(cost_ptr)
        chosen = tl.where(plain >= best, 0, best_m)
    else:
        chosen = limit
    threshold = tl.sum(tl.where(idx == chosen - 1, ordered, 0), axis=0)
    threshold = tl.where(chosen > 0, threshold, 1 << 62)  # nothing selected
    depth = tl.zeros([BLOCK_B], tl.int64)
    for j in tl.static_range(K_PAD):
        ok = row_ok & ((rows * 0 + j) < K)
        s_j = tl.load(survival_ptr + rows * K + j, mask=ok, other=0.0)
        key_j = (s_j.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_N - (rows * K + j)).to(tl.int64)
        depth += (ok & (j < drafted) & (key_j >= threshold)).to(tl.int64)
    tl.store(depth_ptr + rows, depth, mask=row_ok)
    tl.store(chosen_ptr, chosen.to(tl.int64))


def dcut_select(accept_prob, num_drafted, budget: int, step_cost=None, base_gain: float = 0.0):
    batch, k = accept_prob.shape
    survival = torch.empty(batch, k, dtype=torch.float32, device=accept_prob.device)
    depth = torch.empty(batch, dtype=torch.int64, device=accept_prob.device)
    chosen = torch.empty((), dtype=torch.int64, device=accept_prob.device)
    if batch == 0 or k == 0:
        return depth.zero_(), survival, chosen.zero_()
    cost = step_cost.float().contiguous() if step_cost is not None else survival
    _dcut_select_kernel[(1,)](
        accept_prob.float().contiguous(), num_drafted.contiguous(), cost, survival, depth, chosen, batch,
        int(budget), float(base_gain), k, K_PAD=triton.next_power_of_2(k), BLOCK_B=triton.next_power_of_2(batch),
        BLOCK_N=triton.next_power_of_2(batch * k), HAS_COST=step_cost is not None,
    )
    return depth, survival, chosen


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    best = -float("inf")
    best_i = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = start + tl.argmax(x, axis=0)
        take = m > best  # strict: the first maximum wins, as torch.argmax
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    return best_i


@triton.jit
def _block_weights(p_ptr, q_ptr, offs, V, USE_Q: tl.constexpr):
    """One block of the sampling weights: p, or max(p - q, 0) when USE_Q."""
    w = tl.load(p_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
    if USE_Q:
        w = tl.maximum(w - tl.load(q_ptr + offs, mask=offs < V, other=0.0).to(tl.float32), 0.0)
    return w


@triton.jit
def _sample_row(p_ptr, q_ptr, u, V, USE_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inverse-CDF draw from p (or from max(p - q, 0) when USE_Q): the first index whose cumulative mass exceeds u ×
    total, as `torch.searchsorted(cdf, u * total, right=True)`; where rounding leaves none (the blocks' sums and
    cumulative sums round differently), the last index of positive weight (`sampling.sample_from` takes the index where
    the cumulative mass reaches its total: the same one unless rounding absorbed a later, tiny weight), never an index
    of weight zero."""
    total = 0.0
    last = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = _block_weights(p_ptr, q_ptr, offs, V, USE_Q)
        total += tl.sum(w, axis=0)
        last = tl.maximum(last, tl.max(tl.where((w > 0) & (offs < V), offs, 0), axis=0))
    goal = u * total
    running = 0.0
    found = last
    searching = 1
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = _block_weights(p_ptr, q_ptr, offs, V, USE_Q)
        cdf = running + tl.cumsum(w, axis=0)
        hit = (cdf > goal) & (offs < V)
        first = tl.min(tl.where(hit, offs, V), axis=0)
        take = (searching == 1) & (first < V)
        found = tl.where(take, first, found)
        searching = tl.where(take, 0, searching)
        running += tl.sum(w, axis=0)
    return found, total


@triton.jit
def _verify_kernel(scores_ptr, draft_ptr, q_ptr, depth_ptr, greedy_ptr, ua_ptr, us_ptr, n_acc_ptr, next_ptr, V,
                   K, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    depth = tl.load(depth_ptr + b)
    greedy = tl.load(greedy_ptr + b) != 0
    row0 = scores_ptr + b * (K + 1) * V
    n_acc = 0
    going = 1
    for j in range(0, depth):
        d = tl.load(draft_ptr + b * K + j)
        if HAS_Q:
            if greedy:
                ok = _row_argmax(row0 + j * V, V, BLOCK_V) == d
            else:
                p_d = tl.load(row0 + j * V + d).to(tl.float32)
                q_d = tl.load(q_ptr + (b * K + j) * V + d).to(tl.float32)
                ok = tl.load(ua_ptr + b * K + j) * q_d < p_d
        else:  # no draft probabilities: every row accepts by the greedy rule, as the reference does
            ok = _row_argmax(row0 + j * V, V, BLOCK_V) == d
        going = tl.where(ok & (going == 1), 1, 0)
        n_acc += going
    if greedy:
        token = _row_argmax(row0 + n_acc * V, V, BLOCK_V)
    else:
        u = tl.load(us_ptr + b * (K + 1) + n_acc)
        token = 0
        total = 0.0
        resampled = 0
        if HAS_Q:
            if n_acc < depth:
                token, total = _sample_row(row0 + n_acc * V, q_ptr + (b * K + n_acc) * V, u, V, True, BLOCK_V)
                resampled = tl.where(total > 0, 1, 0)
        if resampled == 0:
            token, total = _sample_row(row0 + n_acc * V, row0, u, V, False, BLOCK_V)
    tl.store(n_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


def verify(scores, draft, draft_probs, depth, greedy, u_accept, u_sample):
    batch, k = draft.shape
    vocab = scores.shape[-1]
    num_accepted = torch.empty(batch, dtype=torch.int64, device=scores.device)
    next_token = torch.empty(batch, dtype=torch.int64, device=scores.device)
    has_q = draft_probs is not None and k > 0
    q = draft_probs.float().contiguous() if has_q else scores
    _verify_kernel[(batch,)](
        scores.float().contiguous(), draft.contiguous(), q, depth.contiguous(), greedy.to(torch.int8).contiguous(),
        u_accept.float().contiguous(), u_sample.float().contiguous(), num_accepted, next_token, vocab,
        k, HAS_Q=has_q, BLOCK_V=min(1024, triton.next_power_of_2(vocab)),
    )
    return num_accepted, next_token


@triton.jit
def _row_top(row_ptr, V, BLOCK_V: tl.constexpr):
    """The argmax of one row of V logits and the log-softmax there, as `torch.argmax` and `torch.log_softmax` give them,
    in one pass over the row in blocks: a running maximum and the sum of exp(x - maximum), rescaled whenever the
    maximum grows. The argmax is the first maximum, and the first NaN where there is one (torch orders NaN above
    every number); a NaN or +inf in the row makes the log-probability NaN, as in torch."""
    best = -float("inf")
    best_i = 0
    first_nan = V
    total = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, offs, V), axis=0))
        m, i = tl.max(tl.where(nan, -float("inf"), x), axis=0, return_indices=True)  # the block's first maximum
        new = tl.maximum(best, m)
        shift = tl.where(new == -float("inf"), 0.0, new)  # no -inf - -inf while every value so far is -inf
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
        take = m > best  # strict: an earlier block's equal maximum wins
        best_i = tl.where(take, start + i, best_i)
        best = new
    best_i = tl.where(first_nan < V, first_nan, best_i)
    return best_i, -tl.log(total)  # log-softmax at the argmax: x - max - log(total) with x == max


@triton.jit(do_not_specialize=["span", "stride_pos", "stride_draft"])
def _verify_greedy_kernel(logits_ptr, pos_ptr, draft_ptr, depth_ptr, n_acc_ptr, next_ptr, emitted_ptr, logprob_ptr,
                          V, stride_logits, span, stride_pos, stride_draft, BLOCK_V: tl.constexpr,
                          BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    depth = tl.load(depth_ptr + b)
    n_acc = 0
    token = 0
    going = 1
    while going == 1:  # position n_acc: the token after the accepted drafts
        row = tl.load(pos_ptr + b * stride_pos + n_acc).to(tl.int64)
        token, logprob = _row_top(logits_ptr + row * stride_logits, V, BLOCK_V)
        tl.store(logprob_ptr + b * span + n_acc, logprob)  # the emitted token there is the argmax
        tested = n_acc < depth
        d = tl.load(draft_ptr + b * stride_draft + n_acc, mask=tested, other=-1)
        going = (tested & (d == token)).to(tl.int32)
        n_acc += going
    tl.store(n_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))
    # emitted: the accepted drafts, the next token, then the rest of the drafts (0 in the last column); log-probs
    # past the next token: 0
    for start in range(0, span, BLOCK_S):
        cols = start + tl.arange(0, BLOCK_S)
        rest = tl.load(draft_ptr + b * stride_draft + cols, mask=cols < span - 1, other=0)
        tl.store(emitted_ptr + b * span + cols, tl.where(cols == n_acc, token, rest), mask=cols < span)
        tl.store(logprob_ptr + b * span + cols, tl.zeros([BLOCK_S], tl.float32), mask=(cols > n_acc) & (cols < span))


def verify_greedy(logits, positions, draft, depth, depth_host: list[int] | None = None):
    rows, span = positions.shape
    dev = logits.device
    num_accepted = torch.empty(rows, dtype=torch.int64, device=dev)
    next_token = torch.empty(rows, dtype=torch.int64, device=dev)
    emitted = torch.empty(rows, span, dtype=draft.dtype, device=dev)
    logprobs = torch.empty(rows, span, dtype=torch.float32, device=dev)
    if rows == 0:
        return num_accepted, next_token, emitted, logprobs
    logits, positions, draft = (t if t.stride(-1) == 1 else t.contiguous() for t in (logits, positions, draft))
    drafts = draft if draft.numel() else positions  # (no draft is read when there is none)
    vocab = logits.shape[-1]
    _verify_greedy_kernel[(rows,)](
        logits, positions, drafts, depth.contiguous(), num_accepted, next_token, emitted, logprobs, vocab,
        logits.stride(0), span, positions.stride(0), drafts.stride(0),
        BLOCK_V=min(1024, triton.next_power_of_2(vocab)), BLOCK_S=16,
    )
    return num_accepted, next_token, emitted, logprobs


@triton.jit(do_not_specialize=["group", "head_dim", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                               "stride_table"])
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, slots_ptr, held_ptr, new_ptr, start_ptr,
                            scale_log2, group, head_dim, page_size, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_ot, stride_oh, stride_table, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (sequence b, KV head, tile of BLOCK_M query rows); row r of sequence b's `new * group` rows is its new
    # token r // group in query head `kv_head * group + r % group`: the query heads sharing a KV head read its keys once
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    new = tl.load(new_ptr + b)
    if tile * BLOCK_M < new * group:  # (programs past the sequence's rows do nothing)
        held = tl.load(held_ptr + b)
        start = tl.load(start_ptr + b)
        table_row = table_ptr + tl.load(slots_ptr + b) * stride_table
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < new * group
        token = rows // group
        head = kv_head * group + rows % group
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + (start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if CAUSAL:
            query_pos = held + token  # absolute position: it sees keys 0..query_pos of its sequence
            last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // group, new - 1)
            end = held + last_token + 1  # keys this tile needs
        else:  # a block denoised at once: every row sees all its sequence's keys, the block's own included
            query_pos = held + new - 1 + token * 0
            end = held + new
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for key_start in range(0, end, BLOCK_N):
            key_pos = key_start + tl.arange(0, BLOCK_N)
            key_ok = key_pos < end
            page = tl.load(table_row + key_pos // page_size, mask=key_ok, other=0)
            kv_off = (page * page_size + key_pos % page_size)[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            if FP32_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N], fp32 accumulation
            allowed = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
            s = tl.where(allowed, s * scale_log2, -float("inf"))
            # key 0 is in every row's first block, so the running maximum is finite from the first block on
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + (start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


PAGED_ATTENTION_MAX_HEAD_DIM = 256
_ATTENTION_TILES: dict = {}  # (device, dtype, head-dim tile, causal, preferred rows tile) -> the tiles that launched


def _rows_tile(rows: int) -> int:
    """The query tile a step of `rows` query rows prefers: 16, 32 or 64 rows."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def paged_attention_tiles(dtype, head_dim: int, rows: int) -> list[tuple[int, int]]:
    """(query rows, keys) tiles for `rows` query rows of `head_dim`, in the order `paged_attention` tries them: the
    fastest first (rows: 16, 32 or 64 by the step's rows; keys: 64, or 32 for fp32 heads wider than 128), then ever
    smaller ones. A tile needing more shared memory than one block may have on the GPU (fp32 tiles of wide heads on
    GPUs with 99 KiB a block, such as sm_86 / sm_89) fails before it launches, and the next is tried; the tiles that
    launched are kept per (device, dtype, head-dim tile, causal, rows tile), so a shape pays the fallback once."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if dtype == torch.float32 and block_d > 128 else 64
    tiles = [(_rows_tile(rows), block_n)]
    while tiles[-1] != (16, 16):
        m, n = tiles[-1]
        tiles.append((m, n // 2) if n > 32 or m == 16 else (m // 2, n))
    return tiles


def paged_attention(query, key_cache, value_cache, page_table, slots, held, new, starts, scaling, page_size: int,
                    held_host: list[int], new_host: list[int], groups=None, causal: bool = True):
    """`reference.paged_attention`'s contract, through the page table (`groups` and `held_host` are not needed;
    `new_host` sizes the grid). Any head_dim up to `PAGED_ATTENTION_MAX_HEAD_DIM` (padded to a power of two, at
    least 16, inside the kernel); query and caches must be contiguous in their last dimension. Raises `ValueError`
    otherwise, or when the query heads are not a multiple of the KV heads."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"paged attention: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if head_dim > PAGED_ATTENTION_MAX_HEAD_DIM:
        raise ValueError(f"paged attention: head_dim {head_dim} is above the kernel's limit of "
                         f"{PAGED_ATTENTION_MAX_HEAD_DIM}")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged attention: {name} must be contiguous in its last dimension")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("paged attention: key_cache and value_cache must have the same strides")
    group = num_heads // num_kv_heads
    if scaling is None:
        scaling = head_dim ** -0.5
    # query tiles sized to the longest sequence's rows (new tokens × query heads per KV head), in powers of two
    rows = max(new_host) * group
    block_d = max(16, triton.next_power_of_2(head_dim))
    key = (query.device, query.dtype, block_d, bool(causal), _rows_tile(rows))
    tiles = _ATTENTION_TILES.get(key)
    for block_m, block_n in [tiles] if tiles else paged_attention_tiles(query.dtype, head_dim, rows):
        grid = (len(new_host), num_kv_heads, triton.cdiv(rows, block_m))
        try:
            _paged_attention_kernel[grid](
                query, key_cache, value_cache, out, page_table, slots.contiguous(), held.contiguous(),
                new.contiguous(), starts.contiguous(),
                float(scaling) * 1.4426950408889634, group, head_dim, page_size, query.stride(0), query.stride(1),
                key_cache.stride(0), key_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
                CAUSAL=bool(causal), FP32_DOT=query.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=block_d,
            )
        except OutOfResources:  # raised before the launch: more shared memory than a block may have on this GPU
            continue
        _ATTENTION_TILES[key] = (block_m, block_n)
        break
    else:
        raise ValueError(f"paged attention: no tile of {query.dtype} queries with head_dim {head_dim} fits this GPU's "
                         "shared memory")
    return out
