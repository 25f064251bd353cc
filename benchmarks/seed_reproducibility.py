"""Seeded sampling is reproducible across batch composition in the batched engine: the same seeded request gives the
same token ids (a) alone, (b) in one batch with all the others, (c) in a batch beside its twin (the same request with
the same seed) and greedy and unseeded sampled neighbours. The engine couples a seeded request's draws to Gumbel
noise keyed by (seed, position), so every count should be N/N; a mismatch prints the first differing request and
position. Prints, per verify mode x n-gram lookups (the drafter config's default / `lookup_tokens=0`), the counts and
the mean accepted length (over the three phases).

    python benchmarks/seed_reproducibility.py [--requests 40] [--max-new-tokens 24] [--modes full,auto,16,depth:3]

The real target (embedded SmolLM2-135M-Instruct) and the shipped DFly, chat-templated EVAL prompts (MT-Bench,
HumanEval, GSM8K in turn), T=0.8, top_p 0.95, seeds 0..N-1, one engine per configuration (requests run one at a
time to completion count as "alone"), the cost model profiled or read from the cache, the linear kernels `angelspec
serve` picks (`--linear-kernels auto`: oneDNN-prepacked where faster on this CPU), 2 threads.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import angelspec_hf
from angelspec_hf.cpu_kernels import KERNELS, use_linear_kernels
from angelspec_hf.prompts import chat_ids, load_eval_prompts
from angelspec_hf.shipped import shipped_or_untrained
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine


def run(engine: SpeculativeEngine, batch: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Adds every request of `batch` at once, steps to completion; the token ids per request, in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in batch]
    out = {i: [] for i in ids}
    for events in engine.steps():
        for event in events:
            if event.error is not None:
                raise RuntimeError(f"request {event.request_id} failed: {event.error}")
            out[event.request_id].extend(event.token_ids)
    return [out[i] for i in ids]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(label: str, i: int, ref: list[int], got: list[int]) -> None:
    k = first_difference(ref, got)
    print(f"  MISMATCH {label}: request {i} (seed {i}) first differs at position {k}: alone {ref[k:k + 4]} vs "
          f"{got[k:k + 4]} (lengths {len(ref)} / {len(got)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--modes", default="full,auto,16,depth:3", help="verify modes, comma-separated")
    parser.add_argument("--lookups", default="on,off", help="on (drafter config default), off (lookup_tokens=0)")
    parser.add_argument("--twin-group", type=int, default=8,
                        help="requests per twin batch (each with its twin, plus as many greedy/unseeded neighbours)")
    parser.add_argument("--linear-kernels", choices=KERNELS, default="auto", help="as `angelspec serve`")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    drafter, trained = shipped_or_untrained("dfly", target)
    print("linear kernels:", use_linear_kernels(args.linear_kernels, target, drafter), flush=True)
    print(f"drafter: shipped dfly (trained={trained}), config lookup_tokens="
          f"{getattr(drafter.config, 'lookup_tokens', 0)}", flush=True)
    sets = [load_eval_prompts(name, args.requests) for name in ("mt_bench", "humaneval", "gsm8k")]
    texts = [sets[i % 3][i // 3] for i in range(args.requests)]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    n, g = args.requests, args.twin_group

    def seeded(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature,
                              top_p=args.top_p, seed=i)

    def neighbour(j: int) -> tuple[list[int], SamplingParams]:  # alternately greedy and unseeded sampled
        params = SamplingParams(max_new_tokens=args.max_new_tokens) if j % 2 == 0 else SamplingParams(
            max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature, top_p=args.top_p)
        return prompts[(j * 7 + 3) % n], params

    rows = []
    for mode in args.modes.split(","):
        verify = int(mode) if mode.isdigit() else mode
        for lookups in args.lookups.split(","):
            began = time.perf_counter()
            engine = SpeculativeEngine(target, drafter, verify=verify, max_batch_size=max(n, 3 * g),
                                       lookup_tokens=None if lookups == "on" else 0)
            alone = [run(engine, [(prompts[i], seeded(i))])[0] for i in range(n)]
            batch = run(engine, [(prompts[i], seeded(i)) for i in range(n)])
            twins_ok = 0
            rng = random.Random(0)
            for start in range(0, n, g):
                members = list(range(start, min(start + g, n)))
                entries = [(i, 0) for i in members] + [(i, 1) for i in members] + \
                          [(None, j) for j in range(start, start + len(members))]
                rng.shuffle(entries)
                outs = run(engine, [(prompts[i], seeded(i)) if i is not None else neighbour(j) for i, j in entries])
                got = {(i, j): o for (i, j), o in zip(entries, outs) if i is not None}
                for i in members:
                    ok = got[(i, 0)] == alone[i] and got[(i, 1)] == alone[i]
                    twins_ok += ok
                    if not ok:
                        bad = got[(i, 0)] if got[(i, 0)] != alone[i] else got[(i, 1)]
                        report(f"{mode}/{lookups} twin", i, alone[i], bad)
            batch_ok = sum(a == b for a, b in zip(alone, batch))
            for i in range(n):
                if alone[i] != batch[i]:
                    report(f"{mode}/{lookups} batch", i, alone[i], batch[i])
                    break
            tau = engine.stats["mean_accepted_length"]
            rows.append((mode, lookups, batch_ok, twins_ok, tau))
            print(f"{mode:8s} lookups {lookups:3s}: alone=batch {batch_ok}/{n}, alone=twin {twins_ok}/{n}, "
                  f"tau {tau:.2f}, {time.perf_counter() - began:.0f} s", flush=True)
    print(f"\n{'mode':8s} {'lookups':7s} {'alone=batch':>11s} {'alone=twin':>10s} {'mean acc. len':>13s}")
    for mode, lookups, batch_ok, twins_ok, tau in rows:
        print(f"{mode:8s} {lookups:7s} {f'{batch_ok}/{n}':>11s} {f'{twins_ok}/{n}':>10s} {tau:13.2f}")


if __name__ == "__main__":
    main()
