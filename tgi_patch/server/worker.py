"""The bridge between asyncio request handlers and the synchronous batched engine.

`SpeculativeEngine` is not thread-safe, so one background thread owns it: it admits requests from a thread-safe
inbox, loops `engine.step()` while there is work, and hands every `TokenEvent` to the asyncio queue of the request it
belongs to (`loop.call_soon_threadsafe`). Handlers never touch the engine: they `submit`, read their queue, and
`release` (which cancels a request the engine still runs). The engine knows nothing of tokens as text:
detokenisation, stop strings and protocols live in `text.py` and `serving.py`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .errors import GenerationError, IncompleteGenerationError, OverloadedError, ServingError, ValidationError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RequestHandle:
    """One request as the handler sees it: its asyncio queue receives `TokenEvent`s or a `ServingError`."""

    input_ids: list[int]
    params: object
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    engine_id: int | None = None
    done: bool = False  # set by the handler when it has read its final event (or gave up)

    async def get(self):
        return await self.queue.get()


_ADMITTED = object()  # first item on an admitted request's queue


class EngineWorker:
    """Owns `engine` on a background thread. `metrics` (optional) gets `observe_step(engine, events, seconds)`."""

    def __init__(self, engine, *, max_concurrent_requests: int = 128, metrics=None, idle_poll_s: float = 0.05):
        self.engine = engine
        self.max_concurrent_requests = max_concurrent_requests
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, RequestHandle] = {}  # engine id -> handle; worker thread only
        self._in_flight = 0
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="angelspec-engine", daemon=True)
        self.failure: BaseException | None = None  # an error that killed the worker loop itself

    # ---- handler side (event loop thread) ----
    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queue_size(self) -> int:
        """Requests submitted and not yet running (approximate: read across threads)."""
        return self._inbox.qsize() + self.engine.num_waiting

    async def submit(self, input_ids: list[int], params) -> RequestHandle:
        """Queues a request and waits until the engine accepted it; raises `OverloadedError` past
        `max_concurrent_requests`, `ValidationError` when the engine refuses the parameters."""
        with self._lock:
            if not self._accepting:
                raise OverloadedError("the server is shutting down")
            if self._in_flight >= self.max_concurrent_requests:
                raise OverloadedError("Model is overloaded")
            self._in_flight += 1
            handle = RequestHandle(list(input_ids), params, asyncio.get_running_loop())
            self._inbox.put(("add", handle))  # under the lock: the loop's exit drains what got in before it
        try:
            first = await handle.get()
        except BaseException:
            self.release(handle)
            raise
        if first is not _ADMITTED:
            self.release(handle)
            raise first
        return handle

    def release(self, handle: RequestHandle) -> None:
        """The handler is done with `handle`: cancels it in the engine if it is still running, frees its slot."""
        if handle.done:
            return
        handle.done = True
        self._inbox.put(("cancel", handle))
        with self._lock:
            self._in_flight -= 1

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops accepting, cancels what is still running, joins the thread."""
        with self._lock:
            self._accepting = False
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- worker thread ----
    def _deliver(self, handle: RequestHandle, item) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            pass

    def _handle_message(self, kind: str, handle: RequestHandle | None) -> None:
        if kind == "stop":
            self._stop.set()
        elif kind == "add":
            if handle.done:
                return
            try:
                handle.engine_id = self.engine.add_request(handle.input_ids, handle.params)
            except ValueError as exc:
                self._deliver(handle, ValidationError(str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 - reported to the client as a generation error
                logger.exception("engine.add_request failed")
                self._deliver(handle, GenerationError(f"Request failed during generation: {exc}"))
                return
            self._active[handle.engine_id] = handle
            self._deliver(handle, _ADMITTED)
        elif kind == "cancel" and self._active.get(handle.engine_id) is handle:
            # A cancelled *waiting* request is dropped without an event, so forget it now; a late "cancelled"
            # event for this id is then ignored.
            del self._active[handle.engine_id]
            self.engine.cancel(handle.engine_id)

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_message(*message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a fault the engine could not pin on requests: those running fail,
            logger.exception("engine.step failed")  # the server keeps serving
            self._fail_active(GenerationError(f"Request failed during generation: {exc}"))
            return
        if self.metrics is not None:
            self.metrics.observe_step(self.engine, events, time.perf_counter() - start)
        for event in events:
            handle = self._active.get(event.request_id)
            if handle is None:
                continue
            if event.finished:
                del self._active[event.request_id]
            if event.error is not None:  # this request failed on its own; the engine served the others
                self._deliver(handle, GenerationError(f"Request failed during generation: {event.error}"))
                continue
            self._deliver(handle, event)

    def _fail_active(self, error: ServingError) -> None:
        failed, self._active = self._active, {}
        for engine_id, handle in failed.items():
            self._deliver(handle, error)
            try:
                self.engine.cancel(engine_id)
            except Exception:  # noqa: BLE001
                logger.exception("engine.cancel failed after a failed step")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_work())
                if not self._stop.is_set() and self.engine.has_work():
                    self._step()
            # shutdown: everything still running ends as incomplete; let the engine flush its cancellations
            self._fail_active(IncompleteGenerationError("the server shut down before the request finished"))
            for _ in range(1000):
                if not self.engine.has_work():
                    break
                self.engine.step()
        except BaseException as exc:  # noqa: BLE001 - keep the error for /health, fail whoever waits
            self.failure = exc
            logger.exception("the engine worker stopped")
            self._fail_active(GenerationError(f"the engine worker stopped: {exc}"))
            self._stop.set()
        with self._lock:
            self._accepting = False
        self._reject_pending()

    def _reject_pending(self) -> None:
        """Requests that reached the inbox after the loop ended get an answer instead of waiting forever."""
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._deliver(handle, OverloadedError("the server is shutting down"))
