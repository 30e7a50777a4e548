"""Triton version of `hf_qsa_cache.ops.inkling_router.route_inkling_torch`, in two launches.

1. `_router_logits_kernel`: the projection onto every routed and shared expert, split over experts (rows
   of ``BLOCK_E``) and over ranges of the hidden size, so that a decode step's one token still spreads the
   weight read over many programs (one program per token read the whole weight alone: 60 us per layer on
   the H200 for a 65 x 2048 router, against a few for the read). Partial sums in fp32, weight read as stored.
2. `_inkling_router_kernel`: per token, the partial sums added up, then the choice scores, the top ``k``
   (`triton_common.top_k_picks`) and the log-sigmoid softmax over the chosen and shared experts, in
   registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, top_k_picks

BLOCK_E = 16  # experts (router rows) per program of the projection
BLOCK_H = 256  # hidden columns per chunk of the projection
TARGET_PROGRAMS = 128  # the projection's programs a launch aims for (about one per SM on an H100 / H200)


@triton.jit(do_not_specialize=["stride_xt", "num_tokens", "split_len"])
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, stride_xt, num_tokens, split_len,
                          HIDDEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """part[s, t, e] = sum over the s-th hidden range of x[t, h] * w[e, h] (fp32)."""
    e_block, s, t = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    e = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < ROWS
    lo = s * split_len
    acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
    for h0 in range(lo, lo + split_len, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < HIDDEN  # (split_len is a multiple of BLOCK_H)
        x = tl.load(x_ptr + t * stride_xt + h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * HIDDEN + h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(part_ptr + (s * num_tokens + t) * ROWS + e, tl.sum(acc, axis=1), mask=e_ok)


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _inkling_router_kernel(
    part_ptr, bias_ptr, scale_ptr, weights_ptr, indices_ptr, gammas_ptr, num_tokens, splits, route_scale,
    E: tl.constexpr, S: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
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
    block_h = min(block_h, triton.next_power_of_2(H))
    e_blocks = triton.cdiv(rows, BLOCK_E)
    if splits is None:
        splits = triton.cdiv(TARGET_PROGRAMS, e_blocks * T)
    split_len = block_h * triton.cdiv(triton.cdiv(H, max(1, splits)), block_h)
    splits = triton.cdiv(H, split_len)
    part = torch.empty(splits, T, rows, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(e_blocks, splits, T)](
        x, weight, part, x.stride(0), T, split_len, HIDDEN=H, ROWS=rows, BLOCK_E=BLOCK_E, BLOCK_H=block_h,
        num_warps=4)
    _inkling_router_kernel[(T,)](
        part, bias, global_scale, weights, indices, gammas, T, splits, float(route_scale), E=E, S=n_shared,
        E_PAD=triton.next_power_of_2(rows), K=top_k, K_PAD=triton.next_power_of_2(top_k),
        S_PAD=triton.next_power_of_2(n_shared), num_warps=4)
    return weights, indices, gammas
