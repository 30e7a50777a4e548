"""Triton side of the fp8 cache storage (`hf_qsa_cache.ops.fp8` is the specification): the quantization and
widening helpers the attention kernels inline, and `write_fp8_rows_triton`, the quantizing store write.

Every helper computes bit for bit what the torch functions compute (tested under the interpreter): the scale
from the bits of ``max|x|``, the division by it as a power-of-two multiply, the rounding to e4m3 in fp32
arithmetic (`round_e4m3`), after which the cast to fp8 is exact whatever rounding the cast itself uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, pdl, pdl_begin, pow2


@triton.jit
def round_e4m3(y):
    """`fp8.round_to_e4m3`: fp32 ``y`` (``|y| <= 448``) to the nearest e4m3 value, ties to even, in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    qe = tl.maximum(((bits >> 23) & 0xFF) - 130, -9)
    c = (((qe + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (y + c) - c


@triton.jit
def quantize_rows(x):
    """`fp8.quantize_fp8` of each row of fp32 ``x`` ``[M, D]`` (masked columns 0): ``(fp8 [M, D], scale [M])``."""
    amax = tl.max(tl.abs(x), axis=1)
    bits = amax.to(tl.int32, bitcast=True)
    k = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.minimum(tl.maximum(tl.where(amax > 0, k, 0), -126), 126)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return round_e4m3(x * inverse[:, None]).to(tl.float8e4nv), scale


@triton.jit
def widen(q, scale, DTYPE: tl.constexpr):
    """`fp8.dequantize_fp8`: fp8 ``q`` ``[M, D]`` times ``scale`` ``[M]``, in ``DTYPE`` (exact)."""
    return (q.to(tl.float32) * scale[:, None]).to(DTYPE)


@triton.jit(do_not_specialize=["count", "src_stride", "src_head_stride"])
def _write_fp8_rows_kernel(store_ptr, scale_ptr, rows_ptr, src_ptr, count, src_stride, src_head_stride,
                           HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                           PDL: tl.constexpr = False):
    """One program per token: its ``[HEADS, HEAD_DIM]`` values quantized per head into the store's row."""
    pdl_begin(PDL)
    i = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    ok = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    row = tl.maximum(tl.load(rows_ptr + i).to(tl.int64), 0)
    x = tl.load(src_ptr + i * src_stride + h[:, None] * src_head_stride + d[None, :], mask=ok, other=0.0)
    q, scale = quantize_rows(x.to(tl.float32))
    tl.store(store_ptr + row * (HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :], q, mask=ok)
    tl.store(scale_ptr + row * HEADS + h, scale, mask=h < HEADS)


@on_device_of_first_tensor
def write_fp8_rows_triton(store: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """`fp8.write_fp8_rows` in one launch (rows -1 land in row 0, as `row_writes.write_slots`): ``store``
    ``[S, H, D]`` or ``[S, D]`` fp8, contiguous; ``scales`` ``[S, H]`` or ``[S]`` contiguous; ``values`` with the
    store's row shape, its last dimension of unit stride."""
    n = values.shape[0]
    if n == 0:
        return
    head_dim = store.shape[-1]
    heads = store[0].numel() // head_dim
    assert store.is_contiguous() and scales.is_contiguous() and values.stride(-1) == 1
    src = values.reshape(n, heads, head_dim) if values.dim() == 2 else values
    _write_fp8_rows_kernel[(n,)](
        store, scales, rows, src, n, src.stride(0), src.stride(1),
        HEADS=heads, H_PAD=triton.next_power_of_2(heads), HEAD_DIM=head_dim, D_PAD=pow2(head_dim), num_warps=4, **pdl(store),
    )
