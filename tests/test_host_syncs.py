"""Host synchronisations per engine step, counted on CPU.

On a GPU every read of a tensor's value by Python (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, indexing a list with a
tensor, `.cpu()`, `.numpy()`) waits for the device to finish everything queued before it; so does every copy of
Python data to the device (`torch.tensor(list, device=...)` copies synchronously). Other ops have to learn a size
from the device before they can allocate their output (`nonzero`, boolean-mask indexing, `unique`, ...). None of this
costs anything on CPU, so it is counted here by intercepting the calls with a `TorchFunctionMode` while `step()`
runs, on tiny random models: the counts are what the same step would do on CUDA.

`count_step(engine)` returns a `SyncCount` (calls by kind, each with where in the engine it came from);
`python tests/test_host_syncs.py` prints the table for every step kind.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
from dataclasses import dataclass, field

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(__file__))

from helpers import tiny_drafter, tiny_target  # noqa: E402

from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from angelspec_hf.policy import CostModel  # noqa: E402

# reads of a tensor's value by Python: each waits for the device
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__array__",
          "__complex__"}
# ops whose output size depends on the values of their input: the device reports it to the host first
_DATA_DEPENDENT = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount",
                   "nonzero_static"}
# Python data copied to the device (synchronous unless from pinned memory with non_blocking=True)
_UPLOADS = {"tensor", "as_tensor"}


# Functions that compute on host tensors by design (D-Cut's plan from the drafted rows it remembered, which the step's
# one read brought back): their reads are of host memory, not of the device.
_HOST_SIDE = {"drafting_may_pay", "remember"}


def _names_a_device(args, kwargs) -> bool:
    return kwargs.get("device") is not None or any(isinstance(a, (str, torch.device)) for a in args[1:])


def _caller() -> tuple[str, str]:
    """`("file:line function", source line)` of the innermost frame of this project (or transformers) that made the
    call."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if "/torch/" in path or path.endswith("test_host_syncs.py"):
            continue
        if "/transformers/" in path:
            return f"transformers/{path.split('/transformers/')[-1]}:{frame.lineno} {frame.name}", frame.line or ""
        for root in ("tgi_patch/", "modeling/", "angelspec_hf/"):
            if root in path:
                return f"{root}{path.split(root, 1)[-1]}:{frame.lineno} {frame.name}", frame.line or ""
        if "/engine/" in path:  # a copy of the engine elsewhere (two versions side by side)
            return f"tgi_patch/engine/{path.split('/engine/', 1)[-1]}:{frame.lineno} {frame.name}", frame.line or ""
    return "?", ""


def _where() -> str:
    return _caller()[0]


@dataclass
class SyncCount:
    reads: list = field(default_factory=list)  # (name, where)
    data_dependent: list = field(default_factory=list)
    uploads: list = field(default_factory=list)

    def summary(self) -> dict:
        return {"reads": len(self.reads), "data_dependent": len(self.data_dependent), "uploads": len(self.uploads)}

    def table(self, kind: str) -> str:
        lines = []
        for what in ("reads", "data_dependent", "uploads"):
            for (name, where), n in collections.Counter(getattr(self, what)).most_common():
                lines.append(f"    {what:14s} {n:3d}  {name:18s} {where}")
        return "\n".join(lines)


