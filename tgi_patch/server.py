"""`angelspec serve`: a TGI-protocol HTTP server on the batched speculative engine.

Routes and shapes follow text-generation-inference, so its clients (`text_generation.Client`,
`huggingface_hub.InferenceClient`, the `openai` client against `/v1`) work unchanged: `POST /` (compat: a JSON list, or
SSE with `"stream": true`), `/generate`, `/generate_stream`, `/v1/chat/completions`, `/tokenize`, `GET /info`,
`/health`, `/metrics`, `/v1/models`. Errors are `{"error", "error_type"}`: 422 validation, 424 generation,
429 overloaded, 500 incomplete_generation.

The engine generates token ids; this module owns everything textual: TGI's incremental detokenisation, stop strings
(matched on the decoded text; the request is then cancelled in the engine), chat templates. `create_app(engine,
tokenizer, model_id)` builds the app around any engine with the `SpeculativeEngine` interface.
"""

from __future__ import annotations

import asyncio
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
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ConfigDict, Field
    from sse_starlette import EventSourceResponse
    from starlette.background import BackgroundTask
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("`angelspec serve` needs the serve extra: pip install 'angelspec-hf[serve]'") from exc

ROUTES = ("/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/models", "/tokenize", "/info",
          "/health", "/metrics")
_OPENAI_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


# ---------------------------------------------------------------- request bodies (strict: "5" is not an int)
class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class GenerateParameters(_Body):
    do_sample: bool = False
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    return_full_text: bool | None = False
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    best_of: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    grammar: Any = None
    adapter_id: str | None = None


class GenerateRequest(_Body):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None


