"""The batched engine on a CPU with its packed attention in the C++ kernel (`kernels.cpu_attention`) against the
reference's gather + SDPA (`ANGELSPEC_CPU_ATTENTION=0`, the drafters gathering their pools), for plain batched
decoding and D-Cut with the shipped DFly and its lookups, interleaved in one process (the dispatch reads the variable
at every call, and the drafter's `in_place` is switched with it, so the same engines run both ways).

    python benchmarks/cpu_attention_engine.py --concurrency 1,4,8,16,32 --repeats 3 --threads 2

Closed loop (`bench_batch.closed_loop`): `--requests-per-client` requests per client, 12 chat-templated EVAL prompts
(4 each of HumanEval, GSM8K, MT-Bench), greedy, `--max-new-tokens`. Per concurrency and method: the median tok/s of
each attention path over the repeats and the median of the per-repeat ratios; every output must be the same either
way (and equal plain batched decoding's). The D-Cut engine has one cost model for both paths (profiled as it is made,
with the kernel, and refined from every step it times).

`--baseline-source FILE` adds a third path, interleaved with the other two: the kernel built from another version of
its source (e.g. `git show <rev>:angelspec_hf/csrc/paged_attention.cpp > old.cpp`) with the drafters gathering their
pools, as the engine ran before its drafters read them through the kernel; ratios are then also given against it."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from pathlib import Path

import torch

import angelspec_hf
from angelspec_hf.bench_batch import closed_loop
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.prompts import chat_ids, load_eval_prompts
from angelspec_hf.shipped import trained_drafter
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine
from angelspec_hf.tgi_patch.engine.kernels import cpu_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,8,16,32")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-source", type=Path, default=None,
                        help="another version of angelspec_hf/csrc/paged_attention.cpp, run as a third path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit(f"the CPU attention kernel did not build here: {cpu_attention.unavailable_reason()}")
    target, tokenizer = angelspec_hf.load_default_target()
    drafter = trained_drafter("dfly", target)
    print(use_linear_kernels("auto", target, drafter), flush=True)
    prompts = [chat_ids(tokenizer, p) for name in ("humaneval", "gsm8k", "mt_bench") for p in load_eval_prompts(name, 4)]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engines = {"plain": SpeculativeEngine(target, None, verify=0, max_batch_size=max(concurrencies)),
               "dfly-dcut": SpeculativeEngine(target, drafter, verify="auto", max_batch_size=max(concurrencies))}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    @contextlib.contextmanager
    def gathering():  # the drafters gather their pools, as an engine built with the reference does
        drafting = engines["dfly-dcut"].runner.batch_drafter
        saved = drafting.in_place
        drafting.in_place = False
        try:
            yield
        finally:
            drafting.in_place = saved

    paths = {"reference": gathering, "kernel": contextlib.nullcontext}
    env = {"reference": "0", "kernel": "1", "baseline": "1"}
    if args.baseline_source is not None:
        built = cpu_attention.build(args.baseline_source.resolve(), "angelspec_paged_attention_baseline",
                                    "the baseline CPU attention kernel")
        if isinstance(built, Exception):
            raise SystemExit(f"the baseline kernel did not build: {built}")

        @contextlib.contextmanager
        def baseline():  # that build in place of the kernel, and the drafters gathering their pools
            saved = cpu_attention._extension
            cpu_attention._extension = lambda: built
            try:
                with gathering():
                    yield
            finally:
                cpu_attention._extension = saved

        paths["baseline"] = baseline
    closed_loop(engines["plain"], prompts[:1], 1, 1, SamplingParams(max_new_tokens=4))  # warm-up
    print(f"closed loop, {args.requests_per_client} requests per client, {args.max_new_tokens} tokens, greedy, "
          f"{args.repeats} interleaved repeats, {args.threads} threads")
    for c in concurrencies:
        rates = {(m, p): [] for m in engines for p in paths}
        reference_outputs = {}
        for rep in range(args.repeats):
            order = list(paths) if rep % 2 == 0 else list(reversed(paths))
            for path in order:
                os.environ["ANGELSPEC_CPU_ATTENTION"] = env[path]
                for method, engine in engines.items():
                    with paths[path]():
                        result = closed_loop(engine, prompts, c, c * args.requests_per_client, params)
                    outputs = result["outputs"]
                    if reference_outputs and outputs != reference_outputs:
                        raise SystemExit(f"c={c}: {method} with the {path} attention gave other tokens")
                    reference_outputs = reference_outputs or outputs
                    rates[(method, path)].append(result["throughput"])
        for method in engines:
            ker = rates[(method, "kernel")]
            for other in [p for p in paths if p != "kernel"]:
                ref = rates[(method, other)]
                ratio = statistics.median(k / r for k, r in zip(ker, ref))
                print(f"c={c:>3} {method:<10} {other} {statistics.median(ref):6.1f} tok/s, kernel "
                      f"{statistics.median(ker):6.1f} tok/s: {ratio:.2f}x (per repeat "
                      f"{', '.join(f'{k / r:.2f}' for k, r in zip(ker, ref))})", flush=True)
    os.environ.pop("ANGELSPEC_CPU_ATTENTION", None)
    print("every output the same with either attention path, and equal to plain batched decoding's")


if __name__ == "__main__":
    main()
