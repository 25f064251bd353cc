"""The HTTP layer of `angelspec serve`: `create_app(engine, tokenizer, model_id)` wires `TGIServer` (`serving.py`) into
a FastAPI app: TGI's routes, the payload limit and request metrics as middleware, every error as TGI's
`{"error", "error_type"}`, the engine's worker thread started and stopped with the app's lifespan, this server's own
limits filled into the OpenAPI schema; `build_app(ServeConfig)` loads the models and builds engine and app from one
config; `serve` runs it under uvicorn, `running_in_thread` in the background."""

from __future__ import annotations

import asyncio
import time
import os
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from . import protocol
from .config import APP_LIMITS, ServeConfig
from .errors import ServingError
from .metrics import ServingMetrics
from .protocol import ChatRequest, CompletionRequest, GenerateRequest, TokenizeRequest
from .serving import Job, TGIServer, server_version
from .text import check_text

ROUTES = ("/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize",
          "/info", "/health", "/metrics")


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


def create_app(engine, tokenizer, model_id: str, config: ServeConfig | None = None, *, info_extra: dict | None = None,
               **limits) -> FastAPI:
    """A FastAPI app serving `engine` (a `SpeculativeEngine` or anything with its interface) over TGI's protocol.

    Its limits are `config`'s (a `ServeConfig`; default: `ServeConfig()`), each of which a keyword argument
    overrides (`max_input_tokens=128`; any other keyword is a `TypeError`): TGI's (`/info` reports them), plus
    `max_stop_length` (characters per stop string) and `max_payload_bytes` (request body; TGI's `--payload-limit`);
    `max_client_batch_size` prompts per `/v1/completions` request. `info_extra` is added to `/info`. The engine's
    worker thread starts and stops with the app's lifespan (uvicorn runs it); on shutdown, open streams get
    `graceful_shutdown_s` to finish, then are cut, and whatever the engine still runs ends as
    `incomplete_generation`. `build_app` builds the engine and the app from a `ServeConfig` alone."""
    unknown = sorted(set(limits) - set(APP_LIMITS))
    if unknown:
        raise TypeError(f"create_app got unexpected keyword argument(s) {', '.join(unknown)}; the limits are "
                        f"{', '.join(APP_LIMITS)}")
    config = replace(config or ServeConfig(), **limits)
    server = TGIServer(engine, tokenizer, model_id, info_extra=info_extra,
                       **{name: getattr(config, name) for name in APP_LIMITS if name != "max_payload_bytes"})

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        await asyncio.to_thread(server.worker.shutdown, config.graceful_shutdown_s)

    app = FastAPI(title="angelspec-hf", version=server_version(), lifespan=lifespan,
                  description="TGI's protocol on a batched speculative engine; every error is TGI's "
                              "`{error, error_type}`.")
    app.state.server, app.state.config = server, config
    app.add_middleware(_PayloadLimitMiddleware, limit=config.max_payload_bytes)
    app.add_middleware(_MetricsMiddleware, metrics=server.metrics)

    _add_error_handlers(app)
    _add_generation_routes(app, server)
    _add_service_routes(app, server, tokenizer, model_id)
    _document_limits(app, config)
    return app


