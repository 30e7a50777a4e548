"""Triton version of `hf_qsa_cache.ops.inkling_router.route_inkling_torch`.

1. The projection onto every routed and shared expert, split over experts and over ranges of the hidden size
   (fp32 partial sums; `router_triton`'s).
2. `_inkling_route`: per token, the partial sums added up, then the choice scores, the top ``k``
   (`triton_common.top_k_picks`) and the log-sigmoid softmax over the chosen and shared experts, in registers.

Up to `router_triton.ONE_LAUNCH_MAX_TOKENS` tokens (a decode or verify step) both are one launch,
`_inkling_route_kernel`: the last program of a token's projection to finish (`triton_common.last_to_arrive`)
routes it. More tokens (a prompt) take two launches, the second `_inkling_router_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import router_triton
from .router_triton import BLOCK_H, prefetch_range_rows, project_range, projection_args, router_partials
from .triton_common import (ARRIVAL_COUNTERS, arrival_counters, last_to_arrive, on_device_of_first_tensor, pdl,
                            pdl_begin, top_k_picks)


@triton.jit
def _inkling_route(part_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, t, num_tokens, splits,
                   route_scale, E: tl.constexpr, S: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                   K_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Token ``t``'s routing from the projection's ``splits`` partial sums (read past L1: another program of the
    launch may have written them, `last_to_arrive`)."""
    e = tl.arange(0, E_PAD)  # rows 0..E-1 routed, E..E+S-1 shared
    e_ok = e < E + S
    logits = tl.zeros([E_PAD], tl.float32)
    for split in range(splits):  # (a runtime count: a new batch size does not recompile)
        logits += tl.load(part_ptr + (split * num_tokens + t) * (E + S) + e, mask=e_ok, other=0.0,
                          cache_modifier=".cg")
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


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _inkling_router_kernel(
    part_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, num_tokens, splits, route_scale,
    E: tl.constexpr, S: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    _inkling_route(part_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, tl.program_id(0).to(tl.int64),
                   num_tokens, splits, route_scale, E, S, E_PAD, K, K_PAD, S_PAD)


@triton.jit(do_not_specialize=["stride_xt", "num_tokens", "split_len", "splits"])
def _inkling_route_kernel(
    x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, stride_xt,
    num_tokens, split_len, splits, route_scale, HIDDEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr, LINES: tl.constexpr, E: tl.constexpr, S: tl.constexpr, E_PAD: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """The split projection, then the token's routing in the last of its programs to finish: one launch."""
    if PDL:  # launched early: the program's block of the weight into L2 while the kernel before runs
        prefetch_range_rows(w_ptr, split_len, HIDDEN, ROWS, BLOCK_E, LINES)
    pdl_begin(PDL)
    t = project_range(x_ptr, w_ptr, part_ptr, stride_xt, num_tokens, split_len, HIDDEN, ROWS, BLOCK_E, BLOCK_H)
    if last_to_arrive(count_ptr + t, tl.num_programs(0) * tl.num_programs(1)):
        _inkling_route(part_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, t, num_tokens, splits,
                       route_scale, E, S, E_PAD, K, K_PAD, S_PAD)


@on_device_of_first_tensor
def inkling_router_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, global_scale: torch.Tensor,
                          top_k: int, n_shared: int, route_scale: float, *, block_h: int = BLOCK_H,
                          splits: int | None = None):
    """`inkling_router.route_inkling_torch`: one launch for up to `router_triton.ONE_LAUNCH_MAX_TOKENS` tokens
    (the routing in the last program of each token's projection, `last_to_arrive`), else two. ``block_h`` and
    ``splits`` (hidden ranges; None: enough for `TARGET_PROGRAMS`) are the projection's tiling (tests force them
    small)."""
    T, H = x.shape
    rows = weight.shape[0]
    E = rows - n_shared
    x, weight = x.contiguous(), weight.contiguous()
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    gammas = torch.empty(T, n_shared, dtype=x.dtype, device=x.device)
    if not T:
        return weights, indices, gammas
    routing = dict(E=E, S=n_shared, E_PAD=triton.next_power_of_2(rows), K=top_k, K_PAD=triton.next_power_of_2(top_k),
                   S_PAD=triton.next_power_of_2(n_shared))
    if T <= min(router_triton.ONE_LAUNCH_MAX_TOKENS, ARRIVAL_COUNTERS):
        grid, part, split_len, sizes = projection_args(x, weight, block_h, splits)
        _inkling_route_kernel[grid](
            x, weight, part, arrival_counters(x.device), bias, global_scale, weights, indices, gammas, x.stride(0), T,
            split_len, grid[1], float(route_scale), **sizes, **routing, num_warps=4, **pdl(x))
        return weights, indices, gammas
    part = router_partials(x, weight, block_h, splits)
    _inkling_router_kernel[(T,)](
        part, bias, global_scale, weights, indices, gammas, T, part.shape[0], float(route_scale), **routing,
        num_warps=1, **pdl(part))
    return weights, indices, gammas
