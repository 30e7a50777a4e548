"""Prefix caching in continuous batching (on by default; ``ContinuousBatchingConfig(allow_block_sharing=False)``
turns it off): requests that share a system prompt, and the next turns of conversations, start from cached
prefixes (the prompt's snapshot point, and the last unit boundary a finished request reached), across requests
and turns. Tokens equal transformers' own model on each prompt alone (fp32), both families; prefill chunks end
inside QSA groups, windows and conv spans; pools are tight enough that cached blocks are evicted for new work."""

from __future__ import annotations

import contextlib

import pytest
from helpers.qwen4 import collect_results, random_prompts
from helpers.serving import FAMILIES, alone, family_pair, greedy, pools_full
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestStatus

NEW = 5
# Every prompt here is far shorter than the default `prefix_snapshot_gap` (256 tokens), which would then never stop a
# prefill at its snapshot point: the tests of that stop force the gap to 0, as prompts longer than it meet it.
CUT = {"prefix_snapshot_gap": 0}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *family_pair(request.param))


def run(manager, prompts):
    ids = manager.add_requests(prompts)
    results = collect_results(manager, len(prompts))
    return [results[i] for i in ids]


def check(ref, prompts, results):
    for prompt, result in zip(prompts, results):
        assert result.status == RequestStatus.FINISHED and result.error is None, result.error
        assert result.generated_tokens == alone(ref, prompt, NEW), prompt


@pytest.mark.parametrize("lookup", [0, 2])
def test_shared_system_prompt_and_next_turns(family, lookup):
    """``lookup``: prompt lookup inside the loop (verify steps, per-row crops that never reach into shared blocks;
    Qwen4Exp's cache then keeps rollback history, which a restored row does not have below its prefix)."""
    name, ref, ours = family
    system = random_prompts([14], vocab=90, seed=21)[0]
    users = random_prompts([5, 7, 3], vocab=90, seed=22)
    first = [system + u for u in users]
    # 3 rows, 5-token prefill chunks, 4-token units (page_size): snapshot points at 16 and 12, decode tails at 20.
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=5, max_requests_per_batch=3)
    gen = greedy(NEW, prompt_lookup_num_tokens=lookup) if lookup else greedy(NEW)
    with ours.continuous_batching_context_manager(gen, continuous_batching_config=config, **CUT) as manager:
        cache = manager.cache
        assert cache.prefix is not None and manager.scheduler.unit == 4
        cache.prefix.max_snapshots = 32  # (the default, two a row, would evict some of the tails this checks)
        results = run(manager, first)
        check(ref, first, results)
        after_first = cache.memory_stats()["prefix_cache"]
        # The next turn of each conversation: its history (prompt and answer) and a new user message.
        more = random_prompts([4, 6, 2], vocab=90, seed=23)
        second = [p + r.generated_tokens + m for p, r, m in zip(first, results, more)]
        results2 = run(manager, second)
        check(ref, second, results2)
        stats = cache.memory_stats()["prefix_cache"]
        assert not lookup or manager.stats["drafted_tokens"] > 0
    assert pools_full(cache)  # (once the loop has stopped: it releases a finished request's row after its result)
    assert after_first["snapshots"] > 0
    hits = stats["hit_tokens"] - after_first["hit_tokens"]
    # Each second turn restores at least the last unit boundary its first turn reached while decoding.
    reached = [(len(p) + NEW - 1) // 4 * 4 for p in first]
    assert hits >= sum(reached), (hits, reached)


def test_short_prefill_steps_on_the_graphs_path(family):
    """The shared-prompt workload with each step routed as on a GPU (`steps_routed_as_on_a_gpu`): a prompt's tokens
    after its snapshot point and its later chunks (started rows, steps of one or two rows, at most
    `cuda_graphs.SHORT_PREFILL_TOKENS`) take the recorded step, left-padded to a power-of-two length; every
    request's tokens equal transformers' alone, and the next turns restore what the first cached."""
    from helpers.serving import steps_routed_as_on_a_gpu

    name, ref, ours = family
    system = random_prompts([14], vocab=90, seed=21)[0]
    first = [system + u for u in random_prompts([5, 7, 3], vocab=90, seed=22)]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=5, max_requests_per_batch=3)
    with steps_routed_as_on_a_gpu() as routed, \
            ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=config, **CUT) as manager:
        results = run(manager, first)
        check(ref, first, results)
        second = [p + r.generated_tokens + m for p, r, m in zip(first, results,
                                                                  random_prompts([4, 6, 2], vocab=90, seed=23))]
        check(ref, second, run(manager, second))
        stats = manager.cache.memory_stats()["prefix_cache"]
    assert stats["hit_tokens"] > 0
    assert 1 in routed and any(n > 1 for n in routed)  # decode steps and short prefill steps took the path
    assert pools_full(manager.cache)


