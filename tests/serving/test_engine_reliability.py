"""The continuous-batching engine under pressure, faults and many readers, both families, against transformers'
own model on each prompt alone (fp32, CPU, greedy).

* tight pools: no request that fits alone may fail, none may get a wrong token;
* delivery: each reader gets its own request's results, in order, none lost, none spinning;
* bookkeeping faults: the loop goes on and its requests stay exact;
* lifecycle: requests after stop() and duplicate ids are refused, not lost.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from helpers.qwen4 import make_pair, random_prompts
from helpers.serving import FAMILIES, alone, family_pair, greedy, pools_full, steps_routed_as_on_a_gpu
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from hf_qsa_cache.serving.requests import Request
from hf_qsa_cache.serving.runner import ModelRunner
from hf_qsa_cache.serving.scheduler import Scheduler

LENGTHS = [37, 5, 22, 14, 30, 9, 26]
NEWS = [6, 3, 8, 5, 2, 7, 4]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *family_pair(request.param))


def _run_all(ours, prompts, news, config, gen=None):
    with ours.continuous_batching_context_manager(gen or greedy(max(news)), continuous_batching_config=config) as m:
        ids = [m.add_request(p, max_new_tokens=n) for p, n in zip(prompts, news)]
        results = {}
        while len(results) < len(ids):
            result = m.get_result(timeout=60)
            assert result is not None, "a request was never answered"
            results[result.request_id] = result
        return [results[i] for i in ids], dict(m.stats), m.cache


def _smallest_pool(ours, config_for, need: int) -> int:
    """The fewest main-pool blocks with which one row of ``need`` tokens fits."""
    for blocks in range(2, 200):
        manager = ours.init_continuous_batching(greedy(1), config_for(blocks))
        if manager.cache.why_not_fits([need]) is None:
            return blocks
    raise AssertionError("no pool fits")


@pytest.mark.parametrize("rows,budget", [(3, 8), (4, 13)], ids=["3rows-8tokens", "4rows-13tokens"])
def test_tight_pools_never_fail_a_request_that_fits_alone(family, rows, budget):
    """From the smallest pool the longest request fits alone in, up: every request finishes, exact. Pools this
    tight make the engine preempt, and the step after a preemption plans its chunks again."""
    name, ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=21)

    def config_for(blocks):
        return ContinuousBatchingConfig(page_size=4, num_blocks=blocks, max_batch_tokens=budget,
                                        max_requests_per_batch=rows)

    smallest = _smallest_pool(ours, config_for, max(len(p) + n - 1 for p, n in zip(prompts, NEWS)))
    preempted = 0
    for blocks in (smallest, smallest + 2, smallest + 6):
        results, stats, cache = _run_all(ours, prompts, NEWS, config_for(blocks))
        for prompt, new, result in zip(prompts, NEWS, results):
            assert result.status == RequestStatus.FINISHED, (blocks, result.request_id, result.error)
            assert result.generated_tokens == alone(ref, prompt, new), (blocks, result.request_id)
        assert pools_full(cache)
        preempted += stats["preemptions"]
        # Admission waits for room: no request is admitted only to be preempted again and again.
        assert stats["preemptions"] <= 2 * len(prompts), stats
    assert preempted > 0  # the sweep did put the engine under pressure


def test_eleven_requests_on_a_pool_the_longest_just_fits(family):
    """A workload on which requests failed ("this step needs 4 free blocks, 3 are free") while each fitted
    alone: the room was checked for the prefill chunks planned before the decode step, and the prefill step
    then planned other chunks."""
    name, ref, ours = family
    prompts = random_prompts([54, 84, 11, 1, 77, 25, 90, 43, 21, 31, 29], vocab=90, seed=14)
    news = [21, 15, 13, 23, 29, 22, 19, 28, 14, 2, 13]

    def config_for(blocks):
        return ContinuousBatchingConfig(page_size=4, num_blocks=blocks, max_batch_tokens=32, max_requests_per_batch=8)

    smallest = _smallest_pool(ours, config_for, max(len(p) + n - 1 for p, n in zip(prompts, news)))
    results, stats, cache = _run_all(ours, prompts, news, config_for(max(smallest, 31)))
    for prompt, new, result in zip(prompts, news, results):
        assert result.status == RequestStatus.FINISHED, result.error
        assert result.generated_tokens == alone(ref, prompt, new)
    assert pools_full(cache)


def test_each_reader_gets_its_own_stream_in_order(family):
    """Six threads, each reading its own streaming request slowly: every stream arrives whole and in order
    (each result one token longer than the last), none is another's; one request nobody reads keeps its
    result waiting without slowing the others down, and a fetch of it by id afterwards finds it."""
    name, ref, ours = family
    prompts = random_prompts([9, 14, 6, 11, 17, 8, 10], vocab=90, seed=25)
    new = 7
    streams: dict[str, list] = {}
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, max_requests_per_batch=4)
    with ours.continuous_batching_context_manager(greedy(new), continuous_batching_config=config) as manager:
        unread = manager.add_request(prompts[-1], max_new_tokens=new)
        ids = [manager.add_request(p, max_new_tokens=new, streaming=True) for p in prompts[:-1]]

        def read(request_id):
            items = streams.setdefault(request_id, [])
            for result in manager.request_id_iter(request_id):
                items.append(result)
                time.sleep(0.01)

        threads = [threading.Thread(target=read, args=(i,)) for i in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a reader never finished"
        late = manager.get_result(unread, timeout=10)
    for request_id, prompt in zip(ids, prompts):
        items = streams[request_id]
        assert all(r.request_id == request_id for r in items)
        assert [len(r.generated_tokens) for r in items] == list(range(1, new + 1))
        assert all(a.generated_tokens == b.generated_tokens[:-1] for a, b in zip(items, items[1:]))
        assert items[-1].is_finished() and items[-1].generated_tokens == alone(ref, prompt, new)
    assert late is not None and late.request_id == unread and late.generated_tokens == alone(ref, prompts[-1], new)


def test_fetching_one_request_keeps_the_others_results(qwen):
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    prompts = random_prompts([8, 5], vocab=90, seed=27)
    with qwen.continuous_batching_context_manager(greedy(3), continuous_batching_config=config) as manager:
        first = manager.add_request(prompts[0], max_new_tokens=3)
        second = manager.add_request(prompts[1], max_new_tokens=3)
        got_second = manager.get_result(second, timeout=60)
        time.sleep(0.2)  # the first has long finished: its result waits for its reader
        got_first = manager.get_result(first, timeout=60)
        assert manager.get_result(timeout=0.1) is None
    assert got_second.request_id == second and got_first.request_id == first
    assert got_first.is_finished() and len(got_first.generated_tokens) == 3


def test_result_handlers_run_on_their_event_loop_in_order(qwen):
    """As transformers' server uses it: a handler registered from an asyncio loop (before the request is
    added) gets every streamed result on that loop's thread, then the final one; a handler that raises does
    not stop the engine; a handler registered after its request finished gets the result waiting for it."""
    prompts = random_prompts([7, 12, 5], vocab=90, seed=29)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=3)
    manager = qwen.init_continuous_batching(greedy(5), config)
    manager.start()
    try:
        finished_early = manager.add_request(prompts[2], max_new_tokens=2)
        while manager.health()["rows_in_use"] or manager.health()["waiting"]:
            time.sleep(0.01)

        async def serve():
            loop_thread = threading.get_ident()
            seen, threads, done = [], set(), asyncio.Event()

            def on_result(result):
                seen.append(result)
                threads.add(threading.get_ident())
                if result.is_finished():
                    done.set()

            def broken(result):
                raise RuntimeError("a consumer bug")

            manager.register_result_handler("streamed", on_result)
            manager.add_request(prompts[0], request_id="streamed", max_new_tokens=5, streaming=True)
            manager.register_result_handler("broken", broken)
            manager.add_request(prompts[1], request_id="broken", max_new_tokens=5)
            await asyncio.wait_for(done.wait(), 60)
            late = asyncio.get_running_loop().create_future()
            manager.register_result_handler(finished_early, late.set_result)
            return seen, threads == {loop_thread}, await asyncio.wait_for(late, 10)

        seen, on_loop, late = asyncio.run(serve())
        assert on_loop
        assert [len(r.generated_tokens) for r in seen] == [1, 2, 3, 4, 5] and seen[-1].is_finished()
        assert late.request_id == finished_early and late.is_finished()
        after = manager.add_request(prompts[1], max_new_tokens=5)  # the engine still serves
        served = manager.get_result(after, timeout=60)
        assert served.status == RequestStatus.FINISHED and len(served.generated_tokens) == 5
        assert manager.get_result("broken", timeout=0.1) is None  # its result went to its handler, not here
    finally:
        manager.stop(block=True)


def test_delta_handlers_get_each_new_token_once():
    """``register_result_handler(..., deltas=True)`` (the HTTP engine process's): on the engine thread, each call
    carries only the tokens (and log-probabilities) since the previous one; their sum is the request's result, a
    greedy one equal to generate(); a delta handler registered after its request finished gets the whole of it
    once (on the thread that registers it); one that raises is logged and the engine goes on."""
    ref, ours = make_pair(seed=3)
    prompts = random_prompts([7, 12], vocab=90, seed=41)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    manager = ours.init_continuous_batching(greedy(6), config)
    news, threads, done = {}, set(), threading.Event()

    def on_news(request_id, tokens, logprobs, finished, error):
        got = news.setdefault(request_id, {"tokens": [], "logprobs": [], "calls": 0, "finished": False})
        got["tokens"] += tokens
        got["logprobs"] += logprobs
        got["calls"] += 1
        got["finished"] = finished
        threads.add(threading.get_ident())
        if finished and request_id == "streamed":
            done.set()

    def broken(*args):
        raise RuntimeError("a consumer bug")

    manager.start()
    engine_thread = manager._thread.ident
    try:
        early = manager.add_request(prompts[1], max_new_tokens=3)
        while manager.health()["rows_in_use"] or manager.health()["waiting"]:
            time.sleep(0.01)
        manager.register_result_handler("streamed", on_news, deltas=True)
        manager.add_request(prompts[0], request_id="streamed", max_new_tokens=6, streaming=True, logprobs=True)
        manager.register_result_handler("broken", broken, deltas=True)
        manager.add_request(prompts[1], request_id="broken", max_new_tokens=4, streaming=True)
        assert done.wait(60)
        manager.register_result_handler(early, on_news, deltas=True)  # its result waited in its queue
        after = manager.get_result(manager.add_request(prompts[1], max_new_tokens=2), timeout=60)
    finally:
        manager.stop(block=True)
    streamed = news["streamed"]
    assert streamed["calls"] == 6 and streamed["finished"] and len(streamed["logprobs"]) == 6
    assert streamed["tokens"] == alone(ref, prompts[0], 6)
    assert news[early]["calls"] == 1 and news[early]["tokens"] == alone(ref, prompts[1], 3)
    assert threads == {engine_thread, threading.get_ident()}
    assert after.status == RequestStatus.FINISHED and len(after.generated_tokens) == 2


@pytest.mark.parametrize("where", ["move_rows", "admit", "why_not_fits", "order"])
def test_a_bookkeeping_fault_starts_the_rows_over_and_the_loop_goes_on(family, monkeypatch, where):
    """One fault raised by the loop's own bookkeeping (a row move before it changes anything, admission,
    the room check, the row order): every request still finishes, exact; the pools come back full."""
    name, ref, ours = family
    prompts = random_prompts([19, 8, 25, 11], vocab=90, seed=31)
    news = [6, 6, 4, 5]
    from hf_qsa_cache import QSAPagedCache

    owner, attr = {"move_rows": (QSAPagedCache, "move_rows"), "admit": (Scheduler, "admit"),
                   "why_not_fits": (ModelRunner, "why_not_fits"), "order": (Scheduler, "order")}[where]
    original = getattr(owner, attr)
    calls = {"n": 0}

    def faulty(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError(f"injected fault in {attr}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, attr, faulty)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=8, max_requests_per_batch=3)
    results, stats, cache = _run_all(ours, prompts, news, config)
    assert calls["n"] >= 6 and stats["host_faults"] == 1
    for prompt, new, result in zip(prompts, news, results):
        assert result.status == RequestStatus.FINISHED, result.error
        assert result.generated_tokens == alone(ref, prompt, new)
    assert pools_full(cache)


def test_a_fault_every_iteration_fails_the_running_requests_and_serves_later_ones(qwen, monkeypatch):
    prompts = random_prompts([9, 13, 7], vocab=90, seed=33)
    from hf_qsa_cache import QSAPagedCache

    original = QSAPagedCache.move_rows
    broken = {"on": True}

    def faulty(self, src):
        if broken["on"]:
            raise RuntimeError("a persistent fault")
        return original(self, src)

    monkeypatch.setattr(QSAPagedCache, "move_rows", faulty)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=3)
    manager = qwen.init_continuous_batching(greedy(4), config)
    doomed = manager.add_requests(prompts[:2], max_new_tokens=4)  # queued first: both run in the failing iterations
    manager.start()
    try:
        failed = [manager.get_result(i, timeout=60) for i in doomed]
        broken["on"] = False
        later = manager.add_request(prompts[2], max_new_tokens=4)
        served = manager.get_result(later, timeout=60)
        health = manager.health()
    finally:
        manager.stop(block=True)
    assert all(r.status == RequestStatus.FAILED and "a persistent fault" in r.error for r in failed)
    assert served.status == RequestStatus.FINISHED and len(served.generated_tokens) == 4
    assert health["host_faults"] == 3 and health["fatal_error"] is None


def test_a_failed_step_sends_its_requests_back_oldest_first_and_fails_one_on_its_second_failure(qwen):
    """A model step that raises: its requests go back to the queue in the order they were admitted (the oldest
    first in line), ahead of those already waiting; a request alone in a step that fails a second time fails."""
    from hf_qsa_cache.serving.manager import STEP_RETRIES

    prompts = random_prompts([9, 13, 7], vocab=90, seed=34)
    manager = qwen.init_continuous_batching(greedy(4), ContinuousBatchingConfig(page_size=4,
                                                                              max_requests_per_batch=2))
    ids = manager.add_requests(prompts, max_new_tokens=4)
    manager._intake()
    scheduler = manager.scheduler
    running = scheduler.admit()
    manager.runner.place(scheduler.rows)
    waiting = list(scheduler.waiting)

    def boom():
        raise RuntimeError("a step fault")

    manager._run(list(scheduler.rows), boom, "decode_s")
    assert [r.request_id for r in scheduler.waiting] == [*(r.request_id for r in running), *ids[2:]]
    assert list(scheduler.waiting)[len(running):] == waiting and not scheduler.rows
    lone = scheduler.waiting[0]
    assert lone.step_failures == 1 and not lone.done
    scheduler.max_rows = 1  # alone in its steps from here on
    for failures in range(2, STEP_RETRIES + 2):
        assert scheduler.admit() == [lone]
        manager.runner.place(scheduler.rows)
        manager._run([lone], boom, "decode_s")
        assert lone.step_failures == failures
        assert lone.done == (failures == STEP_RETRIES + 1), failures
    assert lone.status == RequestStatus.FAILED and "a step fault" in lone.error
    manager.runner.release_all()


def test_results_fetched_by_id_leave_no_growing_trail():
    """Results taken by request id, newest first (none through the any-request order), leave stale entries in the
    arrival order `get()` without an id reads; they are dropped once they outnumber the live results, so a server
    that fetches by id holds memory for what waits, not for every result it ever delivered."""
    from hf_qsa_cache.serving.delivery import Delivery
    from hf_qsa_cache.serving.requests import Request

    delivery = Delivery()
    for batch in range(20):
        requests = [Request(f"r{batch}-{i}", [1, 2], 2, frozenset()) for i in range(50)]
        for request in requests:
            delivery.put(request)
        for request in reversed(requests):
            assert delivery.get(request.request_id, timeout=0).request_id == request.request_id
        assert len(delivery._arrivals) <= 64 + 2 * delivery._live, (batch, len(delivery._arrivals))
    assert delivery.get(timeout=0) is None


def test_lifecycle_refuses_instead_of_losing_requests(qwen):
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    prompt = random_prompts([6], vocab=90, seed=35)[0]
    manager = qwen.init_continuous_batching(greedy(3), config)
    queued_before_start = manager.add_request(prompt, max_new_tokens=3)  # accepted: answered once started
    manager.start()
    assert manager.get_result(queued_before_start, timeout=60).is_finished()
    first = manager.add_request(prompt, request_id="same", max_new_tokens=3)
    with pytest.raises(ValueError, match="'same' is still in flight"):
        manager.add_request(prompt, request_id="same", max_new_tokens=3)
    deadline = time.time() + 60
    while not manager.delivery.waiting("same") and time.time() < deadline:  # it finishes, its result unread
        time.sleep(0.01)
    with pytest.raises(ValueError, match="'same' has unread results"):  # they would reach the new one's reader
        manager.add_request(prompt, request_id="same", max_new_tokens=3)
    assert manager.get_result(first, timeout=60).is_finished()
    manager.add_request(prompt, request_id="same", max_new_tokens=3)  # finished and read: its id may come again
    manager.stop(block=False)
    with pytest.raises(RuntimeError, match="stopped: call start"):
        manager.add_request(prompt, max_new_tokens=3)
    manager.start()  # after the earlier loop drained
    again = manager.add_request(prompt, max_new_tokens=3)
    assert manager.get_result(again, timeout=60).is_finished()
    results = [manager.get_result("same", timeout=5)]
    manager.stop(block=True)
    assert results[0] is not None and results[0].is_finished()
    assert manager.get_result(timeout=0.1) is None  # stopped, nothing waiting: returns at once
    assert list(manager.request_id_iter("unknown")) == []
    # Every block is free or idle in the prefix cache (which gives it back on demand): health counts both.
    assert manager.cache.prefix is not None and any(t.idle for t in manager.cache.tables.values())
    assert manager.health()["free_blocks"] == {n: t.num_blocks - 1 for n, t in manager.cache.tables.items()}
    manager.destroy()  # cached prefixes and their snapshots go too
    assert all(len(t.free) == t.num_blocks - 1 for t in manager.cache.tables.values())
    assert manager.cache.memory_stats()["prefix_cache"]["snapshots"] == 0


def test_cancelling_a_waiting_request_ends_it_before_it_runs(qwen):
    prompts = random_prompts([30, 6], vocab=90, seed=37)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=2, max_requests_per_batch=1)
    with qwen.continuous_batching_context_manager(greedy(4), continuous_batching_config=config) as manager:
        running = manager.add_request(prompts[0], max_new_tokens=4)
        waiting = manager.add_request(prompts[1], max_new_tokens=4)
        manager.cancel_request(waiting)
        results = [manager.get_result(waiting, timeout=60)]
        finished = manager.get_result(running, timeout=60)
        time.sleep(0.1)
        results.append(manager.get_result(waiting, timeout=0.1))
        stats = dict(manager.stats)
    assert results[0].status == RequestStatus.FAILED and results[0].error == "cancelled"
    assert results[0].generated_tokens == [] and results[1] is None  # one result, and it never ran
    assert finished.status == RequestStatus.FINISHED
    assert stats["most_rows"] == 1


def test_the_latest_admitted_request_is_preempted():
    from hf_qsa_cache.serving.requests import Request

    scheduler = Scheduler(max_rows=3, max_batch_tokens=8, prefill_first=False)
    requests = [Request(f"r{i}", [1] * (5 + i), 4, frozenset()) for i in range(4)]
    for request in requests:
        scheduler.submit(request)
    scheduler.admit()
    assert list(scheduler.waiting) == [requests[3]]
    assert scheduler.victim() is requests[2]
    scheduler.preempt(requests[2])
    assert list(scheduler.waiting) == [requests[2], requests[3]]  # first in line again, before those who came later
    assert scheduler.victim() is requests[1]
    assert scheduler.admit() == [requests[2]]  # readmitted first (one row free)


def test_admission_waits_while_the_pools_cannot_hold_a_first_step():
    from hf_qsa_cache.serving.requests import Request

    scheduler = Scheduler(max_rows=4, max_batch_tokens=8, prefill_first=False)
    requests = [Request(f"r{i}", [1] * 5, 4, frozenset()) for i in range(3)]
    for request in requests:
        scheduler.submit(request)
    assert scheduler.admit(lambda request, admitted: len(admitted) < 2) == requests[:2]
    assert list(scheduler.waiting) == requests[2:]
    assert scheduler.first_chunk(requests[2]) == 5
    assert scheduler.first_chunk(Request("long", [1] * 20, 4, frozenset())) == 8  # at most the prefill budget


def test_copies_of_a_prompt_and_seeded_requests_draw_their_own_streams(qwen):
    """Copies of one prompt draw different samples; a request's seed gives the same tokens however many
    requests came before it; without a seed, the engine seeds each request from its id."""
    from hf_qsa_cache.serving import Sampling

    prompt = random_prompts([9], vocab=90, seed=39)[0]
    hot = Sampling(do_sample=True, temperature=2.0)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=4, seed=5)
    gen = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=2.0, num_return_sequences=3,
                           eos_token_id=None, pad_token_id=0)
    with qwen.continuous_batching_context_manager(gen, continuous_batching_config=config) as manager:
        parent = manager.add_request(prompt, max_new_tokens=6, sampling=hot)
        copies = [manager.get_result(f"{parent}__child#{i}", timeout=60) for i in range(2)]
        copies.append(manager.get_result(parent, timeout=60))
        alone_first = manager.add_request(prompt, request_id="seeded", max_new_tokens=6, sampling=hot, seed=11)
        first = manager.get_result(alone_first, timeout=60)
        manager.add_request(prompt, max_new_tokens=6, sampling=hot)  # one more request before it this time
        again = manager.add_request(prompt, request_id="seeded-again", max_new_tokens=6, sampling=hot, seed=11)
        second = manager.get_result(again, timeout=60)
        # Seeded copies: the request itself draws from its seed, its copies from the next seeds (so asking for
        # more copies never changes the request's own answer).
        three = manager.add_request(prompt, request_id="three", max_new_tokens=6, sampling=hot, seed=11)
        own = manager.get_result(three, timeout=60)
        copy = [manager.get_result(f"{three}__child#{i}", timeout=60) for i in range(2)]
        alone_12 = manager.add_request(prompt, request_id="twelve", max_new_tokens=6, sampling=hot, seed=12)
        twelve = manager.get_result(alone_12, timeout=60)
    assert len({tuple(c.generated_tokens) for c in copies}) == 3
    assert first.generated_tokens == second.generated_tokens == own.generated_tokens
    assert copy[0].generated_tokens == twelve.generated_tokens != own.generated_tokens


def test_a_sampled_request_draws_each_token_with_its_own_uniform(family):
    """A seeded sampled request's ``i``-th token is `draw` of `next_token_scores` (transformers' model on its
    tokens so far, alone) for `token_uniform(seed, i)`, beside another request; not one number for every token."""
    from hf_qsa_cache.serving import Sampling
    from hf_qsa_cache.serving.sampling import draw, next_token_scores, token_uniform

    name, ref, ours = family
    prompt, other = random_prompts([10, 13], vocab=90, seed=44)
    hot = Sampling(do_sample=True, temperature=1.5, top_k=40)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    with ours.continuous_batching_context_manager(greedy(8), continuous_batching_config=config) as manager:
        ids = [manager.add_request(prompt, max_new_tokens=8, sampling=hot, seed=21),
               manager.add_request(other, max_new_tokens=8)]
        got = manager.get_result(ids[0], timeout=60).generated_tokens
        manager.get_result(ids[1], timeout=60)
    want = []
    with torch.no_grad():
        for i in range(8):
            logits = ref(torch.tensor([prompt + want])).logits[0, -1].float()
            scores = next_token_scores(logits, hot, prompt, want)
            want.append(int(draw(scores[None], torch.tensor([token_uniform(21, i)]))[0]))
    assert got == want and len(set(want)) > 2


def test_per_request_penalties_match_transformers_greedy(family):
    """Greedy with a repetition penalty, per request, beside a plain greedy request: each equals transformers'
    generate() with that setting alone; five penalized requests through two rows (each leaves its history slot
    to the next) too."""
    from hf_qsa_cache.serving import Sampling

    name, ref, ours = family
    prompts = random_prompts([12, 15, 9, 20, 6], vocab=90, seed=41)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    with ours.continuous_batching_context_manager(greedy(8), continuous_batching_config=config) as manager:
        penalized = manager.add_request(prompts[0], max_new_tokens=8, sampling=Sampling(repetition_penalty=1.8))
        plain = manager.add_request(prompts[1], max_new_tokens=8)
        got = {i: manager.get_result(i, timeout=60) for i in (penalized, plain)}
        more = [manager.add_request(p, max_new_tokens=6, sampling=Sampling(repetition_penalty=1.8)) for p in prompts]
        more = [manager.get_result(i, timeout=60) for i in more]
    assert got[penalized].generated_tokens == alone(ref, prompts[0], 8, repetition_penalty=1.8)
    assert got[plain].generated_tokens == alone(ref, prompts[1], 8)
    assert alone(ref, prompts[0], 8, repetition_penalty=1.8) != alone(ref, prompts[0], 8)  # the penalty mattered
    assert [r.generated_tokens for r in more] == [alone(ref, p, 6, repetition_penalty=1.8) for p in prompts]


@pytest.mark.parametrize("family_name, seed, lookup, grouped_steps",
                         [("qwen4_exp", 0, 0, False), ("inkling", 1, 2, True)],
                         ids=["qwen4_exp", "inkling-prompt-lookup-grouped-steps"])
def test_random_arrivals_cancels_and_faults_match_the_reference(family_name, seed, lookup, grouped_steps):
    """A short run of the engine's model-based stress test (tests/helpers/engine_stress.py); Inkling's with
    prompt lookup's drafts verified inside the loop (per-row crops under faults) and grouped steps."""
    from helpers.engine_stress import EngineStress

    stress = EngineStress(family_name, seed, lookup=lookup, grouped_steps=grouped_steps)
    stress.run(ops=60)
    assert stress.counts["finished"] > 10, stress.counts
    assert (stress.manager.stats["drafted_tokens"] > 0) == bool(lookup), stress.manager.stats
    assert (stress.manager.stats["grouped_steps"] > 0) == grouped_steps, stress.manager.stats
    # Which sites the faults land on follows thread timing; steps that fail are covered deterministically by
    # test_a_failed_step_fails_its_requests_only and the bookkeeping places by the test above.
    assert sum(stress.faults.fired.values()) >= 3, stress.faults.fired


