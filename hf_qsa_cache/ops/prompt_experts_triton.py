"""Triton versions of `hf_qsa_cache.ops.prompt_experts`' two elementwise passes (same arithmetic and rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor


@triton.jit(do_not_specialize=["num_rows"])
def _weighted_silu_mul_kernel(gate_up_ptr, weights_ptr, out_ptr, num_rows, I: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < I
    gate = tl.load(gate_up_ptr + s * 2 * I + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + s * 2 * I + I + i, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(weights_ptr + s).to(tl.float32)
    tl.store(out_ptr + s * I + i, (gate * tl.sigmoid(gate) * up * w).to(out_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def weighted_silu_mul_triton(gate_up: torch.Tensor, weights: torch.Tensor, block: int = 512) -> torch.Tensor:
    """`prompt_experts.weighted_silu_mul_torch` in one launch, one program per (row, block of columns)."""
    gate_up, weights = gate_up.contiguous(), weights.contiguous()
    rows, two_i = gate_up.shape
    out = torch.empty(rows, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _weighted_silu_mul_kernel[(rows, triton.cdiv(two_i // 2, block))](gate_up, weights, out, rows, I=two_i // 2,
                                                                            BLOCK=block, num_warps=4)
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _sum_by_token_kernel(rows_ptr, positions_ptr, out_ptr, num_tokens, H: tl.constexpr, K: tl.constexpr,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(K):
        row = tl.load(positions_ptr + t * K + j).to(tl.int64)
        acc += tl.load(rows_ptr + row * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def sum_by_token_triton(rows: torch.Tensor, positions: torch.Tensor, num_tokens: int, top_k: int,
                        block: int = 1024) -> torch.Tensor:
    """`prompt_experts.sum_by_token_torch` in one launch, one program per (token, block of features)."""
    rows, positions = rows.contiguous(), positions.contiguous()
    H = rows.shape[-1]
    out = torch.empty(num_tokens, H, dtype=rows.dtype, device=rows.device)
    if out.numel():
        _sum_by_token_kernel[(num_tokens, triton.cdiv(H, block))](rows, positions, out, num_tokens, H=H, K=top_k,
                                                                   BLOCK=block, num_warps=4)
    return out
