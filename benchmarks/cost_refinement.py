"""Does refining the batched engine's cost model from its own steps pay? One process, interleaved repeats: plain
batched decoding, D-Cut with the profiled cost model used as it is (the engine before the refinement: a cost model
passed in is never refined) and D-Cut refining the same profile from the steps it times (the default). Closed loop,
greedy, the shipped DFly, chat-templated EVAL prompts; every output must equal plain decoding's.

    python benchmarks/cost_refinement.py --concurrency 1,2,4,8,16,32 --repeats 3

Prints each run, then per concurrency the median speed-up over plain (min-max over repeats), the refined
coefficients so far, and the geometric means. The refined engine writes its coefficients back to the cost-model cache
(`~/.cache/angelspec/cost_models/`) every 64 steps, so a second run starts from them: remove the file to start again
from a fresh profile.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

import angelspec_hf
from angelspec_hf.bench import load_prompt_sets
from angelspec_hf.bench_batch import closed_loop
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.shipped import shipped_or_untrained
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine
from angelspec_hf.policy import CostModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sets", default="humaneval,gsm8k,mt_bench")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    target, tokenizer = angelspec_hf.load_target(None)
    drafter, _ = shipped_or_untrained("dfly", target)
    print(use_linear_kernels("prepacked", target, drafter))
    sets = load_prompt_sets(args.sets.split(","), args.prompts_per_set, None)
    prompts = [chat_input_ids(tokenizer, p)[0].tolist() for ps in sets.values() for p in ps]
    batch = max(concurrencies)
    refined = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=batch)
    profile = CostModel.from_dict(json.loads(refined.cost_model.path.read_text()))
    engines = {"plain": SpeculativeEngine(target, None, verify=0, max_batch_size=batch),
               "dcut-profiled": SpeculativeEngine(target, drafter, verify="auto", max_batch_size=batch,
                                                  cost_model=profile),
               "dcut-refined": refined}
    print("profile", profile.verify_coef, profile.draft_coef)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    closed_loop(engines["plain"], prompts[:1], 1, 1, SamplingParams(max_new_tokens=4))  # warm-up
    medians = []
    for c in concurrencies:
        speedups = {name: [] for name in engines}
        for rep in range(args.repeats):
            for name, engine in engines.items():
                result = closed_loop(engine, prompts, c, c, params)
                outputs = result.pop("outputs")
                if name == "plain":
                    plain, plain_outputs = result, outputs
                if any(outputs[i] != plain_outputs[i] for i in outputs):
                    raise SystemExit(f"{name} at concurrency {c}: output differs from plain decoding")
                speedups[name].append(result["throughput"] / plain["throughput"])
                print(f"c={c} repeat {rep + 1} {name:14s} {result['throughput']:6.1f} tok/s "
                      f"x{speedups[name][-1]:.3f} tau {result['tau']:.2f} drafting {result['speculative_steps']:.0%} "
                      f"lookup-only {result['lookup_steps']:.0%}", flush=True)
        print(f"c={c} " + "  ".join(f"{name} {statistics.median(v):.3f}x ({min(v):.2f}-{max(v):.2f})"
                                     for name, v in speedups.items()))
        print("  refined", [round(x, 5) for x in refined.cost_model.verify_coef],
              [round(x, 5) for x in refined.cost_model.draft_coef], flush=True)
        medians.append({name: statistics.median(v) for name, v in speedups.items()})
    for name in engines:
        print(f"{name}: geometric mean {math.exp(statistics.mean(math.log(m[name]) for m in medians)):.3f}x")


if __name__ == "__main__":
    main()