def test_a_short_tail_that_replays_a_graph_steps_without_riding_along(family, monkeypatch):
    """A prompt's last tokens after its snapshot point, beside a started row with more to feed: where their own step
    replays a recorded graph (as on a GPU), the short chunks step alone, without pads, instead of riding along in the
    longer row's step (`Scheduler.prefill_chunks`), and before the decode step. Tokens equal transformers' alone
    either way."""
    from helpers.serving import serve_queued, steps_routed_as_on_a_gpu

    name, ref, ours = family
    prompts = random_prompts([14, 70], vocab=90, seed=24)  # 14: snapshot point 12, a tail of 2
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=32, max_requests_per_batch=2)

    def steps(routed_as_on_a_gpu: bool) -> list:
        manager = ours.init_continuous_batching(greedy(NEW), config, **CUT)
        ran, runner = [], manager.runner
        prefill, decode = runner.prefill, runner.decode
        monkeypatch.setattr(runner, "prefill", lambda chunks: ran.append(list(chunks)) or prefill(chunks))
        monkeypatch.setattr(runner, "decode", lambda drafts: ran.append("decode") or decode(drafts))
        ids = manager.add_requests(prompts)  # both before the loop starts: its first step sees both
        with steps_routed_as_on_a_gpu() if routed_as_on_a_gpu else contextlib.nullcontext():
            results = serve_queued(manager, len(prompts))
        check(ref, prompts, [results[i] for i in ids])
        return ran

    eager, replayed = steps(False), steps(True)
    assert eager[:8] == [[12, 16], [2, 16], "decode", [32], "decode", [2], "decode", "decode"]  # the tail rides along
    # Its own step replays, as the first one does now (short chunks of rows continuous batching placed), with the
    # row that joins at its length; a replayed step that ends a prompt goes before the iteration's decode step, and
    # so does one that leaves a row one short replayed step from its end, which then follows at once
    # (`Scheduler.prefill_goes_first`): the 70-token prompt steps to its snapshot point (68) and its last 2 tokens
    # come right after, its first token in the decode step after them (where a decode step went between).
    assert replayed[:8] == [[12, 12], [2, 2], "decode", "decode", [32], [20], [2], "decode"]


def test_tight_pool_evicts_cached_blocks_and_sharing_can_be_turned_off(family):
    name, ref, ours = family
    prompts = random_prompts([19, 22, 17, 21, 18], vocab=90, seed=31)
    # A pool that holds two rows: every new request needs blocks that cached prefixes hold.
    config = ContinuousBatchingConfig(page_size=4, num_blocks=14, max_batch_tokens=8, max_requests_per_batch=2)
    with ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=config, **CUT) as manager:
        results = run(manager, prompts)
        check(ref, prompts, results)
        stats = manager.cache.memory_stats()["prefix_cache"]
    assert pools_full(manager.cache)
    assert stats["evictions"] > 0
    off = ContinuousBatchingConfig(page_size=4, num_blocks=14, max_batch_tokens=8, max_requests_per_batch=2,
                                   allow_block_sharing=False)
    with ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=off) as manager:
        assert manager.cache.prefix is None and manager.scheduler.unit is None
        check(ref, prompts[:2], run(manager, prompts[:2]))
        assert "prefix_cache" not in manager.cache.memory_stats()


