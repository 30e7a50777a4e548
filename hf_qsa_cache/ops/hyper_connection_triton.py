"""Triton versions of the fused hyper-connection ops (`hf_qsa_cache.ops.hyper_connection` is the spec).

One program per token: a token's ``hc`` streams (``hc * H`` features, 8192 at the benchmark shapes) are
loaded once as an ``[HC_PAD, BLOCK_H]`` tile, fp32 throughout, outputs rounded once. Token counts are
not specialised (a new batch bucket or prefill chunk does not recompile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_common import (
    INTERPRET, dot, grouped_norm, l2_lines, on_device_of_first_tensor, pdl, pdl_begin, prefetch_rows_l2,
)


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4


@triton.jit(do_not_specialize=["num_tokens"])
def _hc_norm_kernel(streams_ptr, out_ptr, inject_ptr, weight_ptr, streams_out_ptr, normed_ptr, num_tokens, eps,
                    HC: tl.constexpr, H: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                    RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
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
    normed = grouped_norm(x, weight_ptr, c, h, ok, H, eps)
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
            num_warps=_warps(hc_pad * block_h), **pdl(streams),
        )
    return (new_streams if residual is not None else streams), normed


@triton.jit
def _scaled_silu_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
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
        _scaled_silu_kernel[(triton.cdiv(n, block),)](x, y, n, float(scale), BLOCK=block, num_warps=4, **pdl(x))
    return y


@triton.jit(do_not_specialize=["num_tokens"])
def _mix_streams_kernel(up_ptr, normed_ptr, logits_ptr, mixed_ptr, inject_ptr, num_tokens,
                        HC: tl.constexpr, H: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                        INJECT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HC_PAD)
    h = tl.arange(0, BLOCK_H)
    ok = (c < HC)[:, None] & (h < H)[None, :]
    offsets = t * HC * H + c[:, None] * H + h[None, :]
    gates = tl.sigmoid(tl.load(up_ptr + offsets, mask=ok, other=0.0).to(tl.float32))
    normed = tl.load(normed_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    mixed = tl.sum(gates * normed, axis=0) / HC  # padded streams load 0 and add nothing
    tl.store(mixed_ptr + t * H + h, mixed.to(mixed_ptr.dtype.element_ty), mask=h < H)
    if INJECT:
        logits = tl.load(logits_ptr + t * HC + c, mask=c < HC, other=0.0).to(tl.float32)
        inject = 2.0 * tl.sigmoid(logits / HC)
        tl.store(inject_ptr + t * HC + c, inject.to(inject_ptr.dtype.element_ty), mask=c < HC)


@on_device_of_first_tensor
def mix_streams_triton(up: torch.Tensor, normed: torch.Tensor, inject_logits: torch.Tensor | None,
                       hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`hyper_connection.mix_streams` in one launch (``inject`` None without logits)."""
    up, normed = up.contiguous(), normed.contiguous()
    width = normed.shape[-1]
    H = width // hc
    tokens = normed.numel() // max(width, 1)
    mixed = torch.empty(*normed.shape[:-1], H, dtype=normed.dtype, device=normed.device)
    inject = (torch.empty(*normed.shape[:-1], hc, dtype=normed.dtype, device=normed.device)
              if inject_logits is not None else None)
    if tokens:
        block_h = triton.next_power_of_2(H)
        hc_pad = triton.next_power_of_2(hc)
        logits = inject_logits.contiguous() if inject is not None else mixed  # (unread without injection)
        _mix_streams_kernel[(tokens,)](up, normed, logits, mixed, inject if inject is not None else mixed, tokens,
                                       HC=hc, H=H, HC_PAD=hc_pad, BLOCK_H=block_h, INJECT=inject is not None,
                                       num_warps=_warps(hc_pad * block_h), **pdl(up))
    return mixed, inject


# ----------------------------------------------------------------------------- the projections (``hc_proj``)
# The tiles of `mix_projections_triton`. The down projection is a split-K GEMM: a decode step's few tokens
# padded to BLOCK_M rows (tl.dot needs 16), the weights read once, in ``splits`` ranges of the hc * H inputs
# so that enough programs stream them. The up projection is GEMVs over ``block_h`` output columns (times the
# streams: weight rows) per program, ``r_chunk`` low-rank columns at a time.
HC_PROJ_BLOCK_M = 16


