"""Prefix caching under faults: a fault at any torch call of a step over rows started from cached prefixes, of a
prefill that restores and caches prefixes, or of a restore itself, changes no shared block, no snapshot, no
reference count and no cached entry; the host state is what it was, and the retried work gives the logits of a
run that never failed (both families). Set HF_QSA_FAULTS=all to try every call."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.faults import FailAt, Injected, count_calls, host_state, sample_points

from helpers.qwen4 import left_pad
from test_prefix_cache import cached_pages, family, feed

from hf_qsa_cache import QSAPagedCache

EVERY = os.environ.get("HF_QSA_FAULTS") == "all"


def record(cache) -> tuple:
    """What no failed work may change: the host state, every table's references, cached and idle blocks, the
    cached entries (and which snapshot each holds) and the cached blocks' pages and snapshots' tensors."""
    prefix = cache.prefix
    entries = sorted((e.serial, id(e.snapshot), tuple(sorted((n, tuple(b)) for n, b in e.blocks.items())))
                     for e in prefix.entries.values())
    tables = {n: (list(t.refs), sorted(t.cached), t.idle) for n, t in cache.tables.items()}
    snapshots = [t.clone() for e in prefix.entries.values() if e.snapshot is not None
                 for t in [*e.snapshot.state, *(p for _, pages in e.snapshot.windows.values() for p in pages)]]
    return host_state(cache), tables, entries, cached_pages(cache), snapshots


def same(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3]
    for x, y in zip(a[3] + a[4], b[3] + b[4]):
        assert torch.equal(x, y), "a failed forward wrote a cached block or a snapshot"


def points(total: int) -> list[int]:
    return list(range(1, total + 1)) if EVERY else sample_points(total, dense_until=40, spread=20)


@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
@torch.no_grad()
def test_faults_change_no_cached_prefix(name):
    ref, ours, prompt, block = family(name)
    a, c = prompt(5 * block - 1, 1), prompt(3 * block + 2, 3)
    b = a[: 4 * block + 1] + prompt(block, 2)  # diverges inside the unit after a's cached 4 units
    # (prefix_snapshot_gap=0: the prefill from cached prefixes stops at the prompts' snapshot points, as longer ones')
    cache = QSAPagedCache(ours.config, 2, 8 * block, block_size=block, prefix_caching=True, prefix_snapshot_gap=0)
    feed_whole = lambda prompts: feed(ours, cache, prompts, keep=1)  # noqa: E731 (a prefill from cached prefixes)
    feed_whole([a, c])  # caches a at 4 blocks, c at 3
    cache.reset()

    # 1. A step over rows started from cached prefixes.
    def restored():
        cache.reset()
        return [cache.restore_prefix(0, b, limit=len(b) - 1), cache.restore_prefix(1, a, limit=len(a) - 1)]

    held = restored()
    assert held == [4 * block, 4 * block]
    ids, mask = left_pad([b[held[0]:], a[held[1]:]])

    def step():  # the model's forward only (what a fault may hit; the test runs under no_grad)
        return ours(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1)

    clean = step().logits
    restored()
    total = count_calls(step)
    for i, n in enumerate(points(total)):
        restored()
        before = record(cache)
        with pytest.raises(Injected), FailAt(n) as mode:
            step()
        assert cache.lengths[:2] == held, (n, total, mode.where)
        same(record(cache), before)
        if i % 8 == 0:
            torch.testing.assert_close(step().logits, clean, atol=1e-5, rtol=0)

    # 2. A prefill that restores prefixes, stops at a boundary to snapshot, and would cache it.
    c2 = c + prompt(block + 1, 4)

    def start():  # the cached prefixes of a and c, no row
        cache.reset(prefixes=True)
        feed_whole([a, c])
        cache.reset()
        return record(cache)

    before = start()
    ids2, mask2 = left_pad([b, c2])

    def prefill():
        return ours(input_ids=ids2, attention_mask=mask2, past_key_values=cache, logits_to_keep=1)

    total = count_calls(prefill)
    before = start()
    failed = 0
    for n in points(total):
        try:
            with FailAt(n):
                prefill()
        except Injected:
            failed += 1
            assert cache.num_rows == 0 or not any(cache.lengths)
            same(record(cache), before)
            continue
        before = start()  # the fault came after the forward landed: start the next try where this one did
    assert failed
    got = prefill().logits[:, -1]
    for i, p in enumerate([b, c2]):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)
    for table in cache.tables.values():
        table.check_accounting()

    # 3. A restore that fails half way leaves its row empty and the entries as they were.
    cache.reset()
    before = record(cache)
    reached = []
    total = count_calls(lambda: reached.append(cache.restore_prefix(0, b)))
    cache.reset()
    for n in points(total):
        with pytest.raises(Injected), FailAt(n):
            cache.restore_prefix(0, b)
        assert cache.lengths[0] == 0 and not any(t.rows[0] for t in cache.tables.values())
        for table in cache.tables.values():
            table.check_accounting()
        after = record(cache)
        assert after[1:3] == before[1:3]
    assert cache.restore_prefix(0, b) == reached[0] > 0