def test_a_prompt_that_ends_at_a_cached_snapshot_still_feeds_its_last_token(family):
    """A next turn that is exactly a finished request's prompt and answer up to the unit boundary its decoding
    reached (a snapshot there): the restore stops a unit short of its last token, which it feeds, so its tokens are
    transformers' alone (a restore of every token would leave nothing to feed)."""
    name, ref, ours = family
    first = random_prompts([8], vocab=90, seed=24)[0]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=8, max_requests_per_batch=2)
    with ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=config, **CUT) as manager:
        answer = run(manager, [first])[0].generated_tokens
        again = first + answer[:4]  # 12 tokens: the decode tail at 12 is cached with a snapshot
        assert manager.cache.prefix_lookup(again, limit=None)[0] == 12
        before = manager.cache.memory_stats()["prefix_cache"]["hit_tokens"]
        check(ref, [again], run(manager, [again]))
        assert 0 < manager.cache.memory_stats()["prefix_cache"]["hit_tokens"] - before < 12


def test_pool_pressure_gives_back_the_least_recently_used_prefix_first(family):
    """Two cached prefixes, the older used again since: when a request needs blocks only idle cached ones can give,
    the least recently used prefix's go (the other still hits); requests stay exact."""
    name, ref, ours = family
    a, b = random_prompts([17, 17], vocab=90, seed=25)
    big = random_prompts([30], vocab=90, seed=26)[0]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=8, max_requests_per_batch=1)
    with ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=config, **CUT) as manager:
        cache = manager.cache
        cache.prefix.max_snapshots = 32  # (the default, two a row, would evict snapshots, and prefixes with them)
        for prompts in ([a], [b], [a + [3]]):  # a, b cached; then a used again: b is the least recently used
            check(ref, prompts, run(manager, prompts))
        check(ref, [big], run(manager, [big]))  # needs blocks the cached prefixes hold
        assert cache.memory_stats()["prefix_cache"]["evictions"] > 0
        assert cache.prefix_lookup(a + [3], limit=None)[0] >= 16 and cache.prefix_lookup(b + [3], limit=None)[0] == 0


def test_requests_admitted_together_restore_what_the_first_cached(family):
    name, ref, ours = family
    shared = random_prompts([18], vocab=90, seed=41)[0]
    prompts = [shared + q for q in random_prompts([3, 5, 2, 4], vocab=90, seed=42)]
    # All four admitted at once: the first sees that the others share its first 16 tokens (whole units) and stops
    # there to cache a snapshot; the others wait for it, then start from it (giving back a token a decode step
    # fed them meanwhile).
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=8, max_requests_per_batch=4)
    manager = ours.init_continuous_batching(greedy(NEW), config, **CUT)
    ids = manager.add_requests(prompts)  # queued before the loop starts: its first iteration admits all four
    manager.start()
    try:
        results = collect_results(manager, len(prompts))
        check(ref, prompts, [results[i] for i in ids])
        stats = manager.cache.memory_stats()["prefix_cache"]
    finally:
        manager.stop(block=True)
    assert pools_full(manager.cache)
    assert stats["hit_tokens"] >= 3 * 16, stats


def test_a_row_restored_again_from_a_longer_prefix_counts_its_hits_once(family):
    """Six requests share 20 tokens, of which 8 are cached: each restores 8, one computes the rest to 20 while
    the others wait, then those restore 20. The hit rate counts each request's lookup once and its longest
    restore once (a second restore counted whole took it past 1)."""
    name, ref, ours = family
    shared = random_prompts([20], vocab=90, seed=45)[0]
    prompts = [shared + [3 + k] for k in range(6)]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=120, max_batch_tokens=4, max_requests_per_batch=6)
    with ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=config, **CUT) as manager:
        check(ref, [shared[:9]], run(manager, [shared[:9]]))  # caches its first 8 tokens
        check(ref, prompts, run(manager, prompts))
        stats = manager.cache.memory_stats()["prefix_cache"]
    assert stats["lookup_tokens"] == 9 + 6 * 21, stats
    assert stats["hit_tokens"] == 8 + 5 * 20, stats


