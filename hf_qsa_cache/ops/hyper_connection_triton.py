"""Triton versions of the fused hyper-connection ops (`hf_qsa_cache.ops.hyper_connection` is the spec).

One program per token: a token's ``hc`` streams (``hc * H`` features, 8192 at the benchmark shapes) are
loaded once as an ``[HC_PAD, BLOCK_H]`` tile, fp32 throughout, outputs rounded once. Token counts are
not specialised (a new batch bucket or prefill chunk does not recompile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4


@triton.jit(do_not_specialize=["num_tokens"])
def _hc_norm_kernel(streams_ptr, out_ptr, inject_ptr, weight_ptr, streams_out_ptr, normed_ptr, num_tokens, eps,
                    HC: tl.constexpr, H: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                    RESIDUAL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HC_PAD)
    h = tl.arange(0, BLOCK_H)
    ok = (c < HC)[:, None] & (h < H)[None, :]
    offsets = t * HC * H + c[:, None] * H + h[None, :]
    x = tl.load(streams_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        out = tl.load(out_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32)
        inject = tl.load(inject_ptr + t * HC + c, mask=c < HC, other=0.0).to(tl.float32)
        x = x + out[None, :] * inject[:, None]
        x = x.to(streams_out_ptr.dtype.element_ty)  # the streams as stored: the norm reads them rounded
        tl.store(streams_out_ptr + offsets, x, mask=ok)
        x = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)  # [HC_PAD]
    w = tl.load(weight_ptr + c[:, None] * H + h[None, :], mask=ok, other=0.0).to(tl.float32)
    normed = x * rms[:, None] * (1.0 + w)
    tl.store(normed_ptr + offsets, normed.to(normed_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def hc_norm_triton(streams: torch.Tensor, weight: torch.Tensor, hc: int, eps: float,
                   residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`hyper_connection.hc_norm` in one launch."""
    streams = streams.contiguous()
    width = streams.shape[-1]
    H = width // hc
    tokens = streams.numel() // max(width, 1)
    normed = torch.empty_like(streams)
    if residual is not None:
        out, inject = residual[0].contiguous(), residual[1].contiguous()
        new_streams = torch.empty_like(streams)
    else:
        out = inject = new_streams = streams  # unread
    if tokens:
        block_h = triton.next_power_of_2(H)
        hc_pad = triton.next_power_of_2(hc)
        _hc_norm_kernel[(tokens,)](
            streams, out, inject, weight, new_streams, normed, tokens, float(eps),
            HC=hc, H=H, HC_PAD=hc_pad, BLOCK_H=block_h, RESIDUAL=residual is not None,
            num_warps=_warps(hc_pad * block_h),
        )
    return (new_streams if residual is not None else streams), normed


@triton.jit
def _scaled_silu_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32) * scale
    tl.store(y_ptr + i, (x * tl.sigmoid(x)).to(y_ptr.dtype.element_ty), mask=i < n)


@on_device_of_first_tensor
def scaled_silu_triton(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`hyper_connection.scaled_silu` in one launch."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        block = 1024
        _scaled_silu_kernel[(triton.cdiv(n, block),)](x, y, n, float(scale), BLOCK=block, num_warps=4)
    return y


@triton.jit(do_not_specialize=["num_tokens"])
def _mix_streams_kernel(up_ptr, normed_ptr, logits_ptr, mixed_ptr, inject_ptr, num_tokens,
                        HC: tl.constexpr, H: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HC_PAD)
    h = tl.arange(0, BLOCK_H)
    ok = (c < HC)[:, None] & (h < H)[None, :]
    offsets = t * HC * H + c[:, None] * H + h[None, :]
    gates = tl.sigmoid(tl.load(up_ptr + offsets, mask=ok, other=0.0).to(tl.float32))
    normed = tl.load(normed_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    mixed = tl.sum(gates * normed, axis=0) / HC  # padded streams load 0 and add nothing
    tl.store(mixed_ptr + t * H + h, mixed.to(mixed_ptr.dtype.element_ty), mask=h < H)
    logits = tl.load(logits_ptr + t * HC + c, mask=c < HC, other=0.0).to(tl.float32)
    inject = 2.0 * tl.sigmoid(logits / HC)
    tl.store(inject_ptr + t * HC + c, inject.to(inject_ptr.dtype.element_ty), mask=c < HC)


@on_device_of_first_tensor
def mix_streams_triton(up: torch.Tensor, normed: torch.Tensor, inject_logits: torch.Tensor,
                       hc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`hyper_connection.mix_streams` in one launch."""
    up, normed, inject_logits = up.contiguous(), normed.contiguous(), inject_logits.contiguous()
    width = normed.shape[-1]
    H = width // hc
    tokens = normed.numel() // max(width, 1)
    mixed = torch.empty(*normed.shape[:-1], H, dtype=normed.dtype, device=normed.device)
    inject = torch.empty(*normed.shape[:-1], hc, dtype=normed.dtype, device=normed.device)
    if tokens:
        block_h = triton.next_power_of_2(H)
        hc_pad = triton.next_power_of_2(hc)
        _mix_streams_kernel[(tokens,)](up, normed, inject_logits, mixed, inject, tokens, HC=hc, H=H,
                                       HC_PAD=hc_pad, BLOCK_H=block_h, num_warps=_warps(hc_pad * block_h))
    return mixed, inject
