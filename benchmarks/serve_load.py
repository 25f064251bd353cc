"""Bounded load test of `angelspec serve`: C concurrent clients send a fixed number of greedy requests (half
`/generate`, half `/generate_stream`), and every answer is checked against the same prompt's answer alone.

    python benchmarks/serve_load.py --clients 64 --requests 256 --max-new-tokens 32 --threads 2
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --clients 64 --requests 256   # a running server

Without `--url` the embedded target, an engine (`--drafter`, `--verify`, `--max-batch-size`, as `angelspec serve`)
and the app run in this process, on a background thread, so the resident memory it reports is the server's.
Reports lost responses (transport error, non-200), garbled ones (tokens or text differing from the prompt's answer
alone, or a malformed stream), RSS growth over the measured round (after a warm-up round at the same concurrency),
p50/p99 latency and throughput; `--out DIR` writes `serve_load.md` and `serve_load.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Question: what is 12 * 7?\nAnswer:",
    "Write a haiku about the sea.",
    "import numpy as np\n\ndef normalise(x):",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "SELECT name FROM users WHERE",
]


def one_request(session: requests.Session, url: str, prompt: str, max_new_tokens: int, stream: bool,
                timeout: float) -> dict:
    """One greedy request; `ids`/`text` of the answer, whether its shape is consistent, and its latency."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    start = time.perf_counter()
    try:
        if stream:
            r = session.post(url + "/generate_stream", json=body, stream=True, timeout=timeout)
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "error": r.text[:200]}
            events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]
            last = events[-1] if events else {}
            ids, text = [e["token"]["id"] for e in events if "token" in e], last.get("generated_text")
            consistent = ("error" not in last and [e.get("index") for e in events] == list(range(1, len(events) + 1))
                          and all(e["details"] is None for e in events[:-1]) and last.get("details") is not None
                          and last["details"]["generated_tokens"] == len(ids))
        else:
            r = session.post(url + "/generate", json=body, timeout=timeout)
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "error": r.text[:200]}
            out = r.json()
            ids, text = [t["id"] for t in out["details"]["tokens"]], out["generated_text"]
            consistent = out["details"]["generated_tokens"] == len(ids)
    except (requests.RequestException, ValueError, KeyError) as exc:
        return {"ok": False, "status": None, "error": repr(exc)[:200]}
    return {"ok": True, "status": 200, "ids": ids, "text": text, "consistent": consistent,
            "latency": time.perf_counter() - start}


def _round(url, jobs, clients, max_new_tokens, timeout):
    """`jobs` (prompt, stream) spread over `clients` threads, one HTTP session each."""
    sessions = [requests.Session() for _ in range(clients)]

    def run(i):
        prompt, stream = jobs[i]
        return one_request(sessions[i % clients], url, prompt, max_new_tokens, stream, timeout)

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(run, range(len(jobs))))
    for s in sessions:
        s.close()
    return results


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))] if ordered else None


