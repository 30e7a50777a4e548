"""Step metadata in one Triton launch.

Produces exactly what `hf_qsa_cache.ops.metadata_ref.build_step_metadata_torch` produces (same tensors,
same dtypes) without any host<->device synchronisation: every output size comes from host ints
(``num_rows``, ``query_len`` and `max_compress_work`).

One program handles ``BLOCK`` consecutive tokens of the flattened ``[B, L]`` batch and, when QSA is
on, the ``BLOCK`` compress-work items with the same indices (there are never more work items than
tokens). A work item finds its row with a running prefix sum over all rows' group counts, which
every program recomputes for itself, so no grid-wide barrier or second launch is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata_ref import QSAGeometry, StepMetadata, host_fields, max_compress_work
from .triton_common import on_device_of_first_tensor, pdl, pdl_begin

# Block tables are passed as separate pointer arguments, specialised on how many are used.
MAX_TABLES = 3

_BLOCK = 128  # tokens (and work items) per program
_ROW_CHUNK = 32  # rows scanned per step of the work-list prefix sum


@triton.jit
def _paged_slot(table_ptr, stride_row, stride_col, width, row, pos, block_size, ok):
    """``table[row, pos // block_size] * block_size + pos % block_size``, or -1 where not ``ok``.

    ``pos`` must be non-negative. A logical block past the table's width also gives -1.
    """
    logical = pos // block_size
    ok = ok & (logical < width)
    block = tl.load(table_ptr + row * stride_row + logical * stride_col, mask=ok, other=0)
    return tl.where(ok, block.to(tl.int64) * block_size + pos % block_size, -1)


# Batch-varying scalars must not be specialised (Triton would otherwise recompile when one of
# them happens to be 1 or a multiple of 16).
@triton.jit(
    do_not_specialize=[
        "num_rows", "query_len", "num_tokens", "num_work",
        "t0_stride_row", "t0_width", "t1_stride_row", "t1_width", "t2_stride_row", "t2_width",
    ]
)
def _step_metadata_kernel(
    prev_len_ptr, count_ptr,  # [B] any int dtype
    token_row_ptr, position_ptr,  # [N] int32, [N] int64
    t0_ptr, t0_stride_row, t0_stride_col, t0_width, t0_block_size, slot0_ptr,
    t1_ptr, t1_stride_row, t1_stride_col, t1_width, t1_block_size, slot1_ptr,
    t2_ptr, t2_stride_row, t2_stride_col, t2_width, t2_block_size, slot2_ptr,
    visible_ptr, ring_slot_ptr, work_ptr,  # [N] i32, [N] i64, [W, 2] i32
    num_rows, query_len, num_tokens, num_work,
    ratio, ring_capacity,
    NUM_TABLES: tl.constexpr,
    HAS_QSA: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_tokens

    # ---- per token: row, position (rows are left-padded: real tokens sit in the last `count` columns)
    row = offs // query_len
    col = offs - row * query_len
    prev = tl.load(prev_len_ptr + row, mask=in_range, other=0).to(tl.int64)
    cnt = tl.load(count_ptr + row, mask=in_range, other=0).to(tl.int64)
    first_real = query_len - cnt
    valid = in_range & (col >= first_real)
    position = tl.where(valid, prev + col - first_real, -1)
    safe_pos = tl.maximum(position, 0)  # keeps // and % on non-negative values (C semantics)
    row64 = row.to(tl.int64)

    tl.store(token_row_ptr + offs, row, mask=in_range)
    tl.store(position_ptr + offs, position, mask=in_range)

    # ---- per token, per table: paged write slot
    if NUM_TABLES > 0:
        s = _paged_slot(t0_ptr, t0_stride_row, t0_stride_col, t0_width, row64, safe_pos, t0_block_size, valid)
        tl.store(slot0_ptr + offs, s, mask=in_range)
    if NUM_TABLES > 1:
        s = _paged_slot(t1_ptr, t1_stride_row, t1_stride_col, t1_width, row64, safe_pos, t1_block_size, valid)
        tl.store(slot1_ptr + offs, s, mask=in_range)
    if NUM_TABLES > 2:
        s = _paged_slot(t2_ptr, t2_stride_row, t2_stride_col, t2_width, row64, safe_pos, t2_block_size, valid)
        tl.store(slot2_ptr + offs, s, mask=in_range)

    if HAS_QSA:
        # Complete groups this query may score: those closed at or before its own position.
        seq_len = prev + cnt
        visible = tl.minimum((safe_pos + 1) // ratio, seq_len // ratio)
        tl.store(visible_ptr + offs, tl.where(valid, visible, 0).to(tl.int32), mask=in_range)

        # Only a row's last `ring_capacity` columns are written to the raw-key ring.
        in_ring = valid & (col + ring_capacity >= query_len)
        ring = tl.where(in_ring, row64 * ring_capacity + safe_pos % ring_capacity, -1)
        tl.store(ring_slot_ptr + offs, ring, mask=in_range)

        # ---- compress work: item w is the (w - start[b])-th group closed by row b, where b is the
        # row whose [start[b], end[b]) range of the row-major concatenation contains w.
        if pid * BLOCK < num_work:  # programs past the work list skip the row scan
            w = offs
            w_in_range = w < num_work
            # Per item: number of rows that end at or before it (= its row) and their total groups
            # (= its row's start). Ends are non-decreasing, so that set is exactly the rows before it.
            w_row = tl.zeros([BLOCK], dtype=tl.int32)
            w_start = tl.zeros([BLOCK], dtype=tl.int32)
            total = tl.full([], 0, tl.int32)  # groups of all rows scanned so far
            for c in range(0, num_rows, ROW_CHUNK):
                rows = c + tl.arange(0, ROW_CHUNK)
                r_ok = rows < num_rows
                p = tl.load(prev_len_ptr + rows, mask=r_ok, other=0).to(tl.int32)
                k = tl.load(count_ptr + rows, mask=r_ok, other=0).to(tl.int32)
                per_row = tl.maximum((p + k) // ratio - p // ratio, 0)  # 0 for masked rows
                ends = tl.cumsum(per_row, axis=0) + total
                before = r_ok[None, :] & (ends[None, :] <= w[:, None])
                w_row += tl.sum(before.to(tl.int32), axis=1)
                w_start += tl.sum(tl.where(before, per_row[None, :], 0), axis=1)
                total += tl.sum(per_row, axis=0)
            active = w_in_range & (w < total)
            w_prev = tl.load(prev_len_ptr + w_row, mask=active, other=0).to(tl.int32)
            w_group = w_prev // ratio + (w - w_start)
            tl.store(work_ptr + 2 * w, tl.where(active, w_row, -1), mask=w_in_range)
            tl.store(work_ptr + 2 * w + 1, tl.where(active, w_group, -1), mask=w_in_range)


@on_device_of_first_tensor
def build_step_metadata_triton(
    prev_len: torch.Tensor,
    count: torch.Tensor,
    query_len: int,
    block_tables: dict[str, torch.Tensor],
    block_sizes: dict[str, int],
    qsa: QSAGeometry | None,
    host_prev_len: list[int] | None,
    host_count: list[int] | None,
    max_seq_len: int | None = None,
) -> StepMetadata:
    """Same contract and outputs as `build_step_metadata_torch`, in one kernel launch."""
    if len(block_tables) > MAX_TABLES:
        raise ValueError(f"at most {MAX_TABLES} block tables are supported, got {len(block_tables)}")
    device = prev_len.device
    num_rows = prev_len.shape[0]
    n = num_rows * query_len
    names = list(block_tables)

    token_row = torch.empty(n, dtype=torch.int32, device=device)
    position = torch.empty(n, dtype=torch.int64, device=device)
    slots = {name: torch.empty(n, dtype=torch.int64, device=device) for name in names}

    # Unused pointer slots get a harmless stand-in; the kernel never touches them.
    table_args = []
    for i in range(MAX_TABLES):
        if i < len(names):
            tab = block_tables[names[i]]
            table_args += [tab, tab.stride(0), tab.stride(1), tab.shape[1], block_sizes[names[i]], slots[names[i]]]
        else:
            table_args += [prev_len, 0, 0, 0, 1, position]

    visible_blocks = ring_slot = compress_work = None
    if qsa is not None:
        r = qsa.compress_ratio
        w = max_compress_work(num_rows, query_len, r)
        visible_blocks = torch.empty(n, dtype=torch.int32, device=device)
        ring_slot = torch.empty(n, dtype=torch.int64, device=device)
        compress_work = torch.empty(w, 2, dtype=torch.int32, device=device)
        qsa_args = [visible_blocks, ring_slot, compress_work]
        ratio, ring_capacity = r, qsa.ring_capacity
    else:
        w = 0
        qsa_args = [position, position, position]
        ratio, ring_capacity = 1, 1

    meta = StepMetadata(
        num_rows=num_rows, query_len=query_len, prev_len=prev_len, count=count, token_row=token_row,
        position=position, slots=slots, block_tables=block_tables, visible_blocks=visible_blocks,
        ring_slot=ring_slot, compress_work=compress_work,
        **host_fields(host_prev_len, host_count, max_seq_len),
    )
    if n == 0:  # nothing to compute (and w <= n, so the work list is empty too)
        return meta

    grid = (triton.cdiv(n, _BLOCK),)
    _step_metadata_kernel[grid](
        prev_len, count, token_row, position,
        *table_args,
        *qsa_args,
        num_rows, query_len, n, w,
        ratio, ring_capacity,
        NUM_TABLES=len(names),
        HAS_QSA=qsa is not None,
        BLOCK=_BLOCK,
        ROW_CHUNK=_ROW_CHUNK, **pdl(prev_len),
    )
    return meta