@pytest.mark.parametrize("family_name, seed, lookup, grouped_steps, graph_path, gap, mixed",
                         [("qwen4_exp", 2, 2, True, False, 0, False), ("inkling", 3, 0, False, False, 0, False),
                          ("qwen4_exp", 4, 2, False, True, 0, False), ("inkling", 5, 0, False, True, 8, False),
                          ("qwen4_exp", 6, 0, False, True, 0, True)],
                         ids=["qwen4_exp-prompt-lookup-grouped-steps", "inkling", "qwen4_exp-prompt-lookup-graph-path",
                              "inkling-graph-path-gap8", "qwen4_exp-graph-path-mixed-steps"])
def test_shared_prefixes_under_faults_match_the_reference(family_name, seed, lookup, grouped_steps, graph_path,
                                                           gap, mixed):
    """The engine stress test with prompts that share prefixes (and continue earlier answers): rows start from
    cached prefixes, cached blocks are taken back for new work, faults fire in steps and bookkeeping. Qwen4Exp's
    with prompt lookup's drafts in grouped steps: rows restored from a prefix wait beside rows that crop; and with
    its decode and verify steps on the CUDA graphs' path, as a GPU runs them. ``gap``: prefix caching's
    `prefix_snapshot_gap` (0: every prefill stops at its snapshot point; 8: only those with more than 8 tokens to
    feed after their restore); ``mixed``: the loop's mixed steps (prefill chunks and decoding rows in one recorded
    step), faults inside them too."""
    from helpers.engine_stress import EngineStress

    stress = EngineStress(family_name, seed, shared=True, lookup=lookup, grouped_steps=grouped_steps,
                          graph_path=graph_path, snapshot_gap=gap, mixed_steps=mixed)
    stress.run(ops=60)
    assert stress.counts["finished"] > 10, stress.counts
    assert (stress.manager.stats["drafted_tokens"] > 0) == bool(lookup), stress.manager.stats
    assert (stress.manager.stats["mixed_steps"] > 0) == mixed, stress.manager.stats
    steps = [n for n in stress.graph_steps if not isinstance(n, tuple)]
    assert (max(steps, default=0) > 1) == graph_path, stress.graph_steps  # verify or prefill steps took it
    assert stress.faults.fired, stress.faults.fired
    stats = stress.prefix_stats
    assert stats["hit_tokens"] > 0 and stats["evictions"] > 0, stats


