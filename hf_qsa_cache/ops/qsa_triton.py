"""Triton versions of the two QSA hot ops, one launch each.

Same signatures and outputs as the torch specification in `hf_qsa_cache.ops.qsa`:

* `sparse_paged_attention_triton`: one program per (token, KV head) runs all GQA query heads of that
  KV head over the token's selected positions in tiles of ``BLOCK_W``, mapping each logical position
  to its physical slot through the block table, with an online softmax in fp32.
* `index_scores_triton`: one program per (token, tile of ``BLOCK_G`` compressed groups) computes
  ``sum_h relu(q_h . k_g) / sqrt(Di)`` for the visible groups and ``-inf`` for the others.

Block-table lookups clamp the logical block to the table's last column, like `paged_rows`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, LOG2E, dot, pow2



# Batch-varying sizes are not specialised, so a new batch or selection width does not recompile.
@triton.jit(do_not_specialize=["num_tokens", "width", "table_width", "stride_tr"])
def _sparse_paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, token_row_ptr, pos_ptr,
    stride_qn, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_tr, stride_tc, stride_pn, stride_pw,
    num_tokens, width, table_width, block_size, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kv * GROUP + g
    q = tl.load(q_ptr + n * stride_qn + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    row = tl.load(token_row_ptr + n).to(tl.int64)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, width, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        pos = tl.load(pos_ptr + n * stride_pn + w * stride_pw, mask=w < width, other=-1).to(tl.int64)
        ok = pos >= 0
        p = tl.maximum(pos, 0)
        logical = tl.minimum(p // block_size, table_width - 1)
        block = tl.load(table_ptr + row * stride_tr + logical * stride_tc, mask=ok, other=0).to(tl.int64)
        slot = block * block_size + p % block_size
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv * stride_kh + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), IEEE, WIDEN) * qk_scale  # [G_PAD, BLOCK_W], log2 domain
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep exp2 finite
        alpha = tl.exp2(m - m_ref)
        prob = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv * stride_vh + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(prob.to(v.dtype), v, IEEE, WIDEN)
        m = m_new
    # A token with no valid position (a pad) writes zeros.
    out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + n * stride_on + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def sparse_paged_attention_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  block_table: torch.Tensor, token_row: torch.Tensor, positions: torch.Tensor,
                                  block_size: int, scaling: float) -> torch.Tensor:
    """`hf_qsa_cache.ops.qsa.sparse_paged_attention` in one launch (see there for shapes)."""
    n, num_heads, head_dim = query.shape
    num_kv = keys.shape[2]
    group = num_heads // num_kv
    width = positions.shape[1]
    out = torch.empty_like(query)
    if n == 0 or num_heads == 0:
        return out
    # A slot is (block, offset) flattened; the store's leading two axes must be one strided axis.
    assert keys.stride(0) == block_size * keys.stride(1) and values.stride(0) == block_size * values.stride(1)
    if width == 0 or block_table.shape[1] == 0:
        return out.zero_()
    grid = (n, num_kv)
    _sparse_paged_attention_kernel[grid](
        query, keys, values, out, block_table, token_row, positions,
        query.stride(0), query.stride(1), query.stride(2),
        keys.stride(1), keys.stride(2), keys.stride(3),
        values.stride(1), values.stride(2), values.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_table.stride(0), block_table.stride(1), positions.stride(0), positions.stride(1),
        n, width, block_table.shape[1], block_size, float(scaling) * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, G_PAD=pow2(group), D_PAD=pow2(head_dim), BLOCK_W=64,
        IEEE=query.dtype == torch.float32, WIDEN=INTERPRET,
        num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=["max_groups", "table_width", "stride_tr"])
def _index_scores_kernel(
    q_ptr, c_ptr, table_ptr, token_row_ptr, visible_ptr, out_ptr,
    stride_qn, stride_qh, stride_qd, stride_cr, stride_cd, stride_tr, stride_tc, stride_on,
    max_groups, table_width, rows_per_block, sqrt_dim,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * BLOCK_G
    g = g0 + tl.arange(0, BLOCK_G)
    visible = tl.load(visible_ptr + n).to(tl.int32)
    live = g < visible
    score = tl.full([BLOCK_G], float("-inf"), tl.float32)
    if g0 < visible:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        row = tl.load(token_row_ptr + n).to(tl.int64)
        logical = tl.minimum(g // rows_per_block, table_width - 1)
        block = tl.load(table_ptr + row * stride_tr + logical * stride_tc, mask=live, other=0).to(tl.int64)
        flat = block * rows_per_block + g % rows_per_block
        key = tl.load(c_ptr + flat[:, None] * stride_cr + d[None, :] * stride_cd,
                      mask=live[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            key = key.to(tl.float32)
        key_t = tl.trans(key)
        total = tl.zeros([BLOCK_G], tl.float32)
        for h0 in range(0, NUM_HEADS, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :] * stride_qd,
                        mask=(h < NUM_HEADS)[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                q = q.to(tl.float32)
            s = dot(q, key_t, IEEE, WIDEN)  # [BLOCK_H, BLOCK_G]; padded heads give 0
            total += tl.sum(tl.maximum(s, 0.0), axis=0)
        score = tl.where(live, total / sqrt_dim, float("-inf"))
    tl.store(out_ptr + n * stride_on + g, score, mask=g < max_groups)


def index_scores_triton(q_index: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                        token_row: torch.Tensor, visible_blocks: torch.Tensor, rows_per_block: int,
                        max_groups: int) -> torch.Tensor:
    """`hf_qsa_cache.ops.qsa.index_scores_torch` in one launch (see there for shapes)."""
    n, num_heads, head_dim = q_index.shape
    out = torch.empty(n, max_groups, dtype=torch.float32, device=q_index.device)
    if n == 0 or max_groups == 0:
        return out
    if block_table.shape[1] == 0:
        return out.fill_(float("-inf"))
    flat = compressed.reshape(-1, head_dim)
    # bf16/fp16 products are exact in fp32, so the tensor-core dot with an fp32 accumulator only
    # differs from the fp32 reference in summation order; fp32 (or mixed) inputs use an IEEE dot.
    ieee = not (q_index.dtype == flat.dtype and q_index.dtype in (torch.bfloat16, torch.float16))
    block_g = 64
    grid = (n, triton.cdiv(max_groups, block_g))
    _index_scores_kernel[grid](
        q_index, flat, block_table, token_row, visible_blocks, out,
        q_index.stride(0), q_index.stride(1), q_index.stride(2), flat.stride(0), flat.stride(1),
        block_table.stride(0), block_table.stride(1), out.stride(0),
        max_groups, block_table.shape[1], rows_per_block, math.sqrt(head_dim),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=pow2(head_dim),
        BLOCK_H=min(pow2(num_heads), 32), BLOCK_G=block_g, IEEE=ieee, WIDEN=INTERPRET,
        num_warps=4,
    )
    return out
