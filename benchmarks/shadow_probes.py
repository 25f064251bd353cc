"""Probes beside plain steps (shadow drafts) against verified probes, in the `generate()` hook with the cost-aware
draft length, for drafters that rarely or never pay: plain `generate`, the hook with shadow probes (the default) and
the hook with verified probes (`DraftLengthPolicy(shadow_probes=False)`), in turn on every prompt, the order rotating
from prompt to prompt. Each variant is its own drafter instance, so each policy learns only from its own calls.

    python benchmarks/shadow_probes.py [--drafters untrained=outputs/untrained-dfly,dflash=shipped] \
        [--sets mt_bench] [--prompts-per-set 8] [--max-new-tokens 128] [--temperature 0] [--threads 2]

Prints per drafter and variant: tokens/s over all prompts, the speed-up over plain `generate` (from totals, and the
median per prompt), verified drafted rounds and shadow probes per call. Greedy outputs are checked against plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import angelspec_hf
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.prompts import chat_input_ids, load_eval_prompts
from angelspec_hf.shipped import drafter_for_target, shipped_or_untrained

VARIANTS = ("plain", "shadow probes", "verified probes")


def load(name: str, spec: str, target):
    """`spec` a drafter folder, or "shipped": the shipped drafter of family `name`."""
    return shipped_or_untrained(name, target)[0] if spec == "shipped" else drafter_for_target(spec, target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="untrained=outputs/untrained-dfly,dflash=shipped",
                        help="name=path (or name=shipped for the shipped drafter of family `name`), comma-separated")
    parser.add_argument("--sets", default="mt_bench")
    parser.add_argument("--prompts-per-set", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    drafters = {}
    for item in args.drafters.split(","):
        name, spec = item.split("=", 1)
        pair = [load(name, spec, target) for _ in range(2)]
        for drafter in pair:
            drafter.config.lookup_tokens = 0  # the drafter's own rounds only
        drafters[name] = dict(zip(VARIANTS[1:], pair))
    print(use_linear_kernels("auto", target, *[d for pair in drafters.values() for d in pair.values()]))
    for pair in drafters.values():
        pair["verified probes"].draft_policy(target).shadow_probes = False
    prompts = [p for name in args.sets.split(",") for p in load_eval_prompts(name, args.prompts_per_set)]
    sample = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    ids_all = [chat_input_ids(tokenizer, p) for p in prompts]
    for pair in drafters.values():  # warm every path
        for drafter in pair.values():
            target.generate(ids_all[0], max_new_tokens=8, assistant_model=drafter, **sample)
    records = {(name, v): [] for name in drafters for v in VARIANTS}
    for i, ids in enumerate(ids_all):
        for name, pair in drafters.items():
            order = VARIANTS[i % 3:] + VARIANTS[: i % 3]
            outputs = {}
            for variant in order:
                drafter = pair.get(variant)
                torch.manual_seed(i)
                start = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, assistant_model=drafter, **sample)
                seconds = time.perf_counter() - start
                stats = drafter.last_speculation_stats if drafter is not None else None
                records[(name, variant)].append(dict(
                    tokens=out.shape[1] - ids.shape[1], seconds=seconds,
                    rounds=stats.rounds if stats else 0, shadows=stats.shadow_probes if stats else 0))
                outputs[variant] = out[0].tolist()
            if not sample["do_sample"]:
                assert all(o == outputs["plain"] for o in outputs.values()), f"greedy output differs, prompt {i}"
        print(f"[shadow_probes] {i + 1}/{len(ids_all)} prompts", flush=True)
    print(f"\n{len(prompts)} EVAL prompts ({args.sets}), {args.max_new_tokens} new tokens, T = {args.temperature}, "
          f"{args.threads} threads, lookups off")
    print("| drafter | variant | tok/s | speed-up (total) | speed-up (median per prompt) | drafted rounds / call | "
          "shadow probes / call |")
    print("|---|---|---|---|---|---|---|")
    for name in drafters:
        plain = records[(name, "plain")]
        for variant in VARIANTS:
            rs = records[(name, variant)]
            rate = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
            base = sum(r["tokens"] for r in plain) / sum(r["seconds"] for r in plain)
            median = statistics.median((r["tokens"] / r["seconds"]) / (p["tokens"] / p["seconds"])
                                       for r, p in zip(rs, plain))
            print(f"| {name} | {variant} | {rate:.1f} | {rate / base:.3f}x | {median:.3f}x | "
                  f"{statistics.mean(r['rounds'] for r in rs):.1f} | {statistics.mean(r['shadows'] for r in rs):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
