"""Whole-row writes into the cache's stores, gathered so that a layer's writes of one step go in one launch.

A QSA layer's step writes five stores: its keys and values into the paged K/V, the compressed keys of the groups
the step closes, and the newest raw index keys and their positions into the ring. In torch each is an
``index_copy_`` after a ``clamp_min`` of its rows (eight launches a layer, writes that share their rows clamping
once; each a microsecond or two for a few kilobytes). `RowWrites` collects them; `RowWrites.flush` runs them in
one launch where the ``qsa_writes`` fusion is on (`row_writes_triton.write_rows_triton`), else one by one in
torch (`row_writes_ref.write_slots` is the specification).
"""

from __future__ import annotations

import torch

from . import fusions, records_grad, use_triton
from .fp8 import FP8, write_fp8_rows
from .row_writes_ref import MAX_TARGETS, copy_rows, row_layout, write_slots

__all__ = ["MAX_TARGETS", "RowWrites", "fuses_row_writes", "row_layout", "write_slots"]

class RowWrites:
    """Pending ``store[rows] = values`` writes (`write_slots` each), run in the order added by `flush`. A caller
    that reads a store flushes first; the rows tensors must not change before then. Writes into an fp8 store
    (`add_quantized`) quantize as they write (`fp8.write_fp8_rows`); they join the others' one launch where it
    applies (no store is written twice in one flush, so their order against the others does not matter)."""

    def __init__(self):
        # ``(store, rows, values)``, or ``(store, rows, values, scales)`` for an fp8 store
        self.pending: list[tuple] = []

    def add(self, store: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.pending.append((store, rows, values))

    def add_quantized(self, store: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                      values: torch.Tensor) -> None:
        """``store[rows], scales[rows] = fp8.quantize_fp8(values)`` (an fp8 store and its scales)."""
        self.pending.append((store, rows, values, scales))

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        if fuses_row_writes(pending):
            from .row_writes_triton import write_rows_triton

            write_rows_triton(pending)
            return
        clamped = {}  # writes that share their rows (keys and values, a ring's keys and positions) clamp once
        for store, rows, values, *scales in pending:
            if id(rows) not in clamped:
                clamped[id(rows)] = rows.clamp_min(0)
            if scales:
                write_fp8_rows(store, scales[0], clamped[id(rows)], values)
            else:
                copy_rows(store, clamped[id(rows)], values)


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether the kernel's cast of a ``b`` value into an ``a`` store is torch's: the same dtype, or integers."""
    return a == b or not (a.is_floating_point or b.is_floating_point)


def fuses_row_writes(pending) -> bool:
    """Whether `RowWrites.flush` takes one launch: the ``qsa_writes`` fusion on, CUDA tensors, at most
    `MAX_TARGETS` writes, no autograd history to drop, each value cast as torch casts it (no float rounding; an fp8
    store's values any float, quantized exactly as the specification), and each store's and value's rows single
    strided runs (a store's contiguous; an fp8 store's scales contiguous, one per head of a row)."""
    return (fusions.enabled("qsa_writes") and 0 < len(pending) <= MAX_TARGETS
            and all(_one_strided_write(*target) for target in pending))


def _one_strided_write(store, rows, values, scales=None) -> bool:
    if scales is None:
        cast_ok = _same_kind(store.dtype, values.dtype)
    else:
        cast_ok = (values.is_floating_point() and store.dtype == FP8 and scales.is_contiguous()
                   and scales.shape == store.shape[:-1] and scales.device == store.device)
    return (use_triton(store) and rows.device == store.device and values.device == store.device
            and values.shape[1:] == store.shape[1:] and cast_ok
            and not records_grad(values) and row_layout(store) is not None and row_layout(store)[1] == 1
            and row_layout(values) is not None and rows.dim() == 1 and rows.numel() == values.shape[0])
