"""Step metadata: hand-checked cases of the torch specification, and the Triton builder against it.

The Triton comparison runs each case as a script under the Triton interpreter (`interpreter.py`), with
TRITON_INTERPRET=1, because the variable is only honoured if it is set before triton is first imported, and
other tests in the same pytest process may already have imported it.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from hf_qsa_cache.metadata import QSAGeometry, build_step_metadata_torch, max_compress_work
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter

NUM_LAYOUTS = 240
SEED = 20240611


def _t(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# ----------------------------------------------------------------------------- hand-checked spec


def _spec(prev_len, count, query_len, tables, block_sizes, qsa):
    return build_step_metadata_torch(prev_len, count, query_len, tables, block_sizes, qsa, prev_len.tolist(),
                                     count.tolist())


def test_spec_single_row_group_boundaries():
    # r=4, prev_len=3, count=5, L=6: one pad column, then positions 3..7 (seq_len 8).
    # "main": block size 4, table [5, 9]; "swa": block size 2, table [7, 0, 3] (null entry, and too
    # narrow for positions 6 and 7, which live in logical block 3).
    meta = _spec(
        _t([3]),
        _t([5]),
        6,
        {"main": _t([[5, 9]]), "swa": _t([[7, 0, 3]])},
        {"main": 4, "swa": 2},
        QSAGeometry(compress_ratio=4, ring_capacity=4),
    )
    assert meta.token_row.tolist() == [0, 0, 0, 0, 0, 0]
    assert meta.position.tolist() == [-1, 3, 4, 5, 6, 7]
    # pos 3 -> block 5 offset 3; pos 4..7 -> block 9 offsets 0..3.
    assert meta.slots["main"].tolist() == [-1, 23, 36, 37, 38, 39]
    # pos 3 -> logical 1 (null block 0) offset 1; 4, 5 -> block 3; 6, 7 -> logical 3, past width 3.
    assert meta.slots["swa"].tolist() == [-1, 1, 6, 7, -1, -1]
    # (pos + 1) // 4: group 0 closes at pos 3, group 1 at pos 7.
    assert meta.visible_blocks.tolist() == [0, 1, 1, 1, 1, 2]
    # cap 4: only columns 2..5 (positions 4..7) go to the ring, at pos % 4.
    assert meta.ring_slot.tolist() == [-1, -1, 0, 1, 2, 3]
    # groups [3 // 4, 8 // 4) = {0, 1}; W = 1 * ceil(6 / 4) = 2.
    assert meta.compress_work.tolist() == [[0, 0], [0, 1]]
    for name, dtype in [
        ("token_row", torch.int32), ("position", torch.int64), ("visible_blocks", torch.int32),
        ("ring_slot", torch.int64), ("compress_work", torch.int32),
    ]:
        assert getattr(meta, name).dtype == dtype, name
    assert all(s.dtype == torch.int64 for s in meta.slots.values())


def test_spec_ragged_rows_with_empty_row():
    # r=2, L=3, cap 2; rows: (prev 4, count 3), (prev 9, count 0: all pads), (prev 1, count 2).
    # "main": block size 4 (2 compressed rows per block), tables [3, 8, 0], [0, 0, 0], [6, 0, 0].
    meta = _spec(
        _t([4, 9, 1]),
        _t([3, 0, 2]),
        3,
        {"main": _t([[3, 8, 0], [0, 0, 0], [6, 0, 0]])},
        {"main": 4},
        QSAGeometry(compress_ratio=2, ring_capacity=2),
    )
    assert meta.token_row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert meta.position.tolist() == [4, 5, 6, -1, -1, -1, -1, 1, 2]
    assert meta.slots["main"].tolist() == [32, 33, 34, -1, -1, -1, -1, 25, 26]
    # row 0: (5, 6, 7) // 2; row 2: (2, 3) // 2.
    assert meta.visible_blocks.tolist() == [2, 3, 3, 0, 0, 0, 0, 1, 1]
    # only columns 1, 2 go to the ring: row * 2 + pos % 2.
    assert meta.ring_slot.tolist() == [-1, 1, 0, -1, -1, -1, -1, 5, 4]
    # row 0 closes group 2, row 1 none, row 2 group 0; W = 3 * ceil(3 / 2) = 6.
    assert meta.compress_work.tolist() == [[0, 2], [2, 0], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert max_compress_work(3, 3, 2) == 6


def test_spec_without_qsa():
    meta = _spec(_t([0, 2]), _t([1, 2]), 2, {"main": _t([[4], [7]])}, {"main": 8}, None)
    assert meta.position.tolist() == [-1, 0, 2, 3]
    assert meta.slots["main"].tolist() == [-1, 32, 58, 59]
    assert meta.visible_blocks is None and meta.ring_slot is None
    assert meta.compress_work is None
    assert meta.host_prev_len == [0, 2] and meta.host_count == [1, 2] and meta.max_seq_len == 4


# ----------------------------------------------------------------------------- triton vs spec


def _random_prev_len(rng: random.Random, r: int) -> int:
    kind = rng.randrange(5)
    if kind == 0:
        return 0
    if kind == 1:  # at a group boundary
        return r * rng.randrange(0, 12)
    if kind == 2:  # just before a boundary: the first token closes a group
        return r * rng.randrange(1, 12) - 1
    if kind == 3:  # a few tokens into a group, so the step straddles a boundary
        return r * rng.randrange(0, 12) + rng.randrange(1, r)
    return rng.randrange(0, 150)


def _random_count(rng: random.Random, query_len: int) -> int:
    kind = rng.randrange(4)
    if kind == 0:
        return 0  # empty row
    if kind == 1:
        return query_len  # full row
    return rng.randint(1, query_len)  # usually left pads


def _random_table(rng: random.Random, num_rows: int, needed: int) -> torch.Tensor:
    # Sometimes narrower than needed (slots past the width must be -1), never empty.
    width = max(1, needed + rng.choice([-2, -1, 0, 0, 0, 1, 3]))
    ids = [[0 if rng.random() < 0.2 else rng.randrange(1, 5000) for _ in range(width)] for _ in range(num_rows)]
    table = torch.tensor(ids, dtype=torch.int32)
    if rng.random() < 0.25:  # a column slice of a wider buffer: row stride != width
        wide = torch.zeros(num_rows, width + 3, dtype=torch.int32)
        wide[:, :width] = table
        table = wide[:, :width]
    return table


def _random_case(rng: random.Random):
    num_rows = rng.randint(1, 9)
    query_len = rng.randint(1, 40)
    r = rng.choice([2, 3, 4, 8])
    spec = rng.randint(0, 5)  # speculative headroom in the raw-key ring
    cap = r * -(-(r + spec) // r)
    prev_len = [_random_prev_len(rng, r) for _ in range(num_rows)]
    count = [_random_count(rng, query_len) for _ in range(num_rows)]
    max_seq = max(p + c for p, c in zip(prev_len, count))

    names = ["main", "swa", "conv"][: rng.randint(1, 3)]
    qsa_table = rng.choice(names)
    block_sizes = {}
    for name in names:
        if name == qsa_table:
            block_sizes[name] = r * rng.randint(1, 4)  # whole groups per block
        else:
            block_sizes[name] = rng.choice([1, 2, 3, 5, 8, 16])
    tables = {name: _random_table(rng, num_rows, -(-max_seq // block_sizes[name])) for name in names}
    qsa = None if rng.random() < 0.15 else QSAGeometry(compress_ratio=r, ring_capacity=cap, table=qsa_table)
    return (_t(prev_len), _t(count), query_len, tables, block_sizes, qsa)


def _edge_cases() -> dict:
    """Named layouts at the edges, each a list of cases (the empty batch, which launches nothing, beside one that
    launches)."""
    one = {"main": _t([[3]])}
    rows = 70  # more rows than one prefix-sum chunk, every row closing groups
    return {
        "first-decode-token": [(_t([0]), _t([1]), 1, one, {"main": 4}, QSAGeometry(4, 4))],
        "decode-closing-a-group": [(_t([7]), _t([1]), 1, one, {"main": 8}, QSAGeometry(8, 8))],
        "all-pads": [(_t([5, 6]), _t([0, 0]), 3, {"main": _t([[1], [2]])}, {"main": 2}, QSAGeometry(2, 4))],
        "narrow-prefill": [(_t([0]), _t([40]), 40, {"main": _t([[1, 2]])}, {"main": 8}, QSAGeometry(8, 8))],
        "no-tables-then-empty-batch": [
            (_t([0, 1]), _t([1, 1]), 1, {}, {}, None),
            (_t([], torch.int32), _t([], torch.int32), 4, {"main": torch.zeros(0, 1, dtype=torch.int32)},
             {"main": 4}, QSAGeometry(2, 2))],
        "70-rows-past-one-prefix-chunk": [
            (torch.arange(rows, dtype=torch.int32), torch.full((rows,), 5, dtype=torch.int32), 5,
             {"main": torch.arange(1, rows * 4 + 1, dtype=torch.int32).view(rows, 4)}, {"main": 4},
             QSAGeometry(2, 4))],
    }


def _compare(case, build_triton):
    """First mismatch as a string, or None."""
    host = (case[0].tolist(), case[1].tolist())
    expected = build_step_metadata_torch(*case, *host)
    got = build_triton(*case, *host)
    if (got.num_rows, got.query_len) != (expected.num_rows, expected.query_len):
        return "num_rows/query_len differ"
    if got.prev_len is not case[0] or got.count is not case[1] or got.block_tables is not case[3]:
        return "inputs are not passed through unchanged"
    if (got.host_prev_len, got.host_count, got.max_seq_len) != (
            expected.host_prev_len, expected.host_count, expected.max_seq_len):
        return "host copies differ"
    fields = ["token_row", "position", "visible_blocks", "ring_slot", "compress_work"]
    pairs = [(f, getattr(expected, f), getattr(got, f)) for f in fields]
    if sorted(expected.slots) != sorted(got.slots):
        return f"slot tables differ: {sorted(expected.slots)} vs {sorted(got.slots)}"
    pairs += [(f"slots[{k}]", expected.slots[k], got.slots[k]) for k in expected.slots]
    for name, want, have in pairs:
        if want is None or have is None:
            if want is not have:
                return f"{name}: expected {want}, got {have}"
            continue
        if want.dtype != have.dtype or want.shape != have.shape or not torch.equal(want, have.cpu()):
            return f"{name}:\n  expected {want.dtype} {want.tolist()}\n  got      {have.dtype} {have.tolist()}"
    return None


def _describe(case) -> str:
    prev_len, count, query_len, tables, block_sizes, qsa = case
    lines = [f"prev_len={prev_len.tolist()} count={count.tolist()} query_len={query_len} qsa={qsa}"]
    for name, tab in tables.items():
        lines.append(f"  table {name}: block_size={block_sizes[name]} stride={tab.stride()} {tab.tolist()}")
    return "\n".join(lines)


def _random_cases(first: int, count: int) -> list:
    """Random layouts ``first`` to ``first + count - 1`` of the one sequence drawn from ``SEED``."""
    rng = random.Random(SEED)
    cases = [_random_case(rng) for _ in range(first + count)]
    return cases[first:]


def _check_cases(cases: list, first: int = 0) -> str | None:
    """Each case built by the kernel as by the specification, with exactly one launch per call (none for an empty
    batch): None, or the first mismatch."""
    from hf_qsa_cache.ops import metadata_triton

    launches: list = []
    count_launches(metadata_triton, "_step_metadata_kernel", launches)
    for i, case in enumerate(cases):
        launches.clear()
        error = _compare(case, metadata_triton.build_step_metadata_triton)
        n = case[0].shape[0] * case[2]
        if error is None and len(launches) != (1 if n else 0):
            error = f"{len(launches)} kernel launches"
        if error is not None:
            return f"case {first + i} mismatch: {error}\n{_describe(case)}"
    return None


# The edge layouts by name, then the random ones in chunks.
RANDOM_CHUNK = 40
KERNEL_CASES = list(_edge_cases()) + [f"random-layouts-{first}-to-{first + RANDOM_CHUNK - 1}"
                             for first in range(0, NUM_LAYOUTS, RANDOM_CHUNK)]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_builder_matches_spec(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import metadata_triton

    if not isinstance(metadata_triton._step_metadata_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    edge = _edge_cases()
    if case in edge:
        return _check_cases(edge[case])
    first = int(case.split("-")[2])
    return _check_cases(_random_cases(first, RANDOM_CHUNK), first)


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
