"""The server's book of the requests it has in flight, shared by both engines (`engine.Engine` in the server's
process, `engine_process.EngineProcess` with the manager in a child): ids, handlers, each request's tokens so
far, counts; and `News`, where the engine thread leaves each request's new tokens for the other side to take.

A request's news arrives as deltas (the manager's ``register_result_handler(..., deltas=True)``: only the tokens
since its previous news, no `GenerationOutput` built per token); the book appends them to the request's lists and
hands its handler a `Result` on the server's event loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Result:
    """One request's news as its handler gets it: the names `text.Choice.update` reads of transformers'
    `GenerationOutput`. ``generated_tokens`` and ``logprobs`` are the request's own lists, not copies (a copy per
    step would cost the event loop every token so far): they only grow, so a handler that reads them later sees
    the same tokens and perhaps the next ones."""

    __slots__ = ("request_id", "generated_tokens", "logprobs", "error", "finished")

    def __init__(self, request_id: str, generated_tokens: list[int], logprobs: list[float], error: str | None,
                 finished: bool):
        self.request_id, self.generated_tokens, self.logprobs = request_id, generated_tokens, logprobs
        self.error, self.finished = error, finished

    def is_finished(self) -> bool:
        """Done, by eos, length or failure (as `GenerationOutput.is_finished`)."""
        return self.finished


class _Request:
    """A request in flight: its handler and its tokens (and log-probabilities) so far."""

    __slots__ = ("handler", "tokens", "logprobs")

    def __init__(self, handler: Callable):
        self.handler, self.tokens, self.logprobs = handler, [], []


class InFlight:
    """Requests from their submission to their final result or their cancel (event-loop side only)."""

    def __init__(self):
        self.inflight: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.counts = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0}

    def track(self, handler: Callable) -> str:
        """A new request id, in flight with ``handler`` (`untrack` it if it cannot be queued after all)."""
        request_id = f"{self._prefix}-{next(self._ids)}"
        self.inflight[request_id] = _Request(handler)
        return request_id

    def queued(self) -> None:
        self.counts["submitted"] += 1

    def untrack(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)

    def cancelled(self, request_id: str) -> bool:
        """Whether ``request_id`` was in flight (it is not any more: its handler gets nothing more)."""
        if self.inflight.pop(request_id, None) is None:
            return False
        self.counts["cancelled"] += 1
        return True

    def cancel_all(self, why: str = "cancelled: the server's requests were reset") -> int:
        """Cancel every request in flight (``/reset``, shutdown). Their clients still wait, so each handler gets a
        last result, failed with ``why``, after its request is cancelled (a cancel alone tells a handler nothing:
        the answer or stream waiting on it would never end)."""
        requests = list(self.inflight.items())
        for request_id, request in requests:
            self.cancel(request_id)
            try:
                request.handler(Result(request_id, request.tokens, request.logprobs, why, True))
            except Exception as failure:  # a handler's failure is its own: the others go on
                logger.error("the result handler of request %s failed: %s", request_id, failure, exc_info=True)
        return len(requests)

    def cancel(self, request_id: str) -> None:  # each engine also tells its manager
        self.cancelled(request_id)

    def deliver(self, request_id: str, tokens: list[int], logprobs: list[float], finished: bool,
                error: str | None) -> None:
        """A request's news (its tokens since its previous news) to its handler, as a `Result`."""
        request = self.inflight.get(request_id)
        if request is None:
            return  # cancelled: its handler gets nothing more
        request.tokens += tokens
        request.logprobs += logprobs
        if finished:
            del self.inflight[request_id]
            self.counts["finished" if error is None else "failed"] += 1
        try:
            request.handler(Result(request_id, request.tokens, request.logprobs, error, finished))
        except Exception as failure:  # a handler's failure is its own: the others go on
            logger.error("the result handler of request %s failed: %s", request_id, failure, exc_info=True)


class News:
    """Where the engine thread leaves each request's news (`put`, the manager's delta handler) until the other
    side takes all of it at once (`take`). What waits for one request is merged into one delta. ``on_first``:
    called (on the engine thread) when news arrives in an empty box, to wake the taker."""

    def __init__(self, on_first: Callable[[], None] | None = None):
        self.lock = threading.Lock()
        self.news: dict[str, list] = {}  # request id -> [new tokens, new logprobs, finished, error]
        self.on_first = on_first

    def put(self, request_id: str, tokens: list[int], logprobs: list[float], finished: bool,
            error: str | None) -> None:
        with self.lock:
            first = not self.news
            news = self.news.get(request_id)
            if news is None:
                self.news[request_id] = [tokens, logprobs, finished, error]
            else:  # its previous delta is not taken yet: one delta for both
                news[0] += tokens
                news[1] += logprobs
                news[2], news[3] = finished, error
        if first and self.on_first is not None:
            self.on_first()

    def take(self) -> list[tuple]:
        """Every request's news waiting: ``(request_id, tokens, logprobs, finished, error)`` each."""
        with self.lock:
            news, self.news = self.news, {}
        return [(request_id, *n) for request_id, n in news.items()]
