"""The server's side of the continuous-batching manager, in the server's own process: one manager, one engine
request per choice, each delivered to its own handler on the server's event loop.

`Engine.submit` registers the request's handler before queueing it (a result can never arrive unclaimed),
`Engine.cancel` ends it and frees its row before the engine's next step, `Engine.stop` cancels what is left
and stops the manager. Every method is called on the event loop.

This is `hf-qsa-serve --engine-in-process`, and what an app built around a model already in memory uses. The
engine thread shares the interpreter lock with the event loop here; `hf-qsa-serve` runs its engine in a
process of its own instead (`engine_process.EngineProcess`, the same interface).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .inflight import InFlight, News

logger = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The manager's loop died: no request can be served (the server answers 503)."""


class Engine(InFlight):
    kind = "in-process"

    def __init__(self, model, generation_config=None, continuous_batching_config=None, cache_dtypes=None,
                 warmup: bool = True):
        InFlight.__init__(self)
        self.model = model
        self.warmup = warmup  # `ContinuousBatchingManager.warmup` before the first request (on a GPU)
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config
        self.cache_dtypes = cache_dtypes or {}  # kv_cache_dtype / index_cache_dtype (fp8 caches)
        self.manager = None
        self.stopping = False
        # The manager's thread leaves each request's new tokens here; the event loop takes them all at once.
        self.news = News(on_first=self._wake)
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Build and start the manager (once: later calls change nothing)."""
        if self.manager is not None:
            return
        self.manager = self.model.init_continuous_batching(generation_config=self.generation_config,
                                                           continuous_batching_config=self.continuous_batching_config,
                                                           **self.cache_dtypes)
        if self.warmup:
            self.manager.warmup()
        self.manager.start()

    # ------------------------------------------------------------------ state
    @property
    def fatal_error(self):
        return None if self.manager is None else self.manager.background_thread_status.fatal_error

    def check_alive(self) -> None:
        if self.stopping:
            raise EngineDead("the server is shutting down")
        if self.manager is None:
            raise EngineDead("the engine has not started")
        error = self.fatal_error
        if error is not None:
            raise EngineDead(f"the engine stopped: {error}")
        if not self.manager.is_running():
            raise EngineDead("the engine is not running")

    @property
    def max_len(self) -> int | None:
        """Tokens a request's row holds (prompt and generated) with the block pools to itself, once started."""
        return None if self.manager is None else int(self.manager.cache.longest_row())

    async def health(self) -> dict:
        """The engine's state for ``/health`` (a coroutine, as `EngineProcess.health`, which asks its process)."""
        if self.manager is None:
            state = {"running": False, "fatal_error": None}
        else:
            state = self.manager.health()
        state["engine"] = self.kind
        state["inflight"] = len(self.inflight)
        state.update({f"requests_{k}": v for k, v in self.counts.items()})
        if self.stopping:
            state["running"] = False
        return state

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], handler: Callable, *, max_new_tokens: int, eos_token_id, sampling,
               seed: int | None, logprobs: bool, streaming: bool, media: dict | None = None) -> str:
        """Queue one request; ``handler(result)`` gets its `inflight.Result`s on the event loop (every step's news
        when ``streaming``, else only the final one). A bad value raises `ValueError` and queues nothing."""
        self.check_alive()
        if self.loop is None:
            try:
                self.loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside a loop: results are handed out on the engine thread
                pass
        request_id = self.track(handler)
        self.manager.register_result_handler(request_id, self.news.put, deltas=True)
        try:
            self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens,
                                     streaming=streaming, eos_token_id=eos_token_id, sampling=sampling, seed=seed,
                                     logprobs=logprobs, **(media or {}))
        except BaseException:
            self.untrack(request_id)
            self.manager.remove_result_handler(request_id)
            raise
        self.queued()
        return request_id

    def _wake(self) -> None:
        """News came into an empty box (on the engine thread): the event loop takes it in one call."""
        loop = self.loop
        if loop is None:
            self._hand_out()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._hand_out)

    def _hand_out(self) -> None:
        for news in self.news.take():
            self.deliver(*news)

    def cancel(self, request_id: str) -> None:
        """End a request in flight (its row is freed before the engine's next step); its handler gets nothing
        more."""
        if self.cancelled(request_id) and self.manager is not None:
            self.manager.cancel_request(request_id)

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel every request still in flight and stop the manager."""
        self.stopping = True
        self.cancel_all()
        if self.manager is not None:
            self.manager.stop(block=True, timeout=timeout)
