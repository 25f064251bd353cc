"""The Space's batch tab: several requests at once through the batched speculative engine
(`angelspec_hf.tgi_patch.engine`), fixed-depth verification against D-Cut, step by step, and throughput over
concurrency. D-Cut spends a verification budget on the draft tokens most likely to be accepted (the drafter's
confidence, calibrated online) and skips drafting when its cost model says plain decoding is faster."""

from __future__ import annotations

import html
import time

import gradio as gr
import pandas as pd

from angelspec_hf.modeling.candidate_generator import mean_accepted_length
from angelspec_hf.prompts import chat_input_ids

MAX_CONCURRENCY = 8
MAX_BATCH_TOKENS = 64
MAX_DEPTH = 15
CONCURRENCY_LEVELS = (1, 2, 4, 8)
BATCH_PROMPTS = [  # written for this demo (not the EVAL prompts): chat, code and math mixed
    "Suggest a name for a bakery that only sells bread made with rye.",
    "Write a Python function that counts the vowels in a string.",
    "Tom has 12 apples and gives a third of them to Ana. How many apples does Tom have left?",
    "Explain in two sentences why the sky looks blue.",
    "Write a SQL query that returns the five most recent orders from a table named orders.",
    "A train travels 180 km in 2 hours. What is its average speed in km per hour?",
    "Give me three tips for writing a clear email.",
    "Write a JavaScript function that reverses an array without using reverse().",
]
BATCH_CSS = """
.steps { font-family: ui-monospace, monospace; font-size: 12px; max-height: 520px; overflow-y: auto; }
.steps table { border-collapse: collapse; }
.steps td { padding: 1px 4px; border-bottom: 1px solid #e5e7eb; vertical-align: middle; }
.steps .sq { display: inline-block; width: 12px; height: 12px; margin-right: 1px; border-radius: 2px; }
.steps .acc { background: #22c55e; } .steps .rej { background: #ef4444; } .steps .pru { background: #cbd5e1; }
.steps .pre { color: #6b7280; }
"""
LEGEND = ('<span style="color:#22c55e">■</span> verified, accepted · '
          '<span style="color:#ef4444">■</span> verified, rejected · '
          '<span style="color:#94a3b8">■</span> drafted, not verified (pruned) · hover a square for the '
          'token and its estimated survival probability')


def engine_import_error() -> str | None:
    try:
        from angelspec_hf.tgi_patch.engine import SpeculativeEngine  # noqa: F401
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


def get_engine(models, family: str | None, verify):
    """An idle engine for `(family, verify)` (None: plain batched decoding), built once and reused (D-Cut keeps
    learning its calibration across runs)."""
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine

    key = (family, verify)
    if key not in models.engines:
        drafter = models.drafters[family] if family else None
        models.engines[key] = SpeculativeEngine(models.target, drafter, verify=verify if drafter else "full",
                                                max_batch_size=MAX_CONCURRENCY)
    return models.engines[key]


def run_requests(models, engine, prompts: list[str], max_new_tokens: int) -> dict:
    """All `prompts` at once, greedy, through `engine`; the per-step traces, per-request tokens and totals."""
    from angelspec_hf.tgi_patch.engine import SamplingParams

    ids = [chat_input_ids(models.tokenizer, p)[0].tolist() for p in prompts]
    rids = [engine.add_request(x, SamplingParams(max_new_tokens=max_new_tokens)) for x in ids]
    tokens = {rid: [] for rid in rids}
    steps, start = [], time.perf_counter()
    try:
        previous = engine.last_step
        for events in engine.steps():
            if engine.last_step is not previous:  # a step that ran the models (not only a cancellation)
                previous = engine.last_step
                trace = previous.to_dict()
                trace["remaining"] = [max_new_tokens - len(tokens[r]) for r in trace["request_ids"]]
                steps.append(trace)
            for event in events:
                tokens[event.request_id] += event.token_ids
    except BaseException:  # the engine's state is unknown now: build a fresh one next time
        models.engines = {k: e for k, e in models.engines.items() if e is not engine}
        raise
    seconds = time.perf_counter() - start
    decode_rows = sum(p == 0 for s in steps for p in s["prefill"])
    accepted = sum(a for s in steps for a, p in zip(s["accepted"], s["prefill"]) if p == 0)
    total = sum(map(len, tokens.values()))
    return {
        "steps": steps, "tokens": [tokens[r] for r in rids], "request_ids": rids, "seconds": seconds, "new_tokens": total, "tokens_per_s": total / seconds,
        "verified": sum(s["verified_tokens"] for s in steps), "pruned": sum(s["pruned_tokens"] for s in steps),
        "accepted": accepted, "mean_accepted_length": mean_accepted_length(accepted, decode_rows) if decode_rows else None,
        "plain_steps": sum(s["choice"] == "plain" for s in steps), "num_steps": len(steps),
    }