def _error(message: str, error_type: str, status: int, headers=None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error TGI-shaped: `{"error", "error_type"}` with its status."""

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request, exc):
        return _error(_validation_message(exc), "validation", 422)

    @app.exception_handler(ServingError)
    async def on_serving_error(request, exc):
        return _error(str(exc), exc.error_type, exc.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request, exc):  # no such route or method, a body FastAPI could not parse, 413
        message = exc.detail
        if exc.status_code == 400 and exc.__cause__ is not None:  # invalid UTF-8, JSON nested too deep
            message = f"Input validation error: the body is not valid JSON: {exc.__cause__}"
        return _error(message, _HTTP_ERROR_TYPES.get(exc.status_code, "http"), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(request, exc):  # a bug: still TGI-shaped (starlette logs the traceback)
        return _error(f"Internal server error: {type(exc).__name__}", "internal", 500)


def _add_generation_routes(app: FastAPI, server: TGIServer) -> None:
    """`/generate`, `/generate_stream`, `/` (TGI) and `/v1/chat/completions`, `/v1/completions` (OpenAI)."""

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


def _add_service_routes(app: FastAPI, server: TGIServer, tokenizer, model_id: str) -> None:
    """`/tokenize`, `/info`, `/v1/models`, `/health`, `/metrics`."""

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
        return _error(f"the engine worker is not running: {server.worker.failure}", "healthcheck", 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=protocol.METRICS_DOC)
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _document_limits(app: FastAPI, config: ServeConfig) -> None:
    """This server's own limits in the OpenAPI schema. What depends on the tokenizer (a prompt's length in tokens,
    and with it prompt + new tokens <= `max_total_tokens`) cannot be stated there; its bound alone can: at most
    `max_total_tokens - 1` new tokens (a prompt has at least one), `truncate` at most `max_input_tokens`."""
    schemas = app.openapi()["components"]["schemas"]
    max_input_tokens, max_total_tokens = config.max_input_tokens, config.max_total_tokens
    most_new = {"maximum": max_total_tokens - 1}
    schemas["GenerateParameters"]["properties"]["max_new_tokens"]["anyOf"][0].update(most_new)
    schemas["GenerateParameters"]["properties"]["truncate"]["anyOf"][0].update(maximum=max_input_tokens)
    for name, field in (("ChatRequest", "max_tokens"), ("ChatRequest", "max_completion_tokens"),
                        ("CompletionRequest", "max_tokens")):
        schemas[name]["properties"][field]["anyOf"][0].update(most_new)
    stop = protocol.stop_schema(config.max_stop_sequences, config.max_stop_length)
    schemas["GenerateParameters"]["properties"]["stop"].update(stop)
    for name in ("ChatRequest", "CompletionRequest"):
        schemas[name]["properties"]["stop"]["anyOf"] = [stop["items"], stop, {"type": "null"}]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    next(p for p in prompt if p.get("type") == "array").update(minItems=1, maxItems=config.max_client_batch_size)


def build_app(config: ServeConfig, log=print):
    """`(app, engine)`: the target, its drafter (`pick_drafter`: n-gram lookup where no trained drafter fits, with
    `lookup_tokens` = `NGRAM_LOOKUP_TOKENS` unless `config.engine` sets it) and the batched engine on them, loaded as
    `config` says, and the TGI app around them, its token limits clamped to the target's positions and the engine's
    prefill budget. Sets torch's CPU threads to `config.threads`. `log` receives what is loaded and why."""
    import torch

    from angelspec_hf.cpu_kernels import use_linear_kernels
    from angelspec_hf.devices import resolve_device, resolve_dtype
    from angelspec_hf.shipped import NGRAM_LOOKUP_TOKENS, pick_drafter
    from angelspec_hf.targets import DEFAULT_TARGET, load_target
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine

    torch.set_num_threads(config.threads)
    corpus = None
    if config.lookup_corpus not in (None, "none"):  # read first: a wrong folder is said before the target loads
        from angelspec_hf.policy import CorpusIndex

        corpus = CorpusIndex.from_path(config.lookup_corpus)
    model_id = config.target or DEFAULT_TARGET
    device = resolve_device(config.device)  # a device this machine lacks: `DeviceError` before anything loads
    dtype = resolve_dtype(config.dtype, device)
    log(f"loading target: {model_id} on {device} ({str(dtype).removeprefix('torch.')}) ...")
    target, tokenizer = load_target(config.target, device=device, dtype=dtype)
    choice = pick_drafter(config.drafter, target)
    if choice.kind in ("lookup", "untrained"):
        log(f"NOTE: {choice.note}" + (": outputs are still the target's own, but expect a slow-down."
                                     if choice.kind == "untrained" else "."))
    elif choice.kind != "none":
        log(f"drafter: {choice.note}")
    engine_config = config.engine
    if choice.drafter is not None and config.lookup_corpus is not None:
        choice.drafter.lookup_corpus = corpus
        if corpus is not None and engine_config.lookup_tokens is None and \
                not getattr(choice.drafter.config, "lookup_tokens", 0):  # asked for: lookups on
            engine_config = replace(engine_config, lookup_tokens=NGRAM_LOOKUP_TOKENS)
    corpus = getattr(choice.drafter, "lookup_corpus", None)
    if corpus is not None:
        log(f"lookups: also in a corpus of {corpus.num_sequences:,} earlier replies ({len(corpus):,} tokens)")
    kernels = use_linear_kernels(config.linear_kernels, target, choice.drafter)
    log(f"linear kernels: {kernels}")
    if choice.kind == "lookup" and engine_config.lookup_tokens is None:
        engine_config = replace(engine_config, lookup_tokens=NGRAM_LOOKUP_TOKENS)
    if engine_config.verify == "auto":
        log("cost model: the cached profile for this machine, or ~20 s of profiling ...")
    engine = SpeculativeEngine(target, choice.drafter, engine_config)
    if engine.config.corpus_window_tokens and engine.policy.corpus is not None:
        log(f"lookups: also in the replies served, their last {engine.config.corpus_window_tokens:,} tokens")
    max_total = min(config.max_total_tokens, engine.max_total_tokens)
    limits = replace(config, max_total_tokens=max_total, engine=engine.config,
                     max_input_tokens=min(config.max_input_tokens, max_total - 1, engine.max_prefill_tokens))
    settings = {name: str(value) if isinstance(value, os.PathLike) else value
                for name, value in asdict(engine.config).items()}
    info = {"drafter": "ngram-lookup" if choice.kind == "lookup" else config.drafter,
            "drafter_trained": choice.kind in ("trained", "given"), "verify": engine.config.verify,
            "lookup_corpus_tokens": len(corpus) if corpus is not None and engine.policy.corpus is not None else 0,
            "max_batch_size": engine.config.max_batch_size, "linear_kernels": kernels, "device": str(target.device),
            "dtype": str(target.dtype).removeprefix("torch."), "engine": settings}
    return create_app(engine, tokenizer, model_id, limits, info_extra={"angelspec": info}), engine


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