@pytest.mark.parametrize("unit", [1, 4, 8])
def test_the_prefix_shared_with_peers_is_the_longest_whole_unit_one(unit):
    """`Scheduler.shared_with_peers` against its definition, on random prompts that share prefixes of every
    length with their peers: the longest whole-unit prefix, short of the request's last token, that its tokens
    share with another request's prompt (a prompt with media, or the request itself, does not count)."""
    import random

    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    def request(prompt, generated=(), media=None):
        return Request("r", list(prompt), 8, frozenset(), generated=list(generated), media=media)

    def definition(mine, peers):
        tokens = mine.prompt + mine.generated
        best = 0
        for other in peers:
            if other is mine or other.media is not None:
                continue
            n = 0
            while n < min(len(tokens) - 1, len(other.prompt)) and tokens[n] == other.prompt[n]:
                n += 1
            best = max(best, n // unit * unit)
        return best if best >= unit else 0

    rng = random.Random(unit)
    for _ in range(300):
        base = [rng.randrange(3) for _ in range(rng.randrange(1, 50))]
        peers = [request(base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(8))],
                         media={"pixel_values": None} if rng.random() < 0.1 else None)
                 for _ in range(rng.randrange(4))]
        cut = rng.randrange(len(base) + 1)
        mine = request(base[:cut] or [0], base[cut:])  # part of its tokens generated (a preempted request)
        peers.append(mine)
        scheduler = Scheduler(max_rows=8, max_batch_tokens=64, prefill_first=True, unit=unit)
        for peer in peers:  # (the peers are found through the scheduler's index, as the manager wires it)
            scheduler.submit(peer)
        shared, peer = scheduler.shared_with_peers(mine)
        assert shared == definition(mine, peers), (mine, peers)
        assert (peer is None) == (shared == 0) and (peer is None or definition(mine, [peer]) == shared)


def test_rows_waiting_for_an_older_rows_prefix_step_aside_for_other_prefixes():
    """Three groups of prompts whose shared prefixes have the same length (stop 16) but other tokens, admitted
    group by group: the first of each group computes its prefix; the others wait for it and are ordered after
    every row that can run, so the first rows of the other groups join the first group's prefill step (before,
    an equal stop counted as the same prefix, and the waiting rows ended the step). Once a group's prefix is in,
    its rows come back in admission order."""
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    groups = [random_prompts([16], vocab=90, seed=60 + g)[0] for g in range(3)]
    requests = [Request(f"g{g}q{q}", groups[g] + [1 + q] * 4, 4, frozenset()) for g in range(3) for q in range(3)]
    scheduler = Scheduler(max_rows=9, max_batch_tokens=64, prefill_first=True, unit=4)
    for request in requests:
        scheduler.submit(request)
        request.stop_prefix_at(16)  # as the runner's restore sets it: these share their first 16 tokens
    scheduler.admit()
    leaders = [requests[0], requests[3], requests[6]]
    assert scheduler.rows[:3] == leaders and set(scheduler.rows[3:]) == set(requests) - set(leaders)
    assert [r.admitted for r in scheduler.rows[3:]] == sorted(r.admitted for r in scheduler.rows[3:])
    assert scheduler.prefill_chunks() == [16, 16, 16]  # each leader to its stop, in one step
    for leader in leaders[:2]:  # two prefixes computed and restored by their groups' other rows
        leader.held = 16
    for request in requests[1:3] + requests[4:6]:
        request.held = 16
    scheduler.order()
    assert scheduler.rows[:6] == [requests[0], requests[1], requests[2], requests[3], requests[4], requests[5]]
    assert scheduler.rows[6] is requests[6] and set(scheduler.rows[7:]) == {requests[7], requests[8]}