@dataclass(frozen=True)
class MixTiles:
    splits: int
    block_n: int
    block_k: int
    down_warps: int
    block_h: int
    r_chunk: int
    up_warps: int
    # One token only: the down projection in the GEMV form (`_hc_down_kernel`'s ``GEMV``), no tl.dot.
    gemv: bool = False


# Chosen by `benchmarks/sweep_hc_tiles.py` (hidden 2048, 4 streams, low rank 320, bf16; graph-timed per mixing).
# One token: the down projection in the GEMV form (`_hc_down_kernel`'s ``GEMV``; the dot form pads the token to 16
# rows), 8 rows a program in 8 input ranges of 1024, so the up projection adds 8 partial sums, not 32: faster than
# the dot form's best tiles (`ONE_TOKEN_DOT_MIX_TILES`) and than the cuBLAS path, per mixing and in the whole
# decode step (`benchmarks/RESULTS.md`). More tokens: the dot form, faster than the cuBLAS path at 8 tokens.
ONE_TOKEN_MIX_TILES = MixTiles(splits=8, block_n=8, block_k=1024, down_warps=4, block_h=8, r_chunk=128, up_warps=4,
                               gemv=True)
ONE_TOKEN_DOT_MIX_TILES = MixTiles(splits=32, block_n=64, block_k=128, down_warps=4, block_h=16, r_chunk=128,
                                   up_warps=8)
MIX_TILES = MixTiles(splits=16, block_n=64, block_k=128, down_warps=4, block_h=32, r_chunk=64, up_warps=2)


