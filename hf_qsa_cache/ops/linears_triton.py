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

from .linears import MAX_WEIGHTS
from .conv_norm_triton import _conv_history, _conv_taps, _scaled, conv_step_args, conv_stream_args
from .triton_common import INTERPRET, dot, l2_lines, on_device_of_first_tensor, pdl, pdl_begin, pow2, prefetch_rows_l2

MAX_TOKENS = 64  # the tokens sit in one tile of registers
# Launch policy (shapes only): output rows per program, reduction chunk, warps, and for one token the GEMV form
# (a fourth element True: no tl.dot, see `_project_tile`). Graph-timed on the H200
# (`benchmarks/sweep_projections.py`, bf16, hidden 2048; benchmarks/RESULTS.md). One token: the GEMV form with 4 rows
# and chunks of 1024 read GatedDeltaNet's input projections in 16.1 us (1.35x their bytes) where the dot tiles took
# 23.5 and cuBLAS 27.5, QSA's in 16.8 (27.5, 29.7), Inkling's in 6.3 (17.1, 23.4), Inkling's o_proj alone in 2.7
# (cuBLAS 5.3; these two partly from L2, the sweep then rotating over too few copies); a 4096-wide reduction
# (GatedDeltaNet's out_proj) is best with 8 rows at 8 warps, 9.3 us (cuBLAS 9.1, with a split-K reduction after it).
# In the graphed steps: a Qwen4Exp 40-layer step at 1 x 4096 4.74 ms against 5.09 with the dot tiles and cuBLAS for
# projections alone (an H100).
# More tokens keep the dot tiles (8 tokens: 19.7 us against cuBLAS's 29.1 for GatedDeltaNet's set).
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


