"""Ragged batches over a paged KV store.

`PagedKVPool` keeps the keys/values of many sequences in fixed-size pages of one preallocated tensor per model (grown
by doubling when a burst needs more), so memory grows with the tokens held, not with batch × longest sequence: the
pages are reserved uninitialised, and on CPU the OS backs each with memory only when a key is first written to it. A sequence owns a row of the
page table; rejected draft tokens are dropped by lowering its length (their slots are overwritten later).

Two ways a model reads it:
* the target runs **packed** — the new tokens of all sequences in one row `[1, T]`, so every linear layer costs the
  tokens actually verified — through the `angelspec_ragged` attention function registered below (it writes the new
  keys/values into the pool, then attends through `kernels.paged_attention`: on CUDA a Triton kernel that reads each
  sequence's keys through the page table, on a CPU in fp32 a C++ kernel that does the same (`kernels.cpu_attention`),
  elsewhere a gather of each sequence's keys, SDPA, and the result packed back). The gathering path pads the queries
  of a group of sequences to its longest: sequences are grouped by their
  new-token count in powers of two (`RaggedStep.groups`), so a prompt prefilled beside decoding requests, or one long
  draft beside short ones, does not pad every sequence of the batch to its length;
* drafters run **padded** `[B, n_max]` through `PoolCache`, a cache object with the `update()` contract transformers'
  attention layers call. Where `kernels.paged_attention` runs a kernel (the Triton one on CUDA, the C++ one on a CPU
  in fp32: `kernels.reads_pool_in_place`), `update()` writes the new keys, and a DFlash block's, into the pool and the
  drafter's attention (`pool_draft_attention`, registered below) reads the pool through the kernel; elsewhere
  `update()` returns each sequence's gathered keys, with an explicit 4-D mask (drafter batches are small: one block
  per sequence).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from itertools import accumulate

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from angelspec_hf.attention import gqa_sdpa_attention
from angelspec_hf.modeling.drafter_utils import additive_mask

from . import kernels
from .kernels.reference import AttentionGroup, attention_groups, slot_index
from .transfer import upload

RAGGED_ATTENTION = "angelspec_ragged"
DRAFT_POOL_ATTENTION = "angelspec_pool_draft"


PAGE_SIZE = 16


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages of a pool that holds `tokens` tokens, the reserved page 0 included."""
    return -(-tokens // page_size) + 1


class PagedKVPool:
    """Keys and values of up to `max_seqs` sequences for `num_layers` layers, in pages of `page_size` tokens.

    Page 0 is never handed out: padding positions read and write its slot 0, and every mask hides them. It is the one
    page zeroed: every other slot is read only after a key was written to it (a sequence's positions below its length),
    so the rest is left uninitialised (`torch.empty`): zero-filling a large pool, or growing it by `torch.cat`, costs
    seconds on a CPU, in the middle of a burst's decoding steps.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_seqs, page_size=PAGE_SIZE,
                 num_pages=64):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.page_size = page_size
        self.k = torch.empty(num_layers, num_pages * page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.k[:, :page_size] = 0
        self.v[:, :page_size] = 0
        self.free_pages = list(range(num_pages - 1, 0, -1))
        self.page_table = torch.zeros(max_seqs, 4, dtype=torch.long, device=device)
        self.num_pages = [0] * max_seqs  # pages owned per sequence slot
        self.owned: list[list[int]] = [[] for _ in range(max_seqs)]  # `page_table`'s rows, on the host
        self.lengths = torch.zeros(max_seqs, dtype=torch.long, device=device)  # valid tokens per slot
        # the same lengths as host integers: allocation and the shapes of a step are host work, and the host knows
        # every length (from what it scheduled and the step's one read-back), so it never reads `lengths` to plan
        self.held = [0] * max_seqs

    @property
    def tokens_allocated(self) -> int:
        return sum(self.num_pages) * self.page_size

    @property
    def total_pages(self) -> int:
        """Pages in the pool, the reserved page 0 included."""
        return self.k.shape[1] // self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def check_accounting(self, idle: bool = False) -> None:
        """Raise `AssertionError` unless every page but the reserved page 0 is either owned by exactly one slot or in
        `free_pages` exactly once (never both, never neither), and each slot's length fits in the pages it owns.
        `idle=True` (no sequence held) also requires every slot to own nothing, and every page to be free."""
        problems = []
        owned: list[int] = []
        table = self.page_table.tolist()
        lengths = self.lengths.tolist()
        for slot, count in enumerate(self.num_pages):
            row = table[slot]
            owned += row[:count]
            if any(row[count:]):
                problems.append(f"slot {slot} has page-table entries beyond its {count} pages: {row[count:]}")
            if lengths[slot] > count * self.page_size:
                problems.append(f"slot {slot} holds {lengths[slot]} tokens in {count} pages of {self.page_size}")
            if idle and (count or lengths[slot]):
                problems.append(f"slot {slot} still owns {count} pages / {lengths[slot]} tokens while idle")
        valid = set(range(1, self.total_pages))
        for name, pages in (("owned", owned), ("free", self.free_pages)):
            if len(set(pages)) != len(pages):
                problems.append(f"a page is {name} twice: {sorted(p for p in set(pages) if pages.count(p) > 1)}")
            if not set(pages) <= valid:
                problems.append(f"{name} pages outside 1..{self.total_pages - 1}: {sorted(set(pages) - valid)}")
        if set(owned) & set(self.free_pages):
            problems.append(f"pages both owned and free: {sorted(set(owned) & set(self.free_pages))}")
        lost = valid - set(owned) - set(self.free_pages)
        if lost:
            problems.append(f"pages neither owned nor free (leaked): {sorted(lost)}")
        if problems:
            raise AssertionError("PagedKVPool accounting: " + "; ".join(problems))

    def _grow(self, min_free: int) -> None:
        old = self.k.shape[1] // self.page_size
        new = max(2 * old, old + min_free)
        for name in ("k", "v"):  # the old pages copied, the new ones left uninitialised
            held = getattr(self, name)
            grown = held.new_empty(held.shape[0], new * self.page_size, *held.shape[2:])
            grown[:, : held.shape[1]] = held
            setattr(self, name, grown)
        self.free_pages = list(range(new - 1, old - 1, -1)) + self.free_pages

    def set_lengths(self, slots: list[int], lengths: list[int], slots_t: torch.Tensor | None = None,
                    lengths_t: torch.Tensor | None = None) -> None:
        """Set the valid tokens of `slots` to `lengths` (host lists), on the device too (from `slots_t` /
        `lengths_t` where the caller has them there already, else uploaded)."""
        for s, n in zip(slots, lengths):
            self.held[s] = n
        dev = self.lengths.device
        self.lengths[slots_t if slots_t is not None else upload(slots, dev)] = (
            lengths_t if lengths_t is not None else upload(lengths, dev))

    def reserve(self, slots, total_lengths) -> None:
        """Make sure each slot owns pages for `total_lengths` tokens (only the few slots crossing a page boundary
        this step are touched). Host lists (a tensor is read: only callers outside a step pass them)."""
        if torch.is_tensor(slots):
            slots = slots.tolist()
        if torch.is_tensor(total_lengths):
            total_lengths = total_lengths.tolist()
        size = self.page_size
        short = [(s, -(-t // size)) for s, t in zip(slots, total_lengths) if -(-t // size) > self.num_pages[s]]
        if not short:
            return
        missing = sum(n - self.num_pages[s] for s, n in short)
        if missing > len(self.free_pages):
            self._grow(missing - len(self.free_pages))
        widest = max(n for _, n in short)
        if widest > self.page_table.shape[1]:
            extra = max(widest, 2 * self.page_table.shape[1]) - self.page_table.shape[1]
            self.page_table = torch.cat([self.page_table, self.page_table.new_zeros(len(self.num_pages), extra)], 1)
        rows, cols, pages = [], [], []
        for s, n in short:
            for c in range(self.num_pages[s], n):
                rows.append(s)
                cols.append(c)
                pages.append(self.free_pages.pop())
                self.owned[s].append(pages[-1])
            self.num_pages[s] = n
        dev = self.page_table.device
        self.page_table[upload(rows, dev), upload(cols, dev)] = upload(pages, dev)  # one write for every new page

    def release(self, slot: int) -> None:
        self.free_pages.extend(self.owned[slot])
        self.owned[slot] = []
        self.page_table[slot] = 0
        self.num_pages[slot] = 0
        self.lengths[slot] = 0
        self.held[slot] = 0

    def slot_index(self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Flat pool indices of `positions` (any shape, first dim = sequences) of `slots`; invalid → dummy slot 0."""
        return slot_index(self.page_table, self.page_size, slots, positions, valid)


@dataclass
class RaggedStep:
    """Index tensors shared by every layer of one forward over `slots`: each holds `held` tokens and adds `new`."""

    pool: PagedKVPool
    slots: torch.Tensor  # [B]
    held: torch.Tensor  # [B] tokens already in the pool
    new: torch.Tensor  # [B] tokens this forward adds
    write_index: torch.Tensor  # packed: [T]; padded: [B, n_max]
    gather_index: torch.Tensor  # [B, kv_max]
    key_valid: torch.Tensor  # [B, kv_max]
    # packed mode only: where each packed token sits in the padded query layout
    token_row: torch.Tensor | None = None  # [T]
    token_col: torch.Tensor | None = None  # [T]
    _groups: list | None = None
    _starts: torch.Tensor | None = None
    # `slots`, `held` and `new` as host integers: every shape of the step comes from them
    slots_host: list[int] | None = None
    held_host: list[int] | None = None
    new_host: list[int] | None = None

    @classmethod
    def build(cls, pool: PagedKVPool, slots, new, packed: bool, slots_host: list[int] | None = None,
              new_host: list[int] | None = None) -> RaggedStep:
        """The step adding `new [B]` tokens to each of `slots [B]`. `slots_host` / `new_host`: the same as host
        lists, from which pages are reserved and every shape is taken without reading the device (else they are
        read: only callers outside a step omit them)."""
        if slots_host is None:
            slots_host = slots.tolist()
        if new_host is None:
            new_host = new.tolist()
        held_host = [pool.held[s] for s in slots_host]
        total_host = [h + n for h, n in zip(held_host, new_host)]
        pool.reserve(slots_host, total_host)
        dev = slots.device
        held = pool.lengths[slots]
        total = held + new
        kv_max = max(total_host, default=0)
        key_pos = torch.arange(kv_max, device=dev).expand(len(slots_host), -1)
        key_valid = key_pos < total[:, None]
        gather_index = pool.slot_index(slots, key_pos, key_valid)
        n_max = max(new_host, default=0)
        cols = torch.arange(n_max, device=dev).expand(len(slots_host), -1)
        new_valid = cols < new[:, None]
        write_pad = pool.slot_index(slots, held[:, None] + cols, new_valid)
        step = cls(pool, slots, held, new, write_pad, gather_index, key_valid, slots_host=slots_host,
                   held_host=held_host, new_host=new_host)
        if packed:  # row-major = packed order
            rows = [r for r, n in enumerate(new_host) for _ in range(n)]
            step.token_row = upload(rows, dev)
            step.token_col = upload([c for n in new_host for c in range(n)], dev)
            step.write_index = write_pad[step.token_row, step.token_col]
        return step

    @property
    def num_tokens(self) -> int:
        """The new tokens of every sequence, together."""
        return sum(self.new_host)

    def query_positions(self) -> torch.Tensor:
        """`[B, n_max]` absolute positions of the new tokens (padding rows repeat valid ones harmlessly)."""
        n_max = max(self.new_host, default=0)
        return self.held[:, None] + torch.arange(n_max, device=self.slots.device)[None, :]

    def causal_mask(self, dtype) -> torch.Tensor:
        """Additive `[B, 1, n_max, kv_max]`: a new token sees valid keys up to its own position."""
        allowed = self.key_valid[:, None, :] & (
            torch.arange(self.key_valid.shape[1], device=self.slots.device)[None, None, :]
            <= self.query_positions()[:, :, None]
        )
        return _additive(allowed[:, None], dtype)

    def groups(self, dtype) -> list[AttentionGroup]:
        """Packed mode: the step's sequences grouped by `new` rounded up to a power of two (padding within a group
        stays under 2x), with what the gathering attention needs per group (`kernels.reference.attention_groups`);
        built once per step, shared by every layer."""
        if self._groups is None:
            self._groups = attention_groups(self.pool.page_table, self.slots, self.held, self.new, self.pool.page_size,
                                            self.held_host, self.new_host, dtype)
        return self._groups

    def starts(self) -> torch.Tensor:
        """Packed mode: `[B]` index of each sequence's first new token in the packed row (computed on the device
        once per step, shared by every layer)."""
        if self._starts is None:
            self._starts = torch.cumsum(self.new, 0) - self.new
        return self._starts

    def commit(self) -> None:
        self.pool.set_lengths(self.slots_host, [h + n for h, n in zip(self.held_host, self.new_host)], self.slots,
                              self.held + self.new)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values `[B, Hkv, kv_max, D]` of every held + new token of each sequence."""
        k = self.pool.k[layer][self.gather_index].transpose(1, 2)
        v = self.pool.v[layer][self.gather_index].transpose(1, 2)
        return k, v


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    return additive_mask(allowed, dtype)


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a packed ragged batch (`ragged=RaggedStep` in the model's kwargs); SDPA otherwise
    (`angelspec_hf.attention.gqa_sdpa_attention`).

    query `[1, H, T, D]` and key/value `[1, Hkv, T, D]` hold the new tokens of all sequences back to back.
    """
    step: RaggedStep | None = kwargs.pop("ragged", None)
    if step is None:
        return gqa_sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)
    layer = module.layer_idx
    pool = step.pool
    pool.k[layer][step.write_index] = key[0].transpose(0, 1).to(pool.k.dtype)
    pool.v[layer][step.write_index] = value[0].transpose(0, 1).to(pool.v.dtype)
    out = kernels.paged_attention(
        query[0].transpose(0, 1), pool.k[layer], pool.v[layer], pool.page_table, step.slots, step.held, step.new,
        step.starts(), scaling, pool.page_size, step.held_host, step.new_host, groups=step.groups,
    )  # [T, H, D]
    return out[None], None  # [1, T, H, D]


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)