def test_a_steps_results_reach_an_event_loop_in_one_hand_over():
    """Handlers registered from one asyncio loop get a step's results through one ``call_soon_threadsafe``
    (a server's loop wakes once a step, not once a request), each handler its own result, in order."""
    from hf_qsa_cache.serving.delivery import Delivery
    from hf_qsa_cache.serving.requests import Request

    delivery, got = Delivery(), []

    def step(request_ids):  # what the engine thread does with a step's results
        with delivery.batched():
            for request_id in request_ids:
                delivery.put(Request(request_id, [1], 4, frozenset(), status=RequestStatus.DECODING))

    async def serve():
        loop = asyncio.get_running_loop()
        handed, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *args: (handed.append(fn), real(fn, *args))[1]
        for i in range(3):
            delivery.register(f"r{i}", lambda out, i=i: got.append((i, out.request_id)))
        engine = threading.Thread(target=step, args=(["r2", "r0", "r1"],))
        engine.start()
        engine.join()
        for _ in range(3):
            await asyncio.sleep(0)
        return len(handed)

    assert asyncio.run(serve()) == 1
    assert got == [(2, "r2"), (0, "r0"), (1, "r1")]


@pytest.mark.parametrize("route", ["eager", "graphs"])
def test_fp8_caches_through_continuous_batching(family, route):
    """``kv_cache_dtype`` / ``index_cache_dtype`` reach the engine's cache (transformers' config has no field for
    them): each request's tokens equal our generate() on that prompt alone on an fp8 cache. Each prompt prefills
    in one step, as generate() does: a step reads its own keys from the activations and earlier steps' from the
    fp8 pages, so other chunkings round differently (by design, as on any fp8 cache). Routed as on a GPU
    (``graphs``), the prefill steps of these short prompts replay the recorded step, new rows' first steps too."""
    import contextlib

    import torch
    from helpers.serving import steps_routed_as_on_a_gpu

    from hf_qsa_cache import QSAPagedCache

    name, ref, ours = family
    fp8 = dict(kv_cache_dtype=torch.float8_e4m3fn, index_cache_dtype=torch.float8_e4m3fn if name == "qwen4_exp" else None)
    prompts = random_prompts([33, 19, 7], vocab=90, seed=43)
    # (Longest first: a step's later rows take at most the first row's length, or half the budget. Without prefix
    # caching, whose snapshot points would split a prefill in two.)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=3,
                                      allow_block_sharing=False)
    manager = ours.init_continuous_batching(greedy(6), config, **fp8)
    assert manager.cache.kv_cache_dtype == torch.float8_e4m3fn
    with steps_routed_as_on_a_gpu() if route == "graphs" else contextlib.nullcontext() as routed:
        results = ours.generate_batch(prompts, greedy(6), config, **fp8)
    assert route == "eager" or 33 in routed  # the first prompt's step, on its new row
    for i, prompt in enumerate(prompts):
        cache = QSAPagedCache(ours.config, 1, len(prompt) + 8, block_size=4, **fp8)
        with torch.no_grad():
            alone_fp8 = ours.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=6,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert results[f"req_{i}"].generated_tokens == alone_fp8, i


