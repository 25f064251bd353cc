"""The wire format of `angelspec serve`: TGI's request bodies and the documented responses, as pydantic models.

Request bodies are strict (`"5"` is not an int) and state in their JSON schema every fixed constraint the server
enforces. `TGIServer` enforces them itself, with TGI's messages (`"max_new_tokens" must be strictly positive`), so a
constrained field keeps its plain type and only its schema says the bound (`_says`). Parameters TGI has and the engine
does not are documented as their neutral values. Limits set per server (stop strings, tokens) are filled into the
schema by `create_app`. Response models are documentation (the routes build plain dicts); the schemathesis test checks
that real responses conform to them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

# the engine's bounds: floats stay positive and finite as the float32 its kernels compute with. Seeds: any
# non-negative integer (TGI's u64 and beyond), used modulo 2**64 (`request.int64_seed`).
from angelspec_hf.tgi_patch.engine.request import FLOAT32_MAX_FINITE, FLOAT32_MIN_POSITIVE

MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
COMPLETION_MAX_TOKENS = 16  # OpenAI's default `max_tokens` for /v1/completions


def _integral(value):
    """JSON has numbers, not ints: `2.0` is the integer 2 (as JSON Schema says), `2.5` and `"2"` are not integers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
_JSON_TYPES = {Int: "integer", float: "number", str: "string"}


def _says(type_, **schema) -> Any:
    """`type_`, validated as is, with `schema` (JSON-schema keywords) stating the bound the server enforces."""
    return Annotated[type_, WithJsonSchema({"type": _JSON_TYPES[type_]} | schema)]


def _neutral(*values) -> WithJsonSchema:
    """The schema of an unsupported parameter: null or its neutral values; anything else gets a 422."""
    return WithJsonSchema({"enum": [*values, None]} if values else {"type": "null"})


# ---------------------------------------------------------------- request bodies (strict: "5" is not an int)
class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class GenerateParameters(_Body):
    do_sample: bool = False
    max_new_tokens: _says(Int, minimum=1) | None = None
    repetition_penalty: _says(float, minimum=FLOAT32_MIN_POSITIVE, maximum=FLOAT32_MAX_FINITE) | None = None
    frequency_penalty: _says(float, minimum=-2, maximum=2) | None = None
    return_full_text: bool | None = False
    stop: list[_says(str, minLength=1)] = Field(default_factory=list)
    seed: _says(Int, minimum=0) | None = None
    temperature: _says(float, minimum=FLOAT32_MIN_POSITIVE) | None = None
    top_k: _says(Int, minimum=1) | None = None
    top_p: _says(float, minimum=FLOAT32_MIN_POSITIVE, maximum=1) | None = None
    truncate: _says(Int, minimum=1) | None = None
    typical_p: Annotated[float | None, _neutral(1.0)] = None
    best_of: Annotated[Int | None, _neutral(1)] = None
    watermark: Annotated[bool, WithJsonSchema({"const": False})] = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: _says(Int, minimum=0, maximum=MAX_TOP_N_TOKENS) | None = None
    grammar: Annotated[Any, _neutral()] = None
    adapter_id: Annotated[str | None, _neutral()] = None


class GenerateRequest(_Body):
    inputs: _says(str, minLength=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


# a part of type "text" needs a string `text`; other parts (images, ...) are ignored
_CONTENT_PART = {"type": "object", "if": {"properties": {"type": {"const": "text"}}, "required": ["type"]},
                 "then": {"properties": {"text": {"type": "string"}}, "required": ["text"]}}


class ChatMessage(_Body):
    role: str
    content: str | list[Annotated[dict, WithJsonSchema(_CONTENT_PART)]] | None = None


class _OpenAIRequest(_Body):
    """What the `/v1` routes share: OpenAI's sampling fields (temperature 0 is greedy), stop, stream, penalties."""

    model: str | None = None
    max_tokens: _says(Int, minimum=1) | None = None
    temperature: _says(float, minimum=0) | None = None
    top_p: _says(float, minimum=FLOAT32_MIN_POSITIVE, maximum=1) | None = None
    seed: _says(Int, minimum=0) | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Annotated[Int | None, _neutral(1)] = None
    frequency_penalty: _says(float, minimum=-2, maximum=2) | None = None
    presence_penalty: _says(float, minimum=-2, maximum=2) | None = None
    repetition_penalty: _says(float, minimum=FLOAT32_MIN_POSITIVE, maximum=FLOAT32_MAX_FINITE) | None = None
    logit_bias: Annotated[Any, WithJsonSchema({"type": ["object", "null"], "maxProperties": 0})] = None


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _says(Int, minimum=1) | None = None
    logprobs: bool | None = None
    top_logprobs: _says(Int, minimum=0, maximum=MAX_TOP_N_TOKENS) | None = None  # with `logprobs`
    tools: Annotated[Any, _neutral()] = None
    tool_choice: Annotated[Any, _neutral("none")] = None
    response_format: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "null"}, {
        "type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"],
        "additionalProperties": False}]})] = None


