"""Triton kernel for `hf_qsa_cache.ops.inkling_attention.paged_rel_attention_torch` (same signature,
same output, same store contents for real slots).

Programs. One program per (row, query tile, KV head, key split). A query tile is ``BLOCK_M``
consecutive token columns of one row; all ``GROUP`` query heads of the KV head are stacked into the
tile's ``BLOCK_M * G_PAD`` rows, so every key tile is loaded once for the whole GQA group. Prefill
runs one key split (the program writes the normalised output); decode (and any launch with too few
programs to fill the GPU) splits the visible keys into ``num_splits`` contiguous ranges, each program
writes its partial (running max, running sum, unnormalised accumulator), and a second small kernel
merges the splits.

Keys. A query at position ``p`` sees keys ``0 .. p`` (full layers) or ``p - window + 1 .. p``
(sliding layers); a tile iterates only over the union of those ranges for its queries, in key tiles
of ``BLOCK_N``. On full layers, keys at distance ``>= E`` from every query of the tile ("far" keys,
most of a long context) skip the bias gather and the causal mask.

Keys of earlier forwards (positions ``< prev_len``) are read from the paged store through the block
table; keys of this forward (positions ``>= prev_len``) are read from the ``k``/``v`` activations,
at column ``L - 1 - (last_position - p)`` of the row (rows are left-padded). Windowed block tables
never allocate blocks below the window, not even for positions a long prefill writes in this
forward (those writes land in the null block), so same-forward keys must not come from the store.
Store reads therefore only touch positions older than this forward, and the store writes of this
forward (done by the first split of each query tile, ``slot.clamp_min(0)`` like the torch op) only
touch this forward's slots: the write and the attention share one launch with no ordering hazard.

Scores. ``logit = tau * (q . k) * scaling + tau * rel[t, h, p_t - p_s]`` for ``0 <= p_t - p_s < E``,
with ``rel = r @ P`` precomputed per query in ``r``'s dtype (``[B, L, Hq, E]``) and gathered per
(query, key). A decode step (one token per query tile) with ``bias_in_kernel`` (the ``rel_bias`` fusion) computes
it in the kernel instead, for the distances of each key tile only: the tile's one query position makes every key's
distance the same for all the tile's rows, so a key tile reads ``P``'s ``[d_rel, keys]`` block at those distances and
multiplies it with the tile's ``r`` rows in one dot (fp32 accumulation), rounded once to ``r``'s dtype as the
matmul rounds. That saves the step one launch (the matmul) a layer and the ``[Hq, E]`` profile's round trip
through memory. With log scaling, ``tau`` is computed in the kernel and rounded into q and the
bias in their own dtypes, exactly where the torch op rounds. Online softmax in fp32 (base 2); a
query that sees no key (a pad) writes zeros.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .fp8_triton import quantize_rows, widen
from .triton_common import (
    INTERPRET, LOG2E, TL_DTYPES, dot, l2_lines, on_device_of_first_tensor, pdl, pdl_begin, pow2, prefetch_rows_l2,
)


# Launch policy (all overridable per call through keyword arguments).
PREFILL_ROWS = 128  # query rows (tokens x padded GQA group) per prefill tile
PREFILL_BLOCK_N = 64  # keys per key tile
DECODE_BLOCK_N = 64
# fp32 tiles take twice the shared memory: half the rows and keys per tile (at head_dim 128 the bf16 prefill
# tiles in fp32 need 295 KB of the H200's 227 KB).
WIDE_PREFILL_ROWS = 64
WIDE_BLOCK_N = 32
# Tile sizes that did not fit the device's shared memory, by (device, dtype, head_dim, group, decode): a launch
# that runs out falls back to smaller tiles (`_smaller_tiles`), and later launches start there.
_TILES_THAT_FIT: dict[tuple, tuple[int, int]] = {}
# Split the keys until a launch has about TARGET_PROGRAMS programs, giving every split at least MIN_SPLIT_KEYS
# keys. Graph-timed on the H200 at the benchmark's Inkling decode steps (`check_inkling_attention.py
# --split-sweep`, bf16): this picks the best split count of each (1 x 16384: 64 splits for the full layer, 8 for a
# sliding layer's 512 keys; 32 x 2048: 2 splits for both kinds), each faster than the earlier 512 / 1024 and
# than no split.
TARGET_PROGRAMS = 256
MIN_SPLIT_KEYS = 64
MAX_SPLITS = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def _round(x, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """fp32 ``x`` to ``DTYPE``, rounding to nearest even (the interpreter truncates fp32 to bf16)."""
    if WIDEN and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _bias_from_r(r_tile, proj_ptr, qpos, kpos, kmask, extent, D_REL: tl.constexpr, R_DTYPE: tl.constexpr,
                 IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """``(r @ P)[row, p - kpos]`` for a tile whose rows share one query position ``p`` (decode): ``r_tile``
    ``[rows, D_REL_PAD]`` (columns from ``D_REL`` on zero) times ``P``'s ``[D_REL_PAD, keys]`` block at the keys'
    distances, one dot in fp32, rounded to ``R_DTYPE``. Distances outside ``[0, extent)`` read 0 (the caller
    masks them)."""
    p = tl.max(qpos, axis=0)
    kdist = p - kpos
    kd_ok = kmask & (kdist >= 0) & (kdist < extent)
    j = tl.arange(0, r_tile.shape[1])
    proj = tl.load(proj_ptr + j[:, None] * extent + kdist[None, :], mask=(j < D_REL)[:, None] & kd_ok[None, :],
                   other=0.0)
    if IEEE:  # as the scores' dots: fp32 operands (bf16 ones widen exactly)
        return _round(dot(r_tile.to(tl.float32), proj.to(tl.float32), IEEE, WIDEN), R_DTYPE, WIDEN)
    return _round(dot(r_tile, proj, IEEE, WIDEN), R_DTYPE, WIDEN)


@triton.jit
def _attend_tile(acc, m, l, q, k, v, qpos, qtau, rel_rows, r_tile, proj_ptr, row_ok, kpos, kmask,
                 qk_scale, window, extent, NEAR: tl.constexpr,
                 WINDOWED: tl.constexpr, LOG_SCALING: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                 REL_FROM_R: tl.constexpr, D_REL: tl.constexpr, R_DTYPE: tl.constexpr):
    """One key tile of the online softmax for all rows of a query tile (base-2 logits).

    A far tile (``NEAR`` false) lies at distance >= extent before every query of the tile, on a
    layer without a window: every real query sees all its keys, and none of them has a bias."""
    if IEEE:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale
    if NEAR:
        dist = qpos[:, None] - kpos[None, :]
        ok = (qpos >= 0)[:, None] & kmask[None, :] & (dist >= 0)
        if WINDOWED:
            ok = ok & (dist < window)
        if REL_FROM_R:
            bias = _bias_from_r(r_tile, proj_ptr, qpos, kpos, kmask, extent, D_REL, R_DTYPE, IEEE, WIDEN)
            bias = tl.where(ok & row_ok[:, None] & (dist < extent), bias, 0.0)
        else:
            bias = tl.load(rel_rows[:, None] + dist, mask=ok & row_ok[:, None] & (dist < extent), other=0.0)
        if LOG_SCALING:
            bias = _round(bias.to(tl.float32) * qtau[:, None], bias.dtype, WIDEN)
        s = tl.where(ok, s + bias.to(tl.float32) * 1.4426950408889634, float("-inf"))
    else:
        s = tl.where((qpos >= 0)[:, None] & kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep exp2 finite
    alpha = tl.exp2(m - m_ref)
    prob = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(prob, axis=1)
    acc = acc * alpha[:, None] + dot(_round(prob, v.dtype, WIDEN), v, IEEE, WIDEN)
    return acc, m_new, l


@triton.jit
def _store_slots(table_row, kpos, kmask, table_cols, block_size):
    """The store slots of a row's key positions ``kpos`` (where ``kmask``), through its block table."""
    blk = tl.load(table_row + tl.minimum(kpos // block_size, table_cols - 1), mask=kmask, other=0).to(tl.int64)
    return blk * block_size + kpos % block_size


@triton.jit
def _scan_store(acc, m, l, lo, hi, q, qpos, qtau, rel_rows, r_tile, proj_ptr, row_ok, kst_ptr, vst_ptr, table_row,
                skst_s, skst_h, skst_d, svst_s, svst_h, svst_d, table_cols, block_size, kv, d, d_ok,
                qk_scale, window, extent, NEAR: tl.constexpr, WINDOWED: tl.constexpr,
                LOG_SCALING: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_N: tl.constexpr,
                REL_FROM_R: tl.constexpr, D_REL: tl.constexpr, R_DTYPE: tl.constexpr,
                ks_ptr, vs_ptr, sks_s, sks_h, svs_s, svs_h, QUANT: tl.constexpr, KV_DTYPE: tl.constexpr):
    """Keys at positions [lo, hi) of earlier forwards: the paged store, through the row's block table (an fp8
    store's, ``QUANT``, widened to the activations' dtype ``KV_DTYPE`` by their scales)."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        kslot = _store_slots(table_row, kpos, kmask, table_cols, block_size)
        lmask = kmask[:, None] & d_ok[None, :]
        k = tl.load(kst_ptr + kslot[:, None] * skst_s + kv * skst_h + d[None, :] * skst_d, mask=lmask, other=0.0)
        v = tl.load(vst_ptr + kslot[:, None] * svst_s + kv * svst_h + d[None, :] * svst_d, mask=lmask, other=0.0)
        if QUANT:
            k = widen(k, tl.load(ks_ptr + kslot * sks_s + kv * sks_h, mask=kmask, other=0.0), KV_DTYPE)
            v = widen(v, tl.load(vs_ptr + kslot * svs_s + kv * svs_h, mask=kmask, other=0.0), KV_DTYPE)
        acc, m, l = _attend_tile(acc, m, l, q, k, v, qpos, qtau, rel_rows, r_tile, proj_ptr, row_ok, kpos, kmask,
                                 qk_scale, window, extent, NEAR, WINDOWED, LOG_SCALING, IEEE, WIDEN,
                                 REL_FROM_R, D_REL, R_DTYPE)
    return acc, m, l


@triton.jit
def _scan_new(acc, m, l, lo, hi, q, qpos, qtau, rel_rows, r_tile, proj_ptr, row_ok, k_row, v_row,
              sk_l, sk_h, sk_d, sv_l, sv_h, sv_d, query_len, last_pos, kv, d, d_ok,
              qk_scale, window, extent, NEAR: tl.constexpr, WINDOWED: tl.constexpr,
              LOG_SCALING: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_N: tl.constexpr,
              REL_FROM_R: tl.constexpr, D_REL: tl.constexpr, R_DTYPE: tl.constexpr):
    """Keys at positions [lo, hi) of this forward: the activations, at the key's column of the row."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        kcol = (query_len - 1 - (last_pos - kpos)).to(tl.int64)
        lmask = kmask[:, None] & d_ok[None, :]
        k = tl.load(k_row + kcol[:, None] * sk_l + kv * sk_h + d[None, :] * sk_d, mask=lmask, other=0.0)
        v = tl.load(v_row + kcol[:, None] * sv_l + kv * sv_h + d[None, :] * sv_d, mask=lmask, other=0.0)
        acc, m, l = _attend_tile(acc, m, l, q, k, v, qpos, qtau, rel_rows, r_tile, proj_ptr, row_ok, kpos, kmask,
                                 qk_scale, window, extent, NEAR, WINDOWED, LOG_SCALING, IEEE, WIDEN,
                                 REL_FROM_R, D_REL, R_DTYPE)
    return acc, m, l


@triton.jit
def _key_ranges(pos_ptr, prev_ptr, b, t, row_ok, query_len, split, split_len, window, extent,
                WINDOWED: tl.constexpr, SPLIT: tl.constexpr):
    """From the step's metadata (read before the wait, `pdl_begin`): the query rows' positions (-1: none), the
    row's earlier length, its last position, and the keys ``[k_lo, k_hi)`` this program scans, the far ones (no
    bias, no causal mask: without a window, keys up to the tile's first query - extent) below ``far_hi``."""
    qpos = tl.load(pos_ptr + t, mask=row_ok, other=-1).to(tl.int32)
    qpos = tl.where(row_ok, qpos, -1)
    prev = tl.load(prev_ptr + b).to(tl.int32)
    last_pos = tl.load(pos_ptr + b.to(tl.int64) * query_len + query_len - 1).to(tl.int32)
    q_hi = tl.max(qpos, axis=0) + 1  # keys end after the tile's last query (0 when all pads)
    q_lo = tl.min(tl.where(qpos >= 0, qpos, q_hi), axis=0)  # 0 when all pads: empty ranges
    if WINDOWED:
        k_lo = tl.maximum(q_lo - window + 1, 0)
    else:
        k_lo = q_hi * 0
    if SPLIT:
        k_lo = k_lo + split * split_len
        k_hi = tl.minimum(q_hi, k_lo + split_len)
    else:
        k_hi = q_hi
    if WINDOWED:
        far_hi = k_lo
    else:
        far_hi = tl.maximum(k_lo, q_lo - extent + 1)
    return qpos, prev, last_pos, k_lo, k_hi, far_hi


@triton.jit
def _store_keys_to_l2(kst_ptr, vst_ptr, table_row, lo, hi, kv, skst_s, skst_h, svst_s, svst_h, table_cols,
                      block_size, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """Ask for the key and value rows of store positions ``[lo, hi)`` (earlier steps') in L2, through the block
    table (step metadata): before the wait, so the scan after it finds them there (a hint; a row's features
    contiguous, ``LINES`` from `l2_lines`)."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        kslot = _store_slots(table_row, kpos, kmask, table_cols, block_size)
        prefetch_rows_l2(kst_ptr + kv * skst_h, kslot, kmask, skst_s, HEAD_DIM, LINES)
        prefetch_rows_l2(vst_ptr + kv * svst_h, kslot, kmask, svst_s, HEAD_DIM, LINES)


# Sizes that change with the cache or the step (lengths, table width, key splits) are plain arguments, not
# specialised: a serving loop meets new ones every step, and each specialisation is a compilation.
# Longer than 100 lines: one loop body over the key tiles, which helper calls would split at the cost of speed.
@triton.jit(do_not_specialize=["stab_b", "query_len", "num_q_tiles", "table_cols", "split_len", "num_splits"])
def _rel_attention_kernel(
    q_ptr, k_ptr, v_ptr, rel_ptr, proj_ptr, kst_ptr, vst_ptr, table_ptr, slots_ptr, pos_ptr, prev_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, ks_ptr, vs_ptr, sks_s, sks_h, svs_s, svs_h,
    sq_b, sq_l, sq_h, sq_d, sk_b, sk_l, sk_h, sk_d, sv_b, sv_l, sv_h, sv_d,
    skst_s, skst_h, skst_d, svst_s, svst_h, svst_d, stab_b,
    query_len, num_q_tiles, table_cols, block_size, window, extent, split_len, num_splits,
    qk_scale, n_floor, alpha,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, WINDOWED: tl.constexpr, LOG_SCALING: tl.constexpr,
    IEEE: tl.constexpr, WIDEN: tl.constexpr, REL_FROM_R: tl.constexpr, D_REL: tl.constexpr, DR_PAD: tl.constexpr,
    R_DTYPE: tl.constexpr, KEY_LINES: tl.constexpr, QUANT: tl.constexpr = False, KV_DTYPE: tl.constexpr = None,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    b = pid // num_q_tiles
    tile = num_q_tiles - 1 - pid % num_q_tiles  # longest key ranges first
    kv = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    c0 = tile * BLOCK_M

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    # Query rows: token c0 + i // G_PAD, head kv * GROUP + i % G_PAD.
    i = tl.arange(0, BLOCK_M * G_PAD)
    col = c0 + i // G_PAD
    g = i % G_PAD
    head = kv * GROUP + g
    row_ok = (col < query_len) & (g < GROUP)
    t = b64 * query_len + col
    qpos, prev, last_pos, k_lo, k_hi, far_hi = _key_ranges(pos_ptr, prev_ptr, b, t, row_ok, query_len, split,
                                                            split_len, window, extent, WINDOWED, SPLIT)
    table_row = table_ptr + b64 * stab_b
    if PDL:  # launched early: this program's keys of earlier steps into L2 while the kernel before still runs
        _store_keys_to_l2(kst_ptr, vst_ptr, table_row, k_lo, tl.minimum(k_hi, prev), kv, skst_s, skst_h, svst_s,
                          svst_h, table_cols, block_size, HEAD_DIM, BLOCK_N, KEY_LINES)
    pdl_begin(PDL)
    # This forward's K/V go to their slots (pads and unallocated positions: the null block).
    if split == 0:
        tc = c0 + tl.arange(0, BLOCK_M)
        t_ok = tc < query_len
        wmask = t_ok[:, None] & d_ok[None, :]
        slot = tl.maximum(tl.load(slots_ptr + b64 * query_len + tc, mask=t_ok, other=0), 0).to(tl.int64)
        if QUANT:  # fp8 stores: each (token, head) quantized with its own scale (`fp8_triton.quantize_rows`)
            kk = tl.load(k_ptr + b64 * sk_b + tc[:, None] * sk_l + kv * sk_h + d[None, :] * sk_d, mask=wmask,
                         other=0.0)
            kq, kscale = quantize_rows(kk.to(tl.float32))
            tl.store(kst_ptr + slot[:, None] * skst_s + kv * skst_h + d[None, :] * skst_d, kq, mask=wmask)
            tl.store(ks_ptr + slot * sks_s + kv * sks_h, kscale, mask=t_ok)
            vv = tl.load(v_ptr + b64 * sv_b + tc[:, None] * sv_l + kv * sv_h + d[None, :] * sv_d, mask=wmask,
                         other=0.0)
            vq, vscale = quantize_rows(vv.to(tl.float32))
            tl.store(vst_ptr + slot[:, None] * svst_s + kv * svst_h + d[None, :] * svst_d, vq, mask=wmask)
            tl.store(vs_ptr + slot * svs_s + kv * svs_h, vscale, mask=t_ok)
        else:
            kk = tl.load(k_ptr + b64 * sk_b + tc[:, None] * sk_l + kv * sk_h + d[None, :] * sk_d, mask=wmask)
            tl.store(kst_ptr + slot[:, None] * skst_s + kv * skst_h + d[None, :] * skst_d,
                     kk.to(kst_ptr.dtype.element_ty), mask=wmask)
            vv = tl.load(v_ptr + b64 * sv_b + tc[:, None] * sv_l + kv * sv_h + d[None, :] * sv_d, mask=wmask)
            tl.store(vst_ptr + slot[:, None] * svst_s + kv * svst_h + d[None, :] * svst_d,
                     vv.to(vst_ptr.dtype.element_ty), mask=wmask)

    q = tl.load(q_ptr + b64 * sq_b + col[:, None] * sq_l + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qtau = tl.full([BLOCK_M * G_PAD], 1.0, tl.float32)
    if LOG_SCALING:
        n = (tl.maximum(qpos, 0) + 1).to(tl.float32)
        qtau = 1.0 + alpha * tl.log(tl.maximum(n / n_floor, 1.0))
        q = _round(q.to(tl.float32) * qtau[:, None], q.dtype, WIDEN)
    if IEEE:
        q = q.to(tl.float32)
    if REL_FROM_R:  # rel_ptr holds r [B, L, Hq, D_REL]: the bias is computed per key tile
        rel_rows = rel_ptr + (t * NUM_HEADS + head) * D_REL
        j_ids = tl.arange(0, DR_PAD)
        r_tile = tl.load(rel_rows[:, None] + j_ids[None, :], mask=row_ok[:, None] & (j_ids < D_REL)[None, :],
                         other=0.0)
    else:  # rel_ptr holds r @ P [B, L, Hq, E]: gathered
        rel_rows = rel_ptr + (t * NUM_HEADS + head) * extent
        r_tile = tl.zeros([BLOCK_M * G_PAD, DR_PAD], tl.float32)

    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)

    # Keys of earlier forwards (positions < prev_len) from the paged store, through the block table.
    store_hi = tl.minimum(k_hi, prev)
    acc, m, l = _scan_store(acc, m, l, k_lo, tl.minimum(far_hi, store_hi), q, qpos, qtau,
                            rel_rows, r_tile, proj_ptr, row_ok,
                            kst_ptr, vst_ptr, table_row, skst_s, skst_h, skst_d, svst_s, svst_h, svst_d,
                            table_cols, block_size, kv, d, d_ok, qk_scale, window, extent,
                            False, WINDOWED, LOG_SCALING, IEEE, WIDEN, BLOCK_N, REL_FROM_R, D_REL, R_DTYPE,
                            ks_ptr, vs_ptr, sks_s, sks_h, svs_s, svs_h, QUANT, KV_DTYPE)
    acc, m, l = _scan_store(acc, m, l, far_hi, store_hi, q, qpos, qtau,
                            rel_rows, r_tile, proj_ptr, row_ok,
                            kst_ptr, vst_ptr, table_row, skst_s, skst_h, skst_d, svst_s, svst_h, svst_d,
                            table_cols, block_size, kv, d, d_ok, qk_scale, window, extent,
                            True, WINDOWED, LOG_SCALING, IEEE, WIDEN, BLOCK_N, REL_FROM_R, D_REL, R_DTYPE,
                            ks_ptr, vs_ptr, sks_s, sks_h, svs_s, svs_h, QUANT, KV_DTYPE)
    # Keys of this forward (positions >= prev_len) from the activations.
    new_lo = tl.maximum(k_lo, prev)
    k_row = k_ptr + b64 * sk_b
    v_row = v_ptr + b64 * sv_b
    acc, m, l = _scan_new(acc, m, l, new_lo, tl.minimum(far_hi, k_hi), q, qpos, qtau,
                          rel_rows, r_tile, proj_ptr, row_ok,
                          k_row, v_row, sk_l, sk_h, sk_d, sv_l, sv_h, sv_d, query_len, last_pos, kv, d, d_ok,
                          qk_scale, window, extent, False, WINDOWED, LOG_SCALING, IEEE, WIDEN, BLOCK_N,
                          REL_FROM_R, D_REL, R_DTYPE)
    acc, m, l = _scan_new(acc, m, l, tl.maximum(new_lo, far_hi), k_hi, q, qpos, qtau,
                          rel_rows, r_tile, proj_ptr, row_ok,
                          k_row, v_row, sk_l, sk_h, sk_d, sv_l, sv_h, sv_d, query_len, last_pos, kv, d, d_ok,
                          qk_scale, window, extent, True, WINDOWED, LOG_SCALING, IEEE, WIDEN, BLOCK_N,
                          REL_FROM_R, D_REL, R_DTYPE)

    omask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (t * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=omask)
    else:
        out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
        tl.store(out_ptr + (t * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :],
                 _round(out, out_ptr.dtype.element_ty, WIDEN), mask=omask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits,
                         HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr,
                         D_PAD: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (token, query head): combine the splits' (max, sum, accumulator)."""
    pdl_begin(PDL)
    th = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    m = tl.load(part_m_ptr + th * num_splits + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + th * num_splits + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (th * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)  # empty splits (max -inf) weigh 0
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0)
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + th * HEAD_DIM + d, _round(o, out_ptr.dtype.element_ty, WIDEN), mask=d < HEAD_DIM)


@on_device_of_first_tensor
def paged_rel_attention_triton(
    q: torch.Tensor,  # [B, L, Hq, hd], normed
    k: torch.Tensor,  # [B, L, Hkv, hd], normed
    v: torch.Tensor,  # [B, L, Hkv, hd]
    r: torch.Tensor,  # [B, L, Hq, d_rel]
    proj: torch.Tensor,  # [d_rel, E]
    key_store: torch.Tensor,  # [slots, Hkv, hd]
    value_store: torch.Tensor,  # [slots, Hkv, hd]
    table: torch.Tensor,  # [B, columns] int32
    block_size: int,
    slots: torch.Tensor,  # [B*L] int64, -1 pads
    position: torch.Tensor,  # [B*L] int64, -1 pads
    prev_len: torch.Tensor,  # [B]
    host_prev_len: list[int],
    scaling: float,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,  # (n_floor, alpha)
    *,
    block_m: int | None = None,  # tokens per query tile
    block_n: int | None = None,  # keys per key tile
    num_splits: int | None = None,  # key splits per query tile (None: launch policy)
    num_warps: int | None = None,
    num_stages: int | None = None,  # software pipelining depth of the key loop (None: Triton's default)
    bias_in_kernel: bool = False,  # one-token tiles compute r @ P in the kernel (the rel_bias fusion's path)
    key_scales: torch.Tensor | None = None,  # [slots, Hkv] fp32: the stores are fp8 (`fp8`)
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_rel_attention_torch` in one launch (two when the keys are split); see the module doc."""
    B, L, Hq, hd = q.shape
    G = Hq // k.shape[2]
    if B * L == 0:
        return torch.empty(B, L, Hq * hd, dtype=q.dtype, device=q.device)
    table = table.contiguous()
    if table.shape[1] == 0:  # nothing cached anywhere: any single null column will do
        table = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    decode = L == 1
    wide = q.element_size() >= 4 or (key_store.element_size() >= 4 and key_scales is None)
    key = (q.device, q.dtype, key_store.dtype, hd, G, decode)
    if block_m is None and block_n is None and key in _TILES_THAT_FIT:
        block_m, block_n = _TILES_THAT_FIT[key]
    if block_m is None:
        block_m = 1 if decode else max(1, (WIDE_PREFILL_ROWS if wide else PREFILL_ROWS) // triton.next_power_of_2(G))
    if block_n is None:
        block_n = WIDE_BLOCK_N if wide else DECODE_BLOCK_N if decode else PREFILL_BLOCK_N
    block_n = pow2(block_n)
    if bias_in_kernel and block_m == 1:  # every query tile one position: the kernel computes r @ P per key tile
        rel = r.contiguous()
    else:  # the bias profile of every query, rounded like the torch op: [B, L, Hq, E] in r's dtype
        rel, proj = (r @ proj).contiguous(), None
    # fp8 stores: their scales (the launch of a store in the model's dtype is called as before)
    scales = {} if key_scales is None else {"key_scales": key_scales, "value_scales": value_scales}
    while True:
        try:
            return _launch(q, k, v, rel, proj, key_store, value_store, table, block_size, slots, position, prev_len,
                           host_prev_len, scaling, window, log_scaling, block_m, block_n, num_splits, num_warps,
                           num_stages, **scales)
        except OutOfResources:
            smaller = _smaller_tiles(block_m, block_n)
            if smaller is None:
                raise
            block_m, block_n = _TILES_THAT_FIT[key] = smaller


def _smaller_tiles(block_m: int, block_n: int) -> tuple[int, int] | None:
    """The next tile sizes to try after a launch ran out of shared memory: fewer keys per tile down to 16,
    then fewer query tokens; None when both are at their least."""
    if block_n > 16:
        return block_m, block_n // 2
    if block_m > 1:
        return block_m // 2, block_n
    return None


def _launch(q, k, v, rel, proj, key_store, value_store, table, block_size, slots, position, prev_len, host_prev_len,
            scaling, window, log_scaling, block_m, block_n, num_splits, num_warps, num_stages=None, *,
            key_scales=None, value_scales=None) -> torch.Tensor:
    """One launch (two with key splits) at these tile sizes; see `paged_rel_attention_triton`. ``proj`` None:
    ``rel`` is ``r @ P``; else ``rel`` is ``r`` and the kernel computes the bias (one-token tiles only)."""
    B, L, Hq, hd = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    from_r = proj is not None  # only with one-token query tiles (the caller's choice; the fallback keeps 1)
    E = proj.shape[1] if from_r else rel.shape[-1]
    d_rel = rel.shape[-1] if from_r else 1
    out = torch.empty(B, L, Hq * hd, dtype=q.dtype, device=q.device)
    g_pow = triton.next_power_of_2(G)
    g_pad = max(g_pow, triton.next_power_of_2(_cdiv(16, block_m)))  # tl.dot needs >= 16 rows
    block_n = pow2(block_n)
    d_pad = pow2(hd)
    num_q_tiles = _cdiv(L, block_m)

    # Keys one query tile may scan (host bound, no device sync).
    longest = max(host_prev_len, default=0) + L
    span = longest if window is None else min(longest, window + block_m - 1)
    if num_splits is None:
        programs = B * num_q_tiles * Hkv
        num_splits = min(MAX_SPLITS, max(1, _cdiv(span, MIN_SPLIT_KEYS)), max(1, _cdiv(TARGET_PROGRAMS, programs)))
    num_splits = max(1, min(num_splits, _cdiv(span, block_n)))
    split_len = block_n * _cdiv(_cdiv(span, num_splits), block_n)
    num_splits = _cdiv(span, split_len)

    quant = key_scales is not None  # fp8 stores widen to k's dtype as read
    stored = (k.dtype, k.dtype) if quant else (key_store.dtype, value_store.dtype)
    ieee = not (q.dtype == k.dtype == v.dtype == stored[0] == stored[1] and q.dtype in (torch.bfloat16, torch.float16))
    scale_args = ((key_scales, value_scales, *key_scales.stride(), *value_scales.stride()) if quant
                  else (q, q, 0, 0, 0, 0))
    n_floor, alpha = log_scaling if log_scaling is not None else (1.0, 0.0)
    T = B * L
    if num_splits > 1:
        part_m = torch.empty(T, Hq, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(T, Hq, num_splits, hd, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out
    if num_warps is None:
        num_warps = 8 if block_m * g_pad * d_pad >= 128 * 128 else 4
    grid = (B * num_q_tiles, Hkv, num_splits)
    _rel_attention_kernel[grid](
        q, k, v, rel, proj.contiguous() if from_r else rel, key_store, value_store, table, slots.contiguous(),
        position.contiguous(),
        prev_len.contiguous(), out, part_m, part_l, part_acc, *scale_args,
        *q.stride(), *k.stride(), *v.stride(),
        *key_store.stride(), *value_store.stride(), table.stride(0),
        L, num_q_tiles, table.shape[1], block_size, window if window is not None else 0, E, split_len, num_splits,
        float(scaling) * LOG2E, float(n_floor), float(alpha),
        NUM_HEADS=Hq, GROUP=G, HEAD_DIM=hd, G_PAD=g_pad, BLOCK_M=block_m, D_PAD=d_pad, BLOCK_N=block_n,
        SPLIT=num_splits > 1, WINDOWED=window is not None, LOG_SCALING=log_scaling is not None,
        IEEE=ieee, WIDEN=INTERPRET, REL_FROM_R=from_r, D_REL=d_rel, DR_PAD=pow2(d_rel), R_DTYPE=TL_DTYPES[rel.dtype],
        KEY_LINES=l2_lines(hd, key_store.dtype), QUANT=quant, KV_DTYPE=TL_DTYPES[k.dtype] if quant else None,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **pdl(q),
    )
    if num_splits > 1:
        _merge_splits_kernel[(T * Hq,)](
            part_m, part_l, part_acc, out, num_splits, HEAD_DIM=hd,
            S_PAD=triton.next_power_of_2(num_splits), D_PAD=triton.next_power_of_2(hd), WIDEN=INTERPRET,
            num_warps=4, **pdl(part_m),
        )
    return out
