"""Choose each shipped drafter's `draft_stop_threshold` (the generate() hook's confidence cut) on held-out TRAIN
prompts — prompts of the drafter's own domain that are *not* in data/regenerated/ (so the drafter never trained on
their answers), and never EVAL prompts. Plain and speculative generate run interleaved per prompt; the threshold with
the best total speed-up is written into drafters/<name>/config.json.

    python scripts/tune_stop_threshold.py [--families dfly,dflash,mtp] [--prompts 4] [--max-new-tokens 64] [--threads 2] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import angelspec_hf
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.shipped import checkout_drafter_path, drafter_for_target
from angelspec_hf.trainer.data import load_train_prompts

DOMAIN_SETS = {"dfly": ["gsm8k", "code_alpaca"], "dflash": ["gsm8k", "code_alpaca"], "mtp": ["sharegpt", "alpaca"]}
THRESHOLDS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4)
REGENERATED = Path(__file__).resolve().parent.parent / "data" / "regenerated" / "smollm2-135m-instruct"


def held_out_prompts(sets, count):
    from angelspec_hf.trainer.regenerated_files import read_records

    seen = {rec["id"] for f in REGENERATED.glob("*.jsonl*") for rec in read_records(f)}  # .jsonl.gz or .jsonl
    per_set = -(-count // len(sets))
    prompts = []
    for name in sets:
        prompts += [p["prompt"] for p in load_train_prompts(name) if p["id"] not in seen][-per_set:]
    return prompts[:count]


def timed(target, ids, **kwargs):
    start = time.perf_counter()
    out = target.generate(ids, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families", default="dfly,dflash,mtp")
    parser.add_argument("--dry-run", action="store_true", help="report only; do not write the configs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    for family in args.families.split(","):
        sets = DOMAIN_SETS[family]
        path = checkout_drafter_path(family)  # it rewrites the config: the checkout's, never the HF cache's
        if path is None:
            print(f"{family}: no shipped drafter in this checkout's drafters/")
            continue
        drafter = drafter_for_target(str(path), target)
        inputs = [chat_input_ids(tokenizer, p) for p in held_out_prompts(sets, args.prompts)]
        timed(target, inputs[0][:, :8], max_new_tokens=4, assistant_model=drafter)  # warm-up
        plain_s, spec_s, taus = 0.0, {t: 0.0 for t in THRESHOLDS}, {t: [] for t in THRESHOLDS}
        for ids in inputs:
            ref, seconds = timed(target, ids, max_new_tokens=args.max_new_tokens)
            plain_s += seconds
            for threshold in THRESHOLDS:
                drafter.config.draft_stop_threshold = threshold
                out, seconds = timed(target, ids, max_new_tokens=args.max_new_tokens, assistant_model=drafter)
                assert torch.equal(out, ref), "speculative output differs from plain greedy output"
                spec_s[threshold] += seconds
                taus[threshold].append(drafter.last_speculation_stats.mean_accepted_length)
        speedups = {t: plain_s / s for t, s in spec_s.items()}
        best = max(speedups, key=speedups.get)
        for t in THRESHOLDS:
            print(f"{family} threshold {t:<5} speed-up {speedups[t]:.2f}x  tau {sum(taus[t]) / len(taus[t]):.2f}"
                  + ("  <- best" if t == best else ""))
        if not args.dry_run:
            config_file = path / "config.json"
            config = json.loads(config_file.read_text())
            config["draft_stop_threshold"] = best
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
