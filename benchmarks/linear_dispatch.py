"""The target's linears with the weight-streaming kernel, called in model order (211 for SmolLM2-135M), rows of a
forward's size, interleaved:

1. what the `PrepackedLinear` module costs around the kernel: every linear called through its module, and as the bare
   kernel on its packed weight (the stock `F.linear` where the module takes it: a one-row step); the difference per
   call is the module's own cost. Between two calls the kernel streams megabytes of weights through the caches, so
   each Python attribute the module reads is a cache miss: its cost here is several times what `timeit` of a lone
   module reads.
2. the bare kernel per kind of linear (q / k / v / o projections, gate / up / down, the LM head), summed over a
   forward, at each row count: how much more a verify's rows cost than one row, weight for weight;
3. the bare kernel on one 512 x 512 weight that stays in cache, repeated: its arithmetic rate (GFLOP/s) at each row
   count, without the wait for memory.

    python benchmarks/linear_dispatch.py [--threads 2] [--rows 1,5,9] [--repeats 15]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch import nn

import angelspec_hf
from angelspec_hf.cpu_kernels import (STREAM_MIN_ROWS, PrepackedLinear, _built_stream_extension, prepack_linears,
                                      stream_available, stream_unavailable_reason)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,5,9")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not stream_available():
        raise SystemExit(f"the weight-streaming kernel did not build here: {stream_unavailable_reason()}")
    torch.set_num_threads(args.threads)
    target, _ = angelspec_hf.load_default_target()
    prepack_linears(target, "stream")
    named = [(name.rsplit(".", 1)[-1], m) for name, m in target.named_modules() if isinstance(m, PrepackedLinear)]
    kernel = _built_stream_extension().linear
    packed = [m._packed_weight() for _, m in named]
    row_counts = [int(r) for r in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    inputs = {(r, n): torch.randn(1, r, n, generator=generator) for r in row_counts
              for n in {m.in_features for _, m in named}}

    def through_modules(rows):
        for _, m in named:
            m(inputs[rows, m.in_features])

    def bare(rows):
        if rows < STREAM_MIN_ROWS:  # what the module calls for a plain step
            for _, m in named:
                nn.functional.linear(inputs[rows, m.in_features], m.weight, m.bias)
        else:
            for (_, m), p in zip(named, packed):
                kernel(inputs[rows, m.in_features], p, m.out_features, m.bias)

    def by_kind(rows):
        spent = collections.defaultdict(float)
        for (kind, m), p in zip(named, packed):
            start = time.perf_counter()
            kernel(inputs[rows, m.in_features], p, m.out_features, m.bias)
            spent[kind] += time.perf_counter() - start
        return spent

    times = collections.defaultdict(list)
    kinds = collections.defaultdict(lambda: collections.defaultdict(list))
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first pass warms up
            for r in row_counts:
                for name, fn in (("module", through_modules), ("bare", bare))[:: 1 if repeat % 2 else -1]:
                    start = time.perf_counter()
                    fn(r)
                    if repeat:
                        times[name, r].append(time.perf_counter() - start)
                for kind, seconds in by_kind(r).items():
                    if repeat:
                        kinds[kind][r].append(seconds)
    print(f"{len(named)} linears, {args.threads} threads, median of {args.repeats}\n")
    print("| rows | through the modules (ms) | bare (ms) | module's cost per call (µs) |")
    print("|---|---|---|---|")
    for r in row_counts:
        module, bare_ms = (statistics.median(times[k, r]) * 1e3 for k in ("module", "bare"))
        print(f"| {r} | {module:.2f} | {bare_ms:.2f} | {(module - bare_ms) * 1e3 / len(named):.1f} |")
    print("\n| bare kernel, ms per forward | " + " | ".join(f"{r} rows" for r in row_counts) + " |")
    print("|---|" + "---|" * len(row_counts))
    totals = collections.Counter()
    for kind, per_rows in kinds.items():
        cells = []
        for r in row_counts:
            ms = statistics.median(per_rows[r]) * 1e3
            totals[r] += ms
            cells.append(f"{ms:.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{totals[r]:.2f}" for r in row_counts) + " |")
    small = torch.randn(512, 512, generator=generator)
    small_packed = _built_stream_extension().pack(small)
    rates = []
    with torch.inference_mode():
        for r in row_counts:
            x, calls, best = torch.randn(r, 512, generator=generator), 200, float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    kernel(x, small_packed, 512)
                best = min(best, (time.perf_counter() - start) / calls)
            rates.append(f"{2 * r * 512 * 512 / best / 1e9:.0f}")
    print("\n| in cache (512 x 512), GFLOP/s | " + " | ".join(rates) + " |")


if __name__ == "__main__":
    main()
