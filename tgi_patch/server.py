"""`angelspec serve`: a TGI-protocol HTTP server on the batched speculative engine.

Routes and shapes follow text-generation-inference, so its clients (`text_generation.Client`,
`huggingface_hub.InferenceClient`, the `openai` client against `/v1`) work unchanged: `POST /` (compat: a JSON list, or
SSE with `"stream": true`), `/generate`, `/generate_stream`, `/v1/chat/completions`, `/v1/completions` (up to
`max_client_batch_size` prompts), `/tokenize`, `GET /info`, `/health`, `/metrics`, `/v1/models`; `/openapi.json` documents them (`protocol.py`). Every error, whatever the input,
is `{"error", "error_type"}`: 400 unparseable body, 404/405 no such route/method, 413 body over the payload limit,
422 validation, 424 generation, 429 overloaded, 500 incomplete_generation.

One request cannot hurt the others: its work is bounded (payload size, prompt tokens, stop strings: count and length,
matched in time linear in the generated text), tokenization and chat templates run off the event loop, and a client
that goes away (streaming or not) has its request cancelled in the engine and its slot freed.

Sampling follows TGI: temperature / top-k / top-p, and `repetition_penalty`, `frequency_penalty`, `presence_penalty`
(applied by the engine to the target's distribution at every verified position, `penalties.py`); `top_n_tokens`
(chat: `top_logprobs`) reports the most likely tokens at each position.

The engine generates token ids; this module owns everything textual: TGI's incremental detokenisation, stop strings
(matched on the decoded text; the request is then cancelled in the engine), chat templates. `create_app(engine,
tokenizer, model_id)` builds the app around any engine with the `SpeculativeEngine` interface.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
import uuid
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from angelspec_hf.tgi_patch.worker import (
    EngineWorker,
    IncompleteGenerationError,
    RequestHandle,
    ServingError,
    ServingMetrics,
    ValidationError,
)

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from sse_starlette import EventSourceResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException

    from angelspec_hf.tgi_patch import protocol
    from angelspec_hf.tgi_patch.protocol import ChatRequest, CompletionRequest, GenerateRequest, TokenizeRequest
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("`angelspec serve` needs the serve extra: pip install 'angelspec-hf[serve]'") from exc

ROUTES = ("/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize",
          "/info", "/health", "/metrics")
_OPENAI_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


# ---------------------------------------------------------------- text
def check_text(text: str, name: str) -> str:
    """`text` if it is valid Unicode (JSON can carry lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"`{name}` is not valid Unicode text ({exc.reason} at position {exc.start})") from None
    return text


def message_text(content) -> str | None:
    """A chat message's text: a string, or the concatenated `text` of its `{"type": "text"}` parts."""
    if content is None or isinstance(content, str):
        return None if content is None else check_text(content, "content")
    parts = []
    for part in content:
        if part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ValidationError("a `text` content part needs a string `text`")
            parts.append(check_text(part["text"], "content"))
    return "".join(parts)


