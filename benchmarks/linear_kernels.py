"""What one target forward of k new tokens costs with the stock linear kernels and with oneDNN-prepacked weights
(`angelspec_hf.cpu_kernels`), the two interleaved in one run: the cost of a verify step against a plain decode step.

    python benchmarks/linear_kernels.py [--threads 2] [--context 256] [--tokens 1,2,4,8] [--repeats 15]

Prints a markdown table (median ms per forward, and each k relative to the stock k = 1 step) and the largest logit
difference between the two kernels.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import DynamicCache

import angelspec_hf
from angelspec_hf.cpu_kernels import prepack_linears, stock_linears


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    parser.add_argument("--tokens", default="1,2,4,8", help="new tokens per forward (1 = a plain decode step)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = angelspec_hf.load_default_target()
    prepack_linears(target)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (1, args.context + 16), generator=generator)
    tokens = [int(k) for k in args.tokens.split(",")]
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, : args.context], cache=cache, use_cache=True)

        def forward(k, stock):
            with stock_linears(target, stock):
                start = time.perf_counter()
                logits = target(input_ids=ids[:, args.context: args.context + k], cache=cache, use_cache=True).logits
                seconds = time.perf_counter() - start
            cache.crop(-k)
            return seconds, logits

        times = {(k, s): [] for k in tokens for s in (True, False)}
        for k in tokens:  # warm-up, both kernels
            forward(k, True), forward(k, False)
        for _ in range(args.repeats):
            for k in tokens:
                for stock in (True, False):
                    times[(k, stock)].append(forward(k, stock)[0])
        diff = max(float((forward(k, True)[1] - forward(k, False)[1]).abs().max()) for k in tokens)
    median = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    base = median[(1, True)]
    print(f"SmolLM2-135M-Instruct (fp32), {args.context}-token cache, {args.threads} threads, "
          f"{platform.machine()} CPU, torch {torch.__version__}; median of {args.repeats}, interleaved\n")
    print("| new tokens k | stock (ms) | prepacked (ms) | stock / stock k=1 | prepacked / stock k=1 "
          "| prepacked / prepacked k=1 |")
    print("|---|---|---|---|---|---|")
    for k in tokens:
        s, p = median[(k, True)], median[(k, False)]
        print(f"| {k} | {s:.1f} | {p:.1f} | {s / base:.2f} | {p / base:.2f} | {p / median[(1, False)]:.2f} |")
    print(f"\nlargest logit difference between the kernels: {diff:.1e}")


if __name__ == "__main__":
    main()
