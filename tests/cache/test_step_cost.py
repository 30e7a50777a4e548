"""The host part of a decode step does work proportional to the rows, never to their lengths.

Counted, not timed: every block-table entry the host visits or changes is counted (`BlockTable.work`),
and the device copy of a table is refreshed only by the entries that changed. A decode step at
131072 tokens must cost exactly what it costs at 4096.
"""

from __future__ import annotations

import pytest
import helpers.inkling as inkling
from helpers.qwen4 import tiny_config

from hf_qsa_cache import QSAPagedCache

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