def render_steps(models, run: dict) -> str:
    """One table row per (step, request): the request's draft tokens as squares (accepted / rejected / pruned)."""
    rid_index = {rid: i for i, rid in enumerate(run["request_ids"])}
    rows = []
    for n, step in enumerate(run["steps"], 1):
        head = f"<b>step {n}</b><br>{step['choice']}<br>budget {step['budget']}"
        for i, rid in enumerate(step["request_ids"]):
            if step["prefill"][i]:
                cells = f'<span class="pre">prefill: {step["prefill"][i]} prompt tokens</span>'
            else:
                draft = step["draft_tokens"][i]
                drafted = min(len(draft), max(step["remaining"][i] - 1, 0))
                survival = step["survival"][i] if step["survival"] else []
                squares = []
                for j in range(drafted):
                    kind = "pru" if j >= step["verified"][i] else "acc" if j < step["accepted"][i] else "rej"
                    tip = repr(models.tokenizer.decode([draft[j]]))
                    tip += f", survival {survival[j]:.2f}" if j < len(survival) else ""
                    squares.append(f'<span class="sq {kind}" title="{html.escape(tip)}"></span>')
                cells = "".join(squares) or '<span class="pre">plain step: no draft</span>'
                cells += f' <span class="pre">+{step["accepted"][i] + 1}</span>'
            first = f'<td rowspan="{len(step["request_ids"])}">{head}</td>' if i == 0 else ""
            rows.append(f"<tr>{first}<td>req {rid_index.get(rid, rid)}</td><td>{cells}</td></tr>")
    return f'<div class="steps"><table>{"".join(rows)}</table></div>'


def run_summary(name: str, run: dict) -> str:
    tau = "n/a" if run["mean_accepted_length"] is None else f"{run['mean_accepted_length']:.2f}"
    return (f"**{name}**: {run['new_tokens']} tokens in {run['seconds']:.1f} s · "
            f"**{run['tokens_per_s']:.1f} tok/s** · "
            f"τ = {tau} · {run['num_steps']} steps ({run['plain_steps']} without drafting) · draft tokens verified "
            f"{run['verified']}, accepted {run['accepted']}, pruned {run['pruned']}")


def _check(name: str, value, low: int, high: int) -> int:
    if not low <= int(value) <= high:
        raise gr.Error(f"{name} must be between {low} and {high}, got {value}.")
    return int(value)


def compare_policies(models, family, concurrency, max_new_tokens, depth):
    """Fixed depth, then D-Cut, on the same requests (one after the other): yields the page's outputs."""
    concurrency = _check("Concurrent requests", concurrency, 1, MAX_CONCURRENCY)
    max_new_tokens = _check("Max new tokens", max_new_tokens, 1, MAX_BATCH_TOKENS)
    depth = _check("Fixed depth", depth, 1, MAX_DEPTH)
    models.wait()
    prompts = [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(concurrency)]
    outputs = ["", "", "", "", ""]
    runs = {}
    for slot, (name, verify) in enumerate([(f"Fixed depth {depth}", f"depth:{depth}"), ("D-Cut", "auto")]):
        outputs[2 * slot] = f"{name}: " + ("building the engine (D-Cut profiles this CPU once, ~20 s)..."
                                              if verify == "auto" else "running...")
        yield tuple(outputs)
        with models.lock:
            runs[name] = run = run_requests(models, get_engine(models, family, verify), prompts, max_new_tokens)
        outputs[2 * slot], outputs[2 * slot + 1] = run_summary(name, run), render_steps(models, run)
        yield tuple(outputs)
    same = [a == b for a, b in zip(*(r["tokens"] for r in runs.values()))]
    outputs[4] = (f"Same tokens under both policies for {sum(same)}/{len(same)} requests "
                  f"({'lossless' if all(same) else 'MISMATCH'}); each is the target's own greedy reply.")
    yield tuple(outputs)


