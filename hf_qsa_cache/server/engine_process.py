"""The engine in a process of its own: the model and the continuous-batching manager run in a child process,
the server process keeps the HTTP work (routes, detokenizing, JSON, sends) and relays tokens.

Why: in one process the event loop (per streamed token: a handler, detokenizing, a JSON chunk, an ASGI send)
and the engine thread share the interpreter lock, and every engine step waits for it (on the GPU at 64 streams:
19 ms a step instead of 7.7 ms). Two processes have two interpreter locks.

`EngineProcess` has the interface of `engine.Engine`, which `app` uses. Its child is started with
multiprocessing's spawn (CUDA cannot be forked); it loads the checkpoint itself (`loading.load_model`), builds
the manager with the server's generation and continuous-batching configs, starts it and says it is ready (or
why it could not start: the server then exits with that message). From then on one duplex pipe carries:

* server to engine: ``("submit", id, prompt, options, media)``, ``("cancel", id)``, ``("health", token)``,
  ``("stop", timeout)``;
* engine to server: ``("results", [(id, new tokens, new logprobs, finished, error), ...])``, what each request
  with news got since the last message (about one message per engine step, several steps in one when the server
  lags; never a request's whole token list), ``("health", token, state)``, and ``("fatal", message)`` once the
  manager's loop died.

The server checks a request with the manager's own checks (`serving.requests`) before sending it, so a bad value
is still a `ValueError` from `submit` with nothing queued; a request the child refuses anyway fails alone. The
server reads the pipe on its event loop (``add_reader``: it never blocks on it), keeps each request's tokens and
calls the request's handler there with a `Result`.

A child that dies (a crash, a kill) is noticed at once (its sentinel, the pipe's end): every request in flight
fails with the reason, `check_alive` raises `EngineDead` (the routes answer 503) and ``/health`` reports it.
`stop` cancels what is in flight, asks the child to stop its manager, waits, and kills it if it must. The child
leaves on its own when the server process goes away (the pipe's end), and ignores SIGINT: a terminal's Ctrl-C
reaches the whole process group, and the server process stops the engine in order. Messages are pickled by plain
`pickle` (media tensors by value: no shared memory or file descriptors to hand over).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for

from ..serving.requests import check_eos, check_max_new_tokens, check_media, check_options, check_prompt
from .engine import EngineDead
from .inflight import InFlight, News

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT = 10.0  # seconds /health waits for the child's answer
STOP_GRACE = 10.0  # seconds beyond stop()'s timeout the child may take to exit before it is killed
SENDER_POLL = 0.5  # seconds between the child's looks at whether its manager's loop died


def send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn):
    return pickle.loads(conn.recv_bytes())


@dataclass
class EngineSettings:
    """What the child needs to build the engine (pickled to it when it is spawned)."""

    path: str
    device: str = "auto"
    dtype: str = "auto"
    generation_config: object = None
    continuous_batching_config: object = None
    cache_dtypes: dict = field(default_factory=dict)  # kv_cache_dtype / index_cache_dtype (fp8 caches)
    torch_threads: int | None = None
    log_level: int = logging.WARNING
    warmup: bool = True  # `ContinuousBatchingManager.warmup` before the engine says it is ready (on a GPU)


# ----------------------------------------------------------------------------- the server's side
class EngineProcess(InFlight):
    kind = "process"

    def __init__(self, settings: EngineSettings, config):
        """``config``: the checkpoint's config (the server's checks need its vocabulary and media inputs)."""
        from .loading import model_class

        cls = model_class(config)
        self.settings = settings
        self.vocab_size = config.get_text_config().vocab_size
        self.media_inputs = tuple(getattr(cls, "media_inputs", ()))
        self.model_name = cls.__name__
        self.process = None
        self.conn = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._fds: tuple[int, int] | None = None  # (pipe, sentinel) while the loop reads them
        self.max_len: int | None = None  # the cache's longest_row(), as the child reports it when ready
        self.fatal_error: str | None = None  # why the engine cannot serve (its process died, its loop failed)
        InFlight.__init__(self)
        self._health: dict[int, asyncio.Future] = {}  # /health questions waiting for the child's answer
        self._tokens = itertools.count()
        self.stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the child and wait until its engine runs (an `EngineDead` saying why it could not); on an event
        loop, also read its pipe there. Later calls only do what is left: the command starts the child before the
        server listens, the app's startup attaches it to the server's loop."""
        if self.process is None:
            self._spawn()
        if self.loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._attach(loop)

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        ours, theirs = context.Pipe(duplex=True)
        # daemon: multiprocessing ends it should this process exit without stop().
        self.process = context.Process(target=run_engine, args=(theirs, self.settings), name="hf-qsa-engine",
                                       daemon=True)
        self.process.start()
        theirs.close()  # the child's end lives in the child only: its exit reads as the pipe's end here
        self.conn = ours
        try:
            message = receive(ours)  # loading takes as long as it takes; a crash ends the pipe
        except (EOFError, OSError):
            self.process.join(5)
            message = ("failed", f"{_exit_reason(self.process.exitcode)} while loading the model")
        if message[0] != "ready":
            self.fatal_error = message[1]
            self._reap(kill_after=5)
            raise EngineDead(f"the engine could not start: {message[1]}")
        self.max_len = int(message[1]["max_len"])

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._fds = (self.conn.fileno(), self.process.sentinel)
        loop.add_reader(self._fds[0], self._read)
        loop.add_reader(self._fds[1], self._lost)  # readable once the child has exited

    def _detach(self) -> None:
        if self._fds is not None and self.loop is not None:
            for fd in self._fds:
                self.loop.remove_reader(fd)
        self._fds = None

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel every request still in flight, stop the child's manager and wait for the child to exit (killed
        after ``timeout`` + `STOP_GRACE` seconds)."""
        self.stopping = True
        self.cancel_all()
        self._detach()
        self._answer_health()
        if self.process is None:
            return
        try:
            self._send(("stop", timeout))
        except EngineDead:
            pass
        self._reap(kill_after=timeout + STOP_GRACE)

    def _reap(self, kill_after: float) -> None:
        """Wait for the child to exit, dropping what it still sends (its sends must not block on a full pipe);
        kill it after ``kill_after`` seconds."""
        deadline = time.monotonic() + kill_after
        while self.process.is_alive() and (left := deadline - time.monotonic()) > 0:
            if self.conn in wait_for([self.conn, self.process.sentinel], left):
                try:
                    self.conn.recv_bytes()  # nothing is waited for any more
                except (EOFError, OSError):  # the child closed its end: it is exiting
                    self.process.join(max(0.0, deadline - time.monotonic()))
                    break
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s: killed", kill_after)
            self.process.kill()
            self.process.join()
        self.conn.close()

    # ------------------------------------------------------------------ state
    def check_alive(self) -> None:
        if self.stopping:
            raise EngineDead("the server is shutting down")
        if self.process is None:
            raise EngineDead("the engine has not started")
        if self.fatal_error is not None:
            raise EngineDead(f"the engine stopped: {self.fatal_error}")
        if not self.process.is_alive():
            raise EngineDead(f"the engine stopped: {_exit_reason(self.process.exitcode)}")

    async def health(self) -> dict:
        """The child's manager's state (asked over the pipe), with the requests this side counted."""
        state = {"running": False, "fatal_error": self.fatal_error}
        try:
            self.check_alive()
            answering = self.loop is not None
        except EngineDead:
            answering = False
        if answering:
            token = next(self._tokens)
            future = self.loop.create_future()
            self._health[token] = future
            try:
                self._send(("health", token))
                answer = await asyncio.wait_for(future, HEALTH_TIMEOUT)
            except EngineDead:
                answer = None
            except asyncio.TimeoutError:
                answer = None
                state["fatal_error"] = f"the engine process did not answer within {HEALTH_TIMEOUT:g} s"
            finally:
                self._health.pop(token, None)
            if answer is not None:
                state.update(answer)
        if self.stopping or self.fatal_error is not None:
            state.update(running=False, fatal_error=self.fatal_error or state.get("fatal_error"))
        state["engine"] = self.kind
        state["engine_pid"] = None if self.process is None else self.process.pid
        state["inflight"] = len(self.inflight)
        state.update({f"requests_{k}": v for k, v in self.counts.items()})
        return state

    def _answer_health(self) -> None:
        """Questions still waiting get no answer (the child is gone or stopping)."""
        for future in self._health.values():
            if not future.done():
                future.set_result(None)
        self._health.clear()

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], handler: Callable, *, max_new_tokens: int, eos_token_id, sampling,
               seed: int | None, logprobs: bool, streaming: bool, media: dict | None = None) -> str:
        """Queue one request in the child; ``handler(result)`` gets its `Result`s on the event loop (every step's
        news when ``streaming``, else only the final one). A bad value raises `ValueError` and sends nothing."""
        self.check_alive()
        # The manager's own checks, here: the child's add_request should then never refuse it.
        media = check_media(dict(media or {}), self.media_inputs, self.model_name)
        prompt = check_prompt(prompt, self.vocab_size)
        check_max_new_tokens(max_new_tokens)
        check_eos(eos_token_id)
        check_options(sampling, seed, logprobs)
        options = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id, "sampling": sampling,
                   "seed": seed, "logprobs": logprobs, "streaming": streaming}
        request_id = self.track(handler)
        try:
            self._send(("submit", request_id, prompt, options, media))
        except BaseException:
            self.untrack(request_id)
            raise
        self.queued()
        return request_id

    def cancel(self, request_id: str) -> None:
        """End a request in flight (the child frees its row before its next step); its handler gets nothing
        more."""
        if self.cancelled(request_id):
            try:
                self._send(("cancel", request_id))
            except EngineDead:  # the child is gone: nothing runs
                pass

    def _send(self, message) -> None:
        try:
            send(self.conn, message)
        except (OSError, ValueError) as error:  # the child is gone (or the pipe closed): its sentinel says the rest
            raise EngineDead(f"the engine process is gone ({type(error).__name__}: {error})") from None

    # ------------------------------------------------------------------ the child's messages
    def _read(self) -> None:
        """Every message waiting on the pipe (the event loop calls this when the pipe is readable)."""
        try:
            while self.conn.poll():
                self.handle(receive(self.conn))
        except (EOFError, OSError):
            self._lost()

    def handle(self, message) -> None:
        kind = message[0]
        if kind == "results":
            for news in message[1]:
                self.deliver(*news)
        elif kind == "health":
            future = self._health.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "fatal":
            self.fatal_error = message[1]
            logger.error("the engine stopped: %s", message[1])

    def _lost(self) -> None:
        """The child is gone (its sentinel fired or its pipe ended): every request in flight fails."""
        self._detach()
        if self.stopping:
            return
        if self.process.is_alive():
            self.process.join(1)  # the pipe ended as it exits: its exit code tells why
        reason = _exit_reason(self.process.exitcode)
        self.fatal_error = f"{reason}" if self.fatal_error is None else f"{self.fatal_error}; {reason}"
        logger.error("the engine stopped: %s; failing %d request(s) in flight", reason, len(self.inflight))
        for request_id in list(self.inflight):
            self.deliver(request_id, [], [], True, self.fatal_error)
        self._answer_health()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "the engine process closed its pipe"
    if code < 0:
        try:
            return f"the engine process was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"the engine process exited with code {code}"


# ----------------------------------------------------------------------------- the engine's side (the child)
class Outbox:
    """The child's side of the pipe. The engine thread puts each request's news here (`put`, the manager's delta
    handler: only its tokens since the request's previous news); a sender thread takes everything waiting and
    writes it as one message, so the engine thread never waits on the pipe. What waits for one request is merged
    into one delta."""

    def __init__(self, conn):
        self.conn = conn
        self.ready = threading.Condition()
        self.news = News(on_first=self._wake)
        self.put = self.news.put  # the manager's delta handler (engine thread): a request's news since its last
        self.messages: list = []  # other messages, in order
        self.closed = False

    def _wake(self) -> None:
        with self.ready:
            self.ready.notify()

    def post(self, message) -> None:
        with self.ready:
            self.messages.append(message)
            self.ready.notify()

    def take(self, timeout: float | None = None) -> list:
        """What is to be sent now (waiting up to ``timeout`` seconds for something): the results first."""
        with self.ready:
            if not (self.news.news or self.messages or self.closed):
                self.ready.wait(timeout)
            out = []
            results = self.news.take()
            if results:
                out.append(("results", results))
            out += self.messages
            self.messages = []
            return out

    def close(self) -> None:
        """The sender stops (what waits is dropped: the server no longer reads)."""
        with self.ready:
            self.closed = True
            self.ready.notify()

    def run(self, manager) -> None:
        """The sender thread."""
        told_fatal = False
        while not self.closed:
            messages = self.take(SENDER_POLL)
            if not told_fatal and manager.fatal_error is not None:
                told_fatal = True
                fatal = manager.fatal_error
                messages.append(("fatal", f"{type(fatal).__name__}: {fatal}"))
            if self.closed:
                return
            try:
                for message in messages:
                    send(self.conn, message)
            except OSError:  # the server process is gone
                return


def run_engine(conn, settings: EngineSettings) -> None:
    """The child process: build the engine, say it is ready, serve the server's messages until it says stop or
    goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us in order
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import torch

        from .loading import load_model

        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        _thread_lock_for_progress_bars()
        model = load_model(settings.path, settings.device, settings.dtype)
        manager = model.init_continuous_batching(generation_config=settings.generation_config,
                                                 continuous_batching_config=settings.continuous_batching_config,
                                                 **settings.cache_dtypes)
        if settings.warmup:
            manager.warmup()
        manager.start()
    except Exception as error:
        logger.error("the engine could not start: %s", error, exc_info=True)
        try:
            send(conn, ("failed", f"{type(error).__name__}: {error}"))
        except OSError:
            pass
        _exit(1)
    send(conn, ("ready", {"max_len": int(manager.cache.longest_row())}))
    outbox = Outbox(conn)
    threading.Thread(target=outbox.run, args=(manager,), name="hf-qsa-engine-outbox", daemon=True).start()
    stop_timeout = 2.0
    try:
        while True:
            try:
                message = receive(conn)
            except (EOFError, OSError):  # the server process is gone: nobody waits for any result
                break
            if message[0] == "stop":
                stop_timeout = message[1]
                break
            try:
                _serve(manager, outbox, message)
            except Exception as error:  # one bad message must not end the engine
                logger.error("the engine process could not serve %r: %s", message[0], error, exc_info=True)
    finally:
        outbox.close()
        manager.stop(block=True, timeout=stop_timeout, hard_stop=True)
    _exit(0)


def _exit(code: int) -> None:
    """Exit now: the interpreter's own teardown (torch's and transformers' modules) takes most of a second, and
    the server waits for this exit. Nothing is left to write but the logs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _thread_lock_for_progress_bars() -> None:
    """tqdm (the loading bar) locks with a multiprocessing semaphore by default, which `os._exit` leaves to the
    resource tracker (a "leaked semaphore" warning in the server's log); this process needs a thread lock only."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.set_lock(threading.RLock())


def _serve(manager, outbox: Outbox, message) -> None:
    kind = message[0]
    if kind == "submit":
        _, request_id, prompt, options, media = message
        manager.register_result_handler(request_id, outbox.put, deltas=True)
        try:
            manager.add_request(prompt, request_id=request_id, **options, **(media or {}))
        except Exception as error:  # the server checked it already; should it still be refused, it fails alone
            manager.remove_result_handler(request_id)
            outbox.put(request_id, [], [], True, f"{type(error).__name__}: {error}")
    elif kind == "cancel":
        manager.cancel_request(message[1])
    elif kind == "health":
        outbox.post(("health", message[1], manager.health()))
