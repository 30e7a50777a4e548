"""Triton version of `hf_qsa_cache.ops.rms_norm.add_rms_norm_torch` (same arithmetic and rounding points). The norm's
weight is read before the kernel's early-launch wait (`triton_common.norm_weight`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import TL_DTYPES, norm_weight, on_device_of_first_tensor, pdl, pdl_begin


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, h_ptr, out_ptr, num_rows, eps,
                         D: tl.constexpr, D_PAD: tl.constexpr, RESIDUAL: tl.constexpr, PRODUCT: tl.constexpr,
                         PDL: tl.constexpr = False):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    ok = d < D
    w = norm_weight(weight_ptr, d, ok)
    pdl_begin(PDL)
    h = tl.load(x_ptr + r * D + d, mask=ok, other=0.0)
    if RESIDUAL:
        # torch adds in fp32 and rounds to the activations' dtype: the residual stream as stored.
        h = (tl.load(residual_ptr + r * D + d, mask=ok, other=0.0).to(tl.float32) + h.to(tl.float32))
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + r * D + d, h, mask=ok)
    widened = h.to(tl.float32)
    normed = (widened * tl.rsqrt(tl.sum(widened * widened, axis=0) / D + eps)).to(h_ptr.dtype.element_ty)
    tl.store(out_ptr + r * D + d, (w * normed.to(tl.float32)).to(PRODUCT), mask=ok)


@on_device_of_first_tensor
def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm.add_rms_norm_torch` in one launch, one program per token."""
    x = x.contiguous()
    D = x.shape[-1]
    rows = x.numel() // max(D, 1)
    h = torch.empty_like(x) if residual is not None else x
    product = torch.promote_types(x.dtype, weight.dtype)  # the weight multiplies as torch promotes
    out = torch.empty(x.shape, dtype=product, device=x.device)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual.contiguous() if residual is not None else x, weight, h, out, rows, float(eps),
            D=D, D_PAD=triton.next_power_of_2(D), RESIDUAL=residual is not None, PRODUCT=TL_DTYPES[product],
            num_warps=4 if D >= 1024 else 1, **pdl(x),
        )
    return h, out
