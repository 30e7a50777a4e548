"""Triton version of `hf_qsa_cache.ops.norm_rope` (same arithmetic and rounding points as upstream's ops)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, pdl, pdl_begin


@triton.jit(do_not_specialize=["num_tokens", "stride_xt", "stride_xh"])
def _norm_rope_kernel(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, num_tokens, eps, stride_xt, stride_xh,
                      H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, H_PAD: tl.constexpr,
                      D_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: all its heads as an ``[H_PAD, D_PAD]`` tile."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    ok = (h < H)[:, None] & (d < D)[None, :]
    row = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    x = tl.load(row + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    w = tl.load(weight_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = (x * rstd * (1.0 + w[None, :])).to(dtype)
    # rotate_half on the first ROT features: feature d takes -x[d + ROT/2] below ROT/2, x[d - ROT/2] above.
    half = ROT // 2
    in_rot = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    partner = tl.where(in_rot, partner, d)
    xp = tl.load(row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    wp = tl.load(weight_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
    turned = (xp * rstd * (1.0 + wp[None, :])).to(dtype).to(tl.float32)  # the partner's normed value, as above
    turned = tl.where((d < half)[None, :], -turned, turned)
    cos = tl.load(cos_ptr + t * ROT + d, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * ROT + d, mask=in_rot, other=0.0).to(tl.float32)
    first = (normed.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
    second = (turned * sin[None, :]).to(dtype).to(tl.float32)
    out = tl.where(in_rot[None, :], (first + second).to(dtype), normed)
    tl.store(out_ptr + t * H * D + h[:, None] * D + d[None, :], out, mask=ok)


@on_device_of_first_tensor
def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """`norm_rope.norm_rope_written_out` in one launch (``x`` ``[N, H, D]``, ``cos``/``sin`` ``[N, rot]``). ``x``
    is read through its strides (a QSA query is every other half-row of its projection: no copy first)."""
    cos, sin = cos.contiguous(), sin.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, H, D = x.shape
    rot = cos.shape[-1]
    assert rot % 2 == 0 and rot <= D, (rot, D)
    out = torch.empty(n, H, D, dtype=x.dtype, device=x.device)
    if n:
        h_pad, d_pad = triton.next_power_of_2(H), triton.next_power_of_2(D)
        _norm_rope_kernel[(n,)](x, weight, cos, sin, out, n, float(eps), x.stride(0), x.stride(1), H=H, D=D, ROT=rot,
                                H_PAD=h_pad, D_PAD=d_pad, num_warps=8 if h_pad * d_pad >= 4096 else 4, **pdl(x))
    return out
