"""`RowWrites`' specification: ``store[rows] = values`` as torch writes it, and how a tensor reads as rows (what
the one-launch kernel, `row_writes_triton`, and the dispatch's check share)."""

from __future__ import annotations

import torch

MAX_TARGETS = 5  # stores one launch writes (a QSA layer's five)


def write_slots(store: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``store[slot] = value`` for every token; slot -1 lands in the store's first row (a paged store's null block,
    never read). Stores keep values, not autograd history (a layer that reads this step's writes back takes
    `PagedKV.with_step_written`)."""
    copy_rows(store, slots.clamp_min(0), values)


def copy_rows(store: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """`write_slots` at rows already clamped (none negative)."""
    store.index_copy_(0, rows, values.detach().to(store.dtype))


def row_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """``(row stride, column stride)`` of ``t`` read as rows of ``t[0].numel()`` elements, or None where a row is
    not one strided run (a row of several dimensions must be contiguous)."""
    if t.dim() == 2:
        return t.stride(0), t.stride(1)
    if t.dim() > 2 and (t.shape[0] == 0 or t[0].is_contiguous()):
        return t.stride(0), 1
    return None
