"""Triton version of `hf_qsa_cache.ops.inkling_router.route_inkling_torch`, in two launches.

1. `router_triton.router_partials`: the projection onto every routed and shared expert, split over experts
   and over ranges of the hidden size (fp32 partial sums).
2. `_inkling_router_kernel`: per token, the partial sums added up, then the choice scores, the top ``k``
   (`triton_common.top_k_picks`) and the log-sigmoid softmax over the chosen and shared experts, in
   registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .router_triton import BLOCK_H, router_partials
from .triton_common import on_device_of_first_tensor, pdl, pdl_begin, top_k_picks


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _inkling_router_kernel(
    part_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, num_tokens, splits, route_scale,
    E: tl.constexpr, S: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)  # rows 0..E-1 routed, E..E+S-1 shared
    e_ok = e < E + S
    logits = tl.zeros([E_PAD], tl.float32)
    for split in range(splits):  # (a runtime count: a new batch size does not recompile)
        logits += tl.load(part_ptr + (split * num_tokens + t) * (E + S) + e, mask=e_ok, other=0.0)
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
                          top_k: int, n_shared: int, route_scale: float, *, block_h: int = BLOCK_H,
                          splits: int | None = None):
    """`inkling_router.route_inkling_torch` in two launches. ``block_h`` and ``splits`` (hidden ranges; None:
    enough for `TARGET_PROGRAMS`) are the projection's tiling (tests force them small)."""
    T, H = x.shape
    rows = weight.shape[0]
    E = rows - n_shared
    x, weight = x.contiguous(), weight.contiguous()
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    gammas = torch.empty(T, n_shared, dtype=x.dtype, device=x.device)
    if not T:
        return weights, indices, gammas
    part = router_partials(x, weight, block_h, splits)
    _inkling_router_kernel[(T,)](
        part, bias, global_scale, weights, indices, gammas, T, part.shape[0], float(route_scale), E=E, S=n_shared,
        E_PAD=triton.next_power_of_2(rows), K=top_k, K_PAD=triton.next_power_of_2(top_k),
        S_PAD=triton.next_power_of_2(n_shared), num_warps=1, **pdl(part))
    return weights, indices, gammas
