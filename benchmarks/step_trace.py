"""What a fresh D-Cut engine does, step by step: plain batched decoding, then a new D-Cut engine (the shipped DFly,
with or without its n-gram lookups) on the same closed loop, every step of the second printed as one line (requests
decoding and prefilled, the kind of step D-Cut chose, draft tokens verified and accepted, milliseconds) and summed
by kind. A server starts from such an engine; `angelspec bench --concurrency` reuses one engine over every
concurrency and repeat, so its first steps are diluted there.

    python benchmarks/step_trace.py --concurrency 32 --requests-per-client 1 [--no-lookup] [--passes 2]

Greedy, chat-templated EVAL prompts, the kernels `--linear-kernels` names (default stock); every output must equal
plain decoding's. `--passes 2` runs the same loop again on the same engine (what it has learnt kept).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import angelspec_hf
from angelspec_hf.bench import load_prompt_sets
from angelspec_hf.bench_batch import closed_loop
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.shipped import shipped_or_untrained
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine


class TracedEngine(SpeculativeEngine):
    """Keeps every step's trace (`last_step`) with the wall time of the whole step, and what D-Cut expected of it: the
    accepted tokens (the sum of the verified positions' calibrated survival) and the target forward's seconds (the
    cost model's verify line as it stood before the step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = []

    def step(self):
        cost = self.policy._cost_model
        coef = cost.verify_coef if cost is not None else None
        start = time.perf_counter()
        events = super().step()
        if self.last_step is not None:
            t = self.last_step
            expected = sum(sum(s[:d]) for s, d, n in zip(t.survival, t.verified, t.prefill) if n == 0)
            n_dec = sum(1 for n in t.prefill if n == 0)
            predicted = None
            if coef is not None and n_dec and not any(t.prefill):
                predicted = max(coef[0] + coef[1] * n_dec + coef[2] * (n_dec + t.verified_tokens), 0.0)
            self.traces.append((t, time.perf_counter() - start, expected, predicted))
            self.last_step = None
        return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--no-lookup", action="store_true")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--sets", default="humaneval,gsm8k,mt_bench")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linear-kernels", default="stock", choices=("auto", "prepacked", "stock"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_target(None)
    drafter, _ = shipped_or_untrained("dfly", target)
    print(use_linear_kernels(args.linear_kernels, target, drafter))
    sets = load_prompt_sets(args.sets.split(","), args.prompts_per_set, None)
    prompts = [chat_input_ids(tokenizer, p)[0].tolist() for ps in sets.values() for p in ps]
    c, total = args.concurrency, args.concurrency * args.requests_per_client
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    plain = SpeculativeEngine(target, None, verify=0, max_batch_size=c)
    closed_loop(plain, prompts[:1], 1, 1, SamplingParams(max_new_tokens=4))  # warm-up
    extra = {"lookup_tokens": 0} if args.no_lookup else {}
    engine = TracedEngine(target, drafter, verify="auto", max_batch_size=c, **extra)
    for p in range(args.passes):
        base = closed_loop(plain, prompts, c, total, params)
        engine.traces.clear()
        run = closed_loop(engine, prompts, c, total, params)
        assert run.pop("outputs") == base.pop("outputs"), "D-Cut's greedy output differs from plain decoding's"
        print(f"\npass {p + 1}: plain {base['throughput']:.1f} tok/s, D-Cut {run['throughput']:.1f} tok/s "
              f"({run['throughput'] / base['throughput']:.2f}x), tau {run['tau']:.2f}")
        print("step  decoding  prefill  kind         verified  accepted  expected      ms  verify ms  predicted")
        by_kind = collections.defaultdict(lambda: [0, 0.0, 0])
        for i, (t, seconds, expected, predicted) in enumerate(engine.traces):
            decoding = sum(1 for n in t.prefill if n == 0)
            accepted = sum(a for a, n in zip(t.accepted, t.prefill) if n == 0)
            verify = (seconds - t.draft_seconds) * 1e3
            guess = f"{predicted * 1e3:9.0f}" if predicted is not None else " " * 9
            print(f"{i:4d}  {decoding:8d}  {len(t.prefill) - decoding:7d}  {t.choice:<11}  {t.verified_tokens:8d}  "
                  f"{accepted:8d}  {expected:8.1f}  {seconds * 1e3:6.0f}  {verify:9.0f}  {guess}")
            k = by_kind[t.choice]
            k[0], k[1], k[2] = k[0] + 1, k[1] + seconds, k[2] + decoding + accepted
        for kind, (n, seconds, tokens) in sorted(by_kind.items()):
            print(f"{kind:<11}: {n:4d} steps, {seconds:6.2f} s, {tokens / seconds:6.1f} tok/s")


if __name__ == "__main__":
    main()
