"""The `generate()` hook's draft-length policy across calls: started afresh with each call (the library's behaviour:
`DraftLengthPolicy.new_sequence`) against carried over from the previous call, on held-out prompts that alternate
chat and code/math — what a server or a notebook sends one drafter.

    python benchmarks/hook_across_calls.py --family dfly --prompts 12 --max-new-tokens 128 --threads 2

Prompts: TRAIN prompts never regenerated (ShareGPT for chat; GSM8K and GPTeacher code for code/math), taken by
`scripts/tune_stop_threshold.held_out_prompts`. Each variant keeps its own policy across all calls, as a drafter does;
plain `generate` and both variants run interleaved per prompt (their order alternating), greedy, with the drafter's
n-gram lookups off unless `--lookups` (they do not depend on the policy's back-off). Prints per prompt the speed-up
and the rounds drafted / plain, then the total and median speed-up per kind of prompt; every output must equal plain
greedy decoding's."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import angelspec_hf
from angelspec_hf.policy import hardware_key
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.shipped import checkout_drafter_path, drafter_for_target

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from tune_stop_threshold import held_out_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="dfly")
    parser.add_argument("--prompts", type=int, default=12, help="prompts of each kind")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lookups", action="store_true", help="keep the drafter's n-gram lookup rounds on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    angelspec_hf.prepack_linears(target)
    path = checkout_drafter_path(args.family)
    if path is None:
        raise SystemExit(f"no shipped {args.family} drafter in this checkout's drafters/")
    drafter = drafter_for_target(str(path), target)
    angelspec_hf.prepack_linears(drafter)
    drafter.config.draft_length = "auto"
    if not args.lookups:
        drafter.config.lookup_tokens = 0
    chat = held_out_prompts(["sharegpt"], args.prompts)
    code = held_out_prompts(["gsm8k", "gpteacher_codegen"], args.prompts)
    prompts = [(kind, p) for pair in zip(chat, code) for kind, p in zip(("chat", "code/math"), pair)]

    def generate(ids, assistant=None):
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=assistant)
        return out, time.perf_counter() - start

    warm = chat_input_ids(tokenizer, "Hello")
    generate(warm), generate(warm, drafter)  # also profiles (or loads) the round costs
    key, base = hardware_key(target, drafter), drafter.draft_policy(target)
    policies = {"afresh": copy.deepcopy(base), "carried": copy.deepcopy(base)}
    policies["carried"].new_sequence = lambda mode=None: None  # what the hook did before it started each call afresh
    ratios = {name: [] for name in policies}
    for i, (kind, prompt) in enumerate(prompts):
        ids = chat_input_ids(tokenizer, prompt)
        reference, plain_seconds = generate(ids)
        line = [f"#{i:<2} {kind:<9} plain {plain_seconds:5.2f}s"]
        for name in (list(policies) if i % 2 == 0 else list(policies)[::-1]):
            drafter._draft_policies = {key: policies[name]}
            out, seconds = generate(ids, drafter)
            if not torch.equal(out, reference):
                raise SystemExit(f"FAILURE: prompt {i} ({name}) differs from plain greedy decoding")
            stats = drafter.last_speculation_stats
            ratios[name].append((kind, plain_seconds, seconds))
            line.append(f"{name} {plain_seconds / seconds:.2f}x (drafted {stats.rounds - stats.lookup_rounds}, "
                        f"lookups {stats.lookup_rounds}, plain {stats.plain_steps})")
        print(" | ".join(line), flush=True)
    print(f"\n{args.family}, cost-aware, lookups {'on' if args.lookups else 'off'}; {args.prompts} + {args.prompts} "
          f"held-out prompts alternating; greedy, {args.max_new_tokens} new tokens, {args.threads} thread(s)")
    for name, runs in ratios.items():
        for kind in ("chat", "code/math", None):
            sel = [(a, b) for k, a, b in runs if kind in (None, k)]
            print(f"{name:<8} {kind or 'all':<9} total {sum(a for a, _ in sel) / sum(b for _, b in sel):.2f}x  "
                  f"median {statistics.median(a / b for a, b in sel):.2f}x")


if __name__ == "__main__":
    main()
