"""Triton kernel for `hf_qsa_cache.ops.row_writes.RowWrites.flush`: up to five ``store[rows] = values`` writes
(`row_writes.write_slots` each, or `fp8.write_fp8_rows` into an fp8 store) in one launch.

Programs: one per (token, write): program ``(i, t)`` copies row ``i`` of write ``t``'s values into its store's
row ``rows[i]`` (-1: row 0, as the specification's ``clamp_min(0)``), ``BLOCK`` elements at a time, cast to the
store's dtype (the same float dtype, or integers: `row_writes.fuses_row_writes`). A write into an fp8 store
quantizes the row per head as it copies it (`fp8_triton.quantize_rows`, bit for bit the specification's) and
writes each head's scale beside it, so an fp8 cache's layer takes the one launch a bf16 cache's does. Rows of
several tokens with the same target (pads into a null row) race as ``index_copy_``'s do: that row is never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_triton import quantize_rows
from .row_writes_ref import MAX_TARGETS, row_layout
from .triton_common import on_device_of_first_tensor, pdl, pdl_begin, pow2

BLOCK = 512  # elements of a row per copy (a QSA layer's K or V row at 2 x 256 in one)
NUM_WARPS = 4


@triton.jit
def _write_row(store_ptr, store_stride, rows_ptr, src_ptr, src_stride, src_col_stride, count, i, scale_ptr,
               WIDTH: tl.constexpr, HEADS: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
               BLOCK: tl.constexpr):
    """Row ``i`` of one write; ``HEADS > 0``: an fp8 store (rows of ``HEADS`` heads of ``WIDTH // HEADS``
    values), quantized per head with the scales at ``scale_ptr`` (``HEADS`` a row)."""
    if i < count:
        row = tl.maximum(tl.load(rows_ptr + i).to(tl.int64), 0)
        if HEADS > 0:
            HEAD_DIM: tl.constexpr = WIDTH // HEADS
            h = tl.arange(0, H_PAD)
            d = tl.arange(0, D_PAD)
            ok = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
            c = h[:, None] * HEAD_DIM + d[None, :]
            x = tl.load(src_ptr + i * src_stride + c * src_col_stride, mask=ok, other=0.0)
            q, scale = quantize_rows(x.to(tl.float32))
            tl.store(store_ptr + row * store_stride + c, q, mask=ok)
            tl.store(scale_ptr + row * HEADS + h, scale, mask=h < HEADS)
        else:
            for start in tl.static_range(0, WIDTH, BLOCK):
                c = start + tl.arange(0, BLOCK)
                ok = c < WIDTH
                value = tl.load(src_ptr + i * src_stride + c * src_col_stride, mask=ok)
                tl.store(store_ptr + row * store_stride + c, value.to(store_ptr.dtype.element_ty), mask=ok)


# Token counts and strides change with the batch and the step: not specialised (no recompilation per batch).
# Per write t: store, rows, values, store row stride, value row and column strides, token count, scales (an fp8
# store's; another write passes its store, never read); WIDTH, HEADS (0: not fp8), H_PAD, D_PAD constexpr.
@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "ss0", "ss1", "ss2", "ss3", "ss4"])
def _write_rows_kernel(d0, r0, s0, ds0, ss0, sc0, n0, q0, d1, r1, s1, ds1, ss1, sc1, n1, q1,
                       d2, r2, s2, ds2, ss2, sc2, n2, q2, d3, r3, s3, ds3, ss3, sc3, n3, q3,
                       d4, r4, s4, ds4, ss4, sc4, n4, q4, COUNT: tl.constexpr,
                       W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                       H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr, H4: tl.constexpr,
                       HP0: tl.constexpr, HP1: tl.constexpr, HP2: tl.constexpr, HP3: tl.constexpr, HP4: tl.constexpr,
                       DP0: tl.constexpr, DP1: tl.constexpr, DP2: tl.constexpr, DP3: tl.constexpr, DP4: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    i = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    if t == 0:
        _write_row(d0, ds0, r0, s0, ss0, sc0, n0, i, q0, W0, H0, HP0, DP0, BLOCK)
    elif COUNT > 1 and t == 1:
        _write_row(d1, ds1, r1, s1, ss1, sc1, n1, i, q1, W1, H1, HP1, DP1, BLOCK)
    elif COUNT > 2 and t == 2:
        _write_row(d2, ds2, r2, s2, ss2, sc2, n2, i, q2, W2, H2, HP2, DP2, BLOCK)
    elif COUNT > 3 and t == 3:
        _write_row(d3, ds3, r3, s3, ss3, sc3, n3, i, q3, W3, H3, HP3, DP3, BLOCK)
    elif COUNT > 4:
        _write_row(d4, ds4, r4, s4, ss4, sc4, n4, i, q4, W4, H4, HP4, DP4, BLOCK)


def write_rows_triton(pending: list[tuple]) -> None:
    """`row_writes.write_slots` of each ``(store, rows, values)``, or `fp8.write_fp8_rows` of each
    ``(store, rows, values, scales)`` with ``scales`` given (an fp8 store), in one launch (at most `MAX_TARGETS`
    writes, each as `row_writes.fuses_row_writes` requires)."""
    count = len(pending)
    assert 0 < count <= MAX_TARGETS, count
    args, shapes = [], []
    for store, rows, values, *scales in pending:
        scales = scales[0] if scales else None
        (store_stride, _), (src_stride, src_col_stride) = row_layout(store), row_layout(values)
        args += [store, rows, values, store_stride, src_stride, src_col_stride, values.shape[0],
                 store if scales is None else scales]
        width = store[0].numel()
        if scales is None:
            shapes.append((width, 0, 1, 1))
        else:  # an fp8 store: [H_PAD, D_PAD] tiles of its heads
            heads = width // store.shape[-1]
            shapes.append((width, heads, triton.next_power_of_2(heads), pow2(store.shape[-1])))
    most = max(values.shape[0] for _, _, values, *_ in pending)
    if most == 0:
        return
    # Unused slots repeat the first write's arguments; COUNT keeps the kernel from reading them.
    args += args[:8] * (MAX_TARGETS - count)
    shapes += shapes[:1] * (MAX_TARGETS - count)
    _launch(pending[0][0], (most, count), args, shapes, min(BLOCK, triton.next_power_of_2(max(w for w, *_ in shapes))))


@on_device_of_first_tensor
def _launch(store: torch.Tensor, grid, args, shapes, block) -> None:
    widths, heads, h_pads, d_pads = zip(*shapes)
    _write_rows_kernel[grid](*args, COUNT=grid[1], **{f"W{t}": w for t, w in enumerate(widths)},
                             **{f"H{t}": h for t, h in enumerate(heads)}, **{f"HP{t}": h for t, h in enumerate(h_pads)},
                             **{f"DP{t}": d for t, d in enumerate(d_pads)}, BLOCK=block, num_warps=NUM_WARPS,
                             **pdl(store))
