"""The background loop of continuous batching and transformers' manager API around it.

One thread runs the loop: take new requests and cancellations, admit waiting requests into free rows (while
the block pools hold their first step), run a prefill step and a decode step (`scheduler`), each after
making sure the pools hold exactly what it feeds (preempting the latest admitted request if not), and hand
each result to its request's own delivery (`delivery`). Everything a request holds is given back the moment
it finishes, is cancelled or fails.

Failures: a step that fails is taken back (its rows' state, which the engine's cache keeps no copy of, is
released with them): the requests in that step go back to the queue with their tokens so far, to be fed again
(a transient fault costs them time, not their result; their tokens are the same: a draw depends on the seed
and the token's index only); a request in a second failed step fails with the error. The others go on. A
fault in the loop's own bookkeeping (admission, row moves, room checks) sends every running request back to
the queue (its tokens so far are kept and fed again) and the loop goes on; only when that happens three
iterations in a row do the requests then running fail with the error.
The loop ends for good (`background_thread_status.fatal_error`) only if it cannot even reset its cache.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from ..cache import QSAPagedCache
from ..prefix_cache import SNAPSHOT_GAP_TOKENS
from .delivery import Delivery
from .requests import Request, check_eos, check_max_new_tokens, check_media, check_options, check_prompt, copy_ids
from .runner import ModelRunner
from .sampling import Sampling, request_seed
from .scheduler import Scheduler
from .settings import vocab_size, warn_unused
from .warmup import warm_up, workload_shape

logger = logging.getLogger(__name__)

DEFAULT_ROWS = 32  # rows (requests in flight) without max_requests_per_batch
DEFAULT_BATCH_TOKENS = 2048  # prefill tokens per step without max_batch_tokens
DEFAULT_TOKENS_PER_ROW = 4096  # pool sizing without num_blocks or workload hints: rows x this many tokens
# Times a request whose step failed is fed again before it fails. One whose steps failed beside other requests is
# then isolated instead (fed alone up to where its step failed: `Request.alone_until`), at most MAX_ISOLATIONS
# times: only a step that fed it alone, or a fault that follows it through every isolation, fails it.
STEP_RETRIES = 1
MAX_ISOLATIONS = 2
HOST_FAULTS_IN_A_ROW = 3  # bookkeeping faults in consecutive iterations before the running requests fail


class LoopStatus:
    """What transformers' server reads of the loop (``background_thread_status.fatal_error``)."""

    def __init__(self):
        self.fatal_error: BaseException | None = None


