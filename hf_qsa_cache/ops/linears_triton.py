"""Triton version of `hf_qsa_cache.ops.linears.linears_torch`: up to `MAX_WEIGHTS` bias-free projections of the
same few tokens in one launch (same arguments, same outputs).

A decode step projects one token's hidden state through several weights in a row: GatedDeltaNet's
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``; QSA attention's ``q_proj``, ``k_proj``,
``v_proj`` and the indexer's ``index_qk_proj``; Inkling's ``q_proj``, ``k_proj``, ``v_proj`` and ``r_proj``.
cuBLAS runs each as its own GEMV: four launches, the small ones (32 or 512 output rows) costing about as long
as a big one, and some followed by a split-K reduction. Here one program per tile of ``BLOCK_N`` output rows of
any of the weights (the tiles of weight 0, then of weight 1, ...) reads its rows once, in place, and multiplies
them with every token (``tl.dot``, tokens padded to 16: the products of bf16 values are exact in the fp32
accumulator; fp32 weights use IEEE fp32 dots), rounding each output once. No scratch, no second launch.
Launched early (the ``pdl`` setting), a program first asks for its tile's weight rows to be fetched into L2
(`triton_common.prefetch_rows_l2`), or for one token and a reduction of at most two chunks reads them into
registers (`_gemv_weights`), then waits for the kernel before it, whose output it multiplies them with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, dot, l2_lines, on_device_of_first_tensor, pdl, pdl_begin, pow2, prefetch_rows_l2

MAX_WEIGHTS = 4
MAX_TOKENS = 64  # the tokens sit in one tile of registers
# Launch policy (shapes only): output rows per program, reduction chunk, warps, and for one token the GEMV form
# (a fourth element True: no tl.dot, see `_project_tile`). Graph-timed on the H200
# (`benchmarks/sweep_projections.py`, bf16, hidden 2048; benchmarks/RESULTS.md). One token: the GEMV form with 4 rows
# and chunks of 1024 read every model's sets of input projections faster than the dot tiles and than cuBLAS (close
# to the time their bytes take); a 4096-wide reduction (GatedDeltaNet's out_proj) is best with 8 rows at 8 warps,
# level with cuBLAS and its split-K reduction. The graphed steps are faster with these tiles than with the dot
# tiles. More tokens keep the dot tiles, faster than cuBLAS at 8 tokens.
ONE_TOKEN_TILES = (4, 1024, 4, True)
ONE_TOKEN_WIDE_TILES = (8, 1024, 8, True)  # one token, reductions longer than `WIDE_K`
WIDE_K = 2048
TILES = (32, 128, 4)
# The one-token GEMV form reads its weight rows before its early-launch wait (`preloads_weights`); off, it asks
# for them in L2 there and reads them after. Timed in `benchmarks/RESULTS.md`.
PRELOAD_WEIGHTS = True
# The dot form for one token, timed against the above (`bench_generate.py --one-token-projections dot`).
ONE_TOKEN_DOT_TILES = (32, 256, 4)


def preloads_weights(K: int, block_k: int) -> bool:
    """Whether the one-token GEMV form loads its weight rows into registers before its early-launch wait (the
    ``pdl`` setting): with ``PRELOAD_WEIGHTS`` on and a reduction of at most two chunks (the rows then take at
    most 2 x ``block_k`` x rows-per-program values of registers a program)."""
    return PRELOAD_WEIGHTS and K <= 2 * block_k


def default_tiles(num_tokens: int, K: int) -> tuple:
    """The launch policy's tiles for ``num_tokens`` tokens and reductions of ``K``."""
    if num_tokens != 1:
        return TILES
    return ONE_TOKEN_TILES if K <= WIDE_K else ONE_TOKEN_WIDE_TILES


@triton.jit
def _gemv_chunk(x_ptr, stride_xk, keep_ptr, k, K: tl.constexpr, KEEP: tl.constexpr):
    """The token's inputs at reduction indices ``k`` in fp32 (zeros past ``K``, or everywhere when its ``keep``
    flag is 0)."""
    x_ok = k < K
    if KEEP:  # the token's flag, read by every lane
        x_ok = x_ok & (tl.load(keep_ptr + k * 0, mask=x_ok, other=0) != 0)
    return tl.load(x_ptr + k * stride_xk, mask=x_ok, other=0.0).to(tl.float32)