def test_the_scheduler_finds_requests_sharing_a_prompts_first_unit_until_they_end():
    """Placing a request looks for the requests in flight or waiting that share its prompt's first unit
    (`Scheduler.sharing_head`, an index, not a pass over the queue): submitted requests are found while they wait,
    run and wait again after preemption, and not once released; prompts shorter than a unit are not indexed."""
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    head = [5, 6, 7, 8]
    a, b = Request("a", head + [1, 2], 4, frozenset()), Request("b", head + [3], 4, frozenset())
    other, short = Request("c", [9, 6, 7, 8, 1], 4, frozenset()), Request("d", head[:3], 4, frozenset())
    scheduler = Scheduler(max_rows=2, max_batch_tokens=64, prefill_first=True, unit=4)
    for request in (a, b, other, short):
        scheduler.submit(request)
    key = hash(tuple(head))
    assert scheduler.sharing_head(key) == [a, b] and scheduler.sharing_head(hash((9, 6, 7, 8))) == [other]
    assert scheduler.admit() == [a, b] and scheduler.sharing_head(key) == [a, b]  # running
    scheduler.preempt(b)
    assert scheduler.sharing_head(key) == [a, b]  # waiting again
    scheduler.release(a)
    scheduler.release(a)  # (a second release changes nothing)
    assert scheduler.sharing_head(key) == [b]
    scheduler.release(b)
    assert scheduler.sharing_head(key) == [] and not scheduler._by_head.get(key)
    scheduler.release(short)
    scheduler.release(other)
    assert not scheduler._by_head


def test_a_prefix_that_cannot_be_cached_fails_no_request(family, monkeypatch):
    """Caching a prefix after a step landed is optional: when it raises (a snapshot's copy out of memory, say),
    the step's requests go on and finish exactly; the prefix is only a later miss."""
    name, ref, ours = family
    shared = random_prompts([18], vocab=90, seed=51)[0]
    prompts = [shared + q for q in random_prompts([3, 5], vocab=90, seed=52)]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=8, max_requests_per_batch=2)
    with ours.continuous_batching_context_manager(greedy(NEW), continuous_batching_config=config, **CUT) as manager:
        failures = []

        def refuse(*args, **kwargs):
            failures.append(args[0])
            raise RuntimeError("no memory for a snapshot")

        monkeypatch.setattr(manager.cache, "cache_prefix", refuse)
        monkeypatch.setattr(manager.cache, "snapshot_row", refuse)
        results = run(manager, prompts)
        check(ref, prompts, results)
        assert manager.stats["failed_steps"] == 0
    assert failures  # the inserts were tried (and refused)


def test_prompts_prefilled_in_one_grouped_step_each_cache_their_prefix(family):
    """Three prompts admitted together share one grouped step's budget (each row a chunk of its own): every
    chunk still stops at its row's snapshot point, so the same prompts with more after them restore it."""
    name, ref, ours = family
    prompts = random_prompts([13, 10, 15], vocab=90, seed=41)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=64, max_requests_per_batch=3)
    manager = ours.init_continuous_batching(greedy(NEW), config, grouped_steps=True, **CUT)
    first = manager.add_requests(prompts)  # queued before the loop starts: admitted together
    manager.start()
    try:
        results = collect_results(manager, len(prompts))
        check(ref, prompts, [results[i] for i in first])
        before = manager.cache.memory_stats()["prefix_cache"]["hit_tokens"]
        again = [p + [7, 8] for p in prompts]
        check(ref, again, run(manager, again))
        hits = manager.cache.memory_stats()["prefix_cache"]["hit_tokens"] - before
        stats = dict(manager.stats)
    finally:
        manager.stop(block=True)
    assert stats["grouped_steps"] > 0
    assert hits >= sum((len(p) - 1) // 4 * 4 for p in prompts), hits


def test_a_request_sharing_a_prefix_with_one_mid_prefill_restores_it_from_there(family, monkeypatch):
    """A request arriving while an older one is still prefilling the prefix they share (a system prompt two users send
    a moment apart): the older one stops at the shared unit boundary to cache its state there, the newer one waits
    and restores it, so the prefix is computed once (before, the newer one computed it again in full)."""
    from helpers.serving import serve_queued

    name, ref, ours = family
    system = random_prompts([24], vocab=90, seed=41)[0]
    users = random_prompts([6, 5], vocab=90, seed=42)
    prompts = [system + u for u in users]  # 30 and 29 tokens: 24 shared, snapshot points 28 and 28
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=8, max_requests_per_batch=2)
    manager = ours.init_continuous_batching(greedy(NEW), config, **CUT)
    runner, sent = manager.runner, []
    prefill = runner.prefill

    def prefill_then_send(chunks):  # the second request arrives after the first one's first chunk
        out = prefill(chunks)
        if not sent:
            sent.append(manager.add_request(prompts[1], request_id="second"))
        return out

    restored = []  # (request, tokens its row starts from) at each restore
    restore = runner._restore
    monkeypatch.setattr(runner, "prefill", prefill_then_send)
    monkeypatch.setattr(runner, "_restore", lambda row, r: restore(row, r) or restored.append((r.request_id, r.held)))
    first = manager.add_request(prompts[0], request_id="first")
    results = serve_queued(manager, 2)
    check(ref, prompts, [results[first], results["second"]])
    assert ("second", len(system)) in restored  # it restored the shared 24 tokens the first one cached


