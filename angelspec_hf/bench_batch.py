"""`angelspec bench --concurrency 1,2,4,...`: the batched engine under closed-loop load.

For each concurrency C, C clients each keep one request in flight (a new prompt as soon as the previous one ends) until
`requests_per_client × C` requests are done; methods run one after another on the same prompts: plain batched
decoding, fixed-depth drafting (every request verifies the same number of draft tokens; DFly at depths 1, 3 and 7
by default) and D-Cut (verify="auto", the cost model profiled on this machine) for each drafter. With `repeats` R > 1
that sequence of methods runs R times in turn (interleaved, so slow drifts of the machine hit every method alike); a
method's speed-up is the median over repeats of its throughput over the same repeat's plain throughput, and its
spread (lowest and highest of those ratios) is reported beside it. Reported per method and concurrency: throughput,
per-request latency (p50 / p99), τ, verified draft tokens per step, and the speed-up over plain decoding; greedy outputs
must equal plain decoding's for every request: a mismatch fails the command, except, for a bf16 / fp16 target, one
that parts from plain decoding only at a precision tie (`identity.py`), which is reported as such.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from angelspec_hf.devices import describe_device
from angelspec_hf import identity
from angelspec_hf.identity import IdentityJudge
from angelspec_hf.modeling.candidate_generator import mean_accepted_length
from angelspec_hf.policy import clock
from angelspec_hf.tgi_patch.engine import SamplingParams, SpeculativeEngine


def percentile(values, q: float):
    """The nearest-rank `q`-th percentile of `values` (None when empty): the smallest value with at least q% of the
    values at or below it, so p99 of 100 latencies is the 99th smallest, and p99 of fewer than 100 is the maximum."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def closed_loop(engine: SpeculativeEngine, prompts: list[list[int]], concurrency: int, total: int,
                params: SamplingParams) -> dict:
    """Run `total` requests with `concurrency` in flight; returns throughput, latencies and outputs by prompt index."""
    queue = list(range(total))
    inflight, started, outputs, latencies = {}, {}, {}, []
    tokens = 0

    def submit():
        i = queue.pop(0)
        rid = engine.add_request(prompts[i % len(prompts)], params)
        inflight[rid], started[rid] = i, time.perf_counter()

    before = dict(engine.totals)
    start = clock(engine.device)  # times read once the device has run the work queued before them
    while queue and len(inflight) < concurrency:
        submit()
    for events in engine.steps():  # finished requests are replaced below until the queue is empty
        for event in events:
            i = inflight[event.request_id]
            outputs.setdefault(i, []).extend(event.token_ids)
            tokens += len(event.token_ids)
            if event.finished:
                latencies.append(clock(engine.device) - started.pop(event.request_id))
                del inflight[event.request_id]
                if queue:
                    submit()
    seconds = clock(engine.device) - start
    delta = {k: engine.totals[k] - before[k] for k in ("steps", "decode_row_steps", "accepted", "verified", "pruned",
                                                       "speculative_steps", "lookup_steps")}
    rounds = delta["decode_row_steps"]
    return {
        "seconds": seconds, "tokens": tokens, "throughput": tokens / seconds,
        "latency_p50": percentile(latencies, 50),
        "latency_p99": percentile(latencies, 99),
        "tau": mean_accepted_length(delta["accepted"], rounds),
        "verified_per_step": delta["verified"] / max(delta["steps"], 1),
        "pruned_per_step": delta["pruned"] / max(delta["steps"], 1),
        "speculative_steps": delta["speculative_steps"] / max(delta["steps"], 1),
        "lookup_steps": delta["lookup_steps"] / max(delta["steps"], 1),
        "outputs": outputs,
    }


