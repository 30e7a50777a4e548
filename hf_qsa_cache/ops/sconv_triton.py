"""Triton kernel for `hf_qsa_cache.ops.sconv.short_conv_torch` (same signature, same results).

One program per (token tile, channel tile): for each token it reads the ``K`` taps (from ``x`` when the tap lies in
this forward, from the paged store when it lies before ``prev_len``, zero before position 0 or for
pads), adds the residual in fp32, and writes the token's input to its slot. Taps read from the
store are always positions of earlier forwards, which this launch never writes, so the insert and
the conv share one launch with no ordering hazard. The grid depends only on the token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, pdl, pdl_begin


# The table's width and row stride follow the cache size: not specialised (no recompilation per cache).
@triton.jit(do_not_specialize=["T", "table_s0", "table_cols", "query_len"])
def _short_conv_kernel(
    x_ptr, w_ptr, store_ptr, table_ptr, slots_ptr, pos_ptr, prev_ptr, y_ptr,
    T, C, width, store_s0, store_s1, table_s0, table_cols, query_len, block_size,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < T
    cm = c < C
    m2 = tm[:, None] & cm[None, :]
    t64 = t.to(tl.int64)
    row = t // query_len
    p = tl.load(pos_ptr + t, mask=tm, other=-1)
    prev = tl.load(prev_ptr + row, mask=tm, other=0).to(tl.int64)
    valid = p >= 0
    head = c // width
    d = c % width
    store_col = head * store_s1 + d
    x_raw = tl.load(x_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        back = K - 1 - j
        src = p - back
        in_x = valid & (src >= prev)
        in_store = valid & (src >= 0) & (src < prev)
        w = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        tap_x = tl.load(x_ptr + (t64 - back)[:, None] * C + c[None, :], mask=m2 & in_x[:, None], other=0.0)
        safe = tl.maximum(src, 0)
        col = tl.minimum(safe // block_size, table_cols - 1)
        block = tl.load(table_ptr + row * table_s0 + col, mask=tm & in_store, other=0).to(tl.int64)
        slot = block * block_size + safe % block_size
        tap_s = tl.load(store_ptr + slot[:, None] * store_s0 + store_col[None, :], mask=m2 & in_store[:, None],
                        other=0.0)
        tap = tl.where(in_x[:, None], tap_x.to(tl.float32), tap_s.to(tl.float32))
        acc = acc + tap * w[None, :]
    y = acc + x_raw.to(tl.float32)
    tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)
    out_slot = tl.maximum(tl.load(slots_ptr + t, mask=tm, other=0), 0)
    tl.store(store_ptr + out_slot[:, None] * store_s0 + store_col[None, :], x_raw.to(store_ptr.dtype.element_ty),
             mask=m2)


@on_device_of_first_tensor
def short_conv_triton(x, weight, store, table, block_size, slots, position, prev_len, query_len, *,
                      block_t: int | None = None, block_c: int | None = None):
    """``block_t`` tokens x ``block_c`` channels per program (defaults by shape; tests force small tiles)."""
    T, C = x.shape
    K = weight.shape[1]
    if store.stride(2) != 1:
        raise ValueError("the conv store's channel dim must be contiguous")
    x = x.contiguous()
    weight = weight.contiguous()
    table = table.contiguous()
    y = torch.empty_like(x)
    if T == 0:
        return y
    if block_t is None:
        block_t = min(16, triton.next_power_of_2(T))
    if block_c is None:
        block_c = min(triton.next_power_of_2(C), 4096 // block_t, 256)
    grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    _short_conv_kernel[grid](
        x, weight, store, table, slots.contiguous(), position.contiguous(), prev_len.contiguous(), y,
        T, C, store.shape[2], store.stride(0), store.stride(1), table.stride(0), table.shape[1], query_len,
        block_size, K=K, BLOCK_T=block_t, BLOCK_C=block_c, **pdl(x),
    )
    return y