def throughput_curve(models, family, max_new_tokens, depth):
    """tokens/s over concurrency for plain batched decoding, fixed depth and D-Cut; yields a growing table."""
    max_new_tokens = _check("Max new tokens", max_new_tokens, 1, MAX_BATCH_TOKENS)
    depth = _check("Fixed depth", depth, 1, MAX_DEPTH)
    models.wait()
    policies = [("plain batched", None, "full"), (f"fixed depth {depth}", family, f"depth:{depth}"),
                ("D-Cut", family, "auto")]
    points = []
    for concurrency in CONCURRENCY_LEVELS:
        prompts = [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(concurrency)]
        for name, fam, verify in policies:
            with models.lock:
                run = run_requests(models, get_engine(models, fam, verify), prompts, max_new_tokens)
            points.append({"concurrent requests": concurrency, "tokens/s": run["tokens_per_s"], "policy": name})
            yield pd.DataFrame(points)


def add_batch_tab(models) -> None:
    """The tab, inside the caller's `gr.Blocks`."""
    with gr.Tab("Many requests (D-Cut)"):
        error = engine_import_error()
        if error is not None:
            gr.Markdown(f"The batched engine is not available in this install ({error}).")
            return
        gr.Markdown("Several requests decoded together by the batched engine: each step the drafter proposes a "
                    "block per request, then the target verifies **one packed forward**. *Fixed depth* verifies "
                    "the first K draft tokens of every request; *D-Cut* verifies the globally most likely ones under "
                    "a budget chosen from a cost model of this CPU, and skips drafting when plain decoding is faster. "
                    "Greedy decoding, so both give exactly the target's own replies.")
        with gr.Row():
            family = gr.Dropdown([("DFly", "dfly"), ("DFlash", "dflash"), ("MTP", "mtp")], value="dfly",
                                 label="Drafter (shipped if trained, else untrained)")
            concurrency = gr.Slider(1, MAX_CONCURRENCY, value=4, step=1, label="Concurrent requests")
            max_tokens = gr.Slider(4, MAX_BATCH_TOKENS, value=16, step=4, label="Max new tokens per request")
            depth = gr.Slider(1, MAX_DEPTH, value=7, step=1, label="Fixed depth K (draft tokens verified per request)")
        with gr.Row():
            go = gr.Button("Run fixed depth vs D-Cut", variant="primary", elem_id="batch_go")
            curve_go = gr.Button("Measure throughput over concurrency (1, 2, 4, 8; about a minute)")
        gr.HTML(LEGEND)
        verdict = gr.Markdown()
        with gr.Row():
            with gr.Column():
                fixed_summary = gr.Markdown()
                fixed_steps = gr.HTML(css_template=BATCH_CSS)
            with gr.Column():
                dcut_summary = gr.Markdown()
                dcut_steps = gr.HTML(css_template=BATCH_CSS)
        curve = gr.LinePlot(x="concurrent requests", y="tokens/s", color="policy",
                            title="Throughput over concurrency (this CPU)")

        def on_compare(family, concurrency, max_tokens, depth):
            yield from compare_policies(models, family, concurrency, max_tokens, depth)

        def on_curve(family, max_tokens, depth):
            yield from throughput_curve(models, family, max_tokens, depth)

        go.click(on_compare, inputs=[family, concurrency, max_tokens, depth],
                 outputs=[fixed_summary, fixed_steps, dcut_summary, dcut_steps, verdict], api_name="batch",
                 concurrency_id="compute", concurrency_limit=1)
        curve_go.click(on_curve, inputs=[family, max_tokens, depth], outputs=[curve], api_name="throughput",
                       concurrency_id="compute", concurrency_limit=1)
