"""The `generate()` hook with a lookup corpus that grows with its greedy replies (`GrowingCorpus`) against the
drafter's corpus alone, on prompts sent twice: a first pass, then the same prompts again (what a notebook re-running a
cell, or a service answering repeated questions, sends one drafter).

    python benchmarks/hook_growing_corpus.py --sets humaneval,gsm8k,mt_bench --prompts-per-set 4 \\
        --max-new-tokens 64 --threads 2

Two copies of the shipped DFly (each with its own corpus and draft-length policy), one given a window of
`--window-tokens`; plain `generate` and both run interleaved per prompt (their order alternating), greedy. Prints per
pass the total speed-up of each over plain `generate` and its τ; every output must equal plain greedy decoding's."""

from __future__ import annotations

import argparse
import time

import torch

import angelspec_hf
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.modeling.candidate_generator import mean_accepted_length
from angelspec_hf.policy import GrowingCorpus
from angelspec_hf.prompts import chat_input_ids, load_eval_prompts
from angelspec_hf.shipped import trained_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="humaneval,gsm8k,mt_bench")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--window-tokens", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    drafters = {"static": trained_drafter("dfly", target), "growing": trained_drafter("dfly", target)}
    if drafters["static"].lookup_corpus is None:
        raise SystemExit("the shipped DFly has no lookup corpus here: run `angelspec install-drafters` first")
    drafters["growing"].lookup_corpus = GrowingCorpus(drafters["growing"].lookup_corpus, args.window_tokens)
    for drafter in drafters.values():
        drafter.lookup_corpus.warm()
    print(use_linear_kernels("auto", target, *drafters.values()), flush=True)
    prompts = [chat_input_ids(tokenizer, p) for name in args.sets.split(",")
               for p in load_eval_prompts(name, args.prompts_per_set)]

    def generate(ids, drafter=None):
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter)
        return out, time.perf_counter() - start

    generate(prompts[0][:, :8])  # warm-up
    for sent in ("first pass", "again"):
        seconds = {"plain": 0.0, "static": 0.0, "growing": 0.0}
        accepted = {"static": [0, 0], "growing": [0, 0]}
        for i, ids in enumerate(prompts):
            order = ["plain", "static", "growing"] if i % 2 == 0 else ["growing", "static", "plain"]
            outputs = {}
            for name in order:
                outputs[name], took = generate(ids, drafters.get(name))
                seconds[name] += took
                if name != "plain":
                    stats = drafters[name].last_speculation_stats
                    accepted[name][0] += sum(stats.accepted)
                    accepted[name][1] += stats.rounds
            for name in ("static", "growing"):
                if not torch.equal(outputs[name], outputs["plain"]):
                    raise SystemExit(f"{name} diverged from plain greedy decoding on prompt {i}")
        line = ", ".join(f"{name} {seconds['plain'] / seconds[name]:.2f}x (τ "
                         f"{mean_accepted_length(*accepted[name]):.2f})" for name in ("static", "growing"))
        print(f"{sent}: {len(prompts)} prompts, plain {seconds['plain']:.1f} s; {line}", flush=True)
    print(f"every output identical to plain greedy decoding; the window holds "
          f"{drafters['growing'].lookup_corpus.added} replies", flush=True)


if __name__ == "__main__":
    main()
