"""Hostile sampling values beside innocent traffic on the real server: `angelspec serve` (its defaults: the embedded
SmolLM2-135M-Instruct, the shipped DFly, D-Cut) runs in a subprocess on a free localhost port; a clean round of the
victims alone (four greedy `/v1/chat/completions`, one greedy `/generate_stream`) is recorded first, then, per edge
value, one `/generate` carrying it (16 new tokens, details) is sent concurrently with the same victims. Prints, per
edge value: the hostile request's status (a 422 refusal or a 200 answer is fine), whether the victims all answered
200 with exactly the clean round's output, and whether any answer was a 424 (a generation error).

    python benchmarks/hostile_serve.py [--threads 2] [--timeout 300] [--startup-timeout 300]

The server is stopped with SIGINT at the end (then waited for; killed after `--stop-timeout`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

CHAT_PROMPTS = ["Write a haiku about the sea.", "What is 12 * 7? Answer briefly.",
                "Name three primary colours.", "Explain recursion in one sentence."]
STREAM_PROMPT = "def fibonacci(n):"
SAMPLED = {"do_sample": True}
# (label, the `parameters` of the hostile /generate)
EDGES = [
    ("temperature 1e-46", SAMPLED | {"temperature": 1e-46}),
    ("temperature 5e-324", SAMPLED | {"temperature": 5e-324}),
    ("temperature 1e39", SAMPLED | {"temperature": 1e39}),
    ("temperature 3.5e38", SAMPLED | {"temperature": 3.5e38}),
    ("repetition_penalty 5e-324", {"repetition_penalty": 5e-324}),
    ("repetition_penalty 1e39", {"repetition_penalty": 1e39}),
    ("repetition_penalty 1e-45", {"repetition_penalty": 1e-45}),
    ("top_p 1e-46", SAMPLED | {"top_p": 1e-46}),
    ("seed 2**64-1 (do_sample)", SAMPLED | {"seed": 2**64 - 1}),
    ("seed 2**70 (do_sample)", SAMPLED | {"seed": 2**70}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(url: str, prompt: str, timeout: float) -> tuple[int, object]:
    r = requests.post(f"{url}/v1/chat/completions", timeout=timeout,
                      json={"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 24})
    return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text[:200])


def stream(url: str, prompt: str, timeout: float) -> tuple[int, object]:
    with requests.post(f"{url}/generate_stream", stream=True, timeout=timeout,
                       json={"inputs": prompt, "parameters": {"max_new_tokens": 32, "details": True}}) as r:
        if r.status_code != 200:
            return r.status_code, r.text[:200]
        events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]
    if not events or "error" in events[-1]:
        return 424 if events and events[-1].get("error_type") == "generation" else 599, events[-1:]  # in-band error
    return 200, ([e["token"]["id"] for e in events], events[-1]["generated_text"])


def hostile(url: str, parameters: dict, timeout: float) -> tuple[int, str]:
    r = requests.post(f"{url}/generate", timeout=timeout,
                      json={"inputs": "Tell me a story.", "parameters": {"max_new_tokens": 16, "details": True}
                            | parameters})
    if r.status_code == 200:
        return 200, repr(r.json()["generated_text"][:40])
    return r.status_code, r.text[:160]


def round_(url: str, timeout: float, parameters: dict | None):
    """The victims (and, with `parameters`, the hostile request) all at once; (hostile result, victims' results)."""
    with ThreadPoolExecutor(8) as pool:
        bad = pool.submit(hostile, url, parameters, timeout) if parameters is not None else None
        victims = [pool.submit(chat, url, p, timeout) for p in CHAT_PROMPTS] + [pool.submit(stream, url, STREAM_PROMPT,
                                                                                            timeout)]
        return (bad.result() if bad else None), [v.result() for v in victims]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per HTTP request")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=60.0)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cli = Path(sys.executable).with_name("angelspec")
    command = [str(cli), "serve", "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads)]
    print("server:", " ".join(command), flush=True)
    server = subprocess.Popen(command, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        began = time.perf_counter()
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited with {server.returncode} before it was healthy")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.perf_counter() - began > args.startup_timeout:
                sys.exit("the server did not become healthy in time")
            time.sleep(1)
        print(f"healthy after {time.perf_counter() - began:.0f} s", flush=True)
        _, clean = round_(url, args.timeout, None)
        print("clean round:", [s for s, _ in clean], flush=True)
        rows = []
        for label, parameters in EDGES:
            (status, detail), victims = round_(url, args.timeout, parameters)
            same = all(s == 200 for s, _ in victims) and victims == clean
            any424 = status == 424 or any(s == 424 for s, _ in victims)
            rows.append((label, status, same, any424))
            print(f"{label:28s} hostile {status} {detail[:100]!s}; victims {[s for s, _ in victims]} "
                  f"identical={same}", flush=True)
            for (s, out), (_, ref) in zip(victims, clean):
                if out != ref:
                    print(f"    victim differs: {s} {str(out)[:120]!r} vs clean {str(ref)[:120]!r}", flush=True)
        print(f"\n{'edge value':28s} {'hostile':>7s} {'victims 200 & identical':>23s} {'any 424':>7s}")
        for label, status, same, any424 in rows:
            print(f"{label:28s} {status:>7d} {'yes' if same else 'NO':>23s} {'YES' if any424 else 'no':>7s}")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(args.stop_timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print(f"server stopped (exit code {server.returncode})", flush=True)


if __name__ == "__main__":
    main()
