"""What one target forward of k new tokens costs with each linear kernel of `angelspec_hf.cpu_kernels` (stock
`F.linear`, oneDNN-prepacked weights, MKL-packed weights for 6-12-token forwards, the weight-streaming kernel for
3-48-row forwards), interleaved in one run: the cost of a verify step against a plain decode step.

    python benchmarks/linear_kernels.py [--threads 2] [--context 256] [--tokens 1,2,3,4,5,6,8,9,11,12] [--repeats 15]

Prints a markdown table (median ms per forward, and each k relative to the stock k = 1 step) and the largest logit
difference between the stock kernel and each packed one. Each packed kernel runs on its own copy of the target.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from transformers import DynamicCache

import angelspec_hf
from angelspec_hf.cpu_kernels import (LIBRARIES, mkl_pack_available, prepack_available, prepack_linears,
                                      stream_available)

NAMES = {"stock": "stock", "prepacked": "oneDNN prepacked", "mkl": "MKL-packed", "stream": "weight-streaming"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    parser.add_argument("--tokens", default="1,2,3,4,5,6,8,9,11,12",
                        help="new tokens per forward (1 = a plain decode step)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = angelspec_hf.load_default_target()
    available = (("prepacked", prepack_available()), ("mkl", mkl_pack_available()), ("stream", stream_available()))
    kinds = ["stock"] + [kind for kind, ok in available if ok]
    models = {"stock": target}
    for kind in kinds[1:]:
        models[kind] = copy.deepcopy(target)
        prepack_linears(models[kind], LIBRARIES[kind])
    generator = torch.Generator().manual_seed(0)
    tokens = [int(k) for k in args.tokens.split(",")]
    ids = torch.randint(3, target.config.vocab_size, (1, args.context + max(tokens)), generator=generator)
    with torch.inference_mode():
        caches = {}
        for kind, model in models.items():
            caches[kind] = DynamicCache(config=model.config)
            model(input_ids=ids[:, : args.context], cache=caches[kind], use_cache=True)

        def forward(k, kind):
            start = time.perf_counter()
            logits = models[kind](input_ids=ids[:, args.context: args.context + k], cache=caches[kind],
                                  use_cache=True).logits
            seconds = time.perf_counter() - start
            caches[kind].crop(-k)
            return seconds, logits

        times = {(k, kind): [] for k in tokens for kind in kinds}
        for k in tokens:  # warm-up (and the packed copies made), every kernel
            for kind in kinds:
                forward(k, kind)
        for _ in range(args.repeats):
            for k in tokens:
                for kind in kinds:
                    times[(k, kind)].append(forward(k, kind)[0])
        diffs = {kind: max(float((forward(k, "stock")[1] - forward(k, kind)[1]).abs().max()) for k in tokens)
                 for kind in kinds[1:]}
    median = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    base = median[(1, "stock")]
    print(f"SmolLM2-135M-Instruct (fp32), {args.context}-token cache, {args.threads} threads, "
          f"{platform.machine()} CPU, torch {torch.__version__}; median of {args.repeats}, interleaved\n")
    print("| new tokens k | " + " | ".join(f"{NAMES[kind]} (ms)" for kind in kinds) + " | "
          + " | ".join(f"{NAMES[kind]} / stock k=1" for kind in kinds) + " |")
    print("|---" * (1 + 2 * len(kinds)) + "|")
    for k in tokens:
        row = [median[(k, kind)] for kind in kinds]
        print(f"| {k} | " + " | ".join(f"{t:.1f}" for t in row) + " | " + " | ".join(f"{t / base:.2f}" for t in row)
              + " |")
    print("\nlargest logit difference from the stock kernel: "
          + ", ".join(f"{NAMES[kind]} {d:.1e}" for kind, d in diffs.items()))


if __name__ == "__main__":
    main()
