"""Triton side of the fp8 cache storage (`hf_qsa_cache.ops.fp8` is the specification): the quantization and
widening helpers the attention kernels inline and the quantizing store write (`row_writes_triton`) calls.

Every helper computes bit for bit what the torch functions compute (tested under the interpreter): the scale
from the bits of ``max|x|``, the division by it as a power-of-two multiply, the rounding to e4m3 in fp32
arithmetic (`round_e4m3`), after which the cast to fp8 is exact whatever rounding the cast itself uses.
"""

from __future__ import annotations

import triton
import triton.language as tl



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
