"""Triton version of `hf_qsa_cache.ops.inkling_router.route_inkling_torch` (one program per token).

The program computes the token's logits against every routed and shared expert (fp32 accumulation over
``BLOCK_H`` chunks of the hidden size, the weight read as stored), then the choice scores, the top ``k``
(`triton_common.top_k_picks`), and the log-sigmoid softmax over the chosen and shared experts, all in
registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, top_k_picks

BLOCK_H = 32  # hidden columns per chunk of the projection (experts padded to 128 rows: registers)


@triton.jit(do_not_specialize=["stride_xt"])
def _inkling_router_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr,
    stride_xt, route_scale,
    HIDDEN: tl.constexpr, E: tl.constexpr, S: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)  # rows 0..E-1 routed, E..E+S-1 shared
    e_ok = e < E + S
    acc = tl.zeros([E_PAD, BLOCK_H], tl.float32)
    for h0 in range(0, HIDDEN, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < HIDDEN
        x = tl.load(x_ptr + t * stride_xt + h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * HIDDEN + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    logits = tl.sum(acc, axis=1)  # [E_PAD]
    routed = e < E
    bias = tl.load(bias_ptr + e, mask=routed, other=0.0).to(tl.float32)
    choice = tl.where(routed, tl.sigmoid(logits) + bias, float("-inf"))
    j = tl.arange(0, K_PAD)
    picked_logit, picked = top_k_picks(choice, logits, e, E_PAD, K, K_PAD)
    sj = tl.arange(0, S_PAD)
    shared_logit = tl.zeros([S_PAD], tl.float32)
    for i in tl.static_range(S):
        shared_logit = tl.where(sj == i, tl.sum(tl.where(e == E + i, logits, 0.0), axis=0), shared_logit)
    # log-sigmoid(z) = min(z, 0) - log(1 + exp(-|z|)); a softmax over the K chosen and S shared of those.
    ls_k = tl.minimum(picked_logit, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(picked_logit)))
    ls_s = tl.minimum(shared_logit, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(shared_logit)))
    ls_k = tl.where(j < K, ls_k, float("-inf"))
    ls_s = tl.where(sj < S, ls_s, float("-inf"))
    top = tl.maximum(tl.max(ls_k, axis=0), tl.max(ls_s, axis=0))
    p_k = tl.exp(ls_k - top)
    p_s = tl.exp(ls_s - top)
    total = tl.sum(p_k, axis=0) + tl.sum(p_s, axis=0)
    scale = route_scale * tl.load(scale_ptr).to(tl.float32)
    out_ty = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + t * K + j, (p_k / total * scale).to(out_ty), mask=j < K)
    tl.store(indices_ptr + t * K + j, picked, mask=j < K)
    tl.store(gammas_ptr + t * S + sj, (p_s / total * scale).to(out_ty), mask=sj < S)


@on_device_of_first_tensor
def inkling_router_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, global_scale: torch.Tensor,
                          top_k: int, n_shared: int, route_scale: float):
    """`inkling_router.route_inkling_torch` in one launch."""
    T, H = x.shape
    E = weight.shape[0] - n_shared
    x, weight = x.contiguous(), weight.contiguous()
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    gammas = torch.empty(T, n_shared, dtype=x.dtype, device=x.device)
    if T:
        _inkling_router_kernel[(T,)](
            x, weight, bias, global_scale, weights, indices, gammas, x.stride(0), float(route_scale),
            HIDDEN=H, E=E, S=n_shared, E_PAD=triton.next_power_of_2(E + n_shared), K=top_k,
            K_PAD=triton.next_power_of_2(top_k), S_PAD=triton.next_power_of_2(n_shared),
            BLOCK_H=min(BLOCK_H, triton.next_power_of_2(H)), num_warps=4)
    return weights, indices, gammas
