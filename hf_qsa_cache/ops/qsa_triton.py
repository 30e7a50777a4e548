"""Triton versions of the QSA hot ops, with the signatures and outputs of their torch specification (`ops.qsa`):

* `sparse_paged_attention_triton`: one program per (token, KV head, split) runs all GQA query heads
  of that KV head over a contiguous range of the token's selected positions, in tiles of ``BLOCK_W``,
  mapping each logical position to its physical slot through the block table, with an online
  softmax in fp32 (base 2). With one split (enough tokens to fill the GPU) the program writes the
  normalised output: one launch. Decode has too few (token, KV head) pairs to fill the GPU, so the
  width is split: each program writes its partial (running max, running sum, unnormalised
  accumulator) in fp32 and a second small kernel merges the splits. The split count depends on the
  shapes only (no host sync: the op is captured into CUDA graphs).
* `index_scores_triton`: one program per (tile of ``BLOCK_M`` consecutive tokens, range of
  compressed groups) computes ``sum_h relu(q_h . k_g) / sqrt(Di)`` for the visible groups and
  ``-inf`` for the others. The queries of all heads of the tile's tokens form one
  ``[BLOCK_M * heads, Di]`` operand, so each key tile costs one tensor-core dot for the whole tile
  (in prefill with the key tile as the dot's rows, so that the sum over heads stays within a warp);
  the relu'd products are then summed over heads. A tile whose tokens read several cache rows runs
  one pass per row. Decode runs one token per program, the groups split across programs. With
  ``tile > 1`` it writes only each tile of groups' best score (the long-context selection ranks tiles
  first, then rescores the best tiles' groups with `candidate_scores_triton`, one program per token).
* `pool_groups_triton`: each group a step closes, its mean raw key and first position (ring or step keys), one launch.

Block-table lookups clamp the logical block to the table's last column, like `paged_rows`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .fp8_triton import widen
from .triton_common import INTERPRET, LOG2E, dot, on_device_of_first_tensor, pdl, pdl_begin, pow2

# Sparse attention launch policy (shapes only; `num_splits` overrides it per call).
ATTENTION_BLOCK_W = 64  # selected positions per tile
# Steps of at most ATTENTION_DECODE_MAX_TOKENS tokens (decode, verify) tile by ATTENTION_DECODE_BLOCK_W and launch
# with the decode warps and stages below, settings of their own that `check_qsa_kernels.py --decode-sweep` times.
ATTENTION_DECODE_BLOCK_W = 64
ATTENTION_DECODE_MAX_TOKENS = 16
# One split per program (prefill): 2 warps gather K/V faster than 4 (the earlier setting, kept for split launches
# of more tokens; benchmarks/check_qsa_kernels.py --attention-sweep).
ATTENTION_NUM_WARPS = 2
ATTENTION_SPLIT_NUM_WARPS = 4
ATTENTION_NUM_STAGES = 3
# Decode steps: 8 warps and no pipelining. A split of a decode step holds one or two tiles, so there is no loop
# for stages to overlap, only their shared memory to pay; more splits of one tile each beat fewer of two
# (`check_qsa_kernels.py --decode-sweep`).
ATTENTION_DECODE_NUM_WARPS = 8
ATTENTION_DECODE_NUM_STAGES = 1
TARGET_PROGRAMS = 512  # split the width until a launch has about this many programs ...
MIN_SPLIT_POSITIONS = 64  # ... but give every split at least this many positions
MAX_SPLITS = 64  # a one-token decode step over 2051 positions: 33 splits of one tile

# Index scores launch policy (shapes only; `block_m` overrides it per call).
SCORES_BLOCK_G = 64  # compressed groups per key tile
SCORES_PREFILL_TOKENS = 64  # from this many tokens on (prefill), ...
SCORES_PREFILL_BLOCK_M = 8  # ... a program scores this many consecutive tokens (x heads: the dot's rows)
SCORES_TARGET_PROGRAMS = 1024  # split the groups across programs until a launch has about this many
# The best of the sweeps (benchmarks/check_qsa_kernels.py) on one row's prefill chunk: 8 tokens x 32 heads,
# 64 groups, 8 warps, 3 stages, groups-major.
SCORES_NUM_WARPS = 8
SCORES_NUM_STAGES = 3
# One token per program (decode) keeps the setting chosen before the groups-major sweep: tokens x heads
# as the dot's rows, 4 warps.
SCORES_DECODE_NUM_WARPS = 4
# The dot's orientation: with the compressed groups as its rows (and tokens x heads as its columns) the
# sum over heads stays within a warp; with tokens x heads as its rows it crosses warps (slower in every
# setting of the sweep).
SCORES_GROUPS_MAJOR = True
# Columns of a groups-major dot (tokens x padded heads) at most: 512 gave wrong scores on the H200
# (the interpreter's were right); a wider tile takes the other orientation.
SCORES_GROUPS_MAJOR_MAX_COLUMNS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention_block_w(num_tokens: int) -> int:
    """Selected positions per tile of a sparse attention launch of ``num_tokens`` tokens."""
    return ATTENTION_DECODE_BLOCK_W if num_tokens <= ATTENTION_DECODE_MAX_TOKENS else ATTENTION_BLOCK_W


def attention_launch(num_tokens: int, num_splits: int) -> dict:
    """Warps and pipelining stages of a sparse attention launch."""
    if num_tokens <= ATTENTION_DECODE_MAX_TOKENS:
        return {"num_warps": ATTENTION_DECODE_NUM_WARPS, "num_stages": ATTENTION_DECODE_NUM_STAGES}
    warps = ATTENTION_SPLIT_NUM_WARPS if num_splits > 1 else ATTENTION_NUM_WARPS
    return {"num_warps": warps, "num_stages": ATTENTION_NUM_STAGES}


def attention_splits(num_tokens: int, num_kv: int, width: int, num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, split_len)`` of a sparse attention launch: the width in ``num_splits`` contiguous
    ranges of ``split_len`` positions (a multiple of `attention_block_w`), none of them empty."""
    block_w = attention_block_w(num_tokens)
    tiles = max(1, _cdiv(width, block_w))
    if num_splits is None:
        programs = max(1, num_tokens * num_kv)
        num_splits = min(MAX_SPLITS, _cdiv(width, MIN_SPLIT_POSITIONS), _cdiv(TARGET_PROGRAMS, programs))
    num_splits = max(1, min(num_splits, tiles))
    tiles_per_split = _cdiv(tiles, num_splits)
    return _cdiv(tiles, tiles_per_split), tiles_per_split * block_w