@triton.jit
def _program_weight(pid, w0, w1, w2, w3, o0, o1, o2, o3, rows0, rows1, rows2, rows3, COUNT: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The weight program ``pid``'s tile belongs to (the tiles of weight 0 come first, then weight 1's, ...): its
    pointer, its output's, the tile's index within it, and its rows."""
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
    return w_ptr, o_ptr, block, rows


# Row counts are not specialised either: a weight of one row would make its count a constant, of another type than
# the counts the program's weight is picked among.
@triton.jit(do_not_specialize=["num_tokens", "stride_xt", "rows0", "rows1", "rows2", "rows3"])
def _linears_kernel(x_ptr, keep_ptr, w0, w1, w2, w3, o0, o1, o2, o3, rows0, rows1, rows2, rows3, stride_xt,
                    stride_xk, num_tokens, K: tl.constexpr, COUNT: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KEEP: tl.constexpr, IEEE: tl.constexpr,
                    WIDEN: tl.constexpr, GEMV: tl.constexpr, PRELOAD: tl.constexpr, LINES: tl.constexpr,
                    PDL: tl.constexpr = False):
    w_ptr, o_ptr, block, rows = _program_weight(tl.program_id(0), w0, w1, w2, w3, o0, o1, o2, o3, rows0, rows1,
                                                rows2, rows3, COUNT, BLOCK_N)
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
    _check_weights(x, weights)
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"linears_triton takes at most {MAX_TOKENS} tokens, got {num_tokens}")
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
    programs, weight_args = _weight_args(weights, outs, block_n)
    _linears_kernel[(programs,)](
        x, keep if keep is not None else x, *weight_args, x.stride(0), x.stride(1), num_tokens,
        K=K, COUNT=len(weights), BLOCK_T=pow2(num_tokens), BLOCK_N=block_n, BLOCK_K=block_k,
        KEEP=keep is not None, IEEE=x.dtype == torch.float32, WIDEN=INTERPRET, GEMV=gemv,
        PRELOAD=gemv and preloads_weights(K, block_k), LINES=l2_lines(K, x.dtype),
        num_warps=warps, **pdl(x),
    )
    return outs


def _check_weights(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"the projections kernel takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"each weight must be contiguous [N, {x.shape[1]}] in {x.dtype}, got {tuple(w.shape)} "
                             f"{w.dtype} (contiguous: {w.is_contiguous()})")


def _weight_args(weights: list[torch.Tensor], outs: list[torch.Tensor], block_n: int) -> tuple[int, list]:
    """(programs, the kernels' weight, output and row-count arguments), unused slots padded (never read: COUNT)."""
    padding = MAX_WEIGHTS - len(weights)
    rows = [w.shape[0] for w in weights] + [0] * padding
    programs = sum(triton.cdiv(r, block_n) for r in rows)
    return programs, [*weights, *[weights[0]] * padding, *outs, *[outs[0]] * padding, *rows]


# ----------------------------------------------------------------------------- with the norm before them
@triton.jit(do_not_specialize=["rows0", "rows1", "rows2", "rows3", "table_s0", "table_cols", "query_len"])
def _conv_norm_linears_kernel(
    x_ptr, residual_ptr, h_ptr, norm_ptr, eps, conv_ptr, store_ptr, store_s0, store_s1, width,
    table_ptr, table_s0, table_cols, slots_ptr, pos_ptr, prev_ptr, query_len, block_size,
    w0, w1, w2, w3, o0, o1, o2, o3, rows0, rows1, rows2, rows3,
    K: tl.constexpr, COUNT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAPS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    w_ptr, o_ptr, block, rows = _program_weight(pid, w0, w1, w2, w3, o0, o1, o2, o3, rows0, rows1, rows2, rows3,
                                                COUNT, BLOCK_N)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    t = pid * 0  # the one token
    # Before the wait: the tile's weight rows, and the conv over the token's taps that earlier steps stored.
    weights = _gemv_weights(w_ptr, n, n < rows, K, BLOCK_K)
    history_lo = _conv_history(t, k, k < K, conv_ptr, store_ptr, store_s0, store_s1, width, table_ptr, table_s0,
                               table_cols, pos_ptr, prev_ptr, query_len, block_size, TAPS)
    history_hi = history_lo
    if K > BLOCK_K:
        history_hi = _conv_history(t, BLOCK_K + k, BLOCK_K + k < K, conv_ptr, store_ptr, store_s0, store_s1, width,
                                   table_ptr, table_s0, table_cols, pos_ptr, prev_ptr, query_len, block_size, TAPS)
    pdl_begin(PDL)
    # Every program computes h and its norm for itself (a few thousand values, from L2); the first one also writes
    # h and the token's conv input.
    first = (k * 0 + pid) == 0  # per lane (a scalar flag in a mask fails under the interpreter)
    h_lo = _conv_residual(history_lo, x_ptr, residual_ptr, h_ptr, t, k, k < K, K, conv_ptr, store_ptr, store_s0,
                          store_s1, width, slots_ptr, first, TAPS)
    squares = tl.sum(h_lo.to(tl.float32) * h_lo.to(tl.float32), axis=0)
    h_hi = h_lo
    if K > BLOCK_K:
        h_hi = _conv_residual(history_hi, x_ptr, residual_ptr, h_ptr, t, BLOCK_K + k, BLOCK_K + k < K, K, conv_ptr,
                              store_ptr, store_s0, store_s1, width, slots_ptr, first, TAPS)
        squares += tl.sum(h_hi.to(tl.float32) * h_hi.to(tl.float32), axis=0)
    inv_rms = tl.rsqrt(squares / K + eps)
    # `_gemv_preloaded`'s products and sums on the normed chunks.
    w_lo, w_hi = weights
    x_dtype = h_ptr.dtype.element_ty
    products = w_lo.to(tl.float32) * _scaled(h_lo, inv_rms, norm_ptr, k, k < K, x_dtype).to(tl.float32)[None, :]
    if K > BLOCK_K:
        products += (w_hi.to(tl.float32)
                     * _scaled(h_hi, inv_rms, norm_ptr, BLOCK_K + k, BLOCK_K + k < K, x_dtype).to(tl.float32)[None, :])
    tl.store(o_ptr + n, tl.sum(products, axis=1).to(o_ptr.dtype.element_ty), mask=n < rows)


@triton.jit
def _conv_residual(history, x_ptr, residual_ptr, h_ptr, t, c, cm, C, conv_ptr, store_ptr, store_s0, store_s1, width,
                   slots_ptr, write, TAPS: tl.constexpr):
    """``h = residual + short_conv(x)`` of token ``t`` at channels ``c``, rounded as `_conv_add_rms_norm_kernel`
    rounds it (the conv's output, then the sum); where ``write``, stored to ``h`` and the input to its conv slot."""
    x_dtype = h_ptr.dtype.element_ty
    h = _conv_taps(history, x_ptr, t, c, cm, C, conv_ptr, store_ptr, store_s0, store_s1, width, slots_ptr, write,
                   TAPS).to(x_dtype)
    row = t.to(tl.int64) * C
    h = (tl.load(residual_ptr + row + c, mask=cm, other=0.0).to(tl.float32) + h.to(tl.float32)).to(x_dtype)
    tl.store(h_ptr + row + c, h, mask=cm & write)
    return h


@on_device_of_first_tensor
def conv_norm_linears_triton(x: torch.Tensor, taps, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weights: list[torch.Tensor], *, tiles: tuple | None = None
                             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`hf_qsa_cache.ops.linears.conv_norm_linears_torch` for one token in one launch: ``h = residual +
    short_conv(x)`` (``taps``: the conv's `hf_qsa_cache.ops.sconv.ConvTaps`), then ``[norm(h) @ w.T for w in
    weights]``; returns ``(h, outputs)`` and writes ``x`` to its conv stream. Each program of the GEMV form computes
    ``h`` and its norm itself before its products (`preloads_weights` tiles only: at most two chunks), which saves
    the norm's own launch. ``tiles`` as `linears_triton`'s GEMV tiles."""
    T, K = x.shape
    if T != 1:
        raise ValueError(f"conv_norm_linears_triton takes one token, got {T}")
    _check_weights(x, weights)
    if residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.shape != (K,) \
            or norm_weight.dtype != x.dtype:
        raise ValueError(f"residual must be {tuple(x.shape)} and the norm's weight ({K},), both in {x.dtype}; got "
                         f"{tuple(residual.shape)} {residual.dtype} and {tuple(norm_weight.shape)} {norm_weight.dtype}")
    block_n, block_k, warps, *gemv = tiles or default_tiles(1, K)
    if not (gemv and gemv[0]) or K > 2 * block_k or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"the fused norm needs GEMV tiles (powers of two) whose chunks hold the reduction in at most "
                         f"two: reduction {K}, tiles {(block_n, block_k, warps, *gemv)}")
    x, residual = x.contiguous(), residual.contiguous()
    h = torch.empty_like(x)
    outs = [torch.empty(1, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    programs, weight_args = _weight_args(weights, outs, block_n)
    _conv_norm_linears_kernel[(programs,)](
        x, residual, h, norm_weight, float(eps), *conv_stream_args(taps), *conv_step_args(taps), *weight_args,
        K=K, COUNT=len(weights), BLOCK_N=block_n, BLOCK_K=block_k, TAPS=taps.weight.shape[1], num_warps=warps,
        **pdl(x),
    )
    return h, outs