class ContinuousBatchingManager:
    def __init__(self, model, generation_config: GenerationConfig | None = None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, workload_hints=None, *,
                 kv_cache_dtype: torch.dtype | None = None, index_cache_dtype: torch.dtype | None = None,
                 grouped_steps: bool = False, mixed_steps: bool = False,
                 prefix_snapshot_gap: int = SNAPSHOT_GAP_TOKENS):
        """``kv_cache_dtype`` / ``index_cache_dtype``: the cache's fp8 switches (`QSAPagedCache`; None: the
        model's dtype), which transformers' `ContinuousBatchingConfig` has no field for. ``grouped_steps``: every
        iteration with prefilling rows one eager step of their chunks and the decoding rows' tokens
        (`hf_qsa_cache.grouped`); ``mixed_steps``: that step only where it replays a recorded graph
        (`ModelRunner.mixed`); both off by default: a prefill step, then a decode step (docs/serving.md says why).
        ``prefix_snapshot_gap``: `QSAPagedCache`'s (`Scheduler.plan_prefix_stop`)."""
        self.model = model
        for name, value in (("grouped_steps", grouped_steps), ("mixed_steps", mixed_steps)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.grouped_steps = grouped_steps
        self.mixed_steps = mixed_steps
        self._chunks: list[int] = []  # the next grouped step's prefill chunks (rows 0, 1, ...)
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        config = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
        self.continuous_batching_config = config
        warn_unused(config, self.generation_config)
        gen = self.generation_config
        self.num_return_sequences = gen.num_return_sequences or 1
        self.sampling = Sampling.from_generation_config(gen)  # a request's sampling unless it brings its own
        self.seed = config.seed
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        rows = config.max_requests_per_batch or DEFAULT_ROWS
        max_len = getattr(text_config, "max_position_embeddings", None) or 32768
        per_row = DEFAULT_TOKENS_PER_ROW
        if workload_hints is not None and workload_hints.max_prompt_length and workload_hints.max_generated_length:
            per_row = workload_hints.max_prompt_length + workload_hints.max_generated_length
            max_len = max(max_len, per_row)
        # Prompt lookup inside the loop (GenerationConfig.prompt_lookup_num_tokens, as generate() reads it): a
        # greedy decoding row feeds up to that many drafts after its token, verified in the same step.
        self.lookup_drafts = int(gen.prompt_lookup_num_tokens or 0)
        self.lookup_ngram = int(getattr(gen, "max_matching_ngram_size", None) or 2)
        self._drafts: list[list[int]] = []  # the next decode step's drafts, one list per row
        block_size = config.block_size or config.page_size
        num_blocks = config.num_blocks or rows * -(-min(per_row, max_len) // block_size) + 1
        # Prefix caching across requests and turns, unless allow_block_sharing=False (docs/prefix_caching.md).
        # No undo copies: a failed step fails the requests it carried and their rows are released (`_run`).
        self.cache = QSAPagedCache(model.config, max_batch_size=rows, max_cache_len=max_len, block_size=block_size,
                                   num_blocks=num_blocks, num_speculative_tokens=self.lookup_drafts,
                                   kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype,
                                   step_undo=False, prefix_caching=bool(getattr(config, "allow_block_sharing", True)),
                                   prefix_snapshot_gap=prefix_snapshot_gap)
        self.runner = ModelRunner(model, self.cache, return_logprobs=bool(config.return_logprobs))
        self.scheduler = Scheduler(rows, config.max_batch_tokens or DEFAULT_BATCH_TOKENS,
                                   prefill_first=config.scheduler_type == "prefill_first",
                                   unit=self.cache.prefix.unit if self.cache.prefix is not None else None,
                                   replays=self.runner.replays_prefill,
                                   snapshot_gap=self.cache.prefix.snapshot_gap if self.cache.prefix is not None else 0)
        self.runner.plan_prefix_stop = self.scheduler.plan_prefix_stop  # (prefix caching: the scheduler plans stops)
        if config.scheduler_type not in ("fifo", "prefill_first"):
            raise ValueError(f"scheduler_type must be 'fifo' or 'prefill_first', got {config.scheduler_type!r}")
        self.input_queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size or 0)
        self.cancel_queue: queue.Queue = queue.Queue()
        self.delivery = Delivery()  # each request's results: its handler or its own queue
        self._wake = threading.Event()
        self._stop: str | None = None  # "flush" (finish what was submitted) or "hard" (fail it)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # add_request against stop(): a request is queued only while accepted
        self._accepting = True  # until stop(); again at start()
        self._counter = 0
        self._in_flight: set[str] = set()  # ids submitted and not yet finished (an id is not reused meanwhile)
        self.background_thread_status = LoopStatus()
        self._host_faults = 0  # bookkeeping faults in consecutive iterations
        # What the loop did (for tests, benchmarks and curious users).
        # ``prefill_tokens``: prompt (and recomputed) tokens prefill and grouped steps fed; ``pad_tokens``: the pads
        # that padded their rows (and verify steps' rows with fewer drafts) to one length; ``prefill_s`` /
        # ``decode_s`` / ``grouped_s``: the wall seconds of those steps (forward and sampling: the loop waits for
        # each); the rest of the loop's time is its own host work and idle waits.
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "preemptions": 0, "failed_steps": 0, "most_rows": 0,
                      "host_faults": 0, "drafted_tokens": 0, "accepted_tokens": 0, "prefill_tokens": 0,
                      "pad_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0, "retried_requests": 0,
                      "isolated_requests": 0, "grouped_steps": 0, "grouped_s": 0.0,
                      "mixed_steps": 0, "mixed_s": 0.0}
        self.warmed_up = False
        self.workload_hints = workload_hints  # (the warm-up's longest row and its rows)
        self._warned_unbounded = False  # a request bounded only by its row's room was reported (once)
        self._graphs_before = getattr(model, "use_cuda_graphs", True)

    # ------------------------------------------------------------------ lifecycle
    @property
    def fatal_error(self) -> BaseException | None:
        return self.background_thread_status.fatal_error

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def warmup(self, run: bool | None = None) -> None:
        """Pay before the first request what a workload's first steps would pay for (`hf_qsa_cache.serving.warmup`:
        the prefill kernels compiled and tuned for a whole chunk, a CUDA graph of the decode step for every row-count
        bucket at every reach up to that of the longest announced row), by dummy requests through
        the loop. Call it before `start()`; it leaves no row, no cached prefix (it drops those cached before) and
        the stats as they were. ``run``: None warms up a model on a CUDA device only (on the CPU nothing is compiled
        or recorded)."""
        if self.is_running():
            raise RuntimeError("warmup() runs before start(): the continuous batching loop is running")
        if run is None:
            run = self.model.device.type == "cuda"
        if run:
            rows, longest = workload_shape(self.workload_hints, self.scheduler)
            started, stats = time.perf_counter(), dict(self.stats)
            try:
                warm_up(self, rows, longest, vocab_size(self.model))
            finally:
                self.stats.clear()  # (the dummy requests leave no count)
                self.stats.update(stats)
                with self._lock:  # (requests added before start() wait for it, as on a manager that never ran)
                    self._accepting = True
            logger.info("warmed up in %.1f s (%d rows, rows of up to %d tokens)", time.perf_counter() - started, rows,
                        longest)
        self.warmed_up = True

    def start(self) -> None:
        if self._thread is not None and self._stop is not None:  # a stop(block=False) still draining: it ends first
            self.join()
        if self.is_running():
            logger.warning("the continuous batching loop is already running")
            return
        with self._lock:
            self._stop = None
            self._accepting = True
        self.background_thread_status.fatal_error = None
        self.runner.start_session()
        if self.continuous_batching_config.use_cuda_graph is not None:
            self.model.use_cuda_graphs = bool(self.continuous_batching_config.use_cuda_graph)
        self._thread = threading.Thread(target=self._loop, name="hf-qsa-continuous-batching", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the loop: by default once every submitted request is done; ``hard_stop`` fails those left."""
        with self._lock:  # no request is accepted from here on (add_request raises) until start()
            self._accepting = False
            if self._thread is None:
                return
            self._stop = "hard" if hard_stop else "flush"
        self._wake.set()
        if block:
            self.join(timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self

    def join(self, timeout: float | None = None) -> None:
        if self._thread is None:
            return
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self._thread = None
            self.model.use_cuda_graphs = self._graphs_before

    def destroy(self) -> None:
        """Stop the loop and empty the cache, cached prefixes and their snapshots included."""
        if self.is_running():
            self.stop(block=True)
        self.cache.reset(prefixes=True)

    def health(self) -> dict:
        """The engine's state, for a server's health route."""
        fatal = self.background_thread_status.fatal_error
        return {"running": self.is_running(), "accepting": self._accepting and fatal is None,
                "fatal_error": None if fatal is None else f"{type(fatal).__name__}: {fatal}",
                "rows_in_use": len(self.scheduler.rows),
                "waiting": len(self.scheduler.waiting) + self.input_queue.qsize(),
                # (idle cached blocks count as free)
                "free_blocks": {name: table.available() for name, table in self.cache.tables.items()},
                **self.stats}

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None, *,
                    sampling: Sampling | None = None, seed: int | None = None, logprobs: bool = False,
                    **kwargs) -> str:
        """Queue a request; returns its id. Children ``{id}__child#{i}`` carry the extra return sequences.

        ``sampling`` (a `Sampling`) overrides the generation config's for this request; ``seed`` gives it its own
        random stream (its copies draw from ``seed + 1``, ...), else it is seeded from the engine's seed and its id,
        so its tokens do not depend on what else was submitted; ``logprobs`` returns its tokens'
        log-probabilities. A multimodal model (one with ``media_inputs``, e.g.
        `Qwen4ExpForConditionalGeneration`) takes the request's media as keyword arguments, as its forward names
        them (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ...), for this one prompt.

        Every argument is checked before anything is queued (a `ValueError` naming it and its value); an id
        still in flight, or whose earlier request's results wait unread, is refused; after `stop()` (until
        `start()`) or once the loop died, a `RuntimeError`."""
        media = check_media(kwargs, getattr(self.model, "media_inputs", ()), type(self.model).__name__)
        prompt = check_prompt(input_ids, vocab_size(self.model))
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        if max_new_tokens is None:
            max_new_tokens = check_max_new_tokens(self.generation_config.max_new_tokens,
                                                  "GenerationConfig.max_new_tokens")
        eos = check_eos(eos_token_id if eos_token_id is not None else self.generation_config.eos_token_id)
        check_options(sampling, seed, logprobs)
        if max_new_tokens is None:  # as transformers: no limit but eos, here the row's capacity
            max_new_tokens = max(1, self.cache.max_cache_len - len(prompt) + 1)
            if not eos and not self._warned_unbounded:
                self._warned_unbounded = True
                logger.warning(
                    "a request has neither max_new_tokens nor an eos token: it generates until its cache row is "
                    "full (max_cache_len=%d, %d new tokens for a prompt of %d); pass max_new_tokens to bound it",
                    self.cache.max_cache_len, max_new_tokens, len(prompt))
        with self._lock:
            if not self._accepting or self.background_thread_status.fatal_error is not None:
                fatal = self.background_thread_status.fatal_error
                raise RuntimeError("the continuous batching loop " + (
                    f"failed ({type(fatal).__name__}: {fatal})" if fatal is not None else "was stopped")
                    + ": call start() before adding requests")
            if request_id is None:
                while f"req_{self._counter}" in self._in_flight:
                    self._counter += 1
                request_id = f"req_{self._counter}"
                self._counter += 1
            ids = copy_ids(request_id, self.num_return_sequences)
            taken = [rid for rid in ids if rid in self._in_flight]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is still in flight: ids must be unique")
            unread = [rid for rid in ids if self.delivery.waiting(rid)]
            if unread:  # they would reach this request's consumer as its own
                raise ValueError(f"request_id {unread[0]!r} has unread results of an earlier request with that id: "
                                 "take them (get_result) or use another id")
            self._in_flight.update(ids)
            requests = []
            for k, rid in enumerate(ids):  # (the request itself last: its own seed, its copies the next ones)
                own_seed = (seed + (k + 1) % len(ids) if seed is not None
                            else secrets.randbits(63) if self.seed is None else request_seed(self.seed, rid))
                requests.append(Request(rid, prompt, max_new_tokens, eos, sampling or self.sampling, seed=own_seed,
                                        want_logprobs=logprobs, streaming=streaming,
                                        record_timestamps=record_timestamps, media=media))
            for k, request in enumerate(requests):
                try:  # a bounded queue (max_queue_size) waits for room, as transformers' does
                    self.input_queue.put(request, block=True, timeout=10)
                except queue.Full:
                    self._in_flight.difference_update(ids[k:])
                    raise RuntimeError(f"the request queue stayed full for 10 s (max_queue_size="
                                       f"{self.input_queue.maxsize}); request {request.request_id!r} was not queued")
        self._wake.set()
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **kwargs) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """End the request (waiting or running): status FAILED, error "cancelled"; its row and blocks go back
        before the next step. Unknown or finished ids are ignored."""
        self.cancel_queue.put(request_id)
        self._wake.set()

    def register_result_handler(self, request_id: str, callback, deltas: bool = False) -> None:
        """Every result of ``request_id`` (each token's when streaming, else the final one) goes to
        ``callback(GenerationOutput)``, not to `get_result`: on the asyncio loop this is called from (via
        ``call_soon_threadsafe``), or on the engine thread when called outside a loop. May come before
        `add_request`; dropped after the final result. ``deltas=True`` (not in transformers): ``callback(request_id,
        tokens, logprobs, finished, error)`` with only the tokens (and log-probabilities) since its previous call,
        always on the engine thread, and no `GenerationOutput` built (`hf_qsa_cache.serving.delivery`)."""
        self.delivery.register(request_id, callback, deltas)

    def remove_result_handler(self, request_id: str) -> None:
        """Drop the handler of a request that was never queued (its `add_request` raised)."""
        self.delivery.unregister(request_id)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next result (a finished request, or a streaming request's progress) of ``request_id``, or of any
        request when None; None after ``timeout`` seconds, or at once when the loop is not running and none waits.
        A result of one request is never handed to, or dropped for, a reader of another."""
        return self.delivery.get(request_id, timeout, alive=self.is_running)

    def __iter__(self):
        while self.is_running() or self.delivery.waiting():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str):
        while self.is_running() or self.delivery.waiting(request_id):
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:
            with torch.no_grad():
                while True:
                    if self._stop == "hard":
                        self._fail_all("the continuous batching loop was stopped (hard_stop)")
                        break
                    try:
                        self._intake()
                        if not self.scheduler.has_work:
                            if self._stop == "flush" and self.input_queue.empty():
                                break
                            self._wake.wait(timeout=0.05)
                            self._wake.clear()
                            continue
                        self._iteration()
                        self._host_faults = 0
                    except Exception as error:  # the loop's own bookkeeping failed: start its rows over
                        self._recover(error)
        except BaseException as error:  # the loop cannot go on: every request gets the error
            self.background_thread_status.fatal_error = error
            logger.error("continuous batching loop failed: %s", error, exc_info=True)
            self._fail_all(f"the continuous batching loop failed: {type(error).__name__}: {error}")
        finally:
            try:
                self.runner.release_all()
            finally:
                self.delivery.wake()

    def _recover(self, error: Exception) -> None:
        """A fault outside the model's steps (admission, row moves, room checks, result hand-out): the rows' host
        state and the cache may disagree, so every running request goes back to the queue (oldest first, its
        tokens so far kept: they are fed again) and the cache is reset. Three such iterations in a row fail the
        requests then running. A failure here ends the loop."""
        logger.error("continuous batching bookkeeping failed: %s", error, exc_info=True)
        self.stats["host_faults"] += 1
        self._host_faults += 1
        running = sorted(self.scheduler.rows, key=lambda r: r.admitted)
        if self._host_faults >= HOST_FAULTS_IN_A_ROW:
            self._host_faults = 0
            for request in running:
                self._end(request, RequestStatus.FAILED, f"{type(error).__name__}: {error}")
        else:
            for request in reversed(running):  # the latest first: the oldest ends at the queue's front
                self.scheduler.preempt(request)
        self.runner.release_all()

    def _intake(self) -> None:
        while not self.input_queue.empty():  # (this thread is the only reader: no raised Empty per iteration)
            self.scheduler.submit(self.input_queue.get_nowait())
        while not self.cancel_queue.empty():
            request_id = self.cancel_queue.get_nowait()
            for request in [*self.scheduler.rows, *self.scheduler.waiting]:
                if request.request_id == request_id:
                    self._end(request, RequestStatus.FAILED, "cancelled")

    def _iteration(self) -> None:
        scheduler, runner = self.scheduler, self.runner
        if scheduler.isolated_waits():  # the rows make way (they are fed again after it)
            for request in sorted(scheduler.rows, key=lambda r: r.admitted, reverse=True):
                scheduler.preempt(request)
                self.stats["preemptions"] += 1
        runner.place(scheduler.rows)  # rows of requests that ended (cancelled) go back before admission
        for request in scheduler.admit(self._fits_first_step):
            if request.started < 0:
                request.started = time.perf_counter()
            need, longest, most = request.most_held, self.cache.longest_row(), self.cache.max_cache_len
            if need > longest:  # (failed before its first step, not once it ran out of room)
                where = (f"the cache holds max_cache_len={most}" if longest == most else
                         f"the request cannot fit even alone: the block pools hold at most {longest} tokens a row")
                self._end(request, RequestStatus.FAILED, f"prompt of {len(request.prompt)} tokens + max_new_tokens="
                                                         f"{request.max_new_tokens} needs {need} slots, {where}")
                continue
            try:  # a prompt's media are encoded once, before its first step (a bad one fails that request alone)
                runner.encode(request)
            except Exception as error:
                logger.error("encoding the media of request %s failed: %s", request.request_id, error, exc_info=True)
                self._end(request, RequestStatus.FAILED, f"{type(error).__name__}: {error}")
        scheduler.order()  # requests that failed here leave their rows to others, not a shift
        runner.place(scheduler.rows)
        if runner.retry_restores():  # rows that have fed nothing start from what was cached meanwhile
            scheduler.order()
            runner.place(scheduler.rows)
        self._steps()

    def _steps(self) -> None:
        """The iteration's steps over the placed rows: one grouped or mixed step where the options allow it, else a
        prefill step (and its short rest) and a decode step, in the order `Scheduler.prefill_goes_first` says."""
        scheduler, runner = self.scheduler, self.runner
        if self.grouped_steps and scheduler.prefilling() and runner.can_group():
            growth = self._make_room(self._grouped_growth)
            if growth:  # the prefill chunks and every other row's token (and drafts), in one step without pads
                chunks, drafts = self._chunks, self._drafts
                self.stats["grouped_steps"] += 1
                self.stats["prefill_tokens"] += sum(chunks)
                self.stats["most_rows"] = max(self.stats["most_rows"], len(runner.rows))
                self._count_drafts(drafts)
                fed = [r for r, n in zip(runner.rows, growth) if n]  # (rows still prefilling without a chunk wait)
                self._run(fed, lambda: runner.grouped(chunks, drafts), "grouped_s")
                return
        if self.mixed_steps and scheduler.prefilling() and self._make_room(self._mixed_growth):
            chunks = self._chunks  # the prefill chunks and every decoding row's token, in one recorded step
            self.stats["mixed_steps"] += 1
            self.stats["prefill_tokens"] += sum(chunks)
            self.stats["pad_tokens"] += len(chunks) * max(chunks) - sum(chunks)
            self.stats["most_rows"] = max(self.stats["most_rows"], len(runner.rows))
            self._run(runner.rows, lambda: runner.mixed(chunks), "mixed_s")
            return
        first = scheduler.prefill_goes_first()
        for kind in ("prefill", "decode") if first else ("decode", "prefill"):
            if kind == "prefill":
                self._prefill_step()
                # The short rest that step left a row (its tail after its snapshot point) follows at once.
                if first and not scheduler.prefill_first and scheduler.prefill_goes_first(then_ends=False):
                    self._prefill_step()
            elif self._make_room(self._decode_growth):
                self.stats["decode_steps"] += 1
                self.stats["most_rows"] = max(self.stats["most_rows"], len(runner.rows))
                drafts = self._drafts
                self._count_drafts(drafts)
                self._run(runner.rows, lambda: runner.decode(drafts), "decode_s")

    def _prefill_step(self) -> None:
        # The chunks are planned once the pools hold exactly them (a preemption plans them again).
        chunks = self._make_room(self.scheduler.prefill_chunks)
        if chunks:
            self.stats["prefill_steps"] += 1
            self.stats["prefill_tokens"] += sum(chunks)
            self.stats["pad_tokens"] += len(chunks) * max(chunks) - sum(chunks)
            self._run(self.runner.rows[: len(chunks)], lambda: self.runner.prefill(chunks), "prefill_s")

    def _grouped_growth(self) -> list[int]:
        """A grouped step feeds the first prefilling rows their chunks (`Scheduler.prefill_chunks`), every decoding
        row one token and, greedy, its drafts (prompt lookup); the other prefilling rows nothing
        (`ModelRunner.grouped`). None runs without a chunk to feed."""
        self._chunks = self.scheduler.prefill_chunks(packed=True)
        if not self._chunks:
            return []
        rest = self.scheduler.rows[len(self._chunks):]
        self._drafts = [r.drafts(self.lookup_drafts, self.lookup_ngram) for r in rest] if self.lookup_drafts else []
        drafts = self._drafts or [[]] * len(rest)
        return self._chunks + [0 if r.in_prefill else 1 + len(d) for r, d in zip(rest, drafts)]

    def _mixed_growth(self) -> list[int]:
        """A mixed step (`ModelRunner.mixed`) feeds the prefilling rows their chunks (`Scheduler.prefill_chunks`) and
        every decoding row one token, where it replays a recorded step; None runs otherwise (nor with prompt
        lookup's drafts): the iteration then takes separate steps."""
        chunks = self.scheduler.prefill_chunks()
        if self.lookup_drafts or not self.runner.replays_mixed(chunks):
            return []
        self._chunks = chunks
        return chunks + [1] * (len(self.scheduler.rows) - len(chunks))

    def _count_drafts(self, drafts: list[list[int]]) -> None:
        self.stats["drafted_tokens"] += sum(map(len, drafts))
        if any(drafts):  # a verify step: rows with fewer drafts are padded to the most
            self.stats["pad_tokens"] += sum(max(map(len, drafts)) - len(d) for d in drafts)

    def _decode_growth(self) -> list[int]:
        """A decode step feeds every row one token, and a greedy decoding row its drafts (prompt lookup, planned
        here with the room they need); it runs only while some row decodes."""
        rows = self.scheduler.rows
        if len(rows) <= self.scheduler.prefilling():
            return []
        self._drafts = [r.drafts(self.lookup_drafts, self.lookup_ngram) for r in rows] if self.lookup_drafts else []
        return [1 + len(d) for d in self._drafts] if self._drafts else [1] * len(rows)

    def _fits_first_step(self, request: Request, admitted: list[Request]) -> bool:
        """Whether the pools hold the running rows' next token each, plus the first step of ``request`` and of
        those ``admitted`` before it in this iteration (so a request is not admitted only to be preempted)."""
        lengths = [min(r.held + 1, r.most_held) for r in self.runner.rows]
        lengths += [min(r.held + self.scheduler.first_chunk(r), r.most_held) for r in (*admitted, request)]
        return self.cache.why_not_fits(lengths, what="admission") is None

    def _make_room(self, plan) -> list[int]:
        """The growth ``plan()`` gives the rows (tokens each of rows ``0, 1, ...`` feeds in the step about to
        run), once the pools hold it: until then the latest admitted request is preempted and the plan made
        again; a request that cannot fit even alone fails. Empty when no step is left to run."""
        scheduler, runner = self.scheduler, self.runner
        while True:
            growth = plan()
            if not growth:
                return []
            problem = runner.why_not_fits(growth)
            if problem is None:
                return growth
            victim = scheduler.victim()
            if victim is None:
                self._end(scheduler.rows[0], RequestStatus.FAILED, f"the request cannot fit even alone: {problem}")
            else:
                scheduler.preempt(victim)
                self.stats["preemptions"] += 1
            scheduler.order()
            runner.place(scheduler.rows)

    def _run(self, rows: list[Request], step, clock: str) -> None:
        """``step()`` (a prefill or decode step of ``rows``, its sampling included: its wall time is added to
        ``stats[clock]``), then its tokens handed out."""
        start = time.perf_counter()
        try:
            picked = step()
        except Exception as error:  # the cache took the step back: these requests run again, or fail; others go on
            logger.error("a continuous batching step failed: %s", error, exc_info=True)
            self.stats["failed_steps"] += 1
            for request in sorted(rows, key=lambda r: r.admitted, reverse=True):  # the oldest ends up first in line
                request.step_failures += 1
                if request.step_failures > STEP_RETRIES:
                    if len(rows) == 1 or request.isolations >= MAX_ISOLATIONS:
                        self._end(request, RequestStatus.FAILED, f"{type(error).__name__}: {error}")
                        continue
                    # Failed again beside others: which of them brings the fault? Each is fed alone again up to
                    # where this step failed; the one that fails alone fails, the others go on.
                    request.alone_until, request.isolations = request.total, request.isolations + 1
                    self.stats["isolated_requests"] += 1
                self.scheduler.preempt(request)
                self.stats["retried_requests"] += 1
            self.scheduler.order()  # their rows go back before the iteration's next step (it must not carry them)
            self.runner.place(self.scheduler.rows)
            return
        finally:
            self.stats[clock] += time.perf_counter() - start
        with self.delivery.batched():  # the step's results reach a server's loop in one hand-over
            last = {request: i for i, (request, _, _) in enumerate(picked)}  # a row may bring several tokens
            for i, (request, token, logprob) in enumerate(picked):
                if request.done:  # it ended at an earlier token of this step (eos, its last new token)
                    continue
                if i != last[request]:
                    self.stats["accepted_tokens"] += 1
                request.add_token(token, logprob)
                if request.done:
                    self._end(request, request.status, request.error)
                elif request.streaming and i == last[request]:
                    self.delivery.put(request)
        for request in rows:
            if request.alone_until and request.held >= request.alone_until:  # fed alone past its failed step
                request.alone_until = request.step_failures = 0
        self.scheduler.order()
        self.runner.place(self.scheduler.rows)

    def _end(self, request: Request, status: RequestStatus, error: str | None) -> None:
        """The request is done: it leaves the scheduler (its row and blocks go back at the next `place`, before
        any further step), its result goes out."""
        if not request.done or request.status != status:
            request.finish(status, error)
        if status == RequestStatus.FINISHED:
            try:  # its row becomes a cached prefix (prefix caching) before the row is released
                self.runner.retire(request)
            except Exception as failure:  # a prefix not kept is only a later miss
                logger.warning("caching the prefix of request %s failed: %s", request.request_id, failure)
        else:
            self.runner.tails.pop(request, None)
        self.scheduler.release(request)
        self.runner.forget(request)
        with self._lock:
            self._in_flight.discard(request.request_id)
        self.delivery.put(request)

    def _fail_all(self, why: str) -> None:
        for request in [*self.scheduler.rows, *self.scheduler.waiting]:
            self._end(request, RequestStatus.FAILED, why)
        while True:
            try:
                self._end(self.input_queue.get_nowait(), RequestStatus.FAILED, why)
            except queue.Empty:
                break
