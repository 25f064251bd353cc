"""What the `generate()` hook costs in a round that does not draft: plain `generate` against the hook with drafting
switched off (every round a plain step through transformers' assisted-decoding loop), each under cProfile, on the
embedded target with oneDNN-prepacked linears. Prints ms per token of each and the time spent in the hook's own
functions (`get_candidates`, `update_candidate_strategy`), which is what the hook adds beyond the target's forward.

    python benchmarks/hook_overhead.py [--drafter outputs/untrained-dfly] [--tokens 128] [--repeats 3] [--threads 2]

Prompts: the first held-out TRAIN prompt of GSM8K (never regenerated, never EVAL). Timing is wall clock under the
profiler, so compare the two lines of one run, and run it more than once: this machine's spread between runs is
larger than the hook's bookkeeping.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import angelspec_hf  # noqa: E402
from angelspec_hf.modeling.draft_policy import DraftLengthPolicy  # noqa: E402
from angelspec_hf.prompts import chat_input_ids  # noqa: E402
from angelspec_hf.shipped import drafter_for_target, shipped_or_untrained  # noqa: E402
from tune_stop_threshold import held_out_prompts  # noqa: E402

HOOK_FUNCTIONS = ("get_candidates", "update_candidate_strategy")


def profiled(target, ids, tokens: int, repeats: int, **kwargs) -> tuple[float, dict[str, float]]:
    """ms per generated token over `repeats` calls, and cumulative seconds of the hook's functions."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    generated = 0
    for _ in range(repeats):
        out = target.generate(ids, max_new_tokens=tokens, do_sample=False, **kwargs)
        generated += out.shape[1] - ids.shape[1]
    profile.disable()
    ms = (time.perf_counter() - start) / generated * 1000
    stats = pstats.Stats(profile).stats
    hook = {name: sum(v[3] for (path, _, fn), v in stats.items() if fn == name and "candidate_generator" in path)
            for name in HOOK_FUNCTIONS}
    return ms, hook


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped DFly)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    angelspec_hf.prepack_linears(target)
    drafter = drafter_for_target(args.drafter, target) if args.drafter else shipped_or_untrained("dfly", target)[0]
    angelspec_hf.prepack_linears(drafter)
    drafter.config.lookup_tokens = 0
    DraftLengthPolicy.start_round = lambda self, max_tokens: False  # every round a plain step
    ids = chat_input_ids(tokenizer, held_out_prompts(["gsm8k"], 1)[0])
    for kwargs in ({}, {"assistant_model": drafter}):  # warm both paths
        target.generate(ids, max_new_tokens=8, do_sample=False, **kwargs)
    for name, kwargs in (("plain generate", {}), ("hook, no drafting", {"assistant_model": drafter})):
        ms, hook = profiled(target, ids, args.tokens, args.repeats, **kwargs)
        tokens = args.tokens * args.repeats
        own = " + ".join(f"{fn} {1000 * s / tokens:.2f}" for fn, s in hook.items()) if any(hook.values()) else "-"
        print(f"{name:18s} {ms:6.2f} ms/token (under cProfile); hook's own functions: {own} ms/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