class CompletionRequest(_OpenAIRequest):
    """OpenAI's (legacy) completions, as TGI serves them: the prompt is continued as is (no chat template)."""

    prompt: _says(str, minLength=1) | list[_says(str, minLength=1)]
    max_tokens: _says(Int, minimum=1) | None = COMPLETION_MAX_TOKENS  # also for null (chat: to the context's end)
    best_of: Annotated[Int | None, _neutral(1)] = None
    echo: Annotated[bool | None, _neutral(False)] = None
    suffix: Annotated[str | None, _neutral()] = None
    logprobs: Annotated[Int | None, _neutral()] = None
    user: str | None = None


class TokenizeRequest(_Body):
    inputs: str
    add_special_tokens: bool = True


def stop_schema(max_stop_sequences: int, max_stop_length: int) -> dict:
    """The JSON schema of a stop list under a server's limits."""
    return {"type": "array", "maxItems": max_stop_sequences,
            "items": {"type": "string", "minLength": 1, "maxLength": max_stop_length}}


# ---------------------------------------------------------------- documented responses
class ErrorResponse(BaseModel):
    """Every error: TGI's `{"error", "error_type"}`."""

    error: str
    error_type: str


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class Details(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = []  # present when `top_n_tokens` > 0: the most likely tokens at each position


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None  # present when `parameters.details`


class ChatChoice(BaseModel):
    index: int
    message: dict[str, str]
    logprobs: dict | None
    finish_reason: Literal["length", "stop"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["length", "stop"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class TokenizedToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


class Info(BaseModel):
    model_config = ConfigDict(extra="allow")  # `info_extra` (the engine's settings)

    model_id: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_stop_length: int
    max_input_tokens: int
    max_total_tokens: int
    max_client_batch_size: int
    version: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[dict]


def _errors(*statuses: int) -> dict:
    what = {400: "unparseable body", 413: "body larger than the payload limit", 422: "validation",
            424: "generation failed", 429: "overloaded", 500: "incomplete generation (cancelled at shutdown)",
            503: "the engine worker is not running"}
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


# OpenAPI 3.1 has an event stream's `schema` describe one event; `data` is JSON (or the chat's final `[DONE]`)
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "contentMediaType": "application/json"}}}}}
BODY_ERRORS = _errors(400, 413, 422)
GENERATION_ERRORS = _errors(400, 413, 422, 424, 429, 500)
GENERATE_DOC = {200: {"model": GenerateResponse}} | GENERATION_ERRORS
STREAM_DOC = {200: {"description": "SSE: one event per token, the last with `generated_text` and `details`",
                    "content": _SSE}} | GENERATION_ERRORS
COMPAT_DOC = {200: {"description": "`[GenerateResponse]`, or SSE when `stream` is true", "model": list[GenerateResponse],
                    "content": _SSE}} | GENERATION_ERRORS
CHAT_DOC = {200: {"description": "a chat completion, or SSE chunks when `stream` is true", "model": ChatCompletion,
                  "content": _SSE}} | GENERATION_ERRORS
COMPLETIONS_DOC = {200: {"description": "a completion (a choice per prompt), or SSE chunks when `stream` is true",
                         "model": Completion, "content": _SSE}} | GENERATION_ERRORS
HEALTH_DOC = {200: {"description": "the engine worker runs (empty body)"}} | _errors(503)
METRICS_DOC = {200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}
