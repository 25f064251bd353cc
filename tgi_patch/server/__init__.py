"""`angelspec serve`: a TGI-protocol HTTP server on the batched speculative engine.

Routes and shapes follow text-generation-inference, so its clients (`text_generation.Client`,
`huggingface_hub.InferenceClient`, the `openai` client against `/v1`) work unchanged: `POST /` (compat: a JSON list, or
SSE with `"stream": true`), `/generate`, `/generate_stream`, `/v1/chat/completions`, `/v1/completions` (up to
`max_client_batch_size` prompts), `/tokenize`, `GET /info`, `/health`, `/metrics`, `/v1/models`; `/openapi.json`
documents them (`protocol.py`). Every error, whatever the input, is `{"error", "error_type"}`: 400 unparseable body,
404/405 no such route/method, 413 body over the payload limit, 422 validation, 424 generation, 429 overloaded, 500
incomplete_generation.

One request cannot hurt the others: its work is bounded (payload size, prompt tokens, stop strings: count and length,
matched in time linear in the generated text), tokenization and chat templates run off the event loop, and a client
that goes away (streaming or not) has its request cancelled in the engine and its slot freed.

The engine generates token ids; this package owns everything textual: TGI's incremental detokenisation, stop strings
(matched on the decoded text; the request is then cancelled in the engine), chat templates. `create_app(engine,
tokenizer, model_id)` builds the app around any engine with the `SpeculativeEngine` interface.

- `protocol.py`: the wire format (pydantic request bodies, documented responses).
- `errors.py`: `ServingError` and its kinds, each with TGI's `error_type` and status.
- `text.py`: `TextStream` (incremental detokenisation, stop strings), checks on incoming text.
- `worker.py`: `EngineWorker`, the one thread that owns the engine, and each request's `RequestHandle`.
- `metrics.py`: `ServingMetrics`, the Prometheus metrics.
- `serving.py`: `TGIServer`: validation, jobs, streaming and responses shared by the routes.
- `config.py`: `ServeConfig`, every setting of `angelspec serve` (the engine's `EngineConfig` among them).
- `app.py`: the FastAPI app (`create_app`), `build_app` (models, engine and app from a `ServeConfig`), `serve`,
  `running_in_thread`.
"""

import importlib

_EXPORTS = {  # name -> its module; imported on first use, so that `ServeConfig` (and `angelspec serve --help`, built
    # from it) needs neither the serve extra nor its import time
    "ServeConfig": "config", "APP_LIMITS": "config",
    "ROUTES": "app", "build_app": "app", "create_app": "app", "running_in_thread": "app", "serve": "app",
    "ServingError": "errors", "ValidationError": "errors", "ServingMetrics": "metrics", "ChatRequest": "protocol",
    "CompletionRequest": "protocol", "GenerateRequest": "protocol", "TGIServer": "serving", "TextStream": "text",
    "check_text": "text", "message_text": "text", "EngineWorker": "worker",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module != "config":
        try:  # the serve extra; this message rather than a bare ModuleNotFoundError
            import anyio  # noqa: F401
            import fastapi  # noqa: F401
            import sse_starlette  # noqa: F401
        except ImportError as exc:
            raise ImportError("`angelspec serve` needs the serve extra: pip install 'angelspec-hf[serve]'") from exc
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
