"""Triton versions of `hf_qsa_cache.ops.prompt_experts`' ops (same arithmetic and rounding): the two elementwise
passes around transformers' grouped GEMMs, the pairs' grouping, and the tiled experts (`tiled_experts_triton`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, dot, on_device_of_first_tensor, pdl, pdl_begin


@triton.jit(do_not_specialize=["num_rows"])
def _weighted_silu_mul_kernel(gate_up_ptr, weights_ptr, out_ptr, num_rows, I: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
    pdl_begin(PDL)
    s = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < I
    gate = tl.load(gate_up_ptr + s * 2 * I + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + s * 2 * I + I + i, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(weights_ptr + s).to(tl.float32)
    tl.store(out_ptr + s * I + i, (gate * tl.sigmoid(gate) * up * w).to(out_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def weighted_silu_mul_triton(gate_up: torch.Tensor, weights: torch.Tensor, block: int = 512) -> torch.Tensor:
    """`prompt_experts.weighted_silu_mul_torch` in one launch, one program per (row, block of columns)."""
    gate_up, weights = gate_up.contiguous(), weights.contiguous()
    rows, two_i = gate_up.shape
    out = torch.empty(rows, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _weighted_silu_mul_kernel[(rows, triton.cdiv(two_i // 2, block))](gate_up, weights, out, rows, I=two_i // 2,
                                                                            BLOCK=block, num_warps=4, **pdl(gate_up))
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _sum_by_token_kernel(rows_ptr, positions_ptr, out_ptr, num_tokens, H: tl.constexpr, K: tl.constexpr,
                         SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(K):
        row = tl.load(positions_ptr + t * K + j).to(tl.int64)
        acc += tl.load(rows_ptr + row * H + h, mask=ok, other=0.0).to(tl.float32)
    for s in range(SHARED):  # the shared experts' rows follow the pairs' rows, one per token each
        acc += tl.load(rows_ptr + (num_tokens * (K + s) + t) * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def sum_by_token_triton(rows: torch.Tensor, positions: torch.Tensor, num_tokens: int, top_k: int,
                        block: int = 1024, out_dtype: torch.dtype | None = None, shared: int = 0) -> torch.Tensor:
    """`prompt_experts.sum_by_token_torch` in one launch, one program per (token, block of features); with
    ``shared``, each token adds the rows ``num_tokens * (top_k + s) + t`` of the ``shared`` experts too."""
    rows, positions = rows.contiguous(), positions.contiguous()
    H = rows.shape[-1]
    out = torch.empty(num_tokens, H, dtype=out_dtype or rows.dtype, device=rows.device)
    if out.numel():
        _sum_by_token_kernel[(num_tokens, triton.cdiv(H, block))](rows, positions, out, num_tokens, H=H, K=top_k,
                                                                   SHARED=shared, BLOCK=block, num_warps=4, **pdl(rows))
    return out


# Up to this many (token, expert) pairs `pair_order_triton` ranks them by comparing every pair with every other
# (S * S work, spread over programs of BLOCK_I pairs each); more take torch's sort.
PAIR_ORDER_MAX_PAIRS = 1024


@triton.jit(do_not_specialize=["num_pairs"])
def _pair_order_kernel(ids_ptr, perm_ptr, positions_ptr, offsets_ptr, num_pairs,
                       BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program p: the rank of pairs ``[p * BLOCK_I, (p + 1) * BLOCK_I)`` in the stable order by expert (the pairs
    of lower experts, then the earlier pairs of its own expert), written as ``positions[i] = rank`` and
    ``perm[rank] = i``; program 0 also writes each expert's end offset (pairs routed to experts ``<= e``).
    One program ranking every pair took 51 us at 640 pairs (64 rows of Qwen4Exp, H100): the comparisons are
    the work, so they are split over programs."""
    pdl_begin(PDL)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < num_pairs
    mine = tl.load(ids_ptr + i, mask=i_ok, other=E).to(tl.int32)
    rank = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, num_pairs, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        other = tl.load(ids_ptr + j, mask=j < num_pairs, other=E).to(tl.int32)  # padding ranks after every pair
        before = (other[None, :] < mine[:, None]) | ((other[None, :] == mine[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(positions_ptr + i, rank.to(tl.int64), mask=i_ok)
    tl.store(perm_ptr + rank, i.to(tl.int64), mask=i_ok)
    if tl.program_id(0) == 0:
        e = tl.arange(0, E_PAD)
        ends = tl.zeros([E_PAD], tl.int32)
        for j0 in range(0, num_pairs, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            ids = tl.load(ids_ptr + j, mask=j < num_pairs, other=E).to(tl.int32)
            ends += tl.sum((ids[None, :] <= e[:, None]).to(tl.int32), axis=1)
        tl.store(offsets_ptr + e, ends, mask=e < E)


@on_device_of_first_tensor
def pair_order_triton(expert_ids: torch.Tensor, num_experts: int, block_i: int = 64,
                      block_j: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prompt_experts.pair_order_torch` of ``expert_ids [S]`` (``S <= PAIR_ORDER_MAX_PAIRS``) in one launch;
    ``block_i``: pairs ranked per program, ``block_j``: pairs compared at a time (tests force both small)."""
    ids = expert_ids.contiguous()
    S = ids.numel()
    if S > PAIR_ORDER_MAX_PAIRS:
        raise ValueError(f"pair_order_triton ranks at most {PAIR_ORDER_MAX_PAIRS} pairs; got {S}")
    perm = torch.empty(S, dtype=torch.int64, device=ids.device)
    positions = torch.empty(S, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    if S:
        _pair_order_kernel[(triton.cdiv(S, block_i),)](ids, perm, positions, offsets, S, BLOCK_I=block_i,
                                                       BLOCK_J=block_j, E=num_experts,
                                                       E_PAD=triton.next_power_of_2(num_experts), num_warps=4,
                                                       **pdl(ids))
    else:
        offsets.zero_()
    return perm, positions, offsets


# ----------------------------------------------------------------------------- experts tiled by expert
# Launch policy (shapes only; tests force them small): (pairs per tile, output columns per program, reduction
# chunk, warps) of each kernel. Graph-timed on the H200 (`benchmarks/check_fused_kernels.py --experts-sweep`, Inkling's
# experts, bf16): the fastest of the swept tilings at 8 to 64 tokens, ahead of a 128-wide chunk for gate-up; the
# down kernel's tiling changes little.
TILED_GATE_UP = (16, 32, 256, 4)
TILED_DOWN = (16, 64, 128, 4)


@triton.jit
def _expert_rows(offsets_ptr, e):
    """The grouped order's rows ``[start, end)`` of expert ``e`` (``offsets``: each expert's end row)."""
    end = tl.load(offsets_ptr + e).to(tl.int64)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    return start, end


@triton.jit
def _gate_up_tile(x_rows, row_ok, stride_xh, gate_cols, up_cols, stride_wk, n_ok, gate_vector_ptr,
                  HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GATE_VECTOR: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """fp32 ``(x @ gate.T, x @ up.T, x . gate_vector)`` for BLOCK_M rows of inputs (``x_rows`` ``[BLOCK_M, 1]``)
    against one tile of columns (``gate_cols`` / ``up_cols`` ``[1, BLOCK_N]``); the last only with GATE_VECTOR."""
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    gated = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < HIDDEN
        x = tl.load(x_rows + k[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate += dot(x, tl.load(gate_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0), IEEE, WIDEN)
        up += dot(x, tl.load(up_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0), IEEE, WIDEN)
        if GATE_VECTOR:
            vector = tl.load(gate_vector_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            gated += tl.sum(x.to(tl.float32) * vector[None, :], axis=1)
    return gate, up, gated


@triton.jit
def _store_activation(h_ptr, rows, row_ok, stride_ht, n, n_ok, weight, gate, up):
    """``weight * silu(gate) * up`` rounded once into rows ``rows`` of ``h``."""
    h = weight[:, None] * gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None] * stride_ht + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["stride_xt", "stride_swt", "num_tokens"])
def _tiled_gate_up_kernel(x_ptr, perm_ptr, weights_ptr, offsets_ptr, w_ptr, h_ptr, sg_ptr, su_ptr, gate_vector_ptr,
                          token_weights_ptr, stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_ht,
                          stride_se, stride_sn, stride_sk, stride_swt, num_experts, num_tokens,
                          HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SHARED_INTER: tl.constexpr,
                          GATE_VECTOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (expert e, tile of BLOCK_N intermediate columns): for every BLOCK_M of e's rows,
    ``h = w * silu(x @ gate.T) * (x @ up.T)`` for the tile, rounded once into ``h``. A routed expert's rows are
    its pairs in the grouped order (``w``: the pair's routing weight); a shared expert ``s = e - num_experts``
    has one row per token after the pairs' rows (``w``: sigmoid(x . gate_vector) with GATE_VECTOR, else the
    token's given weight). The expert's gate and up rows are read once per BLOCK_M rows (once at decode sizes);
    a routed expert without pairs reads nothing."""
    pdl_begin(PDL)
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if e < num_experts:
        start, end = _expert_rows(offsets_ptr, e)
        n_ok = n < INTER
        gate_cols = w_ptr + e * stride_we + n[None, :] * stride_wn  # the gate half's rows as columns
        up_cols = gate_cols + INTER * stride_wn
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            pair = tl.load(perm_ptr + rows, mask=row_ok, other=0)
            gate, up, _ = _gate_up_tile(x_ptr + (pair // TOP_K)[:, None] * stride_xt, row_ok, stride_xh, gate_cols,
                                        up_cols, stride_wk, n_ok, gate_vector_ptr, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K,
                                        False, IEEE, WIDEN)
            weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            _store_activation(h_ptr, rows, row_ok, stride_ht, n, n_ok, weight, gate, up)
    elif SHARED_INTER > 0:
        s = e - num_experts
        n_ok = n < SHARED_INTER
        gate_cols = sg_ptr + s * stride_se + n[None, :] * stride_sn
        up_cols = su_ptr + s * stride_se + n[None, :] * stride_sn
        first = num_tokens * (TOP_K + s)  # shared expert s's row of token 0
        for t0 in range(0, num_tokens, BLOCK_M):
            t = t0 + tl.arange(0, BLOCK_M)
            t_ok = t < num_tokens
            gate, up, gated = _gate_up_tile(x_ptr + t[:, None] * stride_xt, t_ok, stride_xh, gate_cols, up_cols,
                                            stride_sk, n_ok, gate_vector_ptr, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K,
                                            GATE_VECTOR, IEEE, WIDEN)
            if GATE_VECTOR:
                weight = tl.sigmoid(gated)
            else:
                weight = tl.load(token_weights_ptr + t * stride_swt + s, mask=t_ok, other=0.0).to(tl.float32)
            _store_activation(h_ptr, first + t, t_ok, stride_ht, n, n_ok, weight, gate, up)


@triton.jit
def _down_rows(h_ptr, start, end, stride_ht, cols, stride_k, out_ptr, n, n_ok,
               HIDDEN: tl.constexpr, INNER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """fp32 ``h[rows] @ down.T`` for rows ``[start, end)`` and one tile of hidden columns (``cols`` ``[1, BLOCK_N]``:
    the down rows as columns), into the same rows of ``out``."""
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INNER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < INNER
            h = tl.load(h_ptr + rows[:, None] * stride_ht + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            d = tl.load(cols + k[:, None] * stride_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += dot(h, d, IEEE, WIDEN)
        tl.store(out_ptr + rows[:, None] * HIDDEN + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _tiled_down_kernel(h_ptr, offsets_ptr, d_ptr, sd_ptr, out_ptr, stride_ht, stride_de, stride_dn, stride_dk,
                       stride_sde, stride_sdn, stride_sdk, num_experts, num_tokens,
                       HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SHARED_INTER: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                       WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (expert e, tile of BLOCK_N hidden columns): the down projection of each of e's rows of ``h`` (as in
    the first kernel), in fp32 rows ``[rows of h, HIDDEN]`` summed per token afterwards (`sum_by_token_triton`)."""
    pdl_begin(PDL)
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    if e < num_experts:
        start, end = _expert_rows(offsets_ptr, e)
        _down_rows(h_ptr, start, end, stride_ht, d_ptr + e * stride_de + n[None, :] * stride_dn, stride_dk, out_ptr,
                   n, n_ok, HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, WIDEN)
    elif SHARED_INTER > 0:
        s = e - num_experts
        first = num_tokens * (TOP_K + s)
        _down_rows(h_ptr, first, first + num_tokens, stride_ht, sd_ptr + s * stride_sde + n[None, :] * stride_sdn,
                   stride_sdk, out_ptr, n, n_ok, HIDDEN, SHARED_INTER, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, WIDEN)


def _tiles(value, default, name: str) -> tuple:
    tiles = tuple(value or default)
    if len(tiles) != 4 or any(t < 1 or t & (t - 1) for t in tiles) or min(tiles[:3]) < 16:
        raise ValueError(f"{name} must be (pairs, columns, chunk, warps), powers of two, the first three >= 16 "
                         f"(tl.dot's smallest); got {tiles}")
    return tiles


@on_device_of_first_tensor
def tiled_experts_triton(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor, transposed: bool = False, shared=None,
                         *, gate_up_tiles: tuple | None = None, down_tiles: tuple | None = None) -> torch.Tensor:
    """`prompt_experts.tiled_experts_torch` in four launches: the pairs grouped by expert (`pair_order_triton`),
    the two kernels above (the ``shared`` experts, `hf_qsa_cache.ops.experts.SharedExpert`, as programs after
    the routed experts'), and the sum of each token's rows. ``gate_up_tiles`` / ``down_tiles`` override
    `TILED_GATE_UP` / `TILED_DOWN`."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    m_up, n_up, k_up, warps_up = _tiles(gate_up_tiles, TILED_GATE_UP, "gate_up_tiles")
    m_down, n_down, k_down, warps_down = _tiles(down_tiles, TILED_DOWN, "down_tiles")
    n_shared, shared_inter = (shared.gate.shape[0], shared.gate.shape[1]) if shared is not None else (0, 0)
    if num_tokens == 0 or (top_k * inter == 0 and not shared_inter):
        return torch.zeros_like(hidden_states)
    perm, positions, offsets = pair_order_triton(top_k_index.reshape(-1), num_experts)
    # (expert, output row, reduction) strides of both layouts: the transposed one swaps the last two.
    w_e, w_n, w_k = gate_up_proj.stride()
    d_e, d_n, d_k = down_proj.stride()
    if transposed:
        w_n, w_k, d_n, d_k = w_k, w_n, d_k, d_n
    gate_vector = shared is not None and shared.gate_vector is not None
    if shared_inter:  # one set of strides serves the shared gate and up rows
        shared_gate, shared_up, shared_down = shared.gate.contiguous(), shared.up.contiguous(), shared.down
        vector = shared.gate_vector.reshape(-1).contiguous() if gate_vector else hidden_states
        token_weights = shared.token_weights.contiguous() if not gate_vector else hidden_states
        assert gate_vector or token_weights.shape == (num_tokens, n_shared)
    else:  # unused pointers (never dereferenced: SHARED_INTER = 0 leaves their code out)
        shared_gate = shared_up = shared_down = gate_up_proj
        vector = token_weights = hidden_states
        n_shared = 0
    rows_count = num_tokens * (top_k + n_shared)
    width = max(inter, shared_inter)
    ieee = hidden_states.dtype == torch.float32
    h = torch.empty(rows_count, width, dtype=hidden_states.dtype, device=hidden_states.device)
    _tiled_gate_up_kernel[(num_experts + n_shared, triton.cdiv(width, n_up))](
        hidden_states, perm, top_k_weights.contiguous(), offsets, gate_up_proj, h, shared_gate, shared_up, vector,
        token_weights, hidden_states.stride(0), hidden_states.stride(1), w_e, w_n, w_k, h.stride(0),
        *shared_gate.stride()[-3:], token_weights.stride(0), num_experts, num_tokens,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED_INTER=shared_inter, GATE_VECTOR=gate_vector, BLOCK_M=m_up,
        BLOCK_N=n_up, BLOCK_K=k_up, IEEE=ieee, WIDEN=INTERPRET, num_warps=warps_up, **pdl(hidden_states),
    )
    rows = torch.empty(rows_count, hidden, dtype=torch.float32, device=hidden_states.device)
    _tiled_down_kernel[(num_experts + n_shared, triton.cdiv(hidden, n_down))](
        h, offsets, down_proj, shared_down, rows, h.stride(0), d_e, d_n, d_k, *shared_down.stride()[-3:],
        num_experts, num_tokens,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED_INTER=shared_inter, BLOCK_M=m_down, BLOCK_N=n_down,
        BLOCK_K=k_down, IEEE=ieee, WIDEN=INTERPRET, num_warps=warps_down, **pdl(h),
    )
    return sum_by_token_triton(rows, positions, num_tokens, top_k, out_dtype=hidden_states.dtype, shared=n_shared)
