"""The cache's core pieces on their own: the layout's byte counts against what the stores allocate, `Rows` as
the one writer of per-row host state, and a step's plan as (row, token span) pieces."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from helpers.inkling import make_config as inkling_config
from helpers.qwen4 import tiny_config as qwen_config

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.layout import build_layout
from hf_qsa_cache.rows import Rows
from hf_qsa_cache.step import Piece, StepPlan

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hf_qsa_cache"

CONFIGS = {
    "qwen4_exp": lambda: qwen_config(),
    "qwen4_exp-no-ple": lambda: qwen_config(ple_layer_ids=[]),
    "inkling": lambda: inkling_config(),
}


@pytest.mark.parametrize("spec_tokens", [0, 3], ids=["no-headroom", "headroom-3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layout_bytes_equal_what_the_stores_allocate(name, dtype, spec_tokens):
    config = CONFIGS[name]()
    cache = QSAPagedCache(config, max_batch_size=3, max_cache_len=40, num_speculative_tokens=spec_tokens,
                          device="cpu", dtype=dtype)
    held = sum(size for store in cache.layer_stores() for size in store.nbytes().values())
    assert cache.layout.nbytes(3, dtype, step_undo=False) == held
    assert cache.layout.undo_bytes(3, dtype) == cache.undo.nbytes()
    assert cache.layout.nbytes(3, dtype) == held + cache.undo.nbytes()
    assert QSAPagedCache(config, 3, 40, device="cpu", dtype=dtype, step_undo=False).undo.nbytes() == 0
    for name, table in cache.tables.items():  # a block costs the same over the stores paged on its table
        paged = sum(t.numel() * t.element_size() for s in cache.layer_stores() if s.table == name
                    for t in s.paged_tensors())
        assert cache.layout.bytes_per_block(name, dtype) * table.num_blocks == paged


def test_layout_is_the_one_place_for_default_block_sizes():
    qwen = build_layout(qwen_config(indexer_compress_ratio=3, indexer_budget=6), max_rows=2, max_len=100)
    assert qwen.tables["main"].block_size == 66  # 64 rounded up to the compress ratio
    ink = build_layout(inkling_config(), max_rows=2, max_len=100)
    window = inkling_config().sliding_window_size
    assert ink.tables["main"].block_size == 64
    assert ink.tables["sliding"].block_size == min(64, 1 << (window - 1).bit_length())
    assert ink.tables["conv"].block_size == inkling_config().conv_kernel_size
    with pytest.raises(ValueError, match="block_size must be a multiple of indexer_compress_ratio=3, got block_size=4"):
        build_layout(qwen_config(indexer_compress_ratio=3, indexer_budget=6), max_rows=2, max_len=100, block_size=4)


def _filled(rows: int = 4) -> Rows:
    r = Rows(rows)
    for i, name in enumerate(Rows.PER_ROW):
        setattr(r, name, [100 * (i + 1) + b for b in range(rows)])
    r.count, r.columns = 3, 7
    return r


def test_rows_select_and_move_carry_every_per_row_field():
    r = _filled()
    r.select([2, 0])
    for i, name in enumerate(Rows.PER_ROW):
        assert getattr(r, name) == [100 * (i + 1) + 2, 100 * (i + 1), 0, 0], name
    assert (r.count, r.managed) == (2, False)
    r = _filled()
    r.move([-1, 1, 0])
    for i, name in enumerate(Rows.PER_ROW):
        assert getattr(r, name) == [0, 100 * (i + 1) + 1, 100 * (i + 1), 0], name
    assert (r.count, r.columns, r.managed) == (3, 7, True)


def test_rows_snapshot_restores_everything_and_is_not_aliased():
    r = _filled()
    snap = r.snapshot()
    r.advance([9, 9, 9], query_len=2, rope_deltas=[None, 5])
    r.raise_crop_floor(0, 10**6)
    r.move([1])
    r.restore(snap)
    assert r.snapshot() == snap
    r.lengths[0] = -1  # a later write must not reach the snapshot
    assert snap.fields["lengths"][0] != -1


def test_rows_advance_and_shorten():
    r = Rows(3)
    r.advance([4, 2], query_len=4, rope_deltas=[None, 7])
    assert (r.lengths, r.rope_deltas, r.count, r.columns) == ([4, 2, 0], [0, 7, 0], 2, 4)
    assert r.next_positions(2) == [4, 9]
    r.shorten(1)
    assert (r.lengths, r.columns) == ([3, 1, 0], 3)
    r.shorten([2, 0])  # each row its own count (verify steps in continuous batching); columns by the most
    assert (r.lengths, r.columns) == ([1, 1, 0], 1)
    r.raise_crop_floor(1, 5)
    r.raise_crop_floor(1, 2)  # floors only rise
    assert r.crop_floor == [0, 5, 0]


def _writes_to_row_state(tree: ast.AST) -> list[int]:
    """Lines that assign (or augment, or subscript-assign) a `Rows` field through an attribute."""
    fields = {*Rows.PER_ROW, "count", "columns", "managed"}
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            owner = getattr(target, "value", None)
            if isinstance(target, ast.Attribute) and target.attr in fields and getattr(owner, "attr", None) == "rows":
                lines.append(node.lineno)
    return lines


def test_rows_is_the_only_writer_of_row_state():
    """No module but rows.py assigns ``<x>.rows.<field>`` (a second writer is how a field is forgotten)."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "rows.py":
            continue
        lines = _writes_to_row_state(ast.parse(path.read_text()))
        if lines:
            offenders[str(path.relative_to(PACKAGE))] = lines
    assert offenders == {}


def test_the_writer_check_sees_a_write():
    assert _writes_to_row_state(ast.parse("cache.rows.lengths[0] = 3\nself.rows.count += 1\nx.lengths = 2")) == [1, 2]


def test_a_plan_is_pieces_of_rows_and_token_spans():
    plan = StepPlan(query_len=5, prev=[7, 0, 3], counts=[5, 2, 0])
    assert plan.rows == 3 and plan.new_lengths == [12, 2, 3]
    assert plan.pieces == [Piece(0, 7, 5), Piece(1, 0, 2), Piece(2, 3, 0)]


def test_a_cache_step_plans_what_it_runs():
    cache = QSAPagedCache(qwen_config(), max_batch_size=2, max_cache_len=32)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with cache.transaction(2, 3, mask) as step:
        assert step.plan.pieces == [Piece(0, 0, 2), Piece(1, 0, 3)]
        assert cache.open_step is step
    assert cache.open_step is None and cache.lengths[:2] == [2, 3]


def test_a_per_row_crop_refuses_bad_counts_before_changing_anything(qwen):
    import torch

    from hf_qsa_cache import QSAPagedCache
    from hf_qsa_cache.rollback import crop_rows

    cache = QSAPagedCache(qwen.config, 2, 32, block_size=4, num_speculative_tokens=2)
    with torch.no_grad():
        qwen(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), past_key_values=cache)
    for drops, message in (([1], "one count >= 0 for each of the cache's 2 rows"), ([1, -1], "one count >= 0"),
                           ([0, 3], "row 1 can go back 2 at most")):
        with pytest.raises(ValueError, match=message):
            crop_rows(cache, drops)
        assert cache.lengths[:2] == [4, 4]
    crop_rows(cache, [0, 2])
    assert cache.lengths[:2] == [4, 2]