# The `PoolCache` whose `update()` a drafter layer has just called in place, the layer and the keys it returned: the
# layer's attention function (`pool_draft_attention`) takes it from here, since transformers' attention layers hand
# the cache to `update()` but not to the attention function.
_ATTENDING: ContextVar[tuple | None] = ContextVar("angelspec_pool_attending", default=None)


def pool_draft_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A drafter's attention in the engine where the pool is read through the kernel: the call that follows an
    in-place `PoolCache.update()` of the same layer (`key` is the tensor that update returned) attends through
    `PoolCache.attend`; every other call (the batch-1 hook's cache, training) is SDPA, the drafters' default
    implementation (`angelspec_hf.attention.gqa_sdpa_attention`: transformers' own, bit for bit)."""
    pending = _ATTENDING.get()
    if pending is None or pending[1] != module.layer_idx or pending[2] is not key:
        return gqa_sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)
    _ATTENDING.set(None)
    return pending[0].attend(query, module.layer_idx, scaling), None


AttentionInterface.register(DRAFT_POOL_ATTENTION, pool_draft_attention)
AttentionMaskInterface.register(DRAFT_POOL_ATTENTION, sdpa_mask)


def _token_rows(states: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, n, D]` keys or values → `[B · n, Hkv, D]`, one row per token, in the order of a `[B, n]` index."""
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])


class PoolCache:
    """The `cache` a drafter's attention layers call: `update()` writes the first `n_max` new keys/values of each
    sequence (the valid ones, `RaggedStep.new`) into the pool and returns `[held + new ; transient]`, where the
    trailing `transient` entries (a DFlash block) are attended to but never kept.

    `in_place=True` (where the kernel reads the pool, with the drafter's attention set to `DRAFT_POOL_ATTENTION`):
    `update()` also writes the transient block into the slots after each sequence's new tokens (pages reserved for it;
    the next step overwrites them) and returns its inputs, and `attend()` computes the attention from the pool: no
    copy of any sequence's keys is gathered."""

    def __init__(self, step: RaggedStep, transient: int = 0, in_place: bool = False):
        self.step = step
        self.transient = transient
        self.in_place = in_place
        self._block_index = None
        if in_place and transient:  # [B, transient] slots after each sequence's new tokens
            ahead = (step.held + step.new)[:, None] + torch.arange(transient, device=step.slots.device)[None, :]
            self._block_index = step.pool.slot_index(step.slots, ahead, torch.ones_like(ahead, dtype=torch.bool))

    def update(self, key, value, layer_idx, *args, **kwargs):
        step, pool = self.step, self.step.pool
        stored = key.shape[2] - self.transient
        flat = step.write_index.reshape(-1)
        pool.k[layer_idx][flat] = _token_rows(key[:, :, :stored])
        pool.v[layer_idx][flat] = _token_rows(value[:, :, :stored])
        if self.in_place:
            if self.transient:
                block = self._block_index.reshape(-1)
                pool.k[layer_idx][block] = _token_rows(key[:, :, stored:])
                pool.v[layer_idx][block] = _token_rows(value[:, :, stored:])
            _ATTENDING.set((self, layer_idx, key))
            return key, value
        keys, values = step.gather(layer_idx)
        if self.transient:
            keys = torch.cat([keys, key[:, :, stored:].to(keys.dtype)], dim=2)
            values = torch.cat([values, value[:, :, stored:].to(values.dtype)], dim=2)
        return keys.to(key.dtype), values.to(value.dtype)

    def attend(self, query: torch.Tensor, layer_idx: int, scaling) -> torch.Tensor:
        """In place: the attention `[B, q, H, D]` of the padded queries `[B, H, q, D]` over the pool, through
        `kernels.paged_attention` — each sequence's new tokens causally (`q = n_max`; padding rows are zero), or the
        transient block (`q = transient`) seeing all its sequence's keys and the whole block."""
        step, pool = self.step, self.step.pool
        batch, heads, q_len, dim = query.shape
        dev = query.device
        packed = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
        if self.transient:
            held, new = step.held + step.new, torch.full_like(step.new, self.transient)
            held_host = [h + n for h, n in zip(step.held_host, step.new_host)]
            new_host = [self.transient] * batch
        else:
            held, new, held_host, new_host = step.held, step.new, step.held_host, step.new_host
        padded = sum(new_host) < batch * q_len
        if padded:  # (MTP's first step: sequences adding fewer tokens than the longest) packed back to back
            index = upload([b * q_len + c for b, n in enumerate(new_host) for c in range(n)], dev)
            packed = packed[index]
            starts = upload(list(accumulate(new_host[:-1], initial=0)), dev)
        else:
            starts = torch.arange(batch, device=dev) * q_len
        out = kernels.paged_attention(packed, pool.k[layer_idx], pool.v[layer_idx], pool.page_table, step.slots, held,
                                      new, starts, scaling, pool.page_size, held_host, new_host,
                                      causal=not self.transient)
        if padded:  # the padding rows are zero
            out = out.new_zeros(batch * q_len, heads, dim).index_copy_(0, index, out)
        return out.view(batch, q_len, heads, dim)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def block_mask(self, block: int, dtype) -> torch.Tensor:
        """Additive `[B, 1, block, kv_max + block]` for a non-causal block after each sequence's context."""
        allowed = torch.cat([self.step.key_valid, self.step.key_valid.new_ones(len(self.step.slots), block)], 1)
        return _additive(allowed[:, None, None, :].expand(-1, 1, block, -1), dtype)


class PoolDraftCache:
    """The pool as `drafter.draft` takes its cache (`DrafterPreTrainedModel.draft`), for sequences `slots`: each
    `prepare` is one padded forward's `RaggedStep`. Its lengths are committed as it is built (its write and gather
    indices are fixed then), so the caller rolls back whatever drafting should not keep."""

    def __init__(self, pool: PagedKVPool, slots: torch.Tensor, slots_host: list[int] | None = None,
                 new: torch.Tensor | None = None, new_host: list[int] | None = None, in_place: bool = False):
        self.pool, self.slots = pool, slots
        self.slots_host = slots_host if slots_host is not None else slots.tolist()
        self._known = (new, new_host)  # the counts `new` the caller passes first, and their host values
        self.in_place = in_place  # the drafter's attention reads the pool (`PoolCache(in_place=True)`)

    def prepare(self, num_new: torch.Tensor, block: int, dtype, num_new_host: int | None = None):
        """`(PoolCache, position_ids [B, n_max + block], additive mask)`: causal over each sequence's keys for the
        new tokens; with a `block`, its rows see every valid key and the whole block, which is not stored. The
        counts are read from the device unless they are the `new` given with their host values, or `num_new_host`
        says every sequence adds that many (a chained MTP step: one each). In place, the block's slots are reserved
        too, and no mask is built (the kernel masks)."""
        if num_new_host is not None:
            new_host = [num_new_host] * len(self.slots_host)
        else:
            new_host = self._known[1] if num_new is self._known[0] else None
        if self.in_place and block:
            if new_host is None:
                new_host = num_new.tolist()
            self.pool.reserve(self.slots_host, [self.pool.held[s] + n + block for s, n in zip(self.slots_host, new_host)])
        step = RaggedStep.build(self.pool, self.slots, num_new, packed=False, slots_host=self.slots_host,
                                new_host=new_host)
        step.commit()
        cache = PoolCache(step, transient=block, in_place=self.in_place)
        positions = step.query_positions()
        if block:
            block_positions = (step.held + step.new)[:, None] + torch.arange(block, device=self.slots.device)[None, :]
            positions = torch.cat([positions, block_positions], 1)
        if self.in_place:
            return cache, positions, None
        return cache, positions, step.causal_mask(dtype) if not block else cache.block_mask(block, dtype)