def _lookup_config(new, k=3, **kwargs):
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                            prompt_lookup_num_tokens=k, **kwargs)


def test_prompt_lookup_inside_the_loop_gives_each_prompts_own_tokens(family):
    """Prompt lookup's drafts (GenerationConfig.prompt_lookup_num_tokens) verified inside the decode steps:
    every request's tokens equal transformers' greedy generate() on its prompt alone."""
    name, ref, ours = family
    base = random_prompts([8, 5, 12], vocab=90, seed=51)
    prompts = [p * 3 for p in base] + random_prompts([15, 9], vocab=90, seed=52)  # repeats: lookup finds n-grams
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, max_requests_per_batch=4)
    results, stats, cache = _run_all(ours, prompts, [12] * len(prompts), config, _lookup_config(12))
    for prompt, result in zip(prompts, results):
        assert result.generated_tokens == alone(ref, prompt, 12), result.request_id
    assert stats["drafted_tokens"] > 0 and cache.num_speculative_tokens == 3
    assert pools_full(cache)


def test_verified_drafts_carry_the_log_probabilities_of_plain_decoding(family, monkeypatch):
    """With ``return_logprobs``, the tokens a verify step keeps (the drafts its logits agree with, then its own
    token) carry the log-probabilities plain greedy decoding gives them, one a token. Drafts from an oracle (the
    plain run's own tokens; every other request's second draft made wrong)."""

    name, ref, ours = family
    prompts = random_prompts([14, 9, 21, 6], vocab=90, seed=53)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, max_requests_per_batch=4,
                                      return_logprobs=True)
    plain, _, _ = _run_all(ours, prompts, [10] * len(prompts), config, greedy(10))
    truth = {tuple(p): (i, r.generated_tokens) for i, (p, r) in enumerate(zip(prompts, plain))}

    def oracle(request, most, ngram):  # (as `Request.drafts`)
        room = request.max_new_tokens - len(request.generated) - 1
        if request.in_prefill or room < 1:
            return []
        i, tokens = truth[tuple(request.prompt)]
        drafts = list(tokens[len(request.generated): len(request.generated) + min(3, room)])
        if i % 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 90
        return drafts

    monkeypatch.setattr(Request, "drafts", oracle)
    drafted, stats, _ = _run_all(ours, prompts, [10] * len(prompts), config, _lookup_config(10))
    assert stats["accepted_tokens"] > 0 and stats["drafted_tokens"] > stats["accepted_tokens"]
    for with_drafts, without in zip(drafted, plain):
        assert with_drafts.generated_tokens == without.generated_tokens
        assert len(with_drafts.logprobs) == len(without.logprobs) == 10
        torch.testing.assert_close(torch.tensor(with_drafts.logprobs), torch.tensor(without.logprobs),
                                   rtol=0, atol=1e-4)


