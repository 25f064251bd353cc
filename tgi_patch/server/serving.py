"""Validation and generation behind the routes of `angelspec serve` (`TGIServer`, one per app): TGI's parameter
rules and messages, request bodies turned into engine jobs, tokens streamed from the worker into TGI's and OpenAI's
response shapes (JSON or SSE), and a client that goes away has its request cancelled in the engine.

Sampling follows TGI: temperature / top-k / top-p, and `repetition_penalty`, `frequency_penalty`, `presence_penalty`
(applied by the engine to the target's distribution at every verified position, `engine/sampling.py`); `top_n_tokens`
(chat: `top_logprobs`) reports the most likely tokens at each position.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from . import protocol
from .errors import ClientDisconnected, IncompleteGenerationError, ServingError, ValidationError
from .metrics import ServingMetrics
from .protocol import FLOAT32_MAX_FINITE, FLOAT32_MIN_POSITIVE, ChatRequest, CompletionRequest, GenerateRequest
from .text import TextStream, check_text, message_text
from .worker import EngineWorker, RequestHandle

_OPENAI_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


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


def _sse(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


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
        if not ids:  # e.g. only control characters, which the tokenizer drops
            raise ValidationError("`inputs` cannot be empty: it has no tokens")
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
        # floats must stay valid as the float32 the sampling kernels compute with (TGI parses them as 32-bit floats)
        if temperature is not None and not (math.isfinite(temperature) and temperature >= FLOAT32_MIN_POSITIVE):
            raise ValidationError(f"`temperature` must be strictly positive and finite (>= {FLOAT32_MIN_POSITIVE}: a "
                                  f"smaller one is 0 as a float32)")
        if top_k is not None and top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        if top_k is not None:
            top_k = min(top_k, 2**31 - 1)  # beyond the vocabulary it keeps every token; as an int64 it must fit
        if top_p is not None and not FLOAT32_MIN_POSITIVE <= top_p <= 1:
            raise ValidationError(f"`top_p` must be > 0.0 and <= 1.0 (>= {FLOAT32_MIN_POSITIVE}: a smaller one is 0 as "
                                  f"a float32)")
        if seed is not None and seed < 0:
            raise ValidationError("`seed` must be a non-negative integer")
        if len(stop) > self.max_stop_sequences:
            raise ValidationError(f"`stop` supports up to {self.max_stop_sequences} stop sequences. Given: "
                                  f"{len(stop)}")
        if any(not s for s in stop):
            raise ValidationError("`stop` sequences cannot be empty")
        if any(len(s) > self.max_stop_length for s in stop):
            raise ValidationError(f"`stop` sequences must have at most {self.max_stop_length} characters. Given: "
                                  f"{max(map(len, stop))}")
        if repetition_penalty is not None and not \
                FLOAT32_MIN_POSITIVE <= repetition_penalty <= FLOAT32_MAX_FINITE:
            raise ValidationError(f"`repetition_penalty` must be strictly positive and finite as a float32 (in "
                                  f"[{FLOAT32_MIN_POSITIVE}, {FLOAT32_MAX_FINITE}])")
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
                                logit_bias=(_logit_bias(body.logit_bias), ()))
        # no content (OpenAI allows `null`) is empty text: templates concatenate it
        messages = [{"role": m.role, "content": message_text(m.content) or ""} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that refuses the conversation is a client error
            raise ValidationError(f"the chat template refused the messages: {exc}") from exc
        ids = self._input_ids(None, self.tokenizer(text, add_special_tokens=False).input_ids)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= protocol.MAX_TOP_N_TOKENS:
            raise ValidationError(f"`top_logprobs` must be >= 0 and <= {protocol.MAX_TOP_N_TOKENS}")
        for name in ("max_tokens", "max_completion_tokens"):  # both held to the schema, also the one not used
            if (value := getattr(body, name)) is not None and not 1 <= value <= self.max_total_tokens - 1:
                raise ValidationError(f"`{name}` must be >= 1 and <= {self.max_total_tokens - 1} (max_total_tokens - 1)")
        max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._openai_job(body, ids, max_new, top_n_tokens=body.top_logprobs if body.logprobs else None)

    def _openai_job(self, body, ids: list[int], max_new_tokens, top_n_tokens=None) -> Job:
        """A chat or completions request's job: OpenAI's stop (a string or a list), TGI's rule that temperature 0 is
        greedy and anything else samples, and the three penalties."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if body.temperature is not None and not (math.isfinite(body.temperature) and body.temperature >= 0):
            raise ValidationError("`temperature` must be >= 0 and finite")
        if body.top_p is not None and not FLOAT32_MIN_POSITIVE <= body.top_p <= 1:  # checked even where greedy
            raise ValidationError(f"`top_p` must be > 0.0 and <= 1.0 (>= {FLOAT32_MIN_POSITIVE}: a smaller one is 0 "
                                  f"as a float32)")
        # 0 is greedy, and so is what rounds to 0 as a float32 (as TGI, which parses it as an f32, sees it)
        greedy = body.temperature is not None and body.temperature < FLOAT32_MIN_POSITIVE
        return self.job(ids, max_new_tokens=max_new_tokens, do_sample=not greedy,
                        temperature=None if greedy else body.temperature, top_k=None,
                        top_p=None if greedy else body.top_p, seed=body.seed, stop=stop,
                        repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
                        presence_penalty=body.presence_penalty, top_n_tokens=top_n_tokens)

    def completion_jobs(self, body: CompletionRequest) -> list[Job]:
        self._check_unsupported(n=(body.n, (1,)), best_of=(body.best_of, (1,)), echo=(body.echo, (False,)),
                                suffix=(body.suffix, ()), logprobs=(body.logprobs, ()),
                                logit_bias=(_logit_bias(body.logit_bias), ()))
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not 1 <= len(prompts) <= self.max_client_batch_size:
            raise ValidationError(f"`prompt` takes 1 to {self.max_client_batch_size} prompts (max_client_batch_size)."
                                  f" Given: {len(prompts)}")
        max_tokens = body.max_tokens if body.max_tokens is not None else protocol.COMPLETION_MAX_TOKENS
        return [self._openai_job(body, self._input_ids(prompt), max_tokens) for prompt in prompts]

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
                "model": self.model_id, "system_fingerprint": f"angelspec-hf-{server_version()}"}

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
                "router": "angelspec-hf", "version": server_version(), "sha": None, "docker_label": None,
                **self.info_extra}


def _logit_bias(value):
    """`logit_bias` as `_check_unsupported` takes it: null and `{}` are its neutral values (None); anything else,
    a non-empty map or a value that is not a map, is refused."""
    return None if value is None or value == {} else value


def server_version() -> str:
    from angelspec_hf import __version__

    return __version__
