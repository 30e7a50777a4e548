"""The host part of a decode step does work proportional to the rows, never to their lengths, and its block-table
work proportional to the rows that change.

Counted, not timed: every block-table entry the host visits or changes is counted (`BlockTable.work`),
and the device copy of a table is refreshed only by the entries that changed. A decode step at
131072 tokens must cost exactly what it costs at 4096; rows that stay within their blocks and windows add no
call of the tables' per-row work.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import helpers.inkling as inkling
from helpers.qwen4 import tiny_config

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.blocks import BlockTable

ROWS = 8


def _decode_cost(config, prompt_len: int, steps: int) -> tuple[int, int]:
    """(table entries the host touched, device-table entries written) over ``steps`` decode steps."""
    cache = QSAPagedCache(config, max_batch_size=ROWS, max_cache_len=131072 + steps, block_size=8)
    with cache.step(ROWS, prompt_len, None, "cpu"):
        pass
    for table in cache.tables.values():
        table.device_table(ROWS, "cpu")  # the prefill's own changes land first
        table.work = 0
    written = 0
    for _ in range(steps):
        pending = sum(len(t._changed) for t in cache.tables.values())
        with cache.step(ROWS, 1, None, "cpu") as meta:
            assert meta.block_tables["main"].shape == (ROWS, cache.tables["main"].max_columns)
        written += pending
    written += sum(len(t._changed) for t in cache.tables.values())
    return sum(t.work for t in cache.tables.values()), written


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_decode_host_work_does_not_grow_with_length(family):
    config = tiny_config() if family == "qwen4_exp" else inkling.make_config()
    steps = 16  # two whole blocks of 8: every table allocates (and windows release) within them
    short = _decode_cost(config, 4096, steps)
    long = _decode_cost(config, 131072, steps)
    assert short == long
    assert 0 < short[0] <= 4 * ROWS * steps  # a few entries per row per block boundary, not per position


def _rows_at(config, lengths: list[int]) -> QSAPagedCache:
    """A cache whose rows hold ``lengths`` tokens (one left-padded prefill step)."""
    cache = QSAPagedCache(config, max_batch_size=len(lengths), max_cache_len=1024, block_size=8)
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
    with cache.step(len(lengths), width, mask, "cpu"):
        pass
    return cache


def _decode_calls(cache) -> Counter:
    """Calls of the block tables' per-row work (`BlockTable` methods) in one decode step of every row."""
    calls = Counter()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("reserve", "release_out_of_window", "release_row", "_set", "_take", "_unref"):
            def counted(self, *args, _name=name, _method=getattr(BlockTable, name)):
                calls[_name] += 1
                return _method(self, *args)
            patch.setattr(BlockTable, name, counted)
        with cache.step(cache.rows.count, 1, None, "cpu"):
            pass
    return calls


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_decode_host_work_follows_the_rows_that_change(family):
    """Rows a decode step leaves within their blocks and windows cost no call: with the same rows reserving a block
    or releasing one out of a window, a step over 8 rows and a step over those 8 plus 56 such rows do the same
    table work (calls counted, not time)."""
    config = tiny_config() if family == "qwen4_exp" else inkling.make_config()
    active = list(range(40, 48))  # every position within a block of 8: some rows reserve, some release
    quiet = next(n for n in range(49, 120) if not _decode_calls(_rows_at(config, [n])))
    few = _decode_calls(_rows_at(config, active))
    assert few["reserve"] > 0 and (family == "qwen4_exp" or few["release_out_of_window"] > 0)
    assert _decode_calls(_rows_at(config, active + [quiet] * 56)) == few
