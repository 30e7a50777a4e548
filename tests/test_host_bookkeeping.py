"""The host bookkeeping of a step and of row placement stays right where it does less work.

* `BlockTable` under a seeded random sequence of what the cache does to it (steps that reserve and then
  commit or roll back, continuous batching's row moves, row copies, crops, releases, growth, resets): after
  every operation the device table equals the host rows, entries below a row's ``base`` are null, every block
  is held once or free, a move hands each row exactly its source's blocks, a rolled-back step leaves the
  table as it was, and a committed step has released what fell out of the window;
* moving a row costs its live blocks, not its length (windowed tables keep a long null prefix).
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_qsa_cache.blocks import NULL_BLOCK, BlockTable


# ----------------------------------------------------------------------------- block tables
def _check_table(t: BlockTable, rows: int) -> None:
    host = torch.zeros(t.max_rows, t.max_columns, dtype=torch.int32)
    for r, blocks in enumerate(t.rows):
        host[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    for n in {rows, t.max_rows}:
        assert torch.equal(t.device_table(n, "cpu"), host[:n]), f"{t.name}: device table != host rows"
    for r, blocks in enumerate(t.rows):
        assert 0 <= t.base[r] <= len(blocks) and all(b == NULL_BLOCK for b in blocks[: t.base[r]]), (
            f"{t.name}: row {r} holds a block below its base {t.base[r]}")
    held = [b for blocks in t.rows for b in blocks if b != NULL_BLOCK]
    assert len(held) == len(set(held)) and not set(held) & set(t.free), f"{t.name}: a block is held twice"
    assert len(held) + len(t.free) == t.num_blocks - 1, f"{t.name}: blocks leaked"


def _state(t: BlockTable):
    return [list(r) for r in t.rows], list(t.base), list(t.free), t.device_table(t.max_rows, "cpu").clone()


def _same(a, b) -> bool:
    return a[:3] == b[:3] and torch.equal(a[3], b[3])


@pytest.mark.parametrize("window", [None, 5, 9])
@pytest.mark.parametrize("seed", range(4))
def test_block_table_stays_right_under_random_operations(window, seed):
    rng = random.Random(seed)
    R, bs = 5, 2 if seed % 2 else 3
    t = BlockTable("t", 40 if window else 80, bs, R, 48, window=window)
    lengths = [0] * R
    rows = 0
    for op in range(300):
        kind = rng.choice(["step", "step", "step", "abort", "move", "select", "crop", "grow", "reset"])
        if kind in ("step", "abort") and rows:
            batch = rng.randint(1, rows)
            new = [lengths[b] + (rng.randint(0, 7) if rng.random() < 0.3 else rng.randint(0, 1)) for b in range(batch)]
            if max(new) > t.max_columns * bs:
                continue
            naive = sum(t.blocks_needed(b, n) for b, n in enumerate(new))
            assert t.blocks_needed_rows(new) == naive
            if naive > len(t.free):
                continue
            before = _state(t)
            t.begin_step(batch)
            t.reserve_rows(new)
            for b, n in enumerate(new):
                assert len(t.rows[b]) >= -(-n // bs)
                first = max(0, n - window + 1) // bs if window else 0
                assert all(x != NULL_BLOCK for x in t.rows[b][first: -(-n // bs)]), f"row {b} not addressable"
            if kind == "abort":
                t.rollback_step()
                assert _same(_state(t), before), "a rolled-back step changed the table"
            else:
                lengths[:batch] = new
                t.commit_step(lengths[:rows])
                if window:
                    for b in range(rows):
                        first = max(0, lengths[b] - window + 1) // bs
                        assert all(x == NULL_BLOCK for x in t.rows[b][:first]), f"row {b}: a block out of the window"
        elif kind == "move":
            n = rng.randint(0, R)
            keep = rng.sample(range(rows), min(rows, rng.randint(0, n)))
            src = keep + [-1] * (n - len(keep))
            rng.shuffle(src)
            snapshot = [(list(t.rows[s]), t.base[s]) if s >= 0 else ([], 0) for s in src]
            t.move_rows(src, rows)
            for i in range(max(rows, n)):
                want = snapshot[i] if i < n else ([], 0)
                assert (t.rows[i], t.base[i]) == want, f"move {src}: row {i}"
            lengths = [lengths[s] if s >= 0 else 0 for s in src] + [0] * (R - n)
            rows = n
        elif kind == "select" and rows:
            src = [rng.randrange(rows) for _ in range(rng.randint(1, R))]
            if t.blocks_for_select(src, rows) > len(t.free):
                continue
            contents = [[b != NULL_BLOCK for b in t.rows[s]] for s in src]
            t.select_rows(src, rows)
            assert [[b != NULL_BLOCK for b in t.rows[i]] for i in range(len(src))] == contents
            lengths = [lengths[s] for s in src] + [0] * (R - len(src))
            rows = len(src)
        elif kind == "crop" and rows:
            b = rng.randrange(rows)
            new = rng.randint(0, lengths[b])
            lo = max(0, new - window + 1) if window else 0
            if NULL_BLOCK in t.rows[b][lo // bs: -(-new // bs)]:
                continue  # the cache refuses a crop to positions already freed (`QSAPagedCache.crop`)
            lengths[b] = new
            t.truncate(b, new)
        elif kind == "grow":
            t.grow(t.num_blocks + rng.randint(0, 6), 48 + rng.randint(0, 12) * op // 30)
        elif kind == "reset" and rng.random() < 0.2:
            t.reset()
            lengths, rows = [0] * R, 0
        _check_table(t, max(rows, 1))


def test_moving_a_row_costs_its_live_blocks_not_its_length():
    """A windowed row 100k tokens long holds a few live blocks after a long null prefix: moving it (or
    releasing it) visits those, not the prefix."""
    for length in (1000, 100_000):
        t = BlockTable("conv", 64, 4, 4, 200_000, window=4)
        t.begin_step(2)
        t.reserve_rows([length, 7])
        t.commit_step([length, 7])
        t.device_table(4, "cpu")
        t.work = 0
        t.move_rows([1, 0, -1], 2)  # swap, a fresh row
        t.move_rows([1], 3)  # the long row leaves, the short one moves up
        assert t.work <= 12, (length, t.work)
        _check_table(t, 4)
