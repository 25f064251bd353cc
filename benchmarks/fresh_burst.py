"""A fresh engine's first burst with the KV pools reserved up front (the engine's default) against pools that start
small, zero-filled, and double with `torch.cat` (what the engine did before `kv_cache_tokens`), in one process: fresh
engines of each kind in turn, each running the same closed loop twice (the first burst grows a small pool, the second
finds it grown). Prints tokens per second per burst and the medians.

    python benchmarks/fresh_burst.py --concurrency 32 [--plain] [--repeats 4]

Greedy, chat-templated EVAL prompts (4 HumanEval, 4 GSM8K, 4 MT-Bench), 48 new tokens, the shipped DFly with D-Cut
(`--plain`: no drafter), stock linear kernels, 2 threads.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import angelspec_hf
from angelspec_hf.bench import load_prompt_sets
from angelspec_hf.bench_batch import closed_loop
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.shipped import shipped_or_untrained
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine, paged

RESERVED_INIT, RESERVED_GROW = paged.PagedKVPool.__init__, paged.PagedKVPool._grow
SMALL_POOL_TOKENS = 1008  # 63 pages + the reserved one: the pool size the engine used to start with


def zeroed_init(pool, *args, **kwargs):
    RESERVED_INIT(pool, *args, **kwargs)
    pool.k.zero_()
    pool.v.zero_()


def cat_grow(pool, min_free: int) -> None:
    old = pool.k.shape[1] // pool.page_size
    new = max(2 * old, old + min_free)
    pad = (pool.k.shape[0], (new - old) * pool.page_size, *pool.k.shape[2:])
    pool.k = torch.cat([pool.k, pool.k.new_zeros(pad)], dim=1)
    pool.v = torch.cat([pool.v, pool.v.new_zeros(pad)], dim=1)
    pool.free_pages = list(range(new - 1, old - 1, -1)) + pool.free_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--plain", action="store_true", help="plain batched decoding (no drafter)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_target(None)
    drafter = None if args.plain else shipped_or_untrained("dfly", target)[0]
    use_linear_kernels("stock", target, drafter)
    sets = load_prompt_sets(["humaneval", "gsm8k", "mt_bench"], 4, None)
    prompts = [chat_input_ids(tokenizer, p)[0].tolist() for ps in sets.values() for p in ps]
    c, params = args.concurrency, SamplingParams(max_new_tokens=48)
    runs = {"reserved": [], "grown": []}
    for repeat in range(args.repeats):
        for kind in runs:
            reserved = kind == "reserved"
            paged.PagedKVPool.__init__ = RESERVED_INIT if reserved else zeroed_init
            paged.PagedKVPool._grow = RESERVED_GROW if reserved else cat_grow
            engine = SpeculativeEngine(target, drafter, verify=0 if args.plain else "auto", max_batch_size=c,
                                       kv_cache_tokens=None if reserved else SMALL_POOL_TOKENS)
            closed_loop(engine, prompts[:1], 1, 1, SamplingParams(max_new_tokens=4))  # warm-up
            bursts = [closed_loop(engine, prompts, c, c, params)["throughput"] for _ in range(2)]
            runs[kind].append(bursts)
            print(f"repeat {repeat} {kind:8s}: first burst {bursts[0]:6.1f} tok/s, second {bursts[1]:6.1f}", flush=True)
    paged.PagedKVPool.__init__, paged.PagedKVPool._grow = RESERVED_INIT, RESERVED_GROW
    for kind, bursts in runs.items():
        print(f"{kind:8s}: median first burst {statistics.median(b[0] for b in bursts):6.1f} tok/s, "
              f"second {statistics.median(b[1] for b in bursts):6.1f}")
    pairs = [round(r[0] / g[0], 2) for r, g in zip(runs["reserved"], runs["grown"])]
    print("first burst, reserved / grown, per repeat:", pairs)


if __name__ == "__main__":
    main()
