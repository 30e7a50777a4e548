"""Triton version of `hf_qsa_cache.ops.router.route_topk` (same arithmetic, one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, top_k_picks


@triton.jit(do_not_specialize=["num_tokens"])
def _route_topk_kernel(logits_ptr, weights_ptr, experts_ptr, num_tokens, stride_t,
                       E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                       NORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # padded experts: exp(-inf) = 0, after every real one (lower index first)
    j = tl.arange(0, K_PAD)
    values, picked = top_k_picks(p, p, e, E_PAD, K, K_PAD)
    if NORMALIZE:
        values = values / tl.sum(tl.where(j < K, values, 0.0), axis=0)
    tl.store(weights_ptr + t * K + j, values.to(weights_ptr.dtype.element_ty), mask=j < K)
    tl.store(experts_ptr + t * K + j, picked, mask=j < K)


@on_device_of_first_tensor
def route_topk_triton(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`router.route_topk_torch` in one launch."""
    logits = logits.contiguous()
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _route_topk_kernel[(T,)](logits, weights, experts, T, logits.stride(0), E=E, E_PAD=triton.next_power_of_2(E),
                                 K=top_k, K_PAD=triton.next_power_of_2(top_k), NORMALIZE=normalize, num_warps=4)
    return weights, experts
