"""Helpers shared by the Triton kernels of this package."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * LOG2E)
# The Triton interpreter multiplies bf16 dot operands as their raw 16-bit patterns; under it the
# operands are widened to fp32 first (bf16 products are exact in fp32, so the math is the same).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's name for each float dtype (a kernel told which dtype to round an intermediate to).
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
