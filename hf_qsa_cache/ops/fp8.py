"""fp8 (e4m3) cache storage: the torch specification of how a cached vector is quantized and read back.

A vector ``x`` of ``D`` values (one head of one token's key or value, or one compressed index key) is stored as
``D`` fp8 e4m3 values and one fp32 scale: ``x ~= q * scale``. The scale is a power of two, the smallest with
``max|x| / scale <= 448`` (e4m3's largest finite value), so that:

* ``x / scale`` is exact (a power-of-two multiply), and rounding it to e4m3 is the only error: a relative error
  of at most 2**-4 per element above ``scale * 2**-6`` (below that, e4m3's subnormals: an absolute error of at
  most ``scale * 2**-10``);
* reading back, ``q * scale`` is exact in bf16 and fp32: the kernels widen to the activations' dtype and run the
  same dots as on a bf16 cache;
* the Triton kernels (`fp8_triton`) compute bit for bit the same scale and fp8 values as this file, on the GPU
  and under the interpreter (whose own fp32 -> fp8 cast truncates): the rounding to e4m3 is written out here in
  fp32 arithmetic (`round_to_e4m3`), exact in both.

The scale is computed from the vector as it is written: no calibration state, nothing a failed step must undo
(the scale is paged beside its values and written in the same store write), and no saturation when later data
grows. ``docs/fp8_cache.md`` says why.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # per stored vector (one head of one token; one compressed key)


def check_cache_dtype(name: str, value) -> torch.dtype | None:
    """``value`` if a cache may store in it (None: the model's dtype; ``torch.float8_e4m3fn``), else ValueError."""
    if value is None or (isinstance(value, torch.dtype) and value == FP8):
        return value
    raise ValueError(f"{name} must be None (the model's dtype) or torch.float8_e4m3fn, got {value!r}")


def is_fp8(dtype) -> bool:
    return dtype == FP8


def vector_bytes(width: int, dtype: torch.dtype | None, model_dtype: torch.dtype) -> int:
    """Bytes one stored vector of ``width`` values costs: fp8 values and their scale, or ``width`` values of the
    model's dtype."""
    if dtype is not None and is_fp8(dtype):
        return width + SCALE_BYTES
    return width * torch.empty((), dtype=model_dtype).element_size()


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``k`` with ``2**k`` the smallest power of two such that ``amax / 2**k <= 448`` (0 where ``amax`` is 0),
    within [-126, 126]. Read from the bits of fp32 ``amax = m * 2**e``: ``m * 2**8 <= 448`` iff ``m <= 1.75``."""
    bits = amax.float().view(torch.int32)
    k = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(amax > 0, k, 0).clamp(-126, 126)


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` (``|y| <= 448``) rounded to the nearest e4m3 value, ties to even, in fp32: adding then
    subtracting ``1.5 * 2**(23 + qe)`` rounds to a multiple of ``2**qe``, the e4m3 quantum at ``y`` (3 mantissa
    bits; ``2**-9`` among subnormals). A zero comes out +0."""
    bits = y.view(torch.int32)
    qe = (((bits >> 23) & 0xFF) - 130).clamp_min(-9)
    c = _from_bits(((qe + 150) << 23) | 0x400000)
    return (y + c) - c


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x [..., D]`` as fp8 e4m3 ``[..., D]`` and fp32 power-of-two scales ``[...]``."""
    x = x.detach().float()
    k = scale_exponent(x.abs().amax(dim=-1))
    scale, inverse = _from_bits((k + 127) << 23), _from_bits((127 - k) << 23)
    return round_to_e4m3(x * inverse[..., None]).to(FP8), scale


def fp8_zeros(shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw, values)``: zeroed fp8 storage as raw bytes (what row copies and pool growth move: torch has no fp8
    ``index_copy_`` on the CPU) and its fp8 view (what the ops read)."""
    raw = torch.zeros(shape, device=device, dtype=torch.uint8)
    return raw, raw.view(FP8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (exact in bf16 and fp32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def write_fp8_rows(store: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``store[rows], scales[rows] = quantize_fp8(values)`` (rows already clamped, none negative): ``store``
    ``[S, ..., D]`` fp8, ``scales`` ``[S, ...]``, ``values`` ``[N, ..., D]``."""
    q, s = quantize_fp8(values)
    store.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))  # no fp8 index_copy_ on the CPU
    scales.index_copy_(0, rows, s)
