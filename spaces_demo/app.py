"""AngelSpec Space: watch speculative decoding work on SmolLM2-135M-Instruct, on CPU.

One prompt runs twice, one run after the other so that the speeds are honest on a small CPU: plain `generate` (the
target alone), then `generate(assistant_model=drafter)`. Both stream. The speculative reply is coloured by where each
token came from (drafted and accepted, or supplied by the target: the prefill token and the correction/bonus token
that ends every verification round), with each round's block outlined; a chart shows the acceptance rate per draft
position. `api_name="generate"` returns the same run as JSON.

A thin client of the public API: `angelspec_hf.load_default_target`, the shipped drafters (`angelspec_hf.shipped`),
`angelspec_hf.router.DrafterRouter`, and a stock `target.generate`. Run it with `angelspec demo` or `python app.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import html
import json
import os
import queue
import threading
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

import angelspec_hf  # noqa: E402
from angelspec_hf.cpu_kernels import use_linear_kernels  # noqa: E402
from angelspec_hf.prompts import chat_input_ids  # noqa: E402
from angelspec_hf.router import DrafterRouter  # noqa: E402
from angelspec_hf.shipped import (  # noqa: E402
    SHIPPED_PREFIX, shipped_drafter_path, shipped_or_untrained, untrained_drafter)

FAMILIES = {"dfly": "DFly", "dflash": "DFlash", "mtp": "MTP"}
MAX_NEW_TOKENS = 256
MAX_PROMPT_TOKENS = 1024
MAX_PROMPT_CHARS = 8000
BLOCK_RANGE = (2, 16)
SPACE_DRAFTERS = Path(__file__).resolve().parent / "drafters"  # on a Space: copies of the shipped drafter folders
EXAMPLES = [  # written for this demo (not the EVAL prompts)
    ["What are three simple ways to keep houseplants healthy in winter?"],
    ["Write a Python function `is_palindrome(s)` that ignores case and spaces, with two doctest examples."],
    ["A bakery sells muffins at $3 each and cookies at $1.50 each. Mia buys 4 muffins and 6 cookies. "
     "How much does she pay in total? Explain step by step."],
]
CSS = """
.spec-out { white-space: pre-wrap; line-height: 1.9; font-family: ui-monospace, monospace; font-size: 14px; }
.spec-out .blk { border: 1px solid #64748b; border-radius: 4px; padding: 1px 0; margin-right: 2px; }
.spec-out .tok { color: #111827; }
.spec-out .tok-draft { background: #86efac; }
.spec-out .tok-target { background: #fcd34d; }
.spec-out .tok-prefill { background: #fdba74; }
.legend span { padding: 0 6px; border-radius: 3px; color: #111827; margin-right: 6px; }
"""


# ---- pure helpers (no gradio, no model): tested directly ---------------------------------------------------------
def drafter_path(family: str) -> Path | None:
    """A trained drafter folder for `family`: beside this app (a Space), else the project's shipped one."""
    local = SPACE_DRAFTERS / f"{SHIPPED_PREFIX}{family}"
    return local if (local / "config.json").is_file() else shipped_drafter_path(family)


def drafter_choices() -> list[tuple[str, str]]:
    """Dropdown (label, value) pairs; untrained drafters are labelled as such."""
    def label(family):
        return FAMILIES[family] + ("" if drafter_path(family) else " (untrained: random weights)")

    return [("Automatic routing (MTP for chat, DFly for code and math)", "auto")] + [(label(f), f) for f in FAMILIES]


def acceptance_by_position(proposed: list[int], accepted: list[int]) -> list[float]:
    """For draft position j = 1..max(proposed): the fraction of rounds that proposed >= j tokens and accepted >= j."""
    rates = []
    for j in range(1, max(proposed, default=0) + 1):
        rounds = [a for p, a in zip(proposed, accepted) if p >= j]
        rates.append(sum(a >= j for a in rounds) / len(rounds))
    return rates


def token_origins(chunks: list[list[int]]) -> list[tuple[str, int]]:
    """(origin, round) per generated token, from the chunks `generate` streamed: chunk 0 is the prefill token (target);
    every later chunk is one verification round, its accepted draft tokens followed by one target token."""
    origins = []
    for r, chunk in enumerate(chunks):
        for j in range(len(chunk)):
            origins.append(("prefill" if r == 0 else "target" if j == len(chunk) - 1 else "draft", r))
    return origins


class TokenTexts:
    """The text of each generated token, such that the pieces concatenate to `tokenizer.decode(ids)` (a token that
    ends inside a multi-byte character shows its text with the token that completes it)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.pieces, self.text = tokenizer, [], [], ""

    def extend(self, ids: list[int]) -> None:
        for token in ids:
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd") or not text.startswith(self.text):
                self.pieces.append("")
                continue
            self.pieces.append(text[len(self.text):])
            self.text = text

    def finish(self) -> str:
        """The decoded text; a tail still pending (an incomplete character) goes to the last piece."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.pieces and text.startswith(self.text):
            self.pieces[-1] += text[len(self.text):]
            self.text = text
        return text


def render_tokens(pieces: list[str], chunks: list[list[int]]) -> str:
    """HTML of the speculative reply: one `<span class="blk">` per round holding `tok-draft` / `tok-target` spans."""
    out, origins, pos = ['<div class="spec-out">'], token_origins(chunks), 0
    for r, chunk in enumerate(chunks):
        title = "prefill: 1 token from the target" if r == 0 else \
            f"round {r}: {len(chunk) - 1} drafted and accepted + 1 from the target"
        spans = []
        for _ in chunk:
            origin = origins[pos][0]
            classes = "tok tok-target tok-prefill" if origin == "prefill" else f"tok tok-{origin}"
            spans.append(f'<span class="{classes}">{html.escape(pieces[pos]) if pos < len(pieces) else ""}</span>')
            pos += 1
        out.append(f'<span class="blk" title="{title}">{"".join(spans)}</span>')
    return "".join(out) + "</div>"


# ---- models --------------------------------------------------------------------------------------------------------
class _Closing(Exception):
    """The process is exiting: loading stops."""


class DemoModels:
    """The target, one drafter per family (shipped if trained, else untrained), and a router; loaded in a background
    thread so the page can say what it is doing. Every generation holds `lock`: one run at a time keeps timings
    honest."""

    def __init__(self, target=None, tokenizer=None, warmup: bool = True, device=None, dtype=None):
        self.target, self.tokenizer, self.warmup = target, tokenizer, warmup
        self.device, self.dtype = device, dtype  # of the target it loads (`load_target`); drafters follow it
        self.drafters, self.trained, self.router, self.kernels = {}, {}, None, None
        self._untrained = {}  # (family, block size) → untrained drafter built for that block size
        self.sources = {}  # family → where its drafter came from, or why it is untrained
        self.engines = {}  # (family, verify) → batched engine (the batch tab)
        self.ready, self.error, self.message = threading.Event(), None, "Loading the target model (about 20 s)..."
        self.lock = threading.Lock()
        self._thread = None
        self._closing = threading.Event()

    def start(self) -> DemoModels:
        if self._thread is None:
            self._thread = threading.Thread(target=self._load, name="angelspec-demo-load", daemon=True)
            self._thread.start()
            # at exit (a script that returns, Ctrl+C during start-up) the loader stops at its next stage and is
            # joined before the interpreter tears down: a thread still inside torch then aborts the process
            atexit.register(self.close)
        return self

    def close(self, timeout: float | None = None) -> None:
        """Stops loading at the next stage and waits for the loading thread (the stage it is in finishes first)."""
        self._closing.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _stage(self, message: str) -> None:
        if self._closing.is_set():
            raise _Closing()
        self.message = message

    def _load(self) -> None:
        try:
            if self.target is None:
                self._stage("Loading the target model (about 20 s)...")
                self.target, self.tokenizer = angelspec_hf.load_default_target(device=self.device, dtype=self.dtype)
            for family, name in FAMILIES.items():
                self._stage(f"Loading the {name} drafter...")
                self.drafters[family], self.trained[family] = self._load_drafter(family)
            # the linear kernels this CPU runs faster (`--linear-kernels auto`): plain and speculative alike
            self._stage("Timing the linear kernels...")
            self.kernels = use_linear_kernels("auto", self.target, *self.drafters.values())
            self.router = DrafterRouter({f: self.drafters[f] for f in ("mtp", "dfly")}, self.tokenizer)
            if self.warmup:  # the first call of each path pays one-off costs: keep them out of the measured runs
                self._stage("Warming up...")
                ids = chat_input_ids(self.tokenizer, "Hi", device=self.target.device)
                with self.lock, torch.no_grad():
                    self.target.generate(ids, max_new_tokens=2, do_sample=False)
                    for drafter in self.drafters.values():
                        self.target.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
            self.message = f"Ready. Linear kernels: {self.kernels}."
        except _Closing:
            self.error, self.message = RuntimeError("the demo is shutting down"), "Shutting down."
        except Exception as error:  # shown on the page and raised to every request
            self.error, self.message = error, f"Loading failed: {type(error).__name__}: {error}"
        finally:
            self.ready.set()

    def _load_drafter(self, family):
        why = []
        local = SPACE_DRAFTERS / f"{SHIPPED_PREFIX}{family}"
        drafter, trained = shipped_or_untrained(family, self.target, why=why, folder=local)
        self.sources[family] = why[-1] if why else ""
        if not trained:
            self._untrained[(family, drafter.num_draft_tokens + 1)] = drafter
        return drafter, trained

    def _fresh(self, family, block_size):  # the same random drafter on every start
        overrides = {} if block_size is None else \
            {"num_draft_tokens": block_size - 1} if family == "mtp" else {"block_size": block_size}
        return untrained_drafter(family, self.target, **overrides)

    def wait(self) -> None:
        self.start().ready.wait()
        if self.error is not None:
            raise gr.Error(self.message)

    def status_markdown(self) -> str:
        if not self.ready.is_set():
            return f"**Loading:** {self.message} The first request waits for it."
        if self.error is not None:
            return f"**{self.message}**"
        parts = [f"{FAMILIES[f]} block {self.drafters[f].num_draft_tokens + 1} "
                 f"({'trained' if t else '**untrained**: random weights'})" for f, t in self.trained.items()]
        reasons = " ".join(f"({self.sources[f]}.)" for f, t in self.trained.items() if not t and self.sources.get(f))
        note = "" if all(self.trained.values()) else \
            f" Untrained drafters accept almost nothing, so expect τ ≈ 1 and a slow-down: the output is still " \
            f"identical to the target's, which is the point they show. {reasons}".rstrip()
        return f"**Ready:** target SmolLM2-135M-Instruct (fp32, CPU); drafters: {'; '.join(parts)}.{note}"

    @contextlib.contextmanager
    def drafter_for(self, family: str, block_size: int):
        """The drafter to use, honouring `block_size` where it is real: an untrained drafter is built for it; the
        trained MTP drafter drafts step by step, so it is capped at `block_size - 1` steps; a trained DFly/DFlash
        drafter denoises the block size it was trained with, which the control cannot change."""
        if family == "auto":
            yield self.router
        elif not self.trained[family]:
            key = (family, block_size)
            if key not in self._untrained:
                self._untrained[key] = self._fresh(family, block_size)
            yield self._untrained[key]
        elif family == "mtp":
            drafter = self.drafters[family]
            trained_steps = drafter.config.num_draft_tokens
            drafter.config.num_draft_tokens = max(1, min(block_size - 1, trained_steps))
            try:
                yield drafter
            finally:
                drafter.config.num_draft_tokens = trained_steps
        else:
            yield self.drafters[family]


# ---- one run: plain, then speculative, both streamed -------------------------------------------------------------
class _ChunkStreamer(BaseStreamer):
    """Queues what `generate` streams, skipping the prompt: one chunk per target forward (assisted decoding puts the
    tokens of a whole verification round at once)."""

    def __init__(self):
        self.queue, self._prompt_seen = queue.Queue(), False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.queue.put(value.reshape(-1).tolist())

    def end(self):
        self.queue.put(None)


class _Cancel(StoppingCriteria):
    """Stops `generate` at its next step once `event` is set (the page that asked has gone away)."""

    def __init__(self):
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _streamed_generate(target, input_ids, kwargs):
    """Yield `(chunks, seconds)` while `target.generate` runs in a thread, then once more when it has finished with
    the seconds the call took. Closing the iterator early stops the generation before returning."""
    streamer, cancel, result, chunks = _ChunkStreamer(), _Cancel(), {}, []

    def work():
        start = time.perf_counter()
        try:
            torch.manual_seed(0)
            target.generate(input_ids, streamer=streamer, stopping_criteria=StoppingCriteriaList([cancel]), **kwargs)
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error
            streamer.end()
        result["seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while (chunk := streamer.queue.get()) is not None:
            chunks.append(chunk)
            yield chunks, time.perf_counter() - start
    finally:  # also when the consumer stops early: the models are free again only once generate has returned
        cancel.event.set()
        thread.join()
    if "error" in result:
        raise result["error"]
    yield chunks, result["seconds"]


def _flat(chunks: list[list[int]]) -> list[int]:
    return [token for chunk in chunks for token in chunk]


def validate(prompt, drafter, block_size, temperature, max_new_tokens) -> str:
    """Clear `gr.Error`s for bad input (the prompt length in tokens is checked once the tokenizer is loaded)."""
    if prompt is None or not str(prompt).strip():
        raise gr.Error("Please enter a prompt: it is empty.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise gr.Error(f"The prompt is too long: {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}.")
    if drafter not in ("auto", *FAMILIES):
        raise gr.Error(f"Unknown drafter {drafter!r}: choose auto, dfly, dflash or mtp.")
    if not BLOCK_RANGE[0] <= int(block_size) <= BLOCK_RANGE[1]:
        raise gr.Error(f"Block size must be between {BLOCK_RANGE[0]} and {BLOCK_RANGE[1]}, got {block_size}.")
    if not 0 <= float(temperature) <= 2:
        raise gr.Error(f"Temperature must be between 0 and 2, got {temperature}.")
    if not 1 <= int(max_new_tokens) <= MAX_NEW_TOKENS:
        raise gr.Error(f"Max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}.")
    return str(prompt).strip()


def compare(models: DemoModels, prompt, drafter="auto", block_size=8, temperature=0.0, max_new_tokens=64):
    """Yield progress snapshots (dicts) of plain then speculative generation; the last one has `"done": True`."""
    prompt = validate(prompt, drafter, block_size, temperature, max_new_tokens)
    if not models.ready.is_set():
        yield {"phase": "loading", "message": models.message}
    models.wait()
    input_ids = chat_input_ids(models.tokenizer, prompt, device=models.target.device)
    if input_ids.shape[1] > MAX_PROMPT_TOKENS:
        raise gr.Error(f"The prompt is too long: {input_ids.shape[1]} tokens with the chat template; "
                       f"the limit is {MAX_PROMPT_TOKENS}.")
    temperature, block_size = float(temperature), int(block_size)
    kwargs = dict(max_new_tokens=int(max_new_tokens), do_sample=False)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    state = {"phase": "plain", "done": False, "temperature": temperature, "max_new_tokens": int(max_new_tokens)}
    with models.lock:
        plain = TokenTexts(models.tokenizer)
        for chunks, seconds in _streamed_generate(models.target, input_ids, kwargs):
            plain.extend(_flat(chunks)[len(plain.ids):])
            state["plain"] = {"text": plain.text, "tokens": len(plain.ids), "seconds": seconds}
            yield state
        state["plain"]["text"] = plain.finish()
        spec = TokenTexts(models.tokenizer)
        state["phase"] = "speculative"
        with models.drafter_for(drafter, block_size) as assistant:
            spec_kwargs = kwargs | {"assistant_model": assistant}
            for chunks, seconds in _streamed_generate(models.target, input_ids, spec_kwargs):
                spec.extend(_flat(chunks)[len(spec.ids):])
                state["spec"] = {"text": spec.text, "tokens": len(spec.ids), "seconds": seconds, "chunks": chunks,
                                 "pieces": spec.pieces}
                yield state
            stats = assistant.last_speculation_stats
            used = assistant.drafters[assistant.choices[-1][1]] if drafter == "auto" else assistant
            routed = assistant.choices[-1] if drafter == "auto" else None
            draft_tokens = used.num_draft_tokens
            lookup_tokens = int(getattr(used.config, "lookup_tokens", 0) or 0)
    state["spec"]["text"] = spec.finish()
    state.update(phase="done", done=True, summary=summarize(models, state, drafter, stats, routed, draft_tokens,
                                                            plain.ids, spec.ids, lookup_tokens))
    yield state


def summarize(models, state, drafter, stats, routed, draft_tokens, plain_ids, spec_ids, lookup_tokens) -> dict:
    family = routed[1] if routed else drafter
    origins = [o for o, _ in token_origins(state["spec"]["chunks"])]
    plain, spec = state["plain"], state["spec"]
    plain_rate, spec_rate = plain["tokens"] / plain["seconds"], spec["tokens"] / spec["seconds"]
    return {
        "drafter": family, "routed_domain": routed[0] if routed else None, "trained": models.trained[family],
        "block_size": draft_tokens + 1, "draft_tokens_per_round": draft_tokens,
        # a round may verify a lookup instead of the block: n-gram, or in the drafter's corpus, up to this many tokens
        "lookup_tokens_per_round": lookup_tokens, "lookup_rounds": stats.lookup_rounds,
        "corpus_rounds": stats.corpus_rounds,
        "temperature": state["temperature"], "new_tokens": len(spec_ids),
        "tokens_from_drafter": origins.count("draft"), "tokens_from_target": len(origins) - origins.count("draft"),
        "rounds": stats.rounds, "proposed": list(stats.proposed), "accepted": list(stats.accepted),
        "mean_accepted_length": stats.mean_accepted_length if stats.rounds else None,
        "acceptance_by_position": acceptance_by_position(stats.proposed, stats.accepted),
        "plain_tokens_per_s": plain_rate, "spec_tokens_per_s": spec_rate, "speedup": spec_rate / plain_rate,
        "plain_seconds": plain["seconds"], "spec_seconds": spec["seconds"],
        "identical_to_plain": plain_ids == spec_ids if state["temperature"] == 0 else None,
    }


# ---- the page --------------------------------------------------------------------------------------------------------
def _rate(side) -> str:
    rate = side["tokens"] / max(side["seconds"], 1e-9)
    return f"{side['tokens']} tokens in {side['seconds']:.1f} s · **{rate:.1f} tok/s**"


def _summary_markdown(s) -> str:
    who = FAMILIES[s["drafter"]] + (f" (routed: {s['routed_domain']} prompt)" if s["routed_domain"] else "")
    tau = "n/a" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}"
    lines = [
        f"**Speed-up {s['speedup']:.2f}×** ({s['spec_tokens_per_s']:.1f} vs {s['plain_tokens_per_s']:.1f} tok/s) · "
        f"**τ = {tau}** tokens per target forward ({s['rounds']} rounds) · {s['tokens_from_drafter']} tokens drafted "
        f"and accepted, {s['tokens_from_target']} from the target",
        f"Drafter: {who}, block {s['block_size']} ({s['draft_tokens_per_round']} draft tokens per round), "
        f"{'trained' if s['trained'] else 'UNTRAINED (random weights)'} · temperature {s['temperature']:g}",
    ]
    if s["lookup_rounds"]:
        lines.append(f"Lookups: {s['lookup_rounds']} rounds verified a lookup of up to {s['lookup_tokens_per_round']} "
                     f"tokens instead of the block ({s['corpus_rounds']} of them in the target's earlier replies)")
    if s["identical_to_plain"] is not None:
        lines.append("Identical to plain greedy output: " + ("**yes**" if s["identical_to_plain"] else "**NO**"))
    else:
        lines.append("Sampling: both follow the target's distribution exactly, so the two texts usually differ.")
    return "  \n".join(lines)


def _acceptance_frame(rates) -> pd.DataFrame:
    positions = pd.Series([str(j) for j in range(1, len(rates) + 1)], dtype=str)  # categories, also when empty
    return pd.DataFrame({"draft position": positions, "acceptance rate": pd.Series(rates, dtype=float)})


def run_ui(models, prompt, drafter, block_size, temperature, max_new_tokens):
    """The button's handler: stream `compare` into the page's components."""
    empty = _acceptance_frame([])
    for state in compare(models, prompt, drafter, block_size, temperature, max_new_tokens):
        if state["phase"] == "loading":
            waiting = f"**Loading:** {state['message']} Your request runs as soon as the models are ready."
            yield "", "", "", "", waiting, empty
            continue
        plain, spec = state.get("plain"), state.get("spec")
        plain_stats = ("Generating..." if state["phase"] == "plain" else "Done. ") + _rate(plain)
        spec_html = render_tokens(spec["pieces"], spec["chunks"]) if spec else ""
        spec_stats = "Waiting for the plain run to finish (runs one after the other, for honest speeds)." \
            if spec is None else ("Done. " if state["done"] else "Generating... ") + _rate(spec)
        if not state["done"]:
            yield plain["text"], plain_stats, spec_html, spec_stats, "", empty
        else:
            s = state["summary"]
            yield (plain["text"], plain_stats, spec_html, spec_stats, _summary_markdown(s),
                   _acceptance_frame(s["acceptance_by_position"]))


def generate_api(models, prompt, drafter="auto", block_size=8, temperature=0.0, max_new_tokens=64) -> dict:
    """Run plain then speculative generation; return the speculative text, the plain text and the statistics."""
    state = None
    for state in compare(models, prompt, drafter, block_size, temperature, max_new_tokens):
        pass
    tokens = [{"text": piece, "origin": origin, "round": r} for piece, (origin, r)
              in zip(state["spec"]["pieces"], token_origins(state["spec"]["chunks"]))]
    return {"text": state["spec"]["text"], "plain_text": state["plain"]["text"], "stats": state["summary"],
            "tokens": tokens}


def block_control(drafter):
    """The block size slider for a drafter choice: free for untrained drafters, capped for trained MTP, fixed for
    trained DFly/DFlash and for routing (each routed drafter uses its own)."""
    if drafter == "auto":
        return gr.update(interactive=False, info="Routing: each drafter uses its own block size.")
    path = drafter_path(drafter)
    if path is None:
        return gr.update(interactive=True, maximum=BLOCK_RANGE[1],
                         info="Untrained drafter: built for this block size (draft tokens = block - 1).")
    config = json.loads((path / "config.json").read_text())
    block = config.get("block_size") or config["num_draft_tokens"] + 1  # DFly/DFlash, else MTP
    if drafter == "mtp":
        return gr.update(interactive=True, maximum=block, value=block,
                         info=f"Trained MTP drafts step by step: capped at its trained {block - 1} steps "
                              f"(block {block}).")
    return gr.update(interactive=False, value=block,
                     info=f"Fixed at {block} by the trained {FAMILIES[drafter]} drafter (it denoises whole blocks).")


def build_demo(models: DemoModels | None = None, batch_view: bool = True) -> gr.Blocks:
    models = models or DemoModels()
    models.start()
    with gr.Blocks(title="AngelSpec: speculative decoding, live") as demo:
        gr.Markdown("# AngelSpec: lossless speculative decoding, live\nA small drafter proposes tokens; the target "
                    "(SmolLM2-135M-Instruct) verifies a whole block in one forward and keeps exactly what it would "
                    "have generated itself. Plain and speculative runs go one after the other on this CPU.")
        status = gr.Markdown(models.status_markdown(), elem_id="status")
        timer = gr.Timer(1.0)
        timer.tick(lambda: (models.status_markdown(), gr.Timer(active=not models.ready.is_set())),
                   outputs=[status, timer], api_visibility="private", queue=False)
        with gr.Tabs():
            with gr.Tab("One request"):
                with gr.Row():
                    with gr.Column(scale=3):
                        prompt = gr.Textbox(label="Prompt", lines=4, elem_id="prompt",
                                            placeholder="Ask something, or pick an example below")
                        gr.Examples(EXAMPLES, inputs=[prompt], label="Examples: chat, code, math")
                    with gr.Column(scale=2):
                        drafter = gr.Dropdown(drafter_choices(), value="auto", label="Drafter", elem_id="drafter")
                        block = gr.Slider(*BLOCK_RANGE, value=8, step=1, label="Block size", elem_id="block")
                        temperature = gr.Slider(0, 1.5, value=0, step=0.05, label="Temperature (0 = greedy)")
                        max_tokens = gr.Slider(8, MAX_NEW_TOKENS, value=64, step=8, label="Max new tokens",
                                               elem_id="max_tokens")
                        go = gr.Button("Generate", variant="primary", elem_id="go")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("### Plain `generate` (target alone)")
                        plain_out = gr.Textbox(label="Plain output", lines=10, elem_id="plain_out")
                        plain_stats = gr.Markdown()
                    with gr.Column():
                        gr.Markdown("### Speculative `generate(assistant_model=drafter)`")
                        gr.HTML('<div class="legend"><span style="background:#86efac">drafted, accepted</span>'
                                '<span style="background:#fcd34d">from the target (correction / bonus)</span>'
                                '<span style="background:#fdba74">prefill token</span> · a box = one verification '
                                'round</div>', css_template=CSS)
                        spec_out = gr.HTML(elem_id="out", css_template=CSS, min_height=200)
                        spec_stats = gr.Markdown()
                with gr.Row():
                    summary = gr.Markdown(elem_id="summary")
                    chart = gr.BarPlot(_acceptance_frame([]), x="draft position", y="acceptance rate", y_lim=[0, 1],
                                       title="Acceptance rate per draft position", elem_id="acceptance")
            if batch_view:
                from angelspec_hf.spaces_demo.batch_view import add_batch_tab

                add_batch_tab(models)

        drafter.change(block_control, inputs=[drafter], outputs=[block],
                       api_visibility="private")
        demo.load(block_control, inputs=[drafter], outputs=[block], api_visibility="private")

        def on_click(prompt, drafter, block_size, temperature, max_new_tokens):
            yield from run_ui(models, prompt, drafter, block_size, temperature, max_new_tokens)

        go.click(on_click, inputs=[prompt, drafter, block, temperature, max_tokens],
                 outputs=[plain_out, plain_stats, spec_out, spec_stats, summary, chart], api_name="compare",
                 api_visibility="undocumented", concurrency_id="compute", concurrency_limit=1)

        def generate(prompt: str, drafter: str = "auto", block_size: int = 8, temperature: float = 0.0,
                     max_new_tokens: int = 64) -> dict:
            """Plain then speculative generation of `prompt`; returns the speculative text and its statistics."""
            return generate_api(models, prompt, drafter, block_size, temperature, max_new_tokens)

        gr.api(generate, api_name="generate", concurrency_id="compute", concurrency_limit=1)
    return demo


def main(host: str = "127.0.0.1", port: int | None = None, threads: int | None = None, share: bool = False,
         device=None, dtype=None):
    torch.set_num_threads(threads or min(2, os.cpu_count() or 1))
    demo = build_demo(DemoModels(device=device, dtype=dtype))
    demo.queue(default_concurrency_limit=1).launch(server_name=host, server_port=port, share=share)


if __name__ == "__main__":
    main(host=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))  # a Space sets 0.0.0.0
