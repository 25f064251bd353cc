"""What one target forward of k new tokens costs with transformers' `sdpa` attention and with `angelspec_sdpa`
(`angelspec_hf.attention`: the grouped-query heads handed to SDPA instead of copied per head, in multi-row forwards
on the CPU), on the same model and KV cache, interleaved, at each context length: a plain decode step (k = 1) against
a speculative verify (k > 1).

    python benchmarks/gqa_attention.py [--threads 2] [--contexts 256,1024] [--tokens 1,3,5,8,11] [--repeats 9] \
        [--linear-kernels auto]

Prints a markdown table (median ms per forward, each relative to the `sdpa` k = 1 step at its context) and whether
every forward's logits were bit for bit those of `sdpa`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import DynamicCache

import angelspec_hf
from angelspec_hf.attention import GQA_SDPA_ATTENTION
from angelspec_hf.cpu_kernels import add_linear_kernels_argument, use_linear_kernels

IMPLEMENTATIONS = ("sdpa", GQA_SDPA_ATTENTION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="256,1024", help="tokens already in the KV cache, one run each")
    parser.add_argument("--tokens", default="1,3,5,8,11", help="new tokens per forward (1 = a plain decode step)")
    parser.add_argument("--repeats", type=int, default=9)
    add_linear_kernels_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = angelspec_hf.load_default_target()
    kernels = use_linear_kernels(args.linear_kernels, target)
    tokens = [int(k) for k in args.tokens.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    generator = torch.Generator().manual_seed(0)
    median, identical = {}, True
    with torch.inference_mode():
        for context in contexts:
            ids = torch.randint(3, target.config.vocab_size, (1, context + max(tokens)), generator=generator)
            cache = DynamicCache(config=target.config)
            target(input_ids=ids[:, :context], cache=cache, use_cache=True)

            def forward(k, implementation):
                target.set_attn_implementation(implementation)
                start = time.perf_counter()
                logits = target(input_ids=ids[:, context: context + k], cache=cache, use_cache=True).logits
                seconds = time.perf_counter() - start
                cache.crop(-k)
                return seconds, logits

            times = {(k, impl): [] for k in tokens for impl in IMPLEMENTATIONS}
            for k in tokens:  # warm-up, and the outputs compared
                identical &= torch.equal(*(forward(k, impl)[1] for impl in IMPLEMENTATIONS))
            for _ in range(args.repeats):
                for k in tokens:
                    for impl in IMPLEMENTATIONS:
                        times[(k, impl)].append(forward(k, impl)[0])
            median.update({(context, *key): statistics.median(v) * 1e3 for key, v in times.items()})
    target.set_attn_implementation(GQA_SDPA_ATTENTION)
    print(f"SmolLM2-135M-Instruct (fp32), {args.threads} threads, {platform.machine()} CPU, torch {torch.__version__}, "
          f"linear kernels: {kernels}; median of {args.repeats}, interleaved\n")
    print("| cached tokens | new tokens k | sdpa (ms) | angelspec_sdpa (ms) | saved (ms) | sdpa / k=1 | "
          "angelspec_sdpa / k=1 |")
    print("|---|---|---|---|---|---|---|")
    for context in contexts:
        base = median[(context, 1, "sdpa")]
        for k in tokens:
            stock, ours = median[(context, k, "sdpa")], median[(context, k, GQA_SDPA_ATTENTION)]
            print(f"| {context} | {k} | {stock:.1f} | {ours:.1f} | {stock - ours:.1f} | {stock / base:.2f} | "
                  f"{ours / base:.2f} |")
    print(f"\nlogits bit for bit those of sdpa at every k and context: {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
