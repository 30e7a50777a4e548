"""Helpers shared by the Triton kernels of this package."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import fusions

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * LOG2E)
# The Triton interpreter multiplies bf16 dot operands as their raw 16-bit patterns; under it the
# operands are widened to fp32 first (bf16 products are exact in fp32, so the math is the same).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's name for each float dtype (a kernel told which dtype to round an intermediate to).
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# Programmatic dependent launch (the ``pdl`` setting of `hf_qsa_cache.fusions`, Hopper and later): each kernel is
# launched while the one before it still runs, waits at its start (`pdl_begin`) until that kernel's writes are
# visible, and lets the next one launch at once. A decode step is tens of kernels of a few microseconds each, and
# the launch gap and start-up of each (about a microsecond inside a CUDA graph) are then hidden behind the kernel
# before. Every kernel of this package takes the ``PDL`` switch and calls `pdl_begin` before it touches memory,
# so a kernel launched early never reads a predecessor's output or overwrites its input too soon.


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched early: a GPU of compute capability 9 or more, and a Triton
    that has the wait instruction and the launch option."""
    if device.type != "cuda":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return (torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
            and "launch_pdl" in CUDAOptions.__dataclass_fields__)


def pdl(tensor: torch.Tensor) -> dict:
    """The launch keywords of a kernel whose tensors live where ``tensor`` does: ``PDL`` (the kernel's switch for
    `pdl_begin`) and ``launch_pdl`` (Triton's launch option), both on exactly when the ``pdl`` setting is on and
    the device supports it (never under the interpreter). One never goes without the other: a kernel launched
    early that does not wait would race the kernel before it."""
    on = fusions.enabled("pdl") and not INTERPRET and _pdl_supported(tensor.device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Called by every kernel before it touches memory that the launch just before it may write: with ``PDL``,
    wait until the previous kernel has finished and its writes are visible, then let the next kernel launch (it
    waits in its own `pdl_begin` for this one to finish).

    Since every kernel lets the next one launch only here, after its own wait, a kernel that starts finds every
    launch but the one just before it finished and its writes visible. So before this call a kernel may read
    what only earlier launches write: weights, the step's metadata (a launch of its own at the step's start,
    never just before a kernel that reads it early) and what earlier steps stored (the conv taps of
    `hf_qsa_cache.ops.conv_norm_triton`), besides `prefetch_l2` hints."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def norm_weight(w_ptr, d, dm):
    """A norm's weight at lanes ``d``, in fp32. Weights are never written in a step: read before the wait."""
    return tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)


@triton.jit
def grouped_norm(x, weight_ptr, c, h, ok, H: tl.constexpr, eps):
    """RMS norm of each row (stream) of fp32 ``x`` ``[HC_PAD, BLOCK_H]`` over its ``H`` features, times ``1 + weight``
    (``weight`` ``[hc * H]``, stream-major): the hyper-connection norm, and the PLE layer's grouped norms."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    w = tl.load(weight_ptr + c[:, None] * H + h[None, :], mask=ok, other=0.0).to(tl.float32)
    return x * rstd[:, None] * (1.0 + w)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask for the cache lines at ``ptrs`` (where ``mask``) to be brought into L2, without waiting or reading: a
    kernel launched early fetches its weights, which no kernel of a step writes, while the kernel before it still
    runs, and before its own `pdl_begin`. A hint only: what the kernel reads later is unchanged."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(ptr, rows, row_ok, row_stride, row_len, LINES: tl.constexpr):
    """`prefetch_l2` of rows ``rows`` (where ``row_ok``) of a matrix at ``ptr`` whose rows are ``row_stride``
    elements apart: ``row_len`` contiguous elements of each, one request per 128 bytes, ``LINES`` a power of two
    at least that many requests (`l2_lines`)."""
    step: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    j = tl.arange(0, LINES) * step
    prefetch_l2(ptr + rows[:, None].to(tl.int64) * row_stride + j[None, :], row_ok[:, None] & (j < row_len)[None, :])


def l2_lines(row_len: int, dtype: torch.dtype) -> int:
    """`prefetch_rows_l2`'s ``LINES`` for rows of ``row_len`` elements of ``dtype``."""
    return triton.next_power_of_2(max(1, -(-row_len * dtype.itemsize // 128)))


def on_device_of_first_tensor(launch):
    """Decorator for a function that launches Triton kernels: launch on the device of its first tensor
    argument. Triton launches on the current CUDA device, which is not the tensors' own when accelerate placed
    a layer on another GPU."""

    @functools.wraps(launch)
    def wrapper(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or not first.is_cuda or first.device.index == torch.cuda.current_device():
            return launch(*args, **kwargs)
        with torch.cuda.device(first.device):
            return launch(*args, **kwargs)

    return wrapper


def pow2(x: int, floor: int = 16) -> int:
    """Next power of two >= x, at least ``floor`` (tl.dot needs every dimension >= 16)."""
    return max(floor, triton.next_power_of_2(max(1, x)))


@triton.jit
def dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """``tl.dot`` in IEEE fp32 when asked (fp32 inputs), widened under the interpreter."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def top_k_picks(scores, carry, e, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr):
    """The ``K`` best of ``scores [E_PAD]`` (indices ``e``), best first, the lower index first among equals:
    ``(carry [E_PAD] at each pick, the picks)``, both ``[K_PAD]`` with slots from ``K`` on zero. A padded slot
    must score below every real one (or equal it with a higher index)."""
    j = tl.arange(0, K_PAD)
    carried = tl.zeros([K_PAD], tl.float32)
    picked = tl.zeros([K_PAD], tl.int64)
    for i in tl.static_range(K):
        best = tl.max(scores, axis=0)
        index = tl.min(tl.where(scores == best, e, E_PAD), axis=0)
        carried = tl.where(j == i, tl.sum(tl.where(e == index, carry, 0.0), axis=0), carried)
        picked = tl.where(j == i, index.to(tl.int64), picked)
        scores = tl.where(e == index, float("-inf"), scores)
    return carried, picked