def test_a_peer_gets_the_shared_stop_only_in_flight_and_without_a_stop_of_its_own_ahead():
    """`Scheduler.plan_prefix_stop`: a request sharing 8 tokens (2 units) with an older one stops there; the older
    one, in flight and short of them, stops there too (it computes the prefix, the newer restores it), unless it
    already stops further on, or waits without a row (its own restore plans its stop when it is placed)."""
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    for peer_stop, admitted, expected in [(0, True, 8), (16, True, 16), (0, False, 0)]:
        scheduler = Scheduler(max_rows=4, max_batch_tokens=64, prefill_first=True, unit=4)
        older = Request("older", shared + [1] * 12, 4, frozenset())
        newer = Request("newer", shared + [2] * 6, 4, frozenset())
        scheduler.submit(older)
        if admitted:
            scheduler.admit()
        older.stop_prefix_at(peer_stop)
        scheduler.submit(newer)
        scheduler.plan_prefix_stop(newer, matched=0)
        assert newer.prefix_stop == 8
        assert older.prefix_stop == expected, (peer_stop, admitted)


@pytest.mark.parametrize(("held", "peer", "gap", "expected"), [
    (0, 0, 0, 28), (0, 0, 29, 28), (0, 0, 30, 0),  # a fresh row: all 30 tokens to feed
    (16, 0, 13, 28), (16, 0, 14, 0),  # restored at 16: 14 tokens after it
    (0, 24, 5, 28), (0, 24, 6, 0),  # no restore, but its prefill stops at 24 (shared with a peer) and caches it there
    (28, 0, 0, 0),  # restored at its snapshot point: nothing to cut
], ids=["fresh-gap0", "fresh-gap29", "fresh-gap30", "restored-gap13", "restored-gap14", "peer-gap5", "peer-gap6",
        "restored-at-point"])
def test_the_snapshot_point_is_cut_only_past_the_gap(held, peer, gap, expected):
    """`Scheduler.plan_prefix_stop`: a 30-token prompt's snapshot point (28, units of 4) stops its prefill only when
    more than ``snapshot_gap`` of its tokens come after both the prefix its row was restored from and its stop; an
    older request given the stop it shares has its own snapshot point planned again."""
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    prompt = list(range(1, 31))
    scheduler = Scheduler(max_rows=4, max_batch_tokens=64, prefill_first=True, unit=4, snapshot_gap=gap)
    if peer:  # an older request in flight that shares the prompt's first `peer` tokens, then differs (30 tokens)
        other = Request("older", prompt[:peer] + [99] * 6, 4, frozenset())
        scheduler.submit(other)
        scheduler.admit()
        scheduler.plan_prefix_stop(other, matched=0)  # (its row placed: nothing cached, no peer yet)
        assert other.prefix_stop == 0 and other.snapshot_at == 28
    request = Request("r", prompt, 4, frozenset())
    scheduler.submit(request)
    request.held = request.prefix_hit = held  # (restored there, as `ModelRunner._restore` does)
    scheduler.plan_prefix_stop(request, matched=held)
    assert request.prefix_stop == (peer if peer > held else 0)
    assert request.snapshot_at == expected
    if peer:  # the older one now stops at the shared prefix too, and its snapshot point (28) is planned again
        assert other.prefix_stop == peer and other.snapshot_at == expected