class SyncCounter(TorchFunctionMode):
    """Records the calls that make the host wait for the device (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.count = SyncCount()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _READS:
            where = _where()
            if where.rsplit(" ", 1)[-1] not in _HOST_SIDE:
                self.count.reads.append((name, where))
        elif name == "to" and _names_a_device(args, kwargs):
            where, line = _caller()
            if "cpu" in line:  # `.to("cpu")`: the device's copy read back by the host
                self.count.reads.append(("to(cpu)", where))
            elif where.startswith("tgi_patch/"):  # `.to(device)` of the engine: a copy between host and device
                self.count.uploads.append(("to(device)", where))  # (on CPU both sides are the same: undecidable)
        elif name in _DATA_DEPENDENT or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                         and len(args) > 1 and torch.is_tensor(args[1])):
            self.count.data_dependent.append((name, _where()))
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and _has_mask_index(args):
            self.count.data_dependent.append((f"{name}[bool]", _where()))
        elif name in _UPLOADS:
            data = args[0] if args else kwargs.get("data")
            if not torch.is_tensor(data):
                self.count.uploads.append((name, _where()))
        return func(*args, **kwargs)



def _has_mask_index(args) -> bool:
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(torch.is_tensor(i) and i.dtype == torch.bool and i.dim() > 0 for i in index)


def count_step(engine: SpeculativeEngine) -> tuple[SyncCount, list]:
    """The host synchronisations of one `engine.step()`, and its events."""
    counter = SyncCounter()
    with counter:
        events = engine.step()
    return counter.count, events


# ---- the step kinds ------------------------------------------------------------------------------------------------
REPEATING = [[5, 7, 9, 11, 5, 7, 9, 11, 5, 7], [20, 21, 22, 20, 21], [30, 31, 30, 31, 30, 31, 30], [40, 41, 42, 43]]
CHEAP_DRAFTS = CostModel((1.0, 0.05, 0.0001), (0.0, 0.0))  # drafting and verified tokens nearly free: "auto" drafts
COSTLY_DRAFTS = CostModel((1.0, 0.05, 0.0001), (50.0, 1.0))  # drafting never pays: "auto" takes lookup steps


def _engine(kind: str, target, drafter):
    sampled = kind in ("drafted_sampled", "drafted_seeded")
    if kind == "plain":
        engine = SpeculativeEngine(target, drafter, verify=0, max_batch_size=4, lookup_tokens=0)
    elif kind.startswith("auto"):
        engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model=CHEAP_DRAFTS,
                                   lookup_tokens=0, measure_rates=False)
    elif kind.startswith("drafted") or kind == "mtp_greedy":
        engine = SpeculativeEngine(target, drafter, verify="full", max_batch_size=4, lookup_tokens=0)
    elif kind == "lookup":
        engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=4, cost_model=COSTLY_DRAFTS,
                                   lookup_tokens=4, measure_rates=False)
    else:
        raise ValueError(kind)
    # the device's configuration: the whole block drafted ("auto" on CPU stops at the first position no request could
    # have verified, asking the device after each: `auto_greedy_cpu`)
    engine.early_stop_drafting = kind == "auto_greedy_cpu"
    for i, prompt in enumerate(REPEATING):
        params = SamplingParams(max_new_tokens=40, do_sample=sampled, temperature=0.8 if sampled else 1.0,
                                seed=(7 + i) if kind == "drafted_seeded" else None)
        engine.add_request(prompt, params)
    return engine


STEP_KINDS = {  # kind: (drafter family, the engine's trace choice expected at the measured step)
    "plain": ("dfly", "plain"),  # verify=0: no drafts
    "drafted_greedy": ("dfly", "speculative"),  # verify="full"
    "drafted_sampled": ("dfly", "speculative"),  # rejection-sampled (unseeded)
    "drafted_seeded": ("dfly", "speculative"),  # seeded sampling (Gumbel-max, exact match)
    "mtp_greedy": ("mtp", "speculative"),
    "auto_greedy": ("dfly", "speculative"),  # D-Cut "auto" chooses the depths
    "auto_greedy_cpu": ("dfly", "speculative"),  # the same with CPU's early stop of drafting
    "lookup": ("dfly", "lookup"),  # n-gram lookups only
}

# The most reads of the device one decoding step of each kind may make. One: the step's results, read together
# (`SpeculativeEngine._read`). Where D-Cut chooses the depths on the device (a budget, "auto", n-gram lookups whose
# use is decided by calibrated acceptance), the host reads them before the packed forward, whose size they are:
# two. MTP's chained drafting steps add one token per sequence, which they tell the KV pool
# (`PoolDraftCache.prepare(..., num_new_host=1)`), so they read nothing. CPU's early stop of drafting in "auto" asks
# after each drafted position.
MAX_READS = {"plain": 1, "drafted_greedy": 1, "drafted_sampled": 1, "drafted_seeded": 1, "mtp_greedy": 1,
             "auto_greedy": 2, "auto_greedy_cpu": 2 + 5, "lookup": 2}


def measure(kind: str, steps: int = 3) -> list[SyncCount]:
    """Counts of `steps` decoding steps of `kind` after the prefill step (4 requests, tiny random models)."""
    family, choice = STEP_KINDS[kind]
    target = tiny_target()
    engine = _engine(kind, target, tiny_drafter(family, target))
    engine.step()  # the prefill
    counts = []
    for _ in range(steps):
        count, _ = count_step(engine)
        assert engine.last_step is not None and engine.last_step.choice == choice, (kind, engine.last_step.choice)
        counts.append(count)
    return counts


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_host_reads_per_step_are_bounded(kind):
    for count in measure(kind):
        assert len(count.reads) <= MAX_READS[kind], f"{kind}: {count.summary()}\n{count.table(kind)}"


def test_host_mirrors_agree_with_the_device_state():
    """The host's integer mirrors the engine plans with (KV lengths, pages owned, pending drafter features) equal the
    device tensors they mirror after every step, through prefills, drafting, lookups and finished requests."""
    target = tiny_target()
    for kind in ("drafted_greedy", "lookup", "mtp_greedy"):
        engine = _engine(kind, target, tiny_drafter(STEP_KINDS[kind][0], target))
        engine.add_request([8, 9, 10], SamplingParams(max_new_tokens=3))  # finishes early: its slot is released
        while engine.has_work():
            engine.step()
            runner = engine.runner
            for pool in (runner.pool, runner.batch_drafter.pool):
                assert pool.held == pool.lengths.tolist(), kind
                table = pool.page_table.tolist()
                assert [table[s][: len(pages)] for s, pages in enumerate(pool.owned)] == pool.owned, kind
                pool.check_accounting()
            assert runner._live_host == runner._live.tolist(), kind
        assert engine.pool.tokens_allocated == 0


def _scan_continuation(ids: list[int], max_ngram: int, num_tokens: int) -> tuple[list[int], int]:
    """Prompt lookup by scanning the whole context (the definition `NgramIndex` must match): the tokens that followed
    the latest earlier occurrence of the last n tokens, for the largest n <= max_ngram that occurs."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + num_tokens], n
    return [], 0