def run_load(url: str, *, clients: int, requests_total: int, max_new_tokens: int, prompts=PROMPTS, rss=None,
             timeout: float = 600.0) -> dict:
    """The load test against a running server at `url`. `rss`: a callable giving the server's resident bytes."""
    with requests.Session() as session:  # each prompt alone: what every answer under load must equal
        refs = {p: one_request(session, url, p, max_new_tokens, False, timeout) for p in prompts}
    if not all(r["ok"] for r in refs.values()):
        raise RuntimeError(f"reference requests failed: {[r for r in refs.values() if not r['ok']]}")
    jobs = [(prompts[i % len(prompts)], i % 2 == 1) for i in range(requests_total)]
    _round(url, jobs[:clients], clients, max_new_tokens, timeout)  # warm-up: pools grow to this batch once
    rss_before = rss() if rss else None
    start = time.perf_counter()
    results = _round(url, jobs, clients, max_new_tokens, timeout)
    wall = time.perf_counter() - start
    rss_after = rss() if rss else None
    lost = [r for r in results if not r["ok"]]
    garbled = [i for i, r in enumerate(results) if r["ok"] and (
        not r["consistent"] or r["ids"] != refs[jobs[i][0]]["ids"] or r["text"] != refs[jobs[i][0]]["text"])]
    latencies = [r["latency"] for r in results if r["ok"]]
    tokens = sum(len(r["ids"]) for r in results if r["ok"])
    return {
        "clients": clients, "requests": requests_total, "max_new_tokens": max_new_tokens,
        "lost": len(lost), "garbled": len(garbled), "errors": sorted({str(r.get("error")) for r in lost})[:5],
        "rss_before_mb": rss_before / 2**20 if rss else None, "rss_after_mb": rss_after / 2**20 if rss else None,
        "rss_growth_pct": 100 * (rss_after - rss_before) / rss_before if rss else None,
        "latency_p50_s": _percentile(latencies, 50), "latency_p99_s": _percentile(latencies, 99),
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(latencies) / wall,
    }


def markdown(report: dict, setting: str) -> str:
    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    rows = [
        ("setting", setting),
        ("clients × requests", f"{report['clients']} concurrent, {report['requests']} requests "
                               f"(half streamed), {report['max_new_tokens']} new tokens each, greedy"),
        ("lost / garbled", f"{report['lost']} / {report['garbled']}"),
        ("RSS (measured round)", f"{fmt(report['rss_before_mb'], '.0f')} → {fmt(report['rss_after_mb'], '.0f')} MB "
                                 f"({fmt(report['rss_growth_pct'], '+.1f')} %)"),
        ("latency p50 / p99", f"{report['latency_p50_s']:.2f} s / {report['latency_p99_s']:.2f} s"),
        ("throughput", f"{report['tokens_per_s']:.1f} tok/s, {report['requests_per_s']:.2f} req/s "
                       f"({report['tokens']} tokens in {report['wall_s']:.1f} s)"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start one in this process")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--drafter", default="dfly", help="as `angelspec serve --drafter` (in-process only)")
    parser.add_argument("--verify", default="auto")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=None, help="folder for serve_load.md and serve_load.json")
    args = parser.parse_args(argv)

    if args.url:
        report = run_load(args.url, clients=args.clients, requests_total=args.requests,
                          max_new_tokens=args.max_new_tokens)
        setting = f"server at {args.url}"
    else:
        import psutil
        import torch

        import angelspec_hf
        from angelspec_hf.shipped import shipped_or_untrained
        from angelspec_hf.tgi_patch.engine import SpeculativeEngine
        from angelspec_hf.tgi_patch.server import create_app, running_in_thread

        torch.set_num_threads(args.threads)
        target, tokenizer = angelspec_hf.load_default_target()
        drafter, trained = (None, False) if args.drafter == "none" else shipped_or_untrained(args.drafter, target)
        engine = SpeculativeEngine(target, drafter, verify=args.verify, max_batch_size=args.max_batch_size)
        app = create_app(engine, tokenizer, "SmolLM2-135M-Instruct", max_concurrent_requests=max(128, args.clients))
        process = psutil.Process()
        with running_in_thread(app) as url:
            report = run_load(url, clients=args.clients, requests_total=args.requests,
                              max_new_tokens=args.max_new_tokens, rss=lambda: process.memory_info().rss)
        report["engine"] = {k: v for k, v in engine.stats.items() if k != "reliability"}
        setting = (f"in-process, embedded SmolLM2-135M-Instruct fp32, drafter {args.drafter} "
                   f"({'trained' if trained else 'untrained'}), verify {args.verify}, max batch {args.max_batch_size}"
                   f", {platform.machine()} CPU, {args.threads} threads")
    report["setting"] = setting
    table = markdown(report, setting)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve_load.md").write_text(table)
        (out / "serve_load.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["lost"] == 0 and report["garbled"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