# Batch-varying sizes are not specialised, so a new batch or selection width does not recompile.
@triton.jit(do_not_specialize=["num_tokens", "width", "table_width", "stride_tr", "split_len", "num_splits"])
def _sparse_paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, table_ptr, token_row_ptr, pos_ptr,
    ks_ptr, vs_ptr, stride_kss, stride_ksh, stride_vss, stride_vsh,
    stride_qn, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_tr, stride_tc, stride_pn, stride_pw,
    num_tokens, width, table_width, block_size, qk_scale, split_len, num_splits,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, WIDEN: tl.constexpr, QUANT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """``QUANT``: the store is fp8 with a scale per (slot, KV head) at ``ks_ptr`` / ``vs_ptr`` (`fp8`): keys and
    values are widened to the queries' dtype as loaded."""
    pdl_begin(PDL)
    n = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kv * GROUP + g
    q = tl.load(q_ptr + n * stride_qn + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    row = tl.load(token_row_ptr + n).to(tl.int64)

    # This program's positions: [lo, hi) of the width (the whole width without a split).
    lo = split * split_len
    hi = tl.minimum(lo + split_len, width)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        pos = tl.load(pos_ptr + n * stride_pn + w * stride_pw, mask=w < hi, other=-1).to(tl.int64)
        ok = pos >= 0
        p = tl.maximum(pos, 0)
        logical = tl.minimum(p // block_size, table_width - 1)
        block = tl.load(table_ptr + row * stride_tr + logical * stride_tc, mask=ok, other=0).to(tl.int64)
        slot = block * block_size + p % block_size
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv * stride_kh + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        if QUANT:
            k = widen(k, tl.load(ks_ptr + slot * stride_kss + kv * stride_ksh, mask=ok, other=0.0),
                      q_ptr.dtype.element_ty)
        s = dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale  # [G_PAD, BLOCK_W], log2 domain
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep exp2 finite
        alpha = tl.exp2(m - m_ref)
        prob = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv * stride_vh + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        if QUANT:
            v = widen(v, tl.load(vs_ptr + slot * stride_vss + kv * stride_vsh, mask=ok, other=0.0),
                      q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + dot(prob.to(v.dtype), v, IEEE, WIDEN)
        m = m_new
    if SPLIT:
        # Partials [N, H, splits] and [N, H, splits, D]; a split of holes only leaves (-inf, 0, 0).
        part = (n * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m, mask=g_ok)
        tl.store(part_l_ptr + part, l, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    else:
        # A token with no valid position (a pad) writes zeros.
        out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
        tl.store(out_ptr + n * stride_on + head[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits", "stride_gn"])
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, gate_ptr, stride_on, stride_oh, stride_od, stride_gn,
    stride_gh, num_splits, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr,
    D_PAD: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (token, query head): combine the splits' (max, sum, accumulator). With ``GATE``, the
    output rounded to its dtype times ``sigmoid(gate)`` rounded alike, the product rounded (``qsa_gate``: the
    torch ops' rounding, `qsa.gated_sparse_paged_attention`)."""
    pdl_begin(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    th = n * NUM_HEADS + h
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    m = tl.load(part_m_ptr + th * num_splits + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + th * num_splits + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (th * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)  # splits of holes only (max -inf) weigh 0
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0)
    # A token with no valid position (a pad) writes zeros.
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0).to(out_ptr.dtype.element_ty)
    if GATE:
        g = tl.load(gate_ptr + n * stride_gn + h * stride_gh + d, mask=d_ok, other=0.0).to(tl.float32)
        g = tl.sigmoid(g).to(out_ptr.dtype.element_ty)
        o = (o.to(tl.float32) * g.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n * stride_on + h * stride_oh + d * stride_od, o, mask=d_ok)


@on_device_of_first_tensor
def sparse_paged_attention_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  block_table: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor,
                                  block_size: int, scaling: float, *, num_splits: int | None = None,
                                  gate: torch.Tensor | None = None, key_scales: torch.Tensor | None = None,
                                  value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """`hf_qsa_cache.ops.qsa.sparse_paged_attention` in one launch, two when the width is split (see
    there for shapes). ``num_splits`` overrides the launch policy (`attention_splits`). ``gate`` (``[N, H, D]``
    logits, unit last stride): `qsa.gated_sparse_paged_attention`'s output ``[N, H * D]`` instead, the gate
    applied by the merge where the width is split, else by torch after the launch."""
    n, num_heads, head_dim = query.shape
    num_kv = keys.shape[2]
    group = num_heads // num_kv
    width = positions.shape[1]
    out = torch.empty_like(query)
    if n == 0 or num_heads == 0:
        return _gated(out, gate, applied=False)
    # A slot is (block, offset) flattened; the store's leading two axes must be one strided axis.
    assert keys.stride(0) == block_size * keys.stride(1) and values.stride(0) == block_size * values.stride(1)
    quant = key_scales is not None
    if quant:  # fp8 pages: scales [num_blocks, block_size, H_kv], one strided slot axis as the pages
        assert key_scales.stride(0) == block_size * key_scales.stride(1)
        assert value_scales.stride(0) == block_size * value_scales.stride(1)
        scale_args = (key_scales, value_scales, key_scales.stride(1), key_scales.stride(2), value_scales.stride(1),
                      value_scales.stride(2))
    else:
        scale_args = (query, query, 0, 0, 0, 0)
    if width == 0 or block_table.shape[1] == 0:
        return _gated(out.zero_(), gate, applied=False)
    splits, split_len = attention_splits(n, num_kv, width, num_splits)
    if splits > 1:
        part_m = torch.empty(n, num_heads, splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(n, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out
    grid = (n, num_kv, splits)
    _sparse_paged_attention_kernel[grid](
        query, keys, values, out, part_m, part_l, part_acc, block_table, token_row, positions, *scale_args,
        query.stride(0), query.stride(1), query.stride(2),
        keys.stride(1), keys.stride(2), keys.stride(3),
        values.stride(1), values.stride(2), values.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_table.stride(0), block_table.stride(1), positions.stride(0), positions.stride(1),
        n, width, block_table.shape[1], block_size, float(scaling) * LOG2E, split_len, splits,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, G_PAD=pow2(group), D_PAD=pow2(head_dim),
        BLOCK_W=attention_block_w(n), SPLIT=splits > 1, IEEE=query.dtype == torch.float32, WIDEN=INTERPRET,
        QUANT=quant, **attention_launch(n, splits), **pdl(query),
    )
    gated = gate is not None and splits > 1
    if splits > 1:
        assert gate is None or gate.stride(2) == 1, gate.stride()
        gate_args = (gate, gate.stride(0), gate.stride(1)) if gated else (out, 0, 0)
        _merge_splits_kernel[(n, num_heads)](
            part_m, part_l, part_acc, out, gate_args[0], out.stride(0), out.stride(1), out.stride(2), *gate_args[1:],
            splits, NUM_HEADS=num_heads, HEAD_DIM=head_dim, S_PAD=triton.next_power_of_2(splits),
            D_PAD=triton.next_power_of_2(head_dim), GATE=gated, num_warps=4, **pdl(part_m),
        )
    return _gated(out, gate, applied=gated)


def _gated(out: torch.Tensor, gate: torch.Tensor | None, applied: bool) -> torch.Tensor:
    """``out`` as `sparse_paged_attention_triton` returns it: unchanged without a gate, else ``[N, H * D]`` times
    ``sigmoid(gate)`` (in torch unless the merge ``applied`` it)."""
    if gate is None:
        return out
    n = out.shape[0]
    return out.reshape(n, -1) if applied else out.reshape(n, -1) * torch.sigmoid(gate).reshape(n, -1)


@triton.jit
def _key_rows(c_ptr, table_ptr, row, g, live, d, d_ok, stride_cr, stride_cd, stride_tr, stride_tc,
              table_width, rows_per_block, IEEE: tl.constexpr, s_ptr, QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """Compressed keys of groups ``g`` of cache row ``row``: ``[BLOCK_G, D_PAD]`` (zero where not ``live``); with
    ``QUANT`` fp8 keys widened to ``DTYPE`` by their scales at ``s_ptr`` (one per store row)."""
    logical = tl.minimum(g // rows_per_block, table_width - 1)
    block = tl.load(table_ptr + row * stride_tr + logical * stride_tc, mask=live, other=0).to(tl.int64)
    flat = block * rows_per_block + g % rows_per_block
    key = tl.load(c_ptr + flat[:, None] * stride_cr + d[None, :] * stride_cd,
                  mask=live[:, None] & d_ok[None, :], other=0.0)
    if QUANT:
        key = widen(key, tl.load(s_ptr + flat, mask=live, other=0.0), DTYPE)
    if IEEE:
        key = key.to(tl.float32)
    return key


@triton.jit
def _store_scores(out_ptr, t, g0, score, mine, g_end, stride_on,
                  BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr):
    """Store the scores ``[BLOCK_M, BLOCK_G]`` of groups ``g0 ..`` of tokens ``t`` (where ``mine``), or with
    ``TILE > 1`` only each tile's maximum (tile ``j`` holds groups ``j*TILE .. j*TILE+TILE-1``)."""
    if TILE == 1:
        g = g0 + tl.arange(0, BLOCK_G)
        tl.store(out_ptr + t[:, None] * stride_on + g[None, :], score, mask=mine[:, None] & (g < g_end)[None, :])
    else:
        tile = g0 // TILE + tl.arange(0, BLOCK_G // TILE)
        best = tl.max(tl.reshape(score, (BLOCK_M, BLOCK_G // TILE, TILE)), axis=2)
        tl.store(out_ptr + t[:, None] * stride_on + tile[None, :], best,
                 mask=mine[:, None] & (tile * TILE < g_end)[None, :])


@triton.jit(do_not_specialize=["num_tokens", "max_groups", "table_width", "stride_tr", "groups_per_program"])
def _index_scores_kernel(
    q_ptr, c_ptr, table_ptr, token_row_ptr, visible_ptr, out_ptr, s_ptr,
    stride_qn, stride_qh, stride_qd, stride_cr, stride_cd, stride_tr, stride_tc, stride_on,
    num_tokens, max_groups, table_width, rows_per_block, groups_per_program, sqrt_dim,
    NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr, GROUPS_MAJOR: tl.constexpr,
    IEEE: tl.constexpr, WIDEN: tl.constexpr, QUANT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    g_start = tl.program_id(1) * groups_per_program
    g_end = tl.minimum(g_start + groups_per_program, max_groups)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    # The queries of all heads of the tile's tokens as one [BLOCK_M * H_PAD, D] operand (padded heads
    # and tokens past the end are zero rows, whose relu scores add nothing).
    qr = tl.arange(0, BLOCK_M * H_PAD)
    q_tok = t0 + qr // H_PAD
    q_head = qr % H_PAD
    q = tl.load(q_ptr + q_tok[:, None] * stride_qn + q_head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=((q_tok < num_tokens) & (q_head < NUM_HEADS))[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    q_t = tl.trans(q)
    t = t0 + tl.arange(0, BLOCK_M)
    t_ok = t < num_tokens
    rows = tl.load(token_row_ptr + t, mask=t_ok, other=-1)
    visible = tl.load(visible_ptr + t, mask=t_ok, other=0)
    # One pass per cache row among the tile's tokens (a prefill tile has one; a row's tokens are
    # consecutive): each key tile of that row is loaded once and scored against all its tokens.
    for i in range(BLOCK_M):
        n = t0 + i
        row = tl.load(token_row_ptr + n, mask=n < num_tokens, other=-1)
        prev = tl.load(token_row_ptr + n - 1, mask=(i > 0) & (n < num_tokens), other=-1)
        if (n < num_tokens) & ((i == 0) | (row != prev)):
            mine = t_ok & (rows == row)
            reach = tl.minimum(tl.max(tl.where(mine, visible, 0), axis=0), g_end)  # groups any of them sees
            for g0 in range(g_start, reach, BLOCK_G):
                g = g0 + tl.arange(0, BLOCK_G)
                key = _key_rows(c_ptr, table_ptr, row.to(tl.int64), g, g < reach, d, d_ok, stride_cr, stride_cd,
                                stride_tr, stride_tc, table_width, rows_per_block, IEEE, s_ptr, QUANT,
                                q_ptr.dtype.element_ty)
                if GROUPS_MAJOR:  # groups are the dot's rows: the sum over heads stays within a warp
                    s = tl.maximum(dot(key, q_t, IEEE, WIDEN), 0.0)  # [BLOCK_G, BLOCK_M * H_PAD]
                    total = tl.trans(tl.sum(tl.reshape(s, (BLOCK_G, BLOCK_M, H_PAD)), axis=2))
                else:
                    s = tl.maximum(dot(q, tl.trans(key), IEEE, WIDEN), 0.0)  # [BLOCK_M * H_PAD, BLOCK_G]
                    total = tl.sum(tl.reshape(s, (BLOCK_M, H_PAD, BLOCK_G)), axis=1)  # over heads
                score = tl.where(g[None, :] < visible[:, None], total / sqrt_dim, float("-inf"))
                _store_scores(out_ptr, t, g0, score, mine, g_end, stride_on, BLOCK_M, BLOCK_G, TILE)
            # Groups past every token's visible count: -inf without loading keys.
            done = g_start + tl.cdiv(tl.maximum(reach - g_start, 0), BLOCK_G) * BLOCK_G
            for g0 in range(done, g_end, BLOCK_G):
                _store_scores(out_ptr, t, g0, tl.full([BLOCK_M, BLOCK_G], float("-inf"), tl.float32), mine, g_end,
                              stride_on, BLOCK_M, BLOCK_G, TILE)


def _scale_rows(scales: torch.Tensor | None, flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An fp8 store's scales, one per flat store row (contiguous), or a stand-in the kernel never reads."""
    if scales is None:
        return like
    scales = scales.reshape(-1)
    assert scales.numel() == flat.shape[0] and scales.is_contiguous()
    return scales


def _nothing_to_score(out: torch.Tensor, block_table: torch.Tensor) -> bool:
    """Whether a score launch into ``out`` ``[N, width]`` has no work: ``out`` is then final (empty, or all
    ``-inf`` when the table has no column to read)."""
    if out.numel() == 0:
        return True
    if block_table.shape[1] == 0:
        out.fill_(float("-inf"))
        return True
    return False


def _ieee_dot(q_index: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the index-score dots run in IEEE fp32: bf16/fp16 products are exact in fp32, so the tensor-core
    dot with an fp32 accumulator only differs from the fp32 reference in summation order; fp32 (or mixed)
    inputs need an IEEE dot."""
    return not (q_index.dtype == keys.dtype and q_index.dtype in (torch.bfloat16, torch.float16))


def scores_block_m(num_tokens: int) -> int:
    """Tokens per index-score program: one at decode, a tile sharing key loads in prefill (shapes only)."""
    return SCORES_PREFILL_BLOCK_M if num_tokens >= SCORES_PREFILL_TOKENS else 1


def scores_group_splits(num_tokens: int, max_groups: int, block_m: int) -> int:
    """Programs along the groups: enough (with the token tiles) to fill the GPU (shapes only)."""
    token_tiles = _cdiv(num_tokens, block_m)
    return max(1, min(_cdiv(SCORES_TARGET_PROGRAMS, token_tiles), _cdiv(max_groups, SCORES_BLOCK_G)))


@on_device_of_first_tensor
def index_scores_triton(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                        token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                        max_groups: int, *, tile: int = 1, block_m: int | None = None,
                        group_splits: int | None = None, groups_major: bool | None = None,
                        scales: torch.Tensor | None = None) -> torch.Tensor:
    """`hf_qsa_cache.ops.qsa.index_scores_torch` in one launch (see there for shapes), or with ``tile > 1``
    `hf_qsa_cache.ops.qsa.index_tile_maxima_torch`: ``[N, ceil(max_groups / tile)]``, the scores never
    written. ``block_m`` overrides the tokens per program (`scores_block_m`), ``group_splits`` the
    programs along the groups (`scores_group_splits`), ``groups_major`` the dot's orientation
    (``SCORES_GROUPS_MAJOR``)."""
    n, num_heads, head_dim = q_index.shape
    if tile < 1 or tile & (tile - 1) or SCORES_BLOCK_G % tile:
        raise ValueError(f"tile must be a power of two dividing the key tile ({SCORES_BLOCK_G} groups), got {tile}")
    out = torch.empty(n, _cdiv(max_groups, tile), dtype=torch.float32, device=q_index.device)
    if _nothing_to_score(out, block_table):
        return out
    flat = compressed.reshape(-1, head_dim)
    ieee = _ieee_dot(q_index, flat if scales is None else q_index)  # fp8 keys widen to the queries' dtype
    h_pad = triton.next_power_of_2(num_heads)
    if block_m is None:
        block_m = scores_block_m(n)
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m={block_m} is not a power of two"
    one_token = block_m == 1  # decode's launch: its own (earlier measured) orientation and warps
    block_m = max(block_m, 16 // h_pad)  # tl.dot needs at least 16 query rows
    if group_splits is None:
        group_splits = scores_group_splits(n, max_groups, block_m)
    if groups_major is None:
        groups_major = SCORES_GROUPS_MAJOR and not one_token
    groups_major = groups_major and block_m * h_pad <= SCORES_GROUPS_MAJOR_MAX_COLUMNS
    tiles = _cdiv(max_groups, SCORES_BLOCK_G)
    groups_per_program = _cdiv(tiles, max(1, min(group_splits, tiles))) * SCORES_BLOCK_G
    grid = (triton.cdiv(n, block_m), triton.cdiv(max_groups, groups_per_program))
    _index_scores_kernel[grid](
        q_index, flat, block_table, token_row, visible_blocks, out, _scale_rows(scales, flat, q_index),
        q_index.stride(0), q_index.stride(1), q_index.stride(2), flat.stride(0), flat.stride(1),
        block_table.stride(0), block_table.stride(1), out.stride(0),
        n, max_groups, block_table.shape[1], rows_per_block, groups_per_program, math.sqrt(head_dim),
        NUM_HEADS=num_heads, H_PAD=h_pad, HEAD_DIM=head_dim, D_PAD=pow2(head_dim), BLOCK_M=block_m,
        BLOCK_G=SCORES_BLOCK_G, TILE=tile, GROUPS_MAJOR=groups_major, IEEE=ieee, WIDEN=INTERPRET,
        QUANT=scales is not None, num_warps=SCORES_DECODE_NUM_WARPS if one_token else SCORES_NUM_WARPS, num_stages=SCORES_NUM_STAGES,
        **pdl(q_index),
    )
    return out


# Candidate scores launch policy: candidates per key tile; per program, as many as fill about
# CANDIDATES_TARGET_PROGRAMS programs (decode has one token), at most CANDIDATES_PER_PROGRAM.
CANDIDATES_BLOCK = 64
CANDIDATES_PER_PROGRAM = 1024
CANDIDATES_TARGET_PROGRAMS = 1024


def candidates_per_program(num_tokens: int, width: int) -> int:
    """Candidates per program of `candidate_scores_triton`: whole key tiles (shapes only)."""
    wanted = _cdiv(num_tokens * width, CANDIDATES_TARGET_PROGRAMS)
    return _cdiv(max(1, min(CANDIDATES_PER_PROGRAM, wanted)), CANDIDATES_BLOCK) * CANDIDATES_BLOCK


@triton.jit(do_not_specialize=["num_candidates", "table_width", "stride_tr", "per_program"])
def _candidate_scores_kernel(
    q_ptr, c_ptr, table_ptr, token_row_ptr, visible_ptr, cand_ptr, out_ptr, s_ptr,
    stride_qn, stride_qh, stride_qd, stride_cr, stride_cd, stride_tr, stride_tc, stride_gn, stride_on,
    num_candidates, table_width, rows_per_block, per_program, sqrt_dim,
    NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, QUANT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One program per (token, range of its candidates): the index score of each candidate group."""
    pdl_begin(PDL)
    n = tl.program_id(0).to(tl.int64)
    c_start = tl.program_id(1) * per_program
    c_end = tl.minimum(c_start + per_program, num_candidates)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    h = tl.arange(0, H_PAD)
    q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=(h < NUM_HEADS)[:, None] & d_ok[None, :], other=0.0)  # padded heads score 0
    if IEEE:
        q = q.to(tl.float32)
    q_t = tl.trans(q)
    row = tl.load(token_row_ptr + n).to(tl.int64)
    visible = tl.load(visible_ptr + n)
    for c0 in range(c_start, c_end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < c_end
        grp = tl.load(cand_ptr + n * stride_gn + c, mask=c_ok, other=-1).to(tl.int64)
        live = c_ok & (grp >= 0) & (grp < visible)
        key = _key_rows(c_ptr, table_ptr, row, tl.maximum(grp, 0), live, d, d_ok, stride_cr, stride_cd,
                        stride_tr, stride_tc, table_width, rows_per_block, IEEE, s_ptr, QUANT, q_ptr.dtype.element_ty)
        s = tl.maximum(dot(key, q_t, IEEE, WIDEN), 0.0)  # [BLOCK_C, H_PAD]
        score = tl.where(live, tl.sum(s, axis=1) / sqrt_dim, float("-inf"))
        tl.store(out_ptr + n * stride_on + c, score, mask=c_ok)


@on_device_of_first_tensor
def candidate_scores_triton(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                            token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                            candidates: torch.Tensor, *, per_program: int | None = None,
                            scales: torch.Tensor | None = None) -> torch.Tensor:
    """`hf_qsa_cache.ops.qsa.candidate_scores_torch` in one launch. ``per_program`` overrides the candidates
    per program (`candidates_per_program`; rounded up to whole tiles of ``CANDIDATES_BLOCK``)."""
    if per_program is not None and per_program < 1:
        raise ValueError(f"per_program must be at least 1 candidate, got {per_program}")
    n, num_heads, head_dim = q_index.shape
    width = candidates.shape[1]
    out = torch.empty(n, width, dtype=torch.float32, device=q_index.device)
    if _nothing_to_score(out, block_table):
        return out
    flat = compressed.reshape(-1, head_dim)
    ieee = _ieee_dot(q_index, flat if scales is None else q_index)
    candidates = candidates if candidates.stride(-1) == 1 else candidates.contiguous()
    if per_program is None:
        per_program = candidates_per_program(n, width)
    per_program = _cdiv(per_program, CANDIDATES_BLOCK) * CANDIDATES_BLOCK
    _candidate_scores_kernel[(n, _cdiv(width, per_program))](
        q_index, flat, block_table, token_row, visible_blocks, candidates, out, _scale_rows(scales, flat, q_index),
        q_index.stride(0), q_index.stride(1), q_index.stride(2), flat.stride(0), flat.stride(1),
        block_table.stride(0), block_table.stride(1), candidates.stride(0), out.stride(0),
        width, block_table.shape[1], rows_per_block, per_program, math.sqrt(head_dim),
        NUM_HEADS=num_heads, H_PAD=pow2(num_heads), HEAD_DIM=head_dim, D_PAD=pow2(head_dim),
        BLOCK_C=CANDIDATES_BLOCK, IEEE=ieee, WIDEN=INTERPRET, QUANT=scales is not None, num_warps=4,
        **pdl(q_index),
    )
    return out


@triton.jit(do_not_specialize=["num_tokens", "query_len", "capacity"])
def _pool_groups_kernel(work_ptr, prev_ptr, count_ptr, ring_keys_ptr, ring_pos_ptr, keys_ptr, pos_ptr,
                        pooled_ptr, first_ptr, num_tokens, query_len, capacity,
                        RATIO: tl.constexpr, R_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One program per work item (row, group): the mean of the group's raw keys (this step's where the
    step holds them, the row's ring for earlier ones) and its first token's 3-axis position."""
    pdl_begin(PDL)
    w = tl.program_id(0).to(tl.int64)
    row = tl.maximum(tl.load(work_ptr + 2 * w).to(tl.int64), 0)
    group = tl.maximum(tl.load(work_ptr + 2 * w + 1).to(tl.int64), 0)
    prev = tl.load(prev_ptr + row).to(tl.int64)
    count = tl.load(count_ptr + row).to(tl.int64)
    j = tl.arange(0, R_PAD)
    d = tl.arange(0, D_PAD)
    pos = group * RATIO + j  # [R_PAD]
    in_step = pos >= prev
    token = row * query_len + (query_len - count) + (pos - prev)
    token = tl.minimum(tl.maximum(token, 0), num_tokens - 1)
    ring_row = row * capacity + pos % capacity
    ok = (j < RATIO)[:, None] & (d < HEAD_DIM)[None, :]
    dtype = pooled_ptr.dtype.element_ty
    from_step = tl.load(keys_ptr + token[:, None] * HEAD_DIM + d[None, :], mask=ok & in_step[:, None], other=0.0)
    from_ring = tl.load(ring_keys_ptr + ring_row[:, None] * HEAD_DIM + d[None, :], mask=ok & ~in_step[:, None],
                        other=0.0)
    keys = tl.where(in_step[:, None], from_step.to(dtype).to(tl.float32), from_ring.to(dtype).to(tl.float32))
    pooled = tl.sum(keys, axis=0) / RATIO
    tl.store(pooled_ptr + w * HEAD_DIM + d, pooled.to(dtype), mask=d < HEAD_DIM)
    # The first token's position: three axes, from this step's positions or the ring's.
    axis = tl.arange(0, 4)
    first_in_step = (group * RATIO + axis * 0) >= prev  # the same for every axis: a vector, as masks want
    first_token = tl.minimum(tl.maximum(row * query_len + (query_len - count) + (group * RATIO - prev), 0),
                             num_tokens - 1)
    step_pos = tl.load(pos_ptr + first_token * 3 + axis, mask=(axis < 3) & first_in_step, other=0)
    ring_pos = tl.load(ring_pos_ptr + (row * capacity + (group * RATIO) % capacity) * 3 + axis,
                       mask=(axis < 3) & ~first_in_step, other=0)
    tl.store(first_ptr + w * 3 + axis, tl.where(first_in_step, step_pos, ring_pos).to(tl.int64), mask=axis < 3)


@on_device_of_first_tensor
def pool_groups_triton(work: torch.Tensor, prev_len: torch.Tensor, count: torch.Tensor, query_len: int, ratio: int,
                       ring_keys: torch.Tensor, ring_positions: torch.Tensor, capacity: int, raw_keys: torch.Tensor,
                       positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`hf_qsa_cache.ops.qsa.pool_groups` in one launch."""
    num_work = work.shape[0]
    head_dim = raw_keys.shape[-1]
    pooled = torch.empty(num_work, head_dim, dtype=raw_keys.dtype, device=raw_keys.device)
    first = torch.empty(num_work, 3, dtype=torch.int64, device=raw_keys.device)
    if num_work:
        _pool_groups_kernel[(num_work,)](
            work.contiguous(), prev_len.contiguous(), count.contiguous(), ring_keys.contiguous(),
            ring_positions.contiguous(), raw_keys.contiguous(), positions.contiguous(), pooled, first,
            max(raw_keys.shape[0], 1), query_len, capacity,
            RATIO=ratio, R_PAD=triton.next_power_of_2(ratio), HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            num_warps=4, **pdl(work),
        )
    return pooled, first