@triton.jit
def _down_tiles(x_ptr, rows, m, m_ok, n_ok, lo, hi, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, FULL: tl.constexpr,
                GEMV: tl.constexpr):
    """`_hc_down_kernel`'s pass over its input range ``[lo, hi)`` for the weight rows at ``rows`` (``[BLOCK_N]``
    pointers): the products ``[BLOCK_M, BLOCK_N]``. ``FULL``: every chunk whole, so inputs are masked
    against K, a compile-time bound (the same lanes as ``hi``): 8 contiguous inputs are then one 16-byte access.
    ``GEMV`` (one token of normed streams, ``BLOCK_M`` 1): no tl.dot, whose 16-row tiles would be padding; each
    lane keeps its fp32 products, summed along the chunk once at the end."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GEMV:
        products = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if FULL:
            k_ok = k < K
        else:
            k_ok = k < hi
        if GEMV:
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            products += w.to(tl.float32) * x[None, :]
        else:
            mk_ok = m_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mk_ok, other=0.0)
            w = tl.load(rows[None, :] + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += dot(x, w, IEEE, WIDEN)
    if GEMV:
        acc = tl.sum(products, axis=1)[None, :]
    return acc


@triton.jit(do_not_specialize=["num_tokens"])
def _hc_down_kernel(x_ptr, down_ptr, inject_w_ptr, part_ptr, num_tokens,
                    K: tl.constexpr, R: tl.constexpr, HC: tl.constexpr, H: tl.constexpr,
                    SPLITS_PER_STREAM: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FULL: tl.constexpr, GEMV: tl.constexpr,
                    IEEE: tl.constexpr, WIDEN: tl.constexpr,
                    INJECT: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr = False):
    """part[s, m, n] = sum over the s-th input range of x[m, k] * W[n, k], W = [down (R rows); inject (HC)]
    (the injection rows only with ``INJECT``). The ranges split each stream's H inputs in SPLITS_PER_STREAM.

    ``x`` is the normed streams. Launched early (``PDL``), the program first asks for its block of W to be fetched
    into L2. The range's length
    is a compile-time value and the down projection's row blocks take its base alone (the block holding the
    injection rows selects between two bases): the compiler can then see 8 neighbouring weights as contiguous
    and aligned, and reads them in one access (`_down_tiles`). ``GEMV``: one token without tl.dot (`_down_tiles`)."""
    n_block, s, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < num_tokens, n < (R + HC if INJECT else R)
    c = s // SPLITS_PER_STREAM  # the stream this range lies in
    lo = c * H + (s % SPLITS_PER_STREAM) * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, c * H + H)
    if PDL:
        prefetch_rows_l2(down_ptr + lo, n, n < R, K, hi - lo, LINES)
        if INJECT:
            prefetch_rows_l2(inject_w_ptr + lo, n - R, n_ok & (n >= R), K, hi - lo, LINES)
    pdl_begin(PDL)
    # Two calls, not one on a base chosen by an if: a value merged from two branches loses the alignment the
    # compiler knows of each, and the down projection's blocks would read their weights 2 bytes at a time.
    if (n_block + 1) * BLOCK_N <= R:  # rows of the down projection only
        acc = _down_tiles(x_ptr, down_ptr + n.to(tl.int64) * K, m, m_ok, n_ok, lo, hi, K, BLOCK_M, BLOCK_N,
                          BLOCK_K, IEEE, WIDEN, FULL, GEMV)
    else:  # output rows 0..R-1 read the down projection, R..R+HC-1 the injection logits' weight
        rows = tl.where(n < R, down_ptr + n.to(tl.int64) * K, inject_w_ptr + (n - R).to(tl.int64) * K)
        acc = _down_tiles(x_ptr, rows, m, m_ok, n_ok, lo, hi, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, WIDEN, FULL,
                          GEMV)
    out = part_ptr + (s * num_tokens + m.to(tl.int64))[:, None] * (R + HC) + n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _hc_up_mix_kernel(part_ptr, x_ptr, up_ptr, mixed_ptr, inject_ptr, num_tokens,
                      H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr, SPLITS: tl.constexpr, HC_PAD: tl.constexpr,
                      R_CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, INJECT: tl.constexpr,
                      LINES: tl.constexpr, PDL: tl.constexpr = False):
    """mixed[t, h] = mean_c sigmoid(low[t] . W_up[c*H + h]) * normed[t, c*H + h], with low = silu(down / HC)
    summed from the splits. One program per (block of BLOCK_H columns, token): its HC_PAD * BLOCK_H weight
    rows (stream-major) are read once, in chunks of R_CHUNK of the low rank, as GEMVs (products summed
    along the chunk at the end; no tl.dot, whose 16-row tiles would be padding for one token). The first
    column block also writes inject = 2 sigmoid(logits / HC). ``x`` is the normed streams. Launched early (``PDL``),
    the program first asks for its weight rows to be fetched into L2."""
    h_block, t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    j = tl.arange(0, HC_PAD * BLOCK_H)
    stream, h = j // BLOCK_H, h_block * BLOCK_H + j % BLOCK_H
    ok = (stream < HC) & (h < H)
    cols = (stream * H + h).to(tl.int64)
    if PDL:
        prefetch_rows_l2(up_ptr, cols, ok, R, R, LINES)
    pdl_begin(PDL)
    dots = tl.zeros([HC_PAD * BLOCK_H, R_CHUNK], tl.float32)
    for r0 in range(0, R, R_CHUNK):
        r = r0 + tl.arange(0, R_CHUNK)
        r_ok = r < R
        low = tl.zeros([R_CHUNK], tl.float32)
        for s in range(SPLITS):
            part = tl.load(part_ptr + (s * num_tokens + t) * (R + HC) + r, mask=r_ok, other=0.0)
            low += part
        low = low / HC
        low = low * tl.sigmoid(low)  # padded columns stay 0 and add nothing
        w = tl.load(up_ptr + cols[:, None] * R + r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        dots += w.to(tl.float32) * low[None, :]
    gate = tl.sigmoid(tl.sum(dots, axis=1))
    x = tl.load(x_ptr + t * (HC * H) + cols, mask=ok, other=0.0).to(tl.float32)
    mixed = tl.sum(tl.reshape(tl.where(ok, gate * x, 0.0), (HC_PAD, BLOCK_H)), axis=0) / HC
    out_h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(mixed_ptr + t * H + out_h, mixed.to(mixed_ptr.dtype.element_ty), mask=out_h < H)
    if INJECT and h_block == 0:
        c = tl.arange(0, HC_PAD)
        logits = tl.zeros([HC_PAD], tl.float32)
        for s in range(SPLITS):
            part = tl.load(part_ptr + (s * num_tokens + t) * (R + HC) + R + c, mask=c < HC, other=0.0)
            logits += part
        inject = 2.0 * tl.sigmoid(logits / HC)
        tl.store(inject_ptr + t * HC + c, inject.to(inject_ptr.dtype.element_ty), mask=c < HC)


def _split_len(H: int, hc: int, tiles: MixTiles) -> int:
    """Inputs per range of the down projection: ``tiles.splits`` ranges over the hc streams, each stream cut in
    the same number of ranges of whole BLOCK_K chunks (a range never crosses a stream)."""
    per_stream = triton.cdiv(tiles.splits, hc)
    return tiles.block_k * triton.cdiv(triton.cdiv(H, per_stream), tiles.block_k)


@on_device_of_first_tensor
def mix_projections_triton(normed: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                           inject_weight: torch.Tensor | None, hc: int,
                           tiles: MixTiles | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`hyper_connection.mix_projections` in two launches (split-K down and injection projections, then the
    up projection with the gating and the mean over streams), tiled by ``tiles`` (default: the measured
    `ONE_TOKEN_MIX_TILES` or `MIX_TILES`; tests force them small)."""
    x = normed.contiguous()
    down, up = down.contiguous(), up.contiguous()
    has_inject = inject_weight is not None  # (the final mixer has none)
    inject_weight = inject_weight.contiguous() if has_inject else down  # (unread without injection)
    K = x.shape[-1]
    H, R = K // hc, down.shape[0]
    tokens = x.numel() // max(K, 1)
    mixed = torch.empty(*x.shape[:-1], H, dtype=x.dtype, device=x.device)
    inject = torch.empty(*x.shape[:-1], hc, dtype=x.dtype, device=x.device) if has_inject else None
    if not tokens:
        return mixed, inject

    t = tiles or (ONE_TOKEN_MIX_TILES if tokens == 1 else MIX_TILES)
    if t.gemv and tokens != 1:
        raise ValueError(f"the down projection's GEMV form takes one token of normed streams, got {tokens} tokens")
    if not t.gemv and (t.block_k < 16 or t.block_n < 16):
        raise ValueError(f"the down projection's tiles must be at least 16 (tl.dot's smallest), got block_k "
                         f"{t.block_k}, block_n {t.block_n}")
    split_len = _split_len(H, hc, t)
    per_stream = triton.cdiv(H, split_len)
    splits = hc * per_stream
    part = torch.empty(splits, tokens, R + hc, dtype=torch.float32, device=x.device)
    block_m = 1 if t.gemv else HC_PROJ_BLOCK_M
    # Every range whole (a range is whole chunks: `_split_len`), so the loads need no mask along the inputs.
    full = H % split_len == 0
    _hc_down_kernel[(triton.cdiv(R + (hc if has_inject else 0), t.block_n), splits, triton.cdiv(tokens, block_m))](
        x, down, inject_weight, part, tokens,
        K=K, R=R, HC=hc, H=H, SPLITS_PER_STREAM=per_stream, SPLIT_LEN=split_len, BLOCK_M=block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, FULL=full, GEMV=t.gemv,
        IEEE=x.dtype == torch.float32, WIDEN=INTERPRET, INJECT=has_inject,
        LINES=l2_lines(split_len, down.dtype), num_warps=t.down_warps, **pdl(x))
    _hc_up_mix_kernel[(triton.cdiv(H, t.block_h), tokens)](
        part, x, up, mixed, inject if has_inject else mixed, tokens,
        H=H, R=R, HC=hc, SPLITS=splits, HC_PAD=triton.next_power_of_2(hc),
        R_CHUNK=min(t.r_chunk, triton.next_power_of_2(R)), BLOCK_H=t.block_h, INJECT=has_inject,
        LINES=l2_lines(R, up.dtype), num_warps=t.up_warps, **pdl(part))
    return mixed, inject