class TextStream:
    """TGI's incremental detokenisation: a token's text is what decoding it adds to the text of the tokens before
    it (five tokens of context), and stays empty while the text ends in an incomplete UTF-8 character. Special
    tokens keep their text on the wire but are left out of the visible text, which is where stop strings are looked
    for. Each token costs time in its own text plus the longest stop string, never in the text so far: stops are
    searched in a window (the visible text's last `longest - 1` characters, where a stop may still start, plus the new
    text) and the visible text is kept in pieces, joined once."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], special_ids: frozenset[int]):
        self.tokenizer, self.stops, self.special_ids = tokenizer, stops, special_ids
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.generated: list[int] = []
        self.stop_span: tuple[int, int] | None = None  # where the first stop string sits in `visible`
        self._keep = max(map(len, stops), default=1) - 1  # characters a stop may span before a new piece
        self._pieces: list[str] = []  # the visible text
        self._size = 0  # its length
        self._window = ""  # its last `_keep` characters
        self._unsent: list[str] = []  # visible text not yet sent as OpenAI deltas (some of the last pieces)

    @property
    def visible(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int, logprob: float) -> dict:
        """The next token as TGI's `{id, text, logprob, special}`; sets `stop_span` when a stop string completes."""
        self.ids.append(token_id)
        self.generated.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            text = text[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        else:
            text = ""
        special = token_id in self.special_ids
        if text and not special:
            window, base = self._window + text, self._size - len(self._window)  # base: the window's offset
            hits = [(base + i, base + i + len(s)) for s in self.stops if (i := window.find(s)) >= 0]
            self.stop_span = min(hits) if hits else None
            self._pieces.append(text)
            self._unsent.append(text)
            self._size += len(text)
            self._window = window[max(0, len(window) - self._keep):] if self._keep else ""
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def final_text(self, openai: bool = False) -> str:
        """The generated text: TGI keeps a stop string (and cuts what follows it), OpenAI drops it."""
        if self.stop_span is not None:
            return self.visible[:self.stop_span[0] if openai else self.stop_span[1]]
        return self.tokenizer.decode(self.generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _held(self) -> int:
        """The length of the longest end of the visible text that begins a stop string (it may still grow into one)."""
        held = 0
        for stop in self.stops:
            held = next((k for k in range(min(len(stop) - 1, len(self._window)), held, -1)
                         if self._window.endswith(stop[:k])), held)
        return held

    def openai_delta(self, final: bool = False) -> str:
        """New visible text safe to stream under OpenAI semantics: nothing from a stop string on, and while not
        `final`, nothing that might still grow into one."""
        unsent = "".join(self._unsent)
        if self.stop_span is not None:
            end = self.stop_span[0] - (self._size - len(unsent))  # the stop's start, in `unsent`
        elif final:
            end = len(unsent)
        else:
            end = len(unsent) - self._held()
        delta, rest = unsent[:max(end, 0)], unsent[max(end, 0):]
        self._unsent = [rest] if rest else []
        return delta


@dataclass
class Job:
    """One validated request: engine inputs plus what the response needs."""

    input_ids: list[int]
    params: Any  # SamplingParams
    stream: TextStream
    seed: int | None
    finish_reason: str | None = None
    tokens: list[dict] = field(default_factory=list)
    top_tokens: list[list[dict]] = field(default_factory=list)  # per token, when `top_n_tokens` was asked for
    handle: RequestHandle | None = None  # set once the engine accepted the request


class ClientDisconnected(IncompleteGenerationError):
    """Nobody reads this answer (status 499, as nginx logs it): only the metrics see it."""

    status = 499


def _sse(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- the server
class TGIServer:
    """Validation and generation shared by the routes; one per app."""

    def __init__(self, engine, tokenizer, model_id: str, *, max_input_tokens: int, max_total_tokens: int,
                 max_concurrent_requests: int, max_stop_sequences: int, max_stop_length: int,
                 max_client_batch_size: int, info_extra: dict | None, graceful_shutdown_s: float,
                 disconnect_poll_s: float = 0.25):
        from angelspec_hf.tgi_patch.engine import SamplingParams

        self.sampling_params_cls = SamplingParams
        self.tokenizer, self.model_id = tokenizer, model_id
        self.max_input_tokens, self.max_total_tokens = max_input_tokens, max_total_tokens
        self.max_concurrent_requests, self.max_stop_sequences = max_concurrent_requests, max_stop_sequences
        self.max_stop_length, self.max_client_batch_size = max_stop_length, max_client_batch_size
        self.disconnect_poll_s = disconnect_poll_s
        # tokenization and chat templates run on one worker thread, off the event loop (and one at a time: a fast
        # tokenizer is not safe to share across threads)
        self.text_thread = anyio.CapacityLimiter(1)
        self.info_extra = info_extra or {}
        self.graceful_shutdown_s = graceful_shutdown_s
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.metrics = ServingMetrics()
        self.worker = EngineWorker(engine, max_concurrent_requests=max_concurrent_requests, metrics=self.metrics)
        self.metrics.bind(self.worker)

    # -- validation (TGI's rules and messages)
    def _check_unsupported(self, **values) -> None:
        """Parameters TGI has and this engine does not: anything but their neutral value is refused."""
        for name, (value, neutral) in values.items():
            if value is not None and value not in neutral:
                raise ValidationError(f"`{name}` is not supported by the angelspec engine (given: {value!r})")

    def _input_ids(self, text: str | None, ids: list[int] | None = None, truncate: int | None = None) -> list[int]:
        if ids is None:
            if not text:
                raise ValidationError("`inputs` cannot be empty")
            ids = self.tokenizer(check_text(text, "inputs")).input_ids
        if truncate is not None:
            if truncate <= 0 or truncate > self.max_input_tokens:
                raise ValidationError(f"`truncate` must be strictly positive and less than {self.max_input_tokens}."
                                      f" Given: {truncate}")
            ids = ids[-truncate:]
        if not ids:
            raise ValidationError("`inputs` cannot be empty")
        if len(ids) > self.max_input_tokens:
            raise ValidationError(f"`inputs` must have less than {self.max_input_tokens} tokens. Given: {len(ids)}")
        return ids

    def job(self, input_ids: list[int], *, max_new_tokens, do_sample, temperature, top_k, top_p, seed,
            stop: list[str], repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
            top_n_tokens=None) -> Job:
        if max_new_tokens is None:
            max_new_tokens = self.max_total_tokens - len(input_ids)
        if max_new_tokens <= 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if len(input_ids) + max_new_tokens > self.max_total_tokens:
            raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= {self.max_total_tokens}. Given: "
                                  f"{len(input_ids)} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
        if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
            raise ValidationError("`temperature` must be strictly positive and finite")
        if top_k is not None and top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        if top_k is not None:
            top_k = min(top_k, 2**31 - 1)  # beyond the vocabulary it keeps every token; as an int64 it must fit
        if top_p is not None and not 0 < top_p <= 1:
            raise ValidationError("`top_p` must be > 0.0 and <= 1.0")
        if seed is not None and not 0 <= seed < 2**63:
            raise ValidationError("`seed` must be a non-negative 63-bit integer")
        if len(stop) > self.max_stop_sequences:
            raise ValidationError(f"`stop` supports up to {self.max_stop_sequences} stop sequences. Given: "
                                  f"{len(stop)}")
        if any(not s for s in stop):
            raise ValidationError("`stop` sequences cannot be empty")
        if any(len(s) > self.max_stop_length for s in stop):
            raise ValidationError(f"`stop` sequences must have at most {self.max_stop_length} characters. Given: "
                                  f"{max(map(len, stop))}")
        if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
            raise ValidationError("`repetition_penalty` must be strictly positive and finite")
        for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            if value is not None and not -2 <= value <= 2:
                raise ValidationError(f"`{name}` must be >= -2.0 and <= 2.0")
        if top_n_tokens is not None and not 0 <= top_n_tokens <= protocol.MAX_TOP_N_TOKENS:
            raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {protocol.MAX_TOP_N_TOKENS}")
        # TGI samples when asked to, or when any warper is active
        sample = bool(do_sample or (temperature not in (None, 1.0)) or top_k or (top_p is not None and top_p < 1))
        if sample and seed is None:
            seed = random.getrandbits(63)
        params = self.sampling_params_cls(
            max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature or 1.0, top_k=top_k or 0,
            top_p=top_p or 1.0, seed=seed if sample else None,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            frequency_penalty=frequency_penalty or 0.0, presence_penalty=presence_penalty or 0.0,
            top_n_tokens=top_n_tokens or 0)
        return Job(input_ids, params, TextStream(self.tokenizer, input_ids, stop, self.special_ids),
                   seed if sample else None)

    def generate_job(self, body: GenerateRequest) -> Job:
        p = body.parameters
        self._check_unsupported(typical_p=(p.typical_p, (1.0,)), best_of=(p.best_of, (1,)),
                                watermark=(p.watermark, (False,)), grammar=(p.grammar, ()),
                                adapter_id=(p.adapter_id, ()))
        ids = self._input_ids(body.inputs, truncate=p.truncate)
        return self.job(ids, max_new_tokens=p.max_new_tokens, do_sample=p.do_sample, temperature=p.temperature,
                        top_k=p.top_k, top_p=p.top_p, seed=p.seed, stop=p.stop,
                        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                        top_n_tokens=p.top_n_tokens)

    def chat_job(self, body: ChatRequest) -> Job:
        self._check_unsupported(n=(body.n, (1,)), tools=(body.tools, ()),
                                tool_choice=(body.tool_choice, ("none",)),
                                response_format=(body.response_format, ({"type": "text"},)),
                                logit_bias=(body.logit_bias or None, ()))
        # no content (OpenAI allows `null`) is empty text: templates concatenate it
        messages = [{"role": m.role, "content": message_text(m.content) or ""} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that refuses the conversation is a client error
            raise ValidationError(f"the chat template refused the messages: {exc}") from exc
        ids = self._input_ids(None, self.tokenizer(text, add_special_tokens=False).input_ids)
        max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._openai_job(body, ids, max_new, top_n_tokens=body.top_logprobs if body.logprobs else None)

    def _openai_job(self, body, ids: list[int], max_new_tokens, top_n_tokens=None) -> Job:
        """A chat or completions request's job: OpenAI's stop (a string or a list), TGI's rule that temperature 0 is
        greedy and anything else samples, and the three penalties."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        greedy = body.temperature == 0
        return self.job(ids, max_new_tokens=max_new_tokens, do_sample=not greedy,
                        temperature=None if greedy else body.temperature, top_k=None,
                        top_p=None if greedy else body.top_p, seed=body.seed, stop=stop,
                        repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
                        presence_penalty=body.presence_penalty, top_n_tokens=top_n_tokens)

    def completion_jobs(self, body: CompletionRequest) -> list[Job]:
        self._check_unsupported(n=(body.n, (1,)), best_of=(body.best_of, (1,)), echo=(body.echo, (False,)),
                                suffix=(body.suffix, ()), logprobs=(body.logprobs, ()),
                                logit_bias=(body.logit_bias or None, ()))
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not 1 <= len(prompts) <= self.max_client_batch_size:
            raise ValidationError(f"`prompt` takes 1 to {self.max_client_batch_size} prompts (max_client_batch_size)."
                                  f" Given: {len(prompts)}")
        return [self._openai_job(body, self._input_ids(prompt), body.max_tokens) for prompt in prompts]

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the text thread: tokenization and templates never block the event loop."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.text_thread)

    # -- generation
    async def submit(self, job: Job) -> Job:
        """Hands the job to the engine; raises 429 / 422 here, before any response has started."""
        job.handle = await self.worker.submit(job.input_ids, job.params)
        return job

    async def run(self, job: Job):
        """Yields `(token, last)` of a submitted job as tokens arrive; sets `job.finish_reason`. Closing the
        generator early (a client that went away) cancels the request in the engine."""
        handle = job.handle
        try:
            while True:
                event = await handle.get()
                if isinstance(event, ServingError):
                    raise event
                if event.finished and event.finish_reason == "cancelled":
                    raise IncompleteGenerationError("the request was cancelled before it finished")
                n = len(event.token_ids)
                for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs)):
                    token = job.stream.push(token_id, logprob)
                    job.tokens.append(token)
                    if event.top_tokens is not None:
                        job.top_tokens.append([self._token(t, lp) for t, lp in event.top_tokens[i]])
                    if job.stream.stop_span is not None:
                        job.finish_reason = "stop_sequence"
                        yield token, True
                        return
                    last = event.finished and i == n - 1
                    if last:
                        job.finish_reason = event.finish_reason
                    yield token, last
                if event.finished:
                    if n == 0:  # the engine promises the last token in the finishing event
                        raise IncompleteGenerationError("the engine finished a request without a final token")
                    return
        finally:
            self.worker.release(handle)

    async def complete(self, job: Job, request: Request) -> Job:
        """Runs a job to its end for a non-streaming response. If the client disconnects first, the request is
        cancelled in the engine (its slot freed) within `disconnect_poll_s`, and `ClientDisconnected` raised."""
        async def drain():
            await self.submit(job)
            async with aclosing(self.run(job)) as tokens:
                async for _ in tokens:
                    pass

        task = asyncio.ensure_future(drain())
        try:
            while not (await asyncio.wait({task}, timeout=self.disconnect_poll_s))[0]:
                if await request.is_disconnected():
                    raise ClientDisconnected("the client disconnected before the request finished")
            task.result()
            return job
        finally:
            task.cancel()  # closing `run` releases the handle: the engine cancels the request

    async def complete_all(self, jobs: list[Job], request: Request) -> list[Job]:
        """`complete` for several jobs at once; when one fails, the others are cancelled."""
        tasks = [asyncio.ensure_future(self.complete(job, request)) for job in jobs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return jobs

    def _token(self, token_id: int, logprob: float) -> dict:
        """A token on its own, as TGI reports top tokens: `{id, text, logprob, special}`."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return {"id": token_id, "text": text, "logprob": logprob, "special": token_id in self.special_ids}

    def tgi_details(self, job: Job, prefill: bool) -> dict:
        prefill_tokens = []
        if prefill:  # ids and texts; the engine does not compute prompt log-probs
            texts = self.tokenizer.batch_decode([[i] for i in job.input_ids], skip_special_tokens=False)
            prefill_tokens = [{"id": i, "text": t, "logprob": None} for i, t in zip(job.input_ids, texts)]
        details = {"finish_reason": job.finish_reason, "generated_tokens": len(job.tokens), "seed": job.seed,
                   "prefill": prefill_tokens, "tokens": job.tokens}
        if job.params.top_n_tokens:
            details["top_tokens"] = job.top_tokens
        return details

    def tgi_response(self, body: GenerateRequest, job: Job) -> dict:
        text = job.stream.final_text()
        out = {"generated_text": body.inputs + text if body.parameters.return_full_text else text}
        if body.parameters.details:
            out["details"] = self.tgi_details(job, body.parameters.decoder_input_details)
        return out

    async def stream(self, job: Job | list[Job], events) -> EventSourceResponse:
        """An SSE response of `events` for a submitted job; an error after the stream started is sent as TGI
        does, as one last event `{"error", "error_type"}`."""
        async def guarded():
            async with aclosing(events):
                try:
                    async for event in events:
                        yield event
                except ServingError as exc:
                    yield _sse({"error": str(exc), "error_type": exc.error_type})

        jobs = job if isinstance(job, list) else [job]
        try:
            for each in jobs:
                await self.submit(each)
        except BaseException:
            self.release(jobs)
            raise
        # the background task frees the slots even when the client left before the stream began
        return EventSourceResponse(guarded(), sep="\n", background=BackgroundTask(self.release, jobs),
                                   shutdown_grace_period=self.graceful_shutdown_s)

    def release(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.handle is not None:
                self.worker.release(job.handle)

    async def tgi_events(self, body: GenerateRequest, job: Job):
        """SSE events of `/generate_stream`; the last one carries `generated_text` and `details`."""
        async with aclosing(self.run(job)) as tokens:
            index = 0
            async for token, last in tokens:
                index += 1
                event = {"index": index, "token": token, "generated_text": None, "details": None}
                if job.params.top_n_tokens:
                    event["top_tokens"] = job.top_tokens[index - 1]
                if last:
                    text = job.stream.final_text()
                    event["generated_text"] = body.inputs + text if body.parameters.return_full_text else text
                    event["details"] = {"finish_reason": job.finish_reason, "generated_tokens": len(job.tokens),
                                        "seed": job.seed, "input_length": len(job.input_ids)}
                yield _sse(event)

    def _chat_base(self, object_name: str, id_prefix: str = "chatcmpl") -> dict:
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": object_name, "created": int(time.time()),
                "model": self.model_id, "system_fingerprint": f"angelspec-hf-{_version()}"}

    @staticmethod
    def _usage(*jobs: Job) -> dict:
        n_in, n_out = sum(len(job.input_ids) for job in jobs), sum(len(job.tokens) for job in jobs)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    @staticmethod
    def _logprobs(tokens: list[dict], tops: list[list[dict]]) -> dict:
        """OpenAI's chat `logprobs` of `tokens`, with their `top_logprobs` (`tops`, possibly empty) beside them."""
        return {"content": [{"token": t["text"], "logprob": t["logprob"], "top_logprobs": [
            {"token": o["text"], "logprob": o["logprob"]} for o in top]}
            for t, top in itertools.zip_longest(tokens, tops[:len(tokens)], fillvalue=[])]}

    def chat_response(self, body: ChatRequest, job: Job) -> dict:
        message = {"role": "assistant", "content": job.stream.final_text(openai=True)}
        choice = {"index": 0, "message": message,
                  "logprobs": self._logprobs(job.tokens, job.top_tokens) if body.logprobs else None,
                  "finish_reason": _OPENAI_FINISH[job.finish_reason]}
        return self._chat_base("chat.completion") | {"choices": [choice], "usage": self._usage(job)}

    async def chat_events(self, body: ChatRequest, job: Job):
        base = self._chat_base("chat.completion.chunk")

        def chunk(content, finish_reason=None, logprobs=None, usage=None):
            delta = {"role": "assistant", "content": content, "tool_calls": None}
            return _sse(base | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish_reason}], "usage": usage})

        async with aclosing(self.run(job)) as tokens:
            async for token, last in tokens:
                delta = job.stream.openai_delta(final=last)
                logprobs = self._logprobs([token], job.top_tokens[-1:]) if body.logprobs else None
                if delta or logprobs:
                    yield chunk(delta, logprobs=logprobs)
        yield chunk("", finish_reason=_OPENAI_FINISH[job.finish_reason])
        if (body.stream_options or {}).get("include_usage"):
            yield _sse(base | {"choices": [], "usage": self._usage(job)})
        yield "[DONE]"

    def completion_response(self, jobs: list[Job]) -> dict:
        choices = [{"index": i, "text": job.stream.final_text(openai=True), "logprobs": None,
                    "finish_reason": _OPENAI_FINISH[job.finish_reason]} for i, job in enumerate(jobs)]
        return self._chat_base("text_completion", "cmpl") | {"choices": choices, "usage": self._usage(*jobs)}

    async def completion_events(self, body: CompletionRequest, jobs: list[Job]):
        """SSE chunks of every prompt's completion as they come (each chunk names its prompt's `index`), each prompt
        ending with a chunk that has its `finish_reason`; then the usage if asked for, and `[DONE]`."""
        base = self._chat_base("text_completion", "cmpl")
        queue: asyncio.Queue = asyncio.Queue()

        def chunk(index, text, finish_reason=None):
            return _sse(base | {"choices": [{"index": index, "text": text, "logprobs": None,
                                             "finish_reason": finish_reason}]})

        async def pump(index: int, job: Job):  # queues (chunk or error, whether this prompt is done)
            try:
                async with aclosing(self.run(job)) as tokens:
                    async for _, last in tokens:
                        if delta := job.stream.openai_delta(final=last):
                            await queue.put((chunk(index, delta), False))
                await queue.put((chunk(index, "", _OPENAI_FINISH[job.finish_reason]), True))
            except Exception as exc:  # noqa: BLE001 - handed to the stream, which reports it as TGI does
                await queue.put((exc, True))

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            running = len(jobs)
            while running:
                item, done = await queue.get()
                if isinstance(item, Exception):
                    raise item
                running -= done
                yield item
        finally:
            for task in tasks:
                task.cancel()  # a client that left: closing each `run` cancels its request in the engine
        if (body.stream_options or {}).get("include_usage"):
            yield _sse(base | {"choices": [], "usage": self._usage(*jobs)})
        yield "[DONE]"

    def info(self) -> dict:
        return {"model_id": self.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": self.max_concurrent_requests, "max_best_of": 1,
                "max_stop_sequences": self.max_stop_sequences, "max_stop_length": self.max_stop_length,
                "max_input_tokens": self.max_input_tokens,
                "max_total_tokens": self.max_total_tokens, "validation_workers": 1,
                "max_client_batch_size": self.max_client_batch_size,
                "router": "angelspec-hf", "version": _version(), "sha": None, "docker_label": None,
                **self.info_extra}


def _version() -> str:
    from angelspec_hf import __version__

    return __version__


# ---------------------------------------------------------------- HTTP
class _MetricsMiddleware:
    """Counts requests by route and status and times them to the last byte (streams included)."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        start, status = time.perf_counter(), 500

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_duration.labels(route).observe(time.perf_counter() - start)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"Input validation error: malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}"
        where = ".".join(str(x) for x in err.get("loc", ())[1:]) or "body"
        parts.append(f"`{where}`: {err['msg']}")
    return "Input validation error: " + "; ".join(parts)


class _PayloadLimitMiddleware:
    """Refuses a request body over `limit` bytes (TGI's `--payload-limit`) with a 413, without reading it whole: the
    error is raised from `receive`, inside the route, so the app's exception handlers answer it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared, received = dict(scope["headers"]).get(b"content-length", b""), 0

        async def limited_receive():
            nonlocal received
            message = None if declared.isdigit() and int(declared) > self.limit else await receive()
            received += len(message.get("body", b"")) if message else 0
            if message is None or received > self.limit:
                raise HTTPException(413, f"Input validation error: the request body is larger than the payload "
                                         f"limit of {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


_HTTP_ERROR_TYPES = {400: "validation", 404: "not_found", 405: "method_not_allowed", 413: "validation"}


def create_app(engine, tokenizer, model_id: str, *, max_input_tokens: int = 1024, max_total_tokens: int = 2048,
               max_concurrent_requests: int = 128, max_stop_sequences: int = 4, max_stop_length: int = 256,
               max_payload_bytes: int = 2_000_000, max_client_batch_size: int = 4, info_extra: dict | None = None,
               graceful_shutdown_s: float = 30.0) -> FastAPI:
    """A FastAPI app serving `engine` (a `SpeculativeEngine` or anything with its interface) over TGI's protocol.

    The limits are TGI's (`/info` reports them), plus `max_stop_length` (characters per stop string) and
    `max_payload_bytes` (request body; TGI's `--payload-limit`); `max_client_batch_size` prompts per `/v1/completions`
    request. The engine's worker thread starts and stops with the
    app's lifespan (uvicorn runs it); on shutdown, open streams get `graceful_shutdown_s` to finish, then are cut, and
    whatever the engine still runs ends as `incomplete_generation`."""
    server = TGIServer(engine, tokenizer, model_id, max_input_tokens=max_input_tokens,
                       max_total_tokens=max_total_tokens, max_concurrent_requests=max_concurrent_requests,
                       max_stop_sequences=max_stop_sequences, max_stop_length=max_stop_length,
                       max_client_batch_size=max_client_batch_size, info_extra=info_extra,
                       graceful_shutdown_s=graceful_shutdown_s)

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        await asyncio.to_thread(server.worker.shutdown, graceful_shutdown_s)

    app = FastAPI(title="angelspec-hf", version=_version(), lifespan=lifespan,
                  description="TGI's protocol on a batched speculative engine; every error is TGI's "
                              "`{error, error_type}`.")
    app.state.server = server
    app.add_middleware(_PayloadLimitMiddleware, limit=max_payload_bytes)
    app.add_middleware(_MetricsMiddleware, metrics=server.metrics)

    def error(message: str, error_type: str, status: int, headers=None) -> JSONResponse:
        return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request, exc):
        return error(_validation_message(exc), "validation", 422)

    @app.exception_handler(ServingError)
    async def on_serving_error(request, exc):
        return error(str(exc), exc.error_type, exc.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request, exc):  # no such route or method, a body FastAPI could not parse, 413
        message = exc.detail
        if exc.status_code == 400 and exc.__cause__ is not None:  # invalid UTF-8, JSON nested too deep
            message = f"Input validation error: the body is not valid JSON: {exc.__cause__}"
        return error(message, _HTTP_ERROR_TYPES.get(exc.status_code, "http"), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(request, exc):  # a bug: still TGI-shaped (starlette logs the traceback)
        return error(f"Internal server error: {type(exc).__name__}", "internal", 500)

    async def generate_job(body: GenerateRequest) -> Job:
        return await server.off_loop(server.generate_job, body)

    async def stream_tgi(body: GenerateRequest):
        job = await generate_job(body)
        return await server.stream(job, server.tgi_events(body, job))

    @app.post("/generate", responses=protocol.GENERATE_DOC)
    async def generate(body: GenerateRequest, request: Request):
        return server.tgi_response(body, await server.complete(await generate_job(body), request))

    @app.post("/generate_stream", response_class=EventSourceResponse, responses=protocol.STREAM_DOC)
    async def generate_stream(body: GenerateRequest):
        return await stream_tgi(body)

    @app.post("/", responses=protocol.COMPAT_DOC)
    async def compat_generate(body: GenerateRequest, request: Request):
        if body.stream:
            return await stream_tgi(body)
        return [server.tgi_response(body, await server.complete(await generate_job(body), request))]

    @app.post("/v1/chat/completions", responses=protocol.CHAT_DOC)
    async def chat_completions(body: ChatRequest, request: Request):
        job = await server.off_loop(server.chat_job, body)
        if body.stream:
            return await server.stream(job, server.chat_events(body, job))
        return server.chat_response(body, await server.complete(job, request))

    @app.post("/v1/completions", responses=protocol.COMPLETIONS_DOC)
    async def completions(body: CompletionRequest, request: Request):
        jobs = await server.off_loop(server.completion_jobs, body)
        if body.stream:
            return await server.stream(jobs, server.completion_events(body, jobs))
        return server.completion_response(await server.complete_all(jobs, request))

    def tokens(body: TokenizeRequest) -> list[dict]:
        enc = tokenizer(check_text(body.inputs, "inputs"), add_special_tokens=body.add_special_tokens,
                        return_offsets_mapping=True)
        return [{"id": i, "text": body.inputs[a:b], "start": a, "stop": b}
                for i, (a, b) in zip(enc.input_ids, enc.offset_mapping)]

    @app.post("/tokenize", responses={200: {"model": list[protocol.TokenizedToken]}} | protocol.BODY_ERRORS)
    async def tokenize(body: TokenizeRequest):
        return await server.off_loop(tokens, body)

    @app.get("/info", responses={200: {"model": protocol.Info}})
    async def info():
        return server.info()

    @app.get("/v1/models", responses={200: {"model": protocol.ModelList}})
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "angelspec-hf"}]}

    @app.get("/health", response_class=Response, responses=protocol.HEALTH_DOC)
    async def health():
        if server.worker.alive:
            return Response(status_code=200)
        return error(f"the engine worker is not running: {server.worker.failure}", "healthcheck", 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=protocol.METRICS_DOC)
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # this server's own limits in the schema
    schemas = app.openapi()["components"]["schemas"]
    stop = protocol.stop_schema(max_stop_sequences, max_stop_length)
    schemas["GenerateParameters"]["properties"]["stop"].update(stop)
    for name in ("ChatRequest", "CompletionRequest"):
        schemas[name]["properties"]["stop"]["anyOf"] = [stop["items"], stop, {"type": "null"}]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    next(p for p in prompt if p.get("type") == "array").update(minItems=1, maxItems=max_client_batch_size)
    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
          graceful_shutdown_s: int = 35) -> None:
    """Runs `app` under uvicorn until interrupted (SIGINT/SIGTERM): it stops accepting connections, lets in-flight
    requests finish for up to `graceful_shutdown_s` (streams get the app's own, shorter, grace), then stops the
    engine thread."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s)


@contextmanager
def running_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
    """Runs `app` under uvicorn on a background thread (tests, benchmarks); yields its base URL, and on exit shuts
    it down the way a signal would (in-flight requests finish, then the lifespan stops the engine worker)."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(timeout_s)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


__all__ = ["ChatRequest", "GenerateRequest", "TGIServer", "TextStream", "create_app", "running_in_thread", "serve"]
