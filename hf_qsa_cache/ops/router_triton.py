"""Triton versions of the MoE routers' arithmetic: `hf_qsa_cache.ops.router.route_torch` (Qwen4Exp) here,
and the split projection that Inkling's router (`inkling_router_triton`) shares.

`router_partials`: a router's projection for a few tokens, split over experts (rows of ``BLOCK_E``) and over
ranges of the hidden size, so that one token still spreads the weight read over many programs (one program
per token took many times longer than the read itself, and than cuBLAS's GEMV). Partial sums in fp32, the weight
read as stored.

`_route_topk_kernel`: per token, the projection's partial sums added up (or the logits of a prompt's GEMM,
one "partial") and rounded to the model's dtype as the projection's output would be, then softmax in fp32,
top ``k`` (`triton_common.top_k_picks`) and the renormalisation, in registers. One warp: its reductions
over 64 experts are warp shuffles, with no shared-memory round trips between the ``k`` picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import TL_DTYPES, l2_lines, on_device_of_first_tensor, pdl, pdl_begin, prefetch_rows_l2, top_k_picks

BLOCK_E = 16  # experts (router rows) per program of the projection
BLOCK_H = 256  # hidden columns per chunk of the projection
TARGET_PROGRAMS = 128  # the projection's programs a launch aims for (about one per SM on an H100 / H200)
# Up to this many tokens the projection is `router_partials` (a decode or verify step); more take the GEMM.
SPLIT_PROJECTION_MAX_TOKENS = 16
# A program whose hidden range is one chunk reads its weight rows before its early-launch wait (the decode shapes:
# 64 experts over a 2048 hidden size in ranges of 256); off, it asks for them in L2 there and reads them after.
PRELOAD_WEIGHTS = True


@triton.jit
def _router_weights(w_ptr, e, e_ok, lo, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows ``e`` of the router's weight at hidden columns ``lo ...`` (one chunk). Weights are never written in a
    step: read before the wait where a program's range is one chunk, in its loop otherwise."""
    h = lo + tl.arange(0, BLOCK_H)
    return tl.load(w_ptr + e[:, None].to(tl.int64) * HIDDEN + h[None, :], mask=e_ok[:, None] & (h < HIDDEN)[None, :],
                   other=0.0)


@triton.jit(do_not_specialize=["stride_xt", "num_tokens", "split_len"])
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, stride_xt, num_tokens, split_len,
                          HIDDEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          ONE_CHUNK: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr = False):
    """part[s, t, e] = sum over the s-th hidden range of x[t, h] * w[e, h] (fp32). Launched early (``PDL``), the
    program first reads its block of the weight where the range is one chunk (``ONE_CHUNK``: ``split_len`` is
    ``BLOCK_H``), else asks for it in L2 (`triton_common.prefetch_rows_l2`)."""
    e_block, s, t = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    e = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < ROWS
    # split_len is a multiple of BLOCK_H (`router_partials`): said to the compiler, which then reads 8 contiguous,
    # aligned weights as one 16-byte access (not knowing it, it read them 2 bytes at a time)
    lo = tl.multiple_of(s * split_len, BLOCK_H)
    if ONE_CHUNK:
        w_chunk = _router_weights(w_ptr, e, e_ok, lo, HIDDEN, BLOCK_H)
    elif PDL:
        prefetch_rows_l2(w_ptr + lo, e, e_ok, HIDDEN, tl.minimum(split_len, HIDDEN - lo), LINES)
    pdl_begin(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
    for h0 in range(lo, lo + split_len, BLOCK_H):  # (one pass with ONE_CHUNK, on the rows read above)
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + t * stride_xt + h, mask=h < HIDDEN, other=0.0).to(tl.float32)
        if ONE_CHUNK:
            w = w_chunk
        else:
            w = _router_weights(w_ptr, e, e_ok, h0, HIDDEN, BLOCK_H)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(part_ptr + (s * num_tokens + t) * ROWS + e, tl.sum(acc, axis=1), mask=e_ok)


def router_partials(x: torch.Tensor, weight: torch.Tensor, block_h: int = BLOCK_H,
                    splits: int | None = None) -> torch.Tensor:
    """``[splits, T, rows]`` fp32 partial sums of ``x [T, H] @ weight.T`` over ranges of the hidden size (one
    launch; ``T >= 1``). ``block_h`` and ``splits`` (None: enough for `TARGET_PROGRAMS`) are its tiling (tests
    force them small)."""
    T, H = x.shape
    rows = weight.shape[0]
    block_h = min(block_h, triton.next_power_of_2(H))
    e_blocks = triton.cdiv(rows, BLOCK_E)
    if splits is None:
        splits = triton.cdiv(TARGET_PROGRAMS, e_blocks * T)
    split_len = block_h * triton.cdiv(triton.cdiv(H, max(1, splits)), block_h)
    splits = triton.cdiv(H, split_len)
    part = torch.empty(splits, T, rows, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(e_blocks, splits, T)](
        x, weight, part, x.stride(0), T, split_len, HIDDEN=H, ROWS=rows, BLOCK_E=BLOCK_E, BLOCK_H=block_h,
        ONE_CHUNK=PRELOAD_WEIGHTS and split_len == block_h, LINES=l2_lines(H, weight.dtype), num_warps=4, **pdl(x))
    return part


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _route_topk_kernel(part_ptr, weights_ptr, experts_ptr, num_tokens, splits,
                       E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                       NORMALIZE: tl.constexpr, LOGITS_DTYPE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    x = tl.zeros([E_PAD], tl.float32)
    for split in range(splits):  # (a runtime count: a new batch size does not recompile)
        x += tl.load(part_ptr + (split * num_tokens + t) * E + e, mask=e < E, other=0.0).to(tl.float32)
    x = x.to(LOGITS_DTYPE).to(tl.float32)  # the projection's output dtype
    x = tl.where(e < E, x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # padded experts: exp(-inf) = 0, after every real one (lower index first)
    j = tl.arange(0, K_PAD)
    values, picked = top_k_picks(p, p, e, E_PAD, K, K_PAD)
    if NORMALIZE:
        values = values / tl.sum(tl.where(j < K, values, 0.0), axis=0)
    tl.store(weights_ptr + t * K + j, values.to(weights_ptr.dtype.element_ty), mask=j < K)
    tl.store(experts_ptr + t * K + j, picked, mask=j < K)


@on_device_of_first_tensor
def route_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, *,
                 split: bool | None = None, block_h: int = BLOCK_H,
                 splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`router.route_torch` in two launches: the projection (`router_partials` for up to
    `SPLIT_PROJECTION_MAX_TOKENS` tokens, else the GEMM; ``split`` forces the choice), then the routing."""
    x, weight = x.contiguous(), weight.contiguous()
    T = x.shape[0]
    E = weight.shape[0]
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    experts = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if not T:
        return weights, experts
    if split if split is not None else T <= SPLIT_PROJECTION_MAX_TOKENS:
        part = router_partials(x, weight, block_h, splits)
    else:
        part = torch.nn.functional.linear(x, weight)[None]  # one "partial": the GEMM's logits, already rounded
    _route_topk_kernel[(T,)](part, weights, experts, T, part.shape[0], E=E, E_PAD=triton.next_power_of_2(E),
                             K=top_k, K_PAD=triton.next_power_of_2(top_k), NORMALIZE=normalize,
                             LOGITS_DTYPE=TL_DTYPES[x.dtype], num_warps=1, **pdl(part))
    return weights, experts
