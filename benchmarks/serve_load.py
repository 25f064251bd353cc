"""Bounded load test (the soak) of `angelspec serve`: C concurrent clients send a fixed number of greedy requests,
rotating through every generation route in its real wire format, and every answer is checked against the same
request answered alone.

    python benchmarks/serve_load.py --clients 64 --requests 256 --max-new-tokens 32 --threads 2
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --clients 64 --requests 256   # a running server
    python benchmarks/serve_load.py --routes generate,generate_stream ...                    # some routes only

Routes (`--routes`, default all): `generate`, `generate_stream` (SSE), `compat` (`POST /`, a JSON list), `chat` and
`chat_stream` (`/v1/chat/completions`, SSE chunks then `[DONE]`), `completions` and `completions_stream`
(`/v1/completions`); greedy everywhere (`temperature: 0` on the OpenAI routes; the streams ask for the usage chunk).

Without `--url` the embedded target, an engine (`--drafter`, `--verify`, `--max-batch-size`, as `angelspec serve`)
and the app run in this process, on a background thread, so the resident memory it reports is the server's.
Reports, per route and in total: lost responses (transport error, non-200; 5xx counted apart), garbled ones (text,
token ids where the route gives them, or finish reason differing from that route's answer to the prompt alone, or a
malformed answer: a stream without `[DONE]`, with wrong indices or an error event), p50/p99 latency; plus RSS growth
over the measured round (after a warm-up round at the same concurrency) and throughput. `--out DIR` writes
`serve_load.md` (tables for the README) and `serve_load.json`.
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

from angelspec_hf.bench_batch import percentile

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
# route name -> path; a name ending in `_stream` is the SSE form
ROUTES = {"generate": "/generate", "generate_stream": "/generate_stream", "compat": "/",
          "chat": "/v1/chat/completions", "chat_stream": "/v1/chat/completions",
          "completions": "/v1/completions", "completions_stream": "/v1/completions"}
LABELS = {"compat": "`POST /` (compat)", "chat_stream": "`/v1/chat/completions` (stream)",
          "completions_stream": "`/v1/completions` (stream)"}


def request_body(route: str, prompt: str, max_new_tokens: int) -> dict:
    """The greedy request of `route` for `prompt`, in that route's wire format."""
    if route in ("generate", "generate_stream", "compat"):
        return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    body = {"max_tokens": max_new_tokens, "temperature": 0}
    if route.endswith("_stream"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    chat = route.startswith("chat")
    return body | ({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})


def _tgi(out: dict) -> dict:
    ids = [t["id"] for t in out["details"]["tokens"]]
    return {"ids": ids, "text": out["generated_text"], "finish": out["details"]["finish_reason"], "tokens": len(ids),
            "consistent": out["details"]["generated_tokens"] == len(ids)}


def _tgi_stream(data: list[str]) -> dict:
    events = [json.loads(d) for d in data]
    last = events[-1] if events else {}
    ids = [e["token"]["id"] for e in events if "token" in e]
    consistent = ("error" not in last and [e.get("index") for e in events] == list(range(1, len(events) + 1))
                  and all(e["details"] is None and e["generated_text"] is None for e in events[:-1])
                  and last.get("details") is not None and last["details"]["generated_tokens"] == len(ids))
    return {"ids": ids, "text": last.get("generated_text"), "finish": (last.get("details") or {}).get("finish_reason"),
            "tokens": len(ids), "consistent": consistent}


def _openai(out: dict, chat: bool) -> dict:
    (choice,) = out["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    consistent = (out["object"] == ("chat.completion" if chat else "text_completion") and choice["index"] == 0
                  and (not chat or choice["message"]["role"] == "assistant") and isinstance(text, str))
    return {"ids": None, "text": text, "finish": choice["finish_reason"], "tokens": out["usage"]["completion_tokens"],
            "consistent": consistent}


def _openai_stream(data: list[str], chat: bool) -> dict:
    """Chunks of one choice (index 0), only the last with a `finish_reason`, then the usage chunk, then `[DONE]`."""
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    usage = chunks.pop() if chunks and not chunks[-1].get("choices") else {}
    choices = [c for chunk in chunks for c in chunk["choices"]]
    finishes = [c["finish_reason"] for c in choices]
    text = "".join((c["delta"]["content"] or "") if chat else c["text"] for c in choices)
    obj = "chat.completion.chunk" if chat else "text_completion"
    consistent = (data[-1:] == ["[DONE]"] and data.count("[DONE]") == 1 and bool(chunks) and "error" not in usage
                  and all("error" not in c and c["object"] == obj and len(c["choices"]) == 1 for c in chunks)
                  and all(c["index"] == 0 for c in choices) and all(f is None for f in finishes[:-1])
                  and finishes[-1] is not None and usage.get("usage") is not None)
    return {"ids": None, "text": text, "finish": finishes[-1] if finishes else None,
            "tokens": (usage.get("usage") or {}).get("completion_tokens", 0), "consistent": consistent}


def parse_answer(route: str, payload) -> dict:
    """`ids` (None where the route gives none), `text`, `finish` reason, `tokens` generated and whether the answer's
    shape is `consistent`, from a 200 answer: the JSON body, or a stream's list of SSE `data` fields. An answer that
    does not parse is inconsistent (garbled), not lost."""
    try:
        if route == "generate":
            return _tgi(payload)
        if route == "compat":
            return _tgi(payload[0]) | ({} if isinstance(payload, list) and len(payload) == 1 else {"consistent": False})
        if route == "generate_stream":
            return _tgi_stream(payload)
        if route.endswith("_stream"):
            return _openai_stream(payload, route.startswith("chat"))
        return _openai(payload, route.startswith("chat"))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return {"ids": None, "text": None, "finish": None, "tokens": 0, "consistent": False, "error": repr(exc)[:200]}


def sse_data(lines) -> list[str]:
    """The `data` fields of an SSE body's lines (comments such as keep-alive pings are skipped)."""
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def one_request(session: requests.Session, url: str, route: str, prompt: str, max_new_tokens: int,
                timeout: float) -> dict:
    """One greedy request to `route`: `ok` (a 200 answer came back), its `status`, latency and `parse_answer`."""
    start = time.perf_counter()
    stream = route.endswith("_stream")
    try:
        r = session.post(url + ROUTES[route], json=request_body(route, prompt, max_new_tokens), stream=stream,
                         timeout=timeout)
        if r.status_code != 200:
            return {"route": route, "ok": False, "status": r.status_code, "error": r.text[:200]}
        if stream:
            payload = sse_data(r.iter_lines(decode_unicode=True))
        else:
            try:
                payload = r.json()
            except ValueError:
                payload = None  # garbled: `parse_answer` says so
    except requests.RequestException as exc:
        return {"route": route, "ok": False, "status": None, "error": repr(exc)[:200]}
    return {"route": route, "ok": True, "status": 200, "latency": time.perf_counter() - start,
            **parse_answer(route, payload)}


def garbled(result: dict, reference: dict) -> bool:
    """A 200 answer that is malformed or differs (ids, text, finish reason) from the same request answered alone."""
    return not result["consistent"] or any(result[k] != reference[k] for k in ("ids", "text", "finish"))


def jobs_for(routes, prompts, requests_total: int) -> list[tuple[str, str]]:
    """`(route, prompt)` of each request: consecutive requests rotate through the routes, then the next prompt, so
    `len(routes) * len(prompts)` requests cover every pair."""
    return [(routes[i % len(routes)], prompts[i // len(routes) % len(prompts)]) for i in range(requests_total)]


def _round(url, jobs, clients, max_new_tokens, timeout):
    """`jobs` (route, prompt) spread over `clients` threads, one HTTP session each."""
    sessions = [requests.Session() for _ in range(clients)]

    def run(i):
        route, prompt = jobs[i]
        return one_request(sessions[i % clients], url, route, prompt, max_new_tokens, timeout)

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(run, range(len(jobs))))
    for s in sessions:
        s.close()
    return results


def summarise(answered: list[tuple[dict, tuple]], refs: dict) -> dict:
    """requests, lost, 5xx, garbled, p50/p99 latency (s) and tokens of `(result, job)` pairs."""
    results = [r for r, _ in answered]
    latencies = [r["latency"] for r in results if r["ok"]]
    lost = [r for r in results if not r["ok"]]
    return {"requests": len(results), "lost": len(lost), "5xx": sum((r["status"] or 0) >= 500 for r in lost),
            "garbled": sum(r["ok"] and garbled(r, refs[job]) for r, job in answered),
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "tokens": sum(r["tokens"] for r in results if r["ok"]),
            "errors": sorted({str(r.get("error")) for r in lost})[:5]}


def run_load(url: str, *, clients: int, requests_total: int, max_new_tokens: int, prompts=PROMPTS,
             routes=tuple(ROUTES), rss=None, timeout: float = 600.0) -> dict:
    """The load test against a running server at `url`. `rss`: a callable giving the server's resident bytes."""
    jobs = jobs_for(list(routes), list(prompts), requests_total)
    with requests.Session() as session:  # each request alone, one after the other: what it must equal under load
        refs = {job: one_request(session, url, *job, max_new_tokens, timeout) for job in dict.fromkeys(jobs)}
    bad = {f"{route} {prompt!r}": r.get("error") for (route, prompt), r in refs.items()
           if not (r["ok"] and r["consistent"])}
    if bad:
        raise RuntimeError(f"reference requests failed: {bad}")
    _round(url, jobs[:clients], clients, max_new_tokens, timeout)  # warm-up: pools grow to this batch once
    rss_before = rss() if rss else None
    start = time.perf_counter()
    results = _round(url, jobs, clients, max_new_tokens, timeout)
    wall = time.perf_counter() - start
    rss_after = rss() if rss else None
    answered = list(zip(results, jobs))
    total = summarise(answered, refs)
    per_route = {route: summarise([a for a in answered if a[1][0] == route], refs)
                 for route in routes if any(job[0] == route for job in jobs)}
    return {
        "clients": clients, "requests": requests_total, "max_new_tokens": max_new_tokens, "routes": list(routes),
        **total, "per_route": per_route,
        "rss_before_mb": rss_before / 2**20 if rss else None, "rss_after_mb": rss_after / 2**20 if rss else None,
        "rss_growth_pct": 100 * (rss_after - rss_before) / rss_before if rss else None,
        "wall_s": wall, "tokens_per_s": total["tokens"] / wall,
        "requests_per_s": (total["requests"] - total["lost"]) / wall,
    }


def markdown(report: dict, setting: str) -> str:
    """Two tables for the README: the run (setting, load, RSS, throughput), then the answers per route and in total."""
    def fmt(v, spec, unit=""):
        return "n/a" if v is None else format(v, spec) + unit

    rows = [
        ("setting", setting),
        ("load", f"{report['clients']} concurrent clients, {report['requests']} requests rotating through "
                 f"{len(report['routes'])} routes, {report['max_new_tokens']} new tokens each, greedy"),
        ("RSS (measured round)", f"{fmt(report['rss_before_mb'], '.0f')} → {fmt(report['rss_after_mb'], '.0f')} MB "
                                 f"({fmt(report['rss_growth_pct'], '+.1f')} %)"),
        ("throughput", f"{report['tokens_per_s']:.1f} tok/s, {report['requests_per_s']:.2f} req/s "
                       f"({report['tokens']} tokens in {report['wall_s']:.1f} s)"),
    ]
    run = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
    lines = ["| route | requests | lost | 5xx | garbled | p50 | p99 |", "|---|--:|--:|--:|--:|--:|--:|"]
    for name, s in [*((LABELS.get(r, f"`{ROUTES[r]}`"), s) for r, s in report["per_route"].items()),
                    ("**all**", report)]:
        lines.append(f"| {name} | {s['requests']} | {s['lost']} | {s['5xx']} | {s['garbled']} | "
                     f"{fmt(s['latency_p50_s'], '.2f', ' s')} | {fmt(s['latency_p99_s'], '.2f', ' s')} |")
    return run + "\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start one in this process")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, of: {', '.join(ROUTES)}")
    parser.add_argument("--drafter", default="dfly", help="as `angelspec serve --drafter` (in-process only)")
    parser.add_argument("--verify", default="auto")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=None, help="folder for serve_load.md and serve_load.json")
    args = parser.parse_args(argv)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if not routes or set(routes) - set(ROUTES):
        parser.error(f"--routes: unknown {sorted(set(routes) - set(ROUTES))}; choose from {', '.join(ROUTES)}")
    load = dict(clients=args.clients, requests_total=args.requests, max_new_tokens=args.max_new_tokens, routes=routes)

    if args.url:
        report = run_load(args.url, **load)
        info = requests.get(args.url + "/info", timeout=30).json()
        engine = info.get("angelspec", {})
        report["server_info"] = info
        setting = (f"server at {args.url} ({info.get('model_id')}, drafter {engine.get('drafter', 'n/a')}, "
                   f"verify {engine.get('verify', 'n/a')}, max batch {engine.get('max_batch_size', 'n/a')}); "
                   f"client on {platform.machine()}, {os.cpu_count()} cores")
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
            report = run_load(url, **load, rss=lambda: process.memory_info().rss)
        report["engine"] = {k: v for k, v in engine.stats.items() if k != "reliability"}
        setting = (f"in-process, embedded SmolLM2-135M-Instruct fp32, drafter {args.drafter} "
                   f"({'trained' if trained else 'untrained'}), verify {args.verify}, max batch {args.max_batch_size}"
                   f", {platform.machine()} CPU ({os.cpu_count()} cores), {args.threads} "
                   f"thread{'s' if args.threads > 1 else ''}")
    report["setting"] = setting
    machine = f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} cores"
    report["settings"] = {k: v for k, v in vars(args).items() if k != "out"} | {"routes": routes, "machine": machine}
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
