"""Where each request's results go: to the handler registered for it, else to its own queue.

The engine thread puts every request with news here (a streaming request's progress, a request's end). A request
with a handler (`register_result_handler`, as transformers' server uses it) gets each result through that
handler: on the asyncio loop that registered it (``call_soon_threadsafe``), or on the engine thread when it was
registered outside a loop. A delta handler (``deltas=True``: the HTTP server's engine process) gets only what is
new, ``callback(request_id, tokens, logprobs, finished, error)``, on the engine thread, and no result object is
built for it (a `GenerationOutput` copies every token so far: ~3 us a request a step). Otherwise the result
waits in the request's own queue: `get(request_id)` takes that request's next result, never another's, and
`get()` the oldest result of any request. A handler that raises, or whose loop is closed, is logged and dropped;
it never stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import Callable

from transformers.generation.continuous_batching.requests import GenerationOutput

logger = logging.getLogger(__name__)

_POLL = 0.05  # seconds a waiting reader sleeps between looks at whether the engine still runs


class Delivery:
    def __init__(self):
        self._ready = threading.Condition()
        self._queues: dict[str, deque[tuple[int, GenerationOutput]]] = {}  # per request: (arrival, result)
        self._arrivals: deque[tuple[str, int]] = deque()  # (request, arrival) in arrival order, for get()
        self._handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop | None]] = {}
        self._batch: list | None = None  # handler calls held back by `batched` (the engine thread's)
        self._count = 0  # results queued so far (numbers their arrivals)
        self._live = 0  # results waiting in the queues

    def register(self, request_id: str, callback: Callable, deltas: bool = False) -> None:
        """Results of ``request_id`` go to ``callback`` until its final one; results already waiting go now.
        ``deltas``: only what is new (see the module docstring), always on the engine thread."""
        loop = None
        if not deltas:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        handler = _Handler(callback, loop, 0 if deltas else None)
        with self._ready:
            waiting = [output for _, output in self._queues.pop(request_id, ())]
            self._live -= len(waiting)
            if not waiting or not waiting[-1].is_finished():
                self._handlers[request_id] = handler
        for output in waiting:
            handler.hand(output)

    def unregister(self, request_id: str) -> None:
        with self._ready:
            self._handlers.pop(request_id, None)

    def put(self, request) -> None:
        """News of ``request`` (a `hf_qsa_cache.serving.requests.Request`: its tokens so far, its status)."""
        request_id = request.request_id
        with self._ready:
            handler = self._handlers.get(request_id)
            if handler is not None:
                if request.done:
                    del self._handlers[request_id]
            else:
                output = request.output()
                self._count += 1
                self._queues.setdefault(request_id, deque()).append((self._count, output))
                self._arrivals.append((request_id, self._count))
                self._live += 1
                self._ready.notify_all()
        if handler is None:
            return
        if handler.sent is not None:
            handler.hand_news(request_id, request.generated, request.logprobs, request.done, request.error)
        elif self._batch is not None:
            self._batch.append((handler.callback, handler.loop, request.output()))
        else:
            _call(handler.callback, handler.loop, request.output())

    @contextlib.contextmanager
    def batched(self):
        """Results put inside reach their handlers at the end, one hand-over per event loop (a step's results:
        one wake-up of a server's loop, not one per request)."""
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            by_loop: dict = {}
            for callback, loop, output in batch:
                if loop is None:
                    _call(callback, None, output)
                else:
                    by_loop.setdefault(loop, []).append((callback, output))
            for loop, calls in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_run_all, calls)
                except Exception as error:  # a closed loop: its consumers are gone, the engine goes on
                    logger.error("results of %d requests could not reach their loop: %s", len(calls), error)

    def get(self, request_id: str | None = None, timeout: float | None = None,
            alive: Callable[[], bool] = lambda: True) -> GenerationOutput | None:
        """The next result of ``request_id`` (of any request when None); None once ``timeout`` seconds pass,
        or at once when nothing waits and ``alive()`` says no more results will come."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while True:
                output = self._take(request_id)
                if output is not None:
                    return output
                if not alive():
                    return None
                wait = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
                if wait <= 0:
                    return None
                self._ready.wait(wait)

    def waiting(self, request_id: str | None = None) -> bool:
        with self._ready:
            return bool(self._queues.get(request_id)) if request_id is not None else bool(self._queues)

    def wake(self) -> None:
        """Readers look again (the engine stopped)."""
        with self._ready:
            self._ready.notify_all()

    def _take(self, request_id: str | None) -> GenerationOutput | None:
        if request_id is not None:
            queue = self._queues.get(request_id)
            if not queue:
                return None
            _, output = queue.popleft()
            self._live -= 1
            if not queue:
                del self._queues[request_id]
            # Its arrival entry goes stale; drop stale entries once they outnumber the live ones.
            if len(self._arrivals) > 64 + 2 * self._live:
                self._arrivals = deque(sorted(((rid, n) for rid, q in self._queues.items() for n, _ in q),
                                              key=lambda entry: entry[1]))
            return output
        while self._arrivals:
            rid, number = self._arrivals.popleft()
            queue = self._queues.get(rid)
            if queue and queue[0][0] == number:
                _, output = queue.popleft()
                self._live -= 1
                if not queue:
                    del self._queues[rid]
                return output
        return None


class _Handler:
    """A registered handler: its callback, the loop it runs on (None: the engine thread), and for a delta handler
    how many tokens it was handed so far (None: it takes whole results)."""

    __slots__ = ("callback", "loop", "sent")

    def __init__(self, callback: Callable, loop: asyncio.AbstractEventLoop | None, sent: int | None):
        self.callback, self.loop, self.sent = callback, loop, sent

    def hand(self, output: GenerationOutput) -> None:
        """A result that waited in the queue before the handler came."""
        if self.sent is None:
            _call(self.callback, self.loop, output)
        else:
            self.hand_news(output.request_id, output.generated_tokens, output.logprobs or [], output.is_finished(),
                           output.error)

    def hand_news(self, request_id: str, tokens: list[int], logprobs: list[float], finished: bool,
                  error: str | None) -> None:
        """The tokens (and log-probabilities, if kept) past those handed before: a request's lists only grow
        (a preempted request keeps its tokens)."""
        sent, self.sent = self.sent, len(tokens)
        try:
            self.callback(request_id, tokens[sent:], logprobs[sent:], finished, error)
        except Exception as error:  # a consumer's failure is its own: the engine goes on
            logger.error("the result handler of request %s failed: %s", request_id, error, exc_info=True)


def _run_all(calls: list[tuple[Callable, GenerationOutput]]) -> None:
    for callback, output in calls:
        _call(callback, None, output)


def _call(callback: Callable, loop: asyncio.AbstractEventLoop | None, output: GenerationOutput) -> None:
    try:
        if loop is None:
            callback(output)
        else:
            loop.call_soon_threadsafe(callback, output)
    except Exception as error:  # a consumer's failure is its own: the engine goes on
        logger.error("the result handler of request %s failed: %s", output.request_id, error, exc_info=True)