def test_prompt_lookup_inside_the_loop_on_the_graphs_path(family):
    """The same workload with each step routed as on a GPU (`steps_routed_as_on_a_gpu`): rows that drafted
    different counts share verify steps (left-padded), which the recorded step runs too. Every request's tokens
    equal transformers' alone."""
    name, ref, ours = family
    base = random_prompts([8, 5, 12], vocab=90, seed=51)
    prompts = [p * 3 for p in base] + random_prompts([15, 9], vocab=90, seed=52)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, max_requests_per_batch=4)
    with steps_routed_as_on_a_gpu() as routed:
        results, stats, cache = _run_all(ours, prompts, [12] * len(prompts), config, _lookup_config(12))
    for prompt, result in zip(prompts, results):
        assert result.generated_tokens == alone(ref, prompt, 12), result.request_id
    assert stats["drafted_tokens"] > 0 and 1 in routed and max(routed) > 1  # decode and verify steps took the path


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2], ids=["all-right", "first-wrong", "second-wrong", "third-wrong"])
def test_verified_drafts_keep_exactly_the_right_ones(family, monkeypatch, wrong_at):
    """Drafts from an oracle (the reference's own next tokens, one of them made wrong): a row keeps the drafts
    before the wrong one plus its own token and drops the rest of its row (each row its own count); rows that
    sample, rows still prefilling and a request whose eos falls inside its drafts ride along, in decode steps and
    in grouped steps beside prefill chunks (grouped steps with the first and third oracle, prefill and decode
    steps with the others); every request equals its reference alone."""
    from hf_qsa_cache.serving import Sampling

    name, ref, ours = family
    prompts = random_prompts([14, 9, 21, 6, 30], vocab=90, seed=53)
    new = 10
    truth = {tuple(p): alone(ref, p, new) for p in prompts}
    eos_prompt = prompts[1]
    eos = truth[tuple(eos_prompt)][4]  # its fifth token ends it (inside a run of drafts)

    def oracle(request, most, ngram):  # (as `Request.drafts`)
        room = request.max_new_tokens - len(request.generated) - 1
        if request.in_prefill or not request.sampling.plain_greedy or room < 1:
            return []
        done = len(request.generated)
        drafts = alone(ref, request.prompt, new, eos=min(request.eos_token_ids, default=None))[done: done + min(3, room)]
        if wrong_at is not None and wrong_at < len(drafts):
            drafts = list(drafts)
            drafts[wrong_at] = (drafts[wrong_at] + 1) % 90
        return list(drafts)

    from hf_qsa_cache.serving.runner import ModelRunner

    grouped, carried = ModelRunner.grouped, []

    def spy(self, chunks, drafts=None):  # grouped steps (a prompt prefilling beside) verify drafts too
        carried.append(bool(drafts and any(drafts)))
        return grouped(self, chunks, drafts)

    monkeypatch.setattr(ModelRunner, "grouped", spy)
    monkeypatch.setattr(Request, "drafts", oracle)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=8, max_requests_per_batch=4, seed=3)
    grouped_steps = wrong_at in (None, 1)
    with ours.continuous_batching_context_manager(_lookup_config(new), continuous_batching_config=config,
                                                  grouped_steps=grouped_steps) as m:
        ids = [m.add_request(p, max_new_tokens=new, eos_token_id=eos if p is eos_prompt else None) for p in prompts]
        sampled = m.add_request(prompts[0], max_new_tokens=new, sampling=Sampling(do_sample=True), seed=5)
        results = {i: m.get_result(i, timeout=60) for i in [*ids, sampled]}
        stats, cache = dict(m.stats), m.cache
    for request_id, prompt in zip(ids, prompts):
        want = alone(ref, prompt, new, eos=eos if prompt is eos_prompt else None)
        assert results[request_id].generated_tokens == want, (request_id, wrong_at)
    assert results[ids[1]].generated_tokens[-1] == eos and len(results[ids[1]].generated_tokens) == 5
    assert results[sampled].status == RequestStatus.FINISHED and len(results[sampled].generated_tokens) == new
    assert (any(carried) and not all(carried)) if grouped_steps else not carried
    if wrong_at is None:
        assert stats["accepted_tokens"] == stats["drafted_tokens"] > 0
    else:
        assert stats["accepted_tokens"] < stats["drafted_tokens"]
        assert (stats["accepted_tokens"] == 0) == (wrong_at == 0)
    assert pools_full(cache)


def test_a_requests_token_array_follows_its_tokens():
    """Prompt lookup's search reads `Request.token_array` (kept across steps, only new tokens copied in)."""
    from hf_qsa_cache.serving.requests import Request

    request = Request("r", [4, 5, 6], 5, frozenset())
    assert request.token_array().tolist() == [4, 5, 6]
    request.add_token(7, None)
    request.add_token(8, None)
    assert request.token_array().tolist() == [4, 5, 6, 7, 8]
    request.add_token(9, None)
    assert request.token_array().tolist() == [4, 5, 6, 7, 8, 9]