class TokenizeRequest(_Body):
    inputs: str
    add_special_tokens: bool = True


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
    tokens keep their text on the wire but are left out of `visible`, which is where stop strings are looked for."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], special_ids: frozenset[int]):
        self.tokenizer, self.stops, self.special_ids = tokenizer, stops, special_ids
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.generated: list[int] = []
        self.visible = ""
        self.stop_span: tuple[int, int] | None = None  # where the first stop string sits in `visible`
        self._emitted = 0  # characters of `visible` already sent as OpenAI deltas

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
        if not special and self.stops:
            start = max(0, len(self.visible) - max(map(len, self.stops)) + 1)
            self.visible += text
            hits = [(i, i + len(s)) for s in self.stops if (i := self.visible.find(s, start)) >= 0]
            self.stop_span = min(hits) if hits else None
        elif not special:
            self.visible += text
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def final_text(self, openai: bool = False) -> str:
        """The generated text: TGI keeps a stop string (and cuts what follows it), OpenAI drops it."""
        if self.stop_span is not None:
            return self.visible[:self.stop_span[0] if openai else self.stop_span[1]]
        return self.tokenizer.decode(self.generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def openai_delta(self, final: bool = False) -> str:
        """New visible text safe to stream under OpenAI semantics: nothing from a stop string on, and while not
        `final`, nothing that might still grow into one."""
        if self.stop_span is not None:
            end = self.stop_span[0]
        elif final:
            end = len(self.visible)
        else:
            held = max((k for s in self.stops for k in range(1, len(s)) if self.visible.endswith(s[:k])), default=0)
            end = len(self.visible) - held
        delta = self.visible[self._emitted:max(end, self._emitted)]
        self._emitted += len(delta)
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
    handle: RequestHandle | None = None  # set once the engine accepted the request


def _sse(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- the server
class TGIServer:
    """Validation and generation shared by the routes; one per app."""

    def __init__(self, engine, tokenizer, model_id: str, *, max_input_tokens: int, max_total_tokens: int,
                 max_concurrent_requests: int, max_stop_sequences: int, info_extra: dict | None,
                 graceful_shutdown_s: float):
        from angelspec_hf.tgi_patch.engine import SamplingParams

        self.sampling_params_cls = SamplingParams
        self.tokenizer, self.model_id = tokenizer, model_id
        self.max_input_tokens, self.max_total_tokens = max_input_tokens, max_total_tokens
        self.max_concurrent_requests, self.max_stop_sequences = max_concurrent_requests, max_stop_sequences
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
            stop: list[str]) -> Job:
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
        # TGI samples when asked to, or when any warper is active
        sample = bool(do_sample or (temperature not in (None, 1.0)) or top_k or (top_p is not None and top_p < 1))
        if sample and seed is None:
            seed = random.getrandbits(63)
        params = self.sampling_params_cls(
            max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature or 1.0, top_k=top_k or 0,
            top_p=top_p or 1.0, seed=seed if sample else None)
        return Job(input_ids, params, TextStream(self.tokenizer, input_ids, stop, self.special_ids),
                   seed if sample else None)

    def generate_job(self, body: GenerateRequest) -> Job:
        p = body.parameters
        self._check_unsupported(repetition_penalty=(p.repetition_penalty, (1.0,)),
                                frequency_penalty=(p.frequency_penalty, (0.0,)), typical_p=(p.typical_p, (1.0,)),
                                best_of=(p.best_of, (1,)), watermark=(p.watermark, (False,)),
                                top_n_tokens=(p.top_n_tokens, (0,)), grammar=(p.grammar, ()),
                                adapter_id=(p.adapter_id, ()))
        ids = self._input_ids(body.inputs, truncate=p.truncate)
        return self.job(ids, max_new_tokens=p.max_new_tokens, do_sample=p.do_sample, temperature=p.temperature,
                        top_k=p.top_k, top_p=p.top_p, seed=p.seed, stop=p.stop)

    def chat_job(self, body: ChatRequest) -> Job:
        self._check_unsupported(n=(body.n, (1,)), frequency_penalty=(body.frequency_penalty, (0.0,)),
                                presence_penalty=(body.presence_penalty, (0.0,)),
                                repetition_penalty=(body.repetition_penalty, (1.0,)),
                                top_logprobs=(body.top_logprobs, (0,)), tools=(body.tools, ()),
                                tool_choice=(body.tool_choice, ("none",)), response_format=(body.response_format, ()),
                                logit_bias=(body.logit_bias or None, ()))
        messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that refuses the conversation is a client error
            raise ValidationError(f"the chat template refused the messages: {exc}") from exc
        ids = self._input_ids(None, self.tokenizer(text, add_special_tokens=False).input_ids)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        greedy = body.temperature == 0  # TGI's chat rule: temperature 0 is greedy, otherwise sample
        max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self.job(ids, max_new_tokens=max_new, do_sample=not greedy, temperature=None if greedy else
                        body.temperature, top_k=None, top_p=None if greedy else body.top_p, seed=body.seed, stop=stop)

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

    async def complete(self, job: Job) -> Job:
        await self.submit(job)
        async with aclosing(self.run(job)) as tokens:
            async for _ in tokens:
                pass
        return job

    def tgi_details(self, job: Job, prefill: bool) -> dict:
        prefill_tokens = []
        if prefill:  # ids and texts; the engine does not compute prompt log-probs
            texts = self.tokenizer.batch_decode([[i] for i in job.input_ids], skip_special_tokens=False)
            prefill_tokens = [{"id": i, "text": t, "logprob": None} for i, t in zip(job.input_ids, texts)]
        return {"finish_reason": job.finish_reason, "generated_tokens": len(job.tokens), "seed": job.seed,
                "prefill": prefill_tokens, "tokens": job.tokens}

    def tgi_response(self, body: GenerateRequest, job: Job) -> dict:
        text = job.stream.final_text()
        out = {"generated_text": body.inputs + text if body.parameters.return_full_text else text}
        if body.parameters.details:
            out["details"] = self.tgi_details(job, body.parameters.decoder_input_details)
        return out

    async def stream(self, job: Job, events) -> EventSourceResponse:
        """An SSE response of `events` for a submitted job; an error after the stream started is sent as TGI
        does, as one last event `{"error", "error_type"}`."""
        async def guarded():
            async with aclosing(events):
                try:
                    async for event in events:
                        yield event
                except ServingError as exc:
                    yield _sse({"error": str(exc), "error_type": exc.error_type})

        await self.submit(job)
        # the background task frees the slot even when the client left before the stream began
        return EventSourceResponse(guarded(), sep="\n", background=BackgroundTask(self.worker.release, job.handle),
                                   shutdown_grace_period=self.graceful_shutdown_s)

    async def tgi_events(self, body: GenerateRequest, job: Job):
        """SSE events of `/generate_stream`; the last one carries `generated_text` and `details`."""
        async with aclosing(self.run(job)) as tokens:
            index = 0
            async for token, last in tokens:
                index += 1
                event = {"index": index, "token": token, "generated_text": None, "details": None}
                if last:
                    text = job.stream.final_text()
                    event["generated_text"] = body.inputs + text if body.parameters.return_full_text else text
                    event["details"] = {"finish_reason": job.finish_reason, "generated_tokens": len(job.tokens),
                                        "seed": job.seed, "input_length": len(job.input_ids)}
                yield _sse(event)

    def _chat_base(self, object_name: str) -> dict:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": object_name, "created": int(time.time()),
                "model": self.model_id, "system_fingerprint": f"angelspec-hf-{_version()}"}

    def _usage(self, job: Job) -> dict:
        n_in, n_out = len(job.input_ids), len(job.tokens)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    @staticmethod
    def _logprobs(tokens: list[dict]) -> dict:
        return {"content": [{"token": t["text"], "logprob": t["logprob"], "top_logprobs": []} for t in tokens]}

    def chat_response(self, body: ChatRequest, job: Job) -> dict:
        message = {"role": "assistant", "content": job.stream.final_text(openai=True)}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(job.tokens) if body.logprobs else None,
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
                logprobs = self._logprobs([token]) if body.logprobs else None
                if delta or logprobs:
                    yield chunk(delta, logprobs=logprobs)
        yield chunk("", finish_reason=_OPENAI_FINISH[job.finish_reason])
        if (body.stream_options or {}).get("include_usage"):
            yield _sse(base | {"choices": [], "usage": self._usage(job)})
        yield "[DONE]"

    def info(self) -> dict:
        return {"model_id": self.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": self.max_concurrent_requests, "max_best_of": 1,
                "max_stop_sequences": self.max_stop_sequences, "max_input_tokens": self.max_input_tokens,
                "max_total_tokens": self.max_total_tokens, "validation_workers": 1, "max_client_batch_size": 1,
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


def create_app(engine, tokenizer, model_id: str, *, max_input_tokens: int = 1024, max_total_tokens: int = 2048,
               max_concurrent_requests: int = 128, max_stop_sequences: int = 4, info_extra: dict | None = None,
               graceful_shutdown_s: float = 30.0) -> FastAPI:
    """A FastAPI app serving `engine` (a `SpeculativeEngine` or anything with its interface) over TGI's protocol.

    The limits are TGI's (`/info` reports them). The engine's worker thread starts and stops with the app's lifespan
    (uvicorn runs it); on shutdown, open streams get `graceful_shutdown_s` to finish, then are cut, and whatever the
    engine still runs ends as `incomplete_generation`."""
    server = TGIServer(engine, tokenizer, model_id, max_input_tokens=max_input_tokens,
                       max_total_tokens=max_total_tokens, max_concurrent_requests=max_concurrent_requests,
                       max_stop_sequences=max_stop_sequences, info_extra=info_extra,
                       graceful_shutdown_s=graceful_shutdown_s)

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        await asyncio.to_thread(server.worker.shutdown, graceful_shutdown_s)

    app = FastAPI(title="angelspec-hf", version=_version(), lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_MetricsMiddleware, metrics=server.metrics)

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request, exc):
        return JSONResponse({"error": _validation_message(exc), "error_type": "validation"}, status_code=422)

    @app.exception_handler(ServingError)
    async def on_serving_error(request, exc):
        return JSONResponse({"error": str(exc), "error_type": exc.error_type}, status_code=exc.status)

    async def stream_tgi(body: GenerateRequest):
        job = server.generate_job(body)
        return await server.stream(job, server.tgi_events(body, job))

    @app.post("/generate")
    async def generate(body: GenerateRequest):
        return server.tgi_response(body, await server.complete(server.generate_job(body)))

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest):
        return await stream_tgi(body)

    @app.post("/")
    async def compat_generate(body: GenerateRequest):
        if body.stream:
            return await stream_tgi(body)
        return [server.tgi_response(body, await server.complete(server.generate_job(body)))]

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        job = server.chat_job(body)
        if body.stream:
            return await server.stream(job, server.chat_events(body, job))
        return server.chat_response(body, await server.complete(job))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        enc = tokenizer(check_text(body.inputs, "inputs"), add_special_tokens=body.add_special_tokens, return_offsets_mapping=True)
        return [{"id": i, "text": body.inputs[a:b], "start": a, "stop": b}
                for i, (a, b) in zip(enc.input_ids, enc.offset_mapping)]

    @app.get("/info")
    async def info():
        return server.info()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "angelspec-hf"}]}

    @app.get("/health")
    async def health():
        if server.worker.alive:
            return Response(status_code=200)
        return JSONResponse({"error": f"the engine worker is not running: {server.worker.failure}",
                             "error_type": "healthcheck"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
