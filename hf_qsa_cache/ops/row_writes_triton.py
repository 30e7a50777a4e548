"""Triton kernel for `hf_qsa_cache.ops.row_writes.RowWrites.flush`: up to five ``store[rows] = values`` writes
(`row_writes.write_slots` each) in one launch.

Programs: one per (token, write): program ``(i, t)`` copies row ``i`` of write ``t``'s values into its store's
row ``rows[i]`` (-1: row 0, as the specification's ``clamp_min(0)``), ``BLOCK`` elements at a time, cast to the
store's dtype (the same float dtype, or integers: `row_writes.fuses_row_writes`). Rows of several tokens with
the same target (pads into a null row) race as ``index_copy_``'s do: that row is never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_writes_ref import MAX_TARGETS, row_layout
from .triton_common import on_device_of_first_tensor, pdl, pdl_begin

BLOCK = 512  # elements of a row per copy (a QSA layer's K or V row at 2 x 256 in one)
NUM_WARPS = 4


@triton.jit
def _write_row(store_ptr, store_stride, rows_ptr, src_ptr, src_stride, src_col_stride, count, i,
               WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    if i < count:
        row = tl.maximum(tl.load(rows_ptr + i).to(tl.int64), 0)
        for start in tl.static_range(0, WIDTH, BLOCK):
            c = start + tl.arange(0, BLOCK)
            ok = c < WIDTH
            value = tl.load(src_ptr + i * src_stride + c * src_col_stride, mask=ok)
            tl.store(store_ptr + row * store_stride + c, value.to(store_ptr.dtype.element_ty), mask=ok)


# Token counts and strides change with the batch and the step: not specialised (no recompilation per batch).
@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "ss0", "ss1", "ss2", "ss3", "ss4"])
def _write_rows_kernel(d0, r0, s0, ds0, ss0, sc0, n0, d1, r1, s1, ds1, ss1, sc1, n1,
                       d2, r2, s2, ds2, ss2, sc2, n2, d3, r3, s3, ds3, ss3, sc3, n3,
                       d4, r4, s4, ds4, ss4, sc4, n4, COUNT: tl.constexpr,
                       W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    i = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    if t == 0:
        _write_row(d0, ds0, r0, s0, ss0, sc0, n0, i, W0, BLOCK)
    elif COUNT > 1 and t == 1:
        _write_row(d1, ds1, r1, s1, ss1, sc1, n1, i, W1, BLOCK)
    elif COUNT > 2 and t == 2:
        _write_row(d2, ds2, r2, s2, ss2, sc2, n2, i, W2, BLOCK)
    elif COUNT > 3 and t == 3:
        _write_row(d3, ds3, r3, s3, ss3, sc3, n3, i, W3, BLOCK)
    elif COUNT > 4:
        _write_row(d4, ds4, r4, s4, ss4, sc4, n4, i, W4, BLOCK)


def write_rows_triton(pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """`row_writes.write_slots` of each ``(store, rows, values)`` (at most `MAX_TARGETS`, each as
    `row_writes.fuses_row_writes` requires) in one launch."""
    count = len(pending)
    assert 0 < count <= MAX_TARGETS, count
    args, widths = [], []
    for store, rows, values in pending:
        (store_stride, _), (src_stride, src_col_stride) = row_layout(store), row_layout(values)
        args += [store, rows, values, store_stride, src_stride, src_col_stride, values.shape[0]]
        widths.append(values[0].numel() if values.shape[0] else 1)
    most = max(values.shape[0] for _, _, values in pending)
    if most == 0:
        return
    # Unused slots repeat the first write's arguments; COUNT keeps the kernel from reading them.
    args += args[:7] * (MAX_TARGETS - count)
    widths += widths[:1] * (MAX_TARGETS - count)
    _launch(pending[0][0], (most, count), args, widths, min(BLOCK, triton.next_power_of_2(max(widths))))


@on_device_of_first_tensor
def _launch(store: torch.Tensor, grid, args, widths, block) -> None:
    _write_rows_kernel[grid](*args, COUNT=grid[1], W0=widths[0], W1=widths[1], W2=widths[2], W3=widths[3],
                             W4=widths[4], BLOCK=block, num_warps=NUM_WARPS, **pdl(store))