@triton.jit
def _project_tile(x_ptr, stride_xt, stride_xk, keep_ptr, w_ptr, o_ptr, block, rows, num_tokens,
                  K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  KEEP: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, GEMV: tl.constexpr):
    """Rows ``block * BLOCK_N ...`` of ``x @ w.T`` for weight ``w`` ``[rows, K]`` (contiguous) into ``o``
    ``[num_tokens, rows]`` (contiguous); with ``KEEP``, tokens whose ``keep`` flag is 0 read as zeros. ``GEMV``
    (one token only): fp32 products kept per lane and summed along the chunk at the end, no tl.dot (a dot pads
    the one token to 16 and reads the weights at about twice the rate of their bytes)."""
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < rows
    if GEMV:
        products = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = _gemv_chunk(x_ptr, stride_xk, keep_ptr, k, K, KEEP)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                        other=0.0)
            products += w.to(tl.float32) * x[None, :]
        tl.store(o_ptr + n, tl.sum(products, axis=1).to(o_ptr.dtype.element_ty), mask=n_ok)
    else:
        t = tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        t_read = t_ok
        if KEEP:
            t_read = t_ok & (tl.load(keep_ptr + t, mask=t_ok, other=0) != 0)
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :] * stride_xk,
                        mask=t_read[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[None, :].to(tl.int64) * K + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            acc += dot(x, w, IEEE, WIDEN)
        tl.store(o_ptr + t[:, None] * rows + n[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_weights(w_ptr, n, n_ok, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows ``n`` of a reduction of at most two chunks, as two ``[rows, BLOCK_K]`` tiles (the second the
    first again when one chunk holds ``K``). Weights are never written in a step: read before the wait."""
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    w_lo = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    w_hi = w_lo
    if K > BLOCK_K:
        w_hi = tl.load(rows + BLOCK_K + k[None, :], mask=n_ok[:, None] & (BLOCK_K + k < K)[None, :], other=0.0)
    return w_lo, w_hi


@triton.jit
def _gemv_preloaded(x_ptr, stride_xk, keep_ptr, weights, o_ptr, n, n_ok, K: tl.constexpr, BLOCK_K: tl.constexpr,
                    KEEP: tl.constexpr):
    """`_project_tile`'s GEMV form on rows `_gemv_weights` read: the same products and sums, in the same order."""
    w_lo, w_hi = weights
    k = tl.arange(0, BLOCK_K)
    products = w_lo.to(tl.float32) * _gemv_chunk(x_ptr, stride_xk, keep_ptr, k, K, KEEP)[None, :]
    if K > BLOCK_K:
        products += w_hi.to(tl.float32) * _gemv_chunk(x_ptr, stride_xk, keep_ptr, BLOCK_K + k, K, KEEP)[None, :]
    tl.store(o_ptr + n, tl.sum(products, axis=1).to(o_ptr.dtype.element_ty), mask=n_ok)


# Row counts are not specialised either: a weight of one row would make its count a constant, of another type than
# the counts the program's weight is picked among.
@triton.jit(do_not_specialize=["num_tokens", "stride_xt", "rows0", "rows1", "rows2", "rows3"])
def _linears_kernel(x_ptr, keep_ptr, w0, w1, w2, w3, o0, o1, o2, o3, rows0, rows1, rows2, rows3, stride_xt,
                    stride_xk, num_tokens, K: tl.constexpr, COUNT: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KEEP: tl.constexpr, IEEE: tl.constexpr,
                    WIDEN: tl.constexpr, GEMV: tl.constexpr, PRELOAD: tl.constexpr, LINES: tl.constexpr,
                    PDL: tl.constexpr = False):
    # The weight this program's tile belongs to: its pointers, rows, and the tile's index within it.
    pid = tl.program_id(0)
    end0 = tl.cdiv(rows0, BLOCK_N)
    end1 = end0 + tl.cdiv(rows1, BLOCK_N)
    end2 = end1 + tl.cdiv(rows2, BLOCK_N)
    w_ptr, o_ptr, block, rows = w0, o0, pid, rows0
    if COUNT > 1 and pid >= end0:
        w_ptr, o_ptr, block, rows = w1, o1, pid - end0, rows1
    if COUNT > 2 and pid >= end1:
        w_ptr, o_ptr, block, rows = w2, o2, pid - end1, rows2
    if COUNT > 3 and pid >= end2:
        w_ptr, o_ptr, block, rows = w3, o3, pid - end2, rows3
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    # Launched early: the tile's weight rows into registers (one token) or asked for in L2, while the kernel
    # before still runs.
    if PRELOAD:
        weights = _gemv_weights(w_ptr, n, n < rows, K, BLOCK_K)
    elif PDL:
        prefetch_rows_l2(w_ptr, n, n < rows, K, K, LINES)
    pdl_begin(PDL)
    if PRELOAD:
        _gemv_preloaded(x_ptr, stride_xk, keep_ptr, weights, o_ptr, n, n < rows, K, BLOCK_K, KEEP)
    else:
        _project_tile(x_ptr, stride_xt, stride_xk, keep_ptr, w_ptr, o_ptr, block, rows, num_tokens,
                      K, BLOCK_T, BLOCK_N, BLOCK_K, KEEP, IEEE, WIDEN, GEMV)


@on_device_of_first_tensor
def linears_triton(x: torch.Tensor, weights: list[torch.Tensor], keep: torch.Tensor | None = None, *,
                   tiles: tuple | None = None) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` for ``x`` ``[T, K]`` and 1 to `MAX_WEIGHTS` contiguous weights ``[N_i, K]``
    of ``x``'s dtype, in one launch; with ``keep`` ``[T]`` (bool), a token it marks False reads as zeros (its
    outputs are zeros: pads in GatedDeltaNet). ``tiles``: ``(rows per program, reduction chunk, warps)`` overriding
    `default_tiles` (the dot form: powers of two >= 16), or with a fourth element True the GEMV form for one token
    (powers of two, rows per program from 1)."""
    num_tokens, K = x.shape
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"linears_triton takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"linears_triton takes at most {MAX_TOKENS} tokens, got {num_tokens}")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"each weight must be contiguous [N, {K}] in {x.dtype}, got {tuple(w.shape)} "
                             f"{w.dtype} (contiguous: {w.is_contiguous()})")
    if keep is not None and keep.shape != (num_tokens,):
        raise ValueError(f"keep must have one flag per token ({num_tokens}), got shape {tuple(keep.shape)}")
    block_n, block_k, warps, *gemv = tiles or default_tiles(num_tokens, K)
    gemv = bool(gemv and gemv[0])
    if gemv and num_tokens > 1:
        raise ValueError(f"the GEMV tiles take one token, got {num_tokens}")
    if min(block_n, block_k) < (1 if gemv else 16) or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"tiles must be powers of two >= {1 if gemv else 16} (tl.dot's smallest: 16), "
                         f"got {(block_n, block_k)}")
    outs = [torch.empty(num_tokens, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    if num_tokens == 0:
        return outs
    padded_w = weights + [weights[0]] * (MAX_WEIGHTS - len(weights))  # unused slots: never read (COUNT)
    padded_o = outs + [outs[0]] * (MAX_WEIGHTS - len(weights))
    rows = [w.shape[0] for w in weights] + [0] * (MAX_WEIGHTS - len(weights))
    programs = sum(triton.cdiv(r, block_n) for r in rows)
    _linears_kernel[(programs,)](
        x, keep if keep is not None else x, *padded_w, *padded_o, *rows, x.stride(0), x.stride(1), num_tokens,
        K=K, COUNT=len(weights), BLOCK_T=pow2(num_tokens), BLOCK_N=block_n, BLOCK_K=block_k,
        KEEP=keep is not None, IEEE=x.dtype == torch.float32, WIDEN=INTERPRET, GEMV=gemv,
        PRELOAD=gemv and preloads_weights(K, block_k), LINES=l2_lines(K, x.dtype),
        num_warps=warps, **pdl(x),
    )
    return outs