def test_incremental_ngram_lookup_equals_the_scan():
    """`NgramIndex`, extended as tokens arrive (per request in the engine, `extend`; from the growing context in the
    hook, `extend_to`), gives the scan's lookups."""
    import random

    from angelspec_hf.policy import NgramIndex

    rng = random.Random(0)
    for trial in range(60):
        max_ngram, vocab = rng.choice([1, 2, 3, 4]), rng.choice([2, 3, 5, 20])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        generated, index, grown = [], NgramIndex(max_ngram), NgramIndex(max_ngram)
        for _ in range(rng.randrange(1, 30)):
            index.extend(prompt, generated)
            grown.extend_to(torch.tensor(prompt + generated))
            span = rng.randrange(0, 6)
            expected = _scan_continuation(prompt + generated, max_ngram, span)
            assert index.continuation(span) == grown.continuation(span) == expected
            generated += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
    ids = [7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert _scan_continuation(ids, 3, 4) == ([4, 8, 1, 2], 2)  # latest earlier "1 2", not the first
    assert _scan_continuation(ids, 1, 2) == ([4, 8], 1)
    assert _scan_continuation([5, 6, 7], 3, 4) == ([], 0) and _scan_continuation([5, 5], 3, 4) == ([5], 1)

if __name__ == "__main__":
    torch.set_num_threads(1)
    for kind in (sys.argv[1:] or STEP_KINDS):
        counts = measure(kind)
        print(f"{kind}: " + "; ".join(str(c.summary()) for c in counts))
        print(counts[-1].table(kind))


@pytest.mark.parametrize("kind", ["drafted_greedy", "mtp_greedy"])
def test_drafters_reading_the_pool_in_place_add_no_reads(monkeypatch, kind):
    """Where the kernel reads the pools (CUDA), the drafters' attention does too (`PoolCache(in_place=True)`): that
    path reads nothing more from the device. Counted here with the kernel's reference standing in for it."""
    from angelspec_hf.tgi_patch.engine import kernels
    from angelspec_hf.tgi_patch.engine.kernels import reference
    from angelspec_hf.tgi_patch.engine.kernels import triton_kernels
    from angelspec_hf.tgi_patch.engine.paged import PoolCache
    from helpers import count_calls

    monkeypatch.setattr(kernels, "use_paged_attention_kernel", lambda tensor: True)
    monkeypatch.setattr(triton_kernels, "paged_attention", reference.paged_attention)
    calls = count_calls(monkeypatch, attend=(PoolCache, "attend"))
    for count in measure(kind):
        assert len(count.reads) <= MAX_READS[kind], f"{kind}: {count.summary()}\n{count.table(kind)}"
    assert calls["attend"] > 0