def run_concurrency_bench(target, drafters: dict, prompts: list[list[int]], concurrencies, requests_per_client=2,
                          max_new_tokens=64, fixed_depths=(1, 3, 7), fixed_for=("dfly",),
                          cost_model_cache=None, repeats: int = 1) -> list[dict]:
    """drafters: {name: drafter}. Every drafter runs with D-Cut (and, when its config proposes lookups, with D-Cut
    and no lookups: `<name>-dcut-nolookup`, and when it has a `lookup_corpus`, with n-gram lookups alone:
    `<name>-dcut-ngram`); those in `fixed_for` also at each fixed depth. Each concurrency
    runs every method `repeats` times, interleaved. Returns one record per (concurrency, method)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    max_batch = max(concurrencies)
    engines = {"plain": SpeculativeEngine(target, None, verify=0, max_batch_size=max_batch)}
    for name, drafter in drafters.items():
        modes = [f"depth:{d}" for d in fixed_depths if d <= drafter.num_draft_tokens] if name in fixed_for else []
        for mode in modes + ["auto"]:
            label = f"{name}-dcut" if mode == "auto" else f"{name}-{mode}"
            engines[label] = SpeculativeEngine(target, drafter, verify=mode, max_batch_size=max_batch,
                                               cost_model_cache=cost_model_cache)
        if getattr(drafter.config, "lookup_tokens", 0):  # its lookups on (as configured) and off
            if getattr(drafter, "lookup_corpus", None) is not None:  # and its n-gram lookups without the corpus
                engine = SpeculativeEngine(target, drafter, verify="auto", max_batch_size=max_batch,
                                           cost_model_cache=cost_model_cache)
                engine.policy.corpus = None
                engines[f"{name}-dcut-ngram"] = engine
            engines[f"{name}-dcut-nolookup"] = SpeculativeEngine(target, drafter, verify="auto", lookup_tokens=0,
                                                                 max_batch_size=max_batch,
                                                                 cost_model_cache=cost_model_cache)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    judge = IdentityJudge(target)
    closed_loop(engines["plain"], prompts[:1], 1, 1, SamplingParams(max_new_tokens=4))  # warm-up
    records = []
    for c in concurrencies:
        total = c * requests_per_client
        runs = {label: [] for label in engines}
        for rep in range(repeats):
            for label, engine in engines.items():
                result = closed_loop(engine, prompts, c, total, params)
                outputs = result.pop("outputs")
                if label == "plain":
                    plain, plain_outputs = result, outputs
                verdicts = [judge(prompts[i % len(prompts)], plain_outputs[i], outputs[i]) for i in sorted(outputs)]
                result["identical"] = all(v["identical"] for v in verdicts)
                result["ties"] = [v for v in verdicts if v["tie"]]  # parted from plain at precision ties only
                result["divergent"] = [v for v in verdicts if not v["identical"] and not v["tie"]]
                result["speedup"] = result["throughput"] / plain["throughput"]
                runs[label].append(result)
                print(f"c={c:>3} {label:<20} {result['throughput']:7.1f} tok/s  x{result['speedup']:.2f}  "
                      f"tau {result['tau']:.2f}  verified/step {result['verified_per_step']:.1f}  "
                      f"identical {identity_label(result)}"
                      + (f"  (repeat {rep + 1}/{repeats})" if repeats > 1 else ""),
                      flush=True)
        records += [_summarise(c, label, total, rs) for label, rs in runs.items()]
    return records


def _summarise(concurrency: int, method: str, requests: int, runs: list[dict]) -> dict:
    """One record from a method's repeats: medians, the speed-up's spread, identical only if every repeat was."""
    record = {"concurrency": concurrency, "method": method, "requests": requests, "repeats": len(runs)}
    for key in ("seconds", "tokens", "throughput", "latency_p50", "latency_p99", "tau", "verified_per_step",
                "pruned_per_step", "speculative_steps", "lookup_steps", "speedup"):
        record[key] = statistics.median(r[key] for r in runs)
    record["speedup_min"] = min(r["speedup"] for r in runs)
    record["speedup_max"] = max(r["speedup"] for r in runs)
    record["identical"] = all(r["identical"] for r in runs)
    record["ties"] = [v for r in runs for v in r["ties"]]
    record["divergent"] = [v for r in runs for v in r["divergent"]]
    return record


def identity_label(record: dict) -> str:
    """`identity.identity_label` of a record, whose `ties` and `divergent` list the requests that parted."""
    return identity.identity_label(record["identical"], len(record["ties"]), len(record["divergent"]))


def write_concurrency_outputs(records, out_dir, setting: str) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps({"setting": setting, "records": records}, indent=1))
    lines = [f"# angelspec bench --concurrency\n\n{setting}\n",
             "| concurrency | method | requests | tok/s | speed-up vs plain (spread) | τ | verified draft tokens/step | "
             "pruned/step | drafting steps | lookup-only steps | p50 latency (s) | p99 latency (s) | greedy identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        spread = f" ({r['speedup_min']:.2f}–{r['speedup_max']:.2f})" if r.get("repeats", 1) > 1 else ""
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['requests']} | {r['throughput']:.1f} | "
                     f"{r['speedup']:.2f}x{spread} | {r['tau']:.2f} | {r['verified_per_step']:.1f} | {r['pruned_per_step']:.1f} | "
                     f"{100 * r['speculative_steps']:.0f}% | {100 * r['lookup_steps']:.0f}% | "
                     f"{r['latency_p50']:.2f} | {r['latency_p99']:.2f} | "
                     f"{identity_label(r).replace('NO', '**NO**')} |")
    methods = list(dict.fromkeys(r["method"] for r in records))
    concurrencies = sorted({r["concurrency"] for r in records})
    lines += ["", "Geometric mean of the speed-up over plain decoding across concurrencies:", ""]
    for m in methods:
        values = [r["speedup"] for r in records if r["method"] == m]
        lines.append(f"- {m}: {statistics.geometric_mean(values):.2f}x")
    (out / "concurrency.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in methods:
        rs = [next(r for r in records if r["method"] == m and r["concurrency"] == c) for c in concurrencies]
        ax1.plot(concurrencies, [r["throughput"] for r in rs], marker="o", label=m)
        ax2.plot(concurrencies, [r["speedup"] for r in rs], marker="o", label=m)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
    ax1.set_ylabel("tokens/s")
    ax2.set_ylabel("speed-up over plain batched decoding")
    ax2.axhline(1.0, color="black", lw=0.8)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    plt.close(fig)
    return {"json": out / "concurrency.json", "markdown": out / "concurrency.md", "plot": out / "concurrency.png"}


def concurrency_main(args, target, tokenizer, drafters: dict, untrained: list, prompt_sets: dict) -> int:
    from angelspec_hf.prompts import chat_input_ids

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = [chat_input_ids(tokenizer, p)[0].tolist() for ps in prompt_sets.values() for p in ps]
    chosen = {f: d for f, d in drafters.items() if f in ("mtp", "dflash", "dfly")}
    setting = (f"closed loop, {args.requests_per_client} requests per client, {args.max_new_tokens} new tokens, "
               f"{args.repeats} interleaved repeat(s) (medians), "
               f"greedy; prompts: {', '.join(f'{k} ({len(v)})' for k, v in prompt_sets.items())} (chat template); "
               + ", ".join(f"{f}: {'UNTRAINED' if f in untrained else 'trained'} (draft {d.num_draft_tokens})"
                           for f, d in chosen.items())
               + f"; {describe_device(target.device)}, {str(target.dtype).removeprefix('torch.')}, {args.threads} CPU "
               f"threads, torch {torch.__version__}; "
               f"linear kernels: {getattr(args, 'kernels_line', 'stock')}")
    depths = [int(d) for d in args.fixed_depths.split(",") if d]
    records = run_concurrency_bench(target, chosen, prompts, concurrencies, args.requests_per_client,
                                    args.max_new_tokens, depths, repeats=args.repeats)
    paths = write_concurrency_outputs(records, args.out, setting)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    for r in records:
        for v in r["ties"]:
            print(f"note: {r['method']} at concurrency {r['concurrency']} parted from plain decoding at a precision "
                  f"tie (new token {v['position']}: tokens {v['tokens'][0]} / {v['tokens'][1]}, float32 margin "
                  f"{v['margin']:.4f}, {str(target.dtype).removeprefix('torch.')} noise {v['noise']:.4f})")
    bad = [r for r in records if r["divergent"]]
    for r in bad:
        print(f"FAILURE: {r['method']} at concurrency {r['concurrency']} differs from plain greedy decoding "
              f"({len(r['divergent'])} requests, not at precision ties)")
    return 1 if bad else 0
