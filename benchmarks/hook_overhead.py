"""What the `generate()` hook costs in a round that does not draft: plain `generate` against the hook with drafting
switched off (every round a plain step through transformers' assisted-decoding loop), on the embedded target with
oneDNN-prepacked linears.

1. Under cProfile, on one prompt: ms per token of each and the time spent in the hook's own functions
   (`get_candidates`, `update_candidate_strategy`), which is what the hook adds beyond the target's forward.
2. Without the profiler, interleaved over `--prompts` prompts and `--repeats` rounds (the order rotating): plain
   `generate`, plain `generate` with the drafter's hidden states captured (`output_hidden_states=[...]` on every
   forward, what the hook asks of the target), and the hook; median ms per token and per target forward, and the
   per-pair speed of each against plain.

    python benchmarks/hook_overhead.py [--drafter outputs/untrained-dfly] [--tokens 128] [--repeats 3] [--prompts 4]

Prompts: held-out TRAIN prompts of GSM8K and GPTeacher code (never regenerated, never EVAL). Compare the lines of one
run, and run it more than once: this machine's spread between runs is larger than the hook's bookkeeping.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
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
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the interleaved comparison")
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
    prompts = [chat_input_ids(tokenizer, p) for p in held_out_prompts(["gsm8k", "gpteacher_codegen"], args.prompts)]
    interleaved(target, drafter, prompts, args.tokens, args.repeats)
    return 0


def interleaved(target, drafter, prompts, tokens: int, repeats: int) -> None:
    """Plain `generate`, plain `generate` capturing the drafter's hidden states, and the hook, in turn on each prompt
    (the order rotating per repeat): median ms per token (wall) and per target forward (decode steps, by forward
    hooks), and each one's per-pair speed against plain."""
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    forwards: list[float] = []
    handles = [target.register_forward_pre_hook(lambda *_: forwards.append(-time.perf_counter())),
               target.register_forward_hook(lambda *_: forwards.__setitem__(-1, forwards[-1] + time.perf_counter()))]
    plain_forward = target.forward

    def capturing_forward(*args, **kwargs):
        return plain_forward(*args, **{**kwargs, "output_hidden_states": layers})

    def run(kind, ids):
        forwards.clear()
        if kind == "capture":
            target.forward = capturing_forward
        try:
            kwargs = {"assistant_model": drafter} if kind == "hook" else {}
            start = time.perf_counter()
            out = target.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **kwargs)
            wall = time.perf_counter() - start
        finally:
            if kind == "capture":
                del target.forward  # back to the class's
        return 1000 * wall / (out.shape[1] - ids.shape[1]), 1000 * statistics.median(forwards[1:])  # no prefill

    kinds = ["plain", "capture", "hook"]
    results = {kind: [] for kind in kinds}
    for repeat in range(repeats):
        for ids in prompts:
            for kind in kinds[repeat % 3:] + kinds[: repeat % 3]:
                results[kind].append(run(kind, ids))
    for handle in handles:
        handle.remove()
    names = {"plain": "plain generate", "capture": "+ hidden states", "hook": "hook, no drafting"}
    for kind in kinds:
        speed = [p[0] / r[0] for p, r in zip(results["plain"], results[kind])]
        print(f"{names[kind]:18s} {statistics.median(r[0] for r in results[kind]):6.2f} ms/token, forward "
              f"{statistics.median(r[1] for r in results[kind]):6.2f} ms; speed vs plain: median "
              f"{statistics.median(speed):.3f}x ({min(speed):.3f}-{max(speed):.3f}x over {len(speed)} pairs)")


if __name__ == "__main__":
    raise SystemExit(main())