@pytest.mark.parametrize("routed", [False, True], ids=["eager", "graph-path"])
def test_a_hit_within_the_gap_prefills_its_rest_in_one_step(family, monkeypatch, routed):
    """A system prompt cached with a snapshot; requests that continue it by a question of at most
    ``prefix_snapshot_gap`` tokens prefill the question in one step (no stop at its snapshot point); with less the
    same question takes a step to its snapshot point and one for its last tokens. Tokens equal transformers' alone
    either way, and a request that resends the first question's prompt again restores the system prompt (with the
    gap: no snapshot was kept past it) or the snapshot point (without). ``routed``: each step a GPU replays from a
    recorded graph (the restored row's short prefill steps among them) takes that path."""
    from helpers.serving import steps_routed_as_on_a_gpu

    name, ref, ours = family
    system = random_prompts([16], vocab=90, seed=51)[0]
    question = system + random_prompts([7], vocab=90, seed=52)[0]  # 23 tokens: 7 after the system's, snapshot point 20
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=32, max_requests_per_batch=2)

    def served(gap: int) -> tuple[list, int]:
        manager = ours.init_continuous_batching(greedy(NEW), config, prefix_snapshot_gap=gap)
        ran, runner = [], manager.runner
        prefill = runner.prefill
        monkeypatch.setattr(runner, "prefill", lambda chunks: ran.append(list(chunks)) or prefill(chunks))
        routing = steps_routed_as_on_a_gpu() if routed else contextlib.nullcontext([])
        with routing as graph_steps:
            manager.start()
            steps, again, replayed = _hits(manager, ran, graph_steps)
        # On the graphs' path the question's prefill steps are the recorded step's (its decode steps too: length 1).
        assert replayed == ([n for chunks in steps for n in chunks] if routed else []), (replayed, steps)
        assert pools_full(manager.cache)
        return steps, again

    def _hits(manager, ran, graph_steps) -> tuple[list, int, list]:
        try:
            check(ref, [system + [5]], run(manager, [system + [5]]))  # caches the system prompt's 16 tokens
            ran.clear()
            graph_steps.clear()
            check(ref, [question], run(manager, [question]))
            steps, replayed = list(ran), [n for n in graph_steps if n > 1]
            before = manager.cache.memory_stats()["prefix_cache"]["hit_tokens"]
            check(ref, [question], run(manager, [question]))
            again = manager.cache.memory_stats()["prefix_cache"]["hit_tokens"] - before
        finally:
            manager.stop(block=True)
        return steps, again, replayed

    assert served(gap=7) == ([[7]], 16)
    assert served(gap=6) == ([[4], [3]], 20)


@pytest.mark.parametrize(("gap", "expected"), [(13, 28), (14, 0)], ids=["gap13", "gap14"])
def test_a_prefilling_row_that_finds_blocks_cached_further_stops_there(gap, expected):
    """`ModelRunner.retry_restores`: a row mid-prefill (8 of 30 tokens fed) whose tokens another request has since
    cached as blocks up to 16, with no snapshot past its own 8, stops its prefill at 16 to cache its state there for
    others; its snapshot point (28) is planned again from that stop (`Scheduler.plan_prefix_stop`)."""
    from types import SimpleNamespace

    import torch
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.runner import ModelRunner
    from hf_qsa_cache.serving.scheduler import Scheduler

    cache = SimpleNamespace(prefix=SimpleNamespace(version=1, unit=4),
                            prefix_lookup=lambda tokens, limit: (8, 16))  # (restorable, blocks matched)
    runner = ModelRunner(torch.nn.Linear(1, 1), cache)
    scheduler = Scheduler(max_rows=2, max_batch_tokens=8, prefill_first=True, unit=4, snapshot_gap=gap)
    runner.plan_prefix_stop = scheduler.plan_prefix_stop
    request = Request("r", list(range(1, 31)), 4, frozenset())
    scheduler.submit(request)
    runner.rows = scheduler.admit()
    request.held, request.prefix_seen = 8, 0  # (fed from an empty row; its last look at version 0)
    scheduler.plan_prefix_stop(request, matched=0)
    assert request.prefix_stop == 0 and request.snapshot_at == 28
    assert not runner.retry_restores()  # (nothing restores further than its 8)
    assert request.prefix_stop == 16 and request.snapshot_at == expected
