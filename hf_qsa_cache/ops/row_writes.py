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
from .fp8 import write_fp8_rows
from .row_writes_ref import MAX_TARGETS, copy_rows, row_layout, write_slots

__all__ = ["MAX_TARGETS", "RowWrites", "fuses_row_writes", "row_layout", "write_slots"]

class RowWrites:
    """Pending ``store[rows] = values`` writes (`write_slots` each), run in the order added by `flush`. A caller
    that reads a store flushes first; the rows tensors must not change before then. Writes into an fp8 store
    (`add_quantized`) quantize as they write (`fp8.write_fp8_rows`), one launch each on CUDA."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.quantized: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, store: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.pending.append((store, rows, values))

    def add_quantized(self, store: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                      values: torch.Tensor) -> None:
        """``store[rows], scales[rows] = fp8.quantize_fp8(values)`` (an fp8 store and its scales)."""
        self.quantized.append((store, scales, rows, values))

    def flush(self) -> None:
        quantized, self.quantized = self.quantized, []
        for store, scales, rows, values in quantized:
            if use_triton(store, rows, values) and not records_grad(values) and values.stride(-1) == 1:
                from .fp8_triton import write_fp8_rows_triton

                write_fp8_rows_triton(store, scales, rows, values)
            else:
                write_fp8_rows(store, scales, rows.clamp_min(0), values)
        pending, self.pending = self.pending, []
        if not pending:
            return
        if fuses_row_writes(pending):
            from .row_writes_triton import write_rows_triton

            write_rows_triton(pending)
        else:
            clamped = {}  # writes that share their rows (keys and values, a ring's keys and positions) clamp once
            for store, rows, values in pending:
                if id(rows) not in clamped:
                    clamped[id(rows)] = rows.clamp_min(0)
                copy_rows(store, clamped[id(rows)], values)


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether the kernel's cast of a ``b`` value into an ``a`` store is torch's: the same dtype, or integers."""
    return a == b or not (a.is_floating_point or b.is_floating_point)


def fuses_row_writes(pending) -> bool:
    """Whether `RowWrites.flush` takes one launch: the ``qsa_writes`` fusion on, CUDA tensors, at most
    `MAX_TARGETS` writes, no autograd history to drop, each value cast as torch casts it (no float rounding), and
    each store's and value's rows single strided runs (a store's contiguous)."""
    return (fusions.enabled("qsa_writes") and 0 < len(pending) <= MAX_TARGETS
            and all(use_triton(store) and rows.device == store.device and values.device == store.device
                    and values.shape[1:] == store.shape[1:] and _same_kind(store.dtype, values.dtype)
                    and not records_grad(values) and row_layout(store) is not None and row_layout(store)[1] == 1
                    and row_layout(values) is not None and rows.dim() == 1 and rows.numel() == values.shape[0]
                    for store, rows, values in pending))
