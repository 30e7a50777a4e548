"""Triton versions of `hf_qsa_cache.ops.prompt_experts`' ops (same arithmetic and rounding): the two elementwise
passes around transformers' grouped GEMMs, the pairs' grouping, and the tiled experts (`tiled_experts_triton`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, dot, on_device_of_first_tensor


@triton.jit(do_not_specialize=["num_rows"])
def _weighted_silu_mul_kernel(gate_up_ptr, weights_ptr, out_ptr, num_rows, I: tl.constexpr, BLOCK: tl.constexpr):
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
                                                                            BLOCK=block, num_warps=4)
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _sum_by_token_kernel(rows_ptr, positions_ptr, out_ptr, num_tokens, H: tl.constexpr, K: tl.constexpr,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(K):
        row = tl.load(positions_ptr + t * K + j).to(tl.int64)
        acc += tl.load(rows_ptr + row * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def sum_by_token_triton(rows: torch.Tensor, positions: torch.Tensor, num_tokens: int, top_k: int,
                        block: int = 1024, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`prompt_experts.sum_by_token_torch` in one launch, one program per (token, block of features)."""
    rows, positions = rows.contiguous(), positions.contiguous()
    H = rows.shape[-1]
    out = torch.empty(num_tokens, H, dtype=out_dtype or rows.dtype, device=rows.device)
    if out.numel():
        _sum_by_token_kernel[(num_tokens, triton.cdiv(H, block))](rows, positions, out, num_tokens, H=H, K=top_k,
                                                                   BLOCK=block, num_warps=4)
    return out


# Up to this many (token, expert) pairs `pair_order_triton` ranks them in one program (it compares every pair
# with every other: S * S work); more take torch's sort.
PAIR_ORDER_MAX_PAIRS = 1024


@triton.jit(do_not_specialize=["num_pairs"])
def _pair_order_kernel(ids_ptr, perm_ptr, positions_ptr, offsets_ptr, num_pairs,
                       S_PAD: tl.constexpr, BLOCK_J: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr):
    """One program: each pair's rank in the stable order by expert (the pairs of lower experts, then the
    earlier pairs of its own expert), written as ``positions[i] = rank`` and ``perm[rank] = i``, and each
    expert's end offset (pairs routed to experts ``<= e``)."""
    i = tl.arange(0, S_PAD)
    i_ok = i < num_pairs
    mine = tl.load(ids_ptr + i, mask=i_ok, other=E).to(tl.int32)
    rank = tl.zeros([S_PAD], tl.int32)
    for j0 in range(0, num_pairs, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        other = tl.load(ids_ptr + j, mask=j < num_pairs, other=E).to(tl.int32)  # padding ranks after every pair
        before = (other[None, :] < mine[:, None]) | ((other[None, :] == mine[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(positions_ptr + i, rank.to(tl.int64), mask=i_ok)
    tl.store(perm_ptr + rank, i.to(tl.int64), mask=i_ok)
    e = tl.arange(0, E_PAD)
    ends = tl.sum(((mine[None, :] <= e[:, None]) & i_ok[None, :]).to(tl.int32), axis=1)
    tl.store(offsets_ptr + e, ends, mask=e < E)


@on_device_of_first_tensor
def pair_order_triton(expert_ids: torch.Tensor, num_experts: int,
                      block_j: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prompt_experts.pair_order_torch` of ``expert_ids [S]`` (``S <= PAIR_ORDER_MAX_PAIRS``) in one launch;
    ``block_j``: pairs compared at a time (tests force it small)."""
    ids = expert_ids.contiguous()
    S = ids.numel()
    if S > PAIR_ORDER_MAX_PAIRS:
        raise ValueError(f"pair_order_triton ranks at most {PAIR_ORDER_MAX_PAIRS} pairs; got {S}")
    perm = torch.empty(S, dtype=torch.int64, device=ids.device)
    positions = torch.empty(S, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    if S:
        _pair_order_kernel[(1,)](ids, perm, positions, offsets, S, S_PAD=triton.next_power_of_2(S), BLOCK_J=block_j,
                                 E=num_experts, E_PAD=triton.next_power_of_2(num_experts), num_warps=4)
    else:
        offsets.zero_()
    return perm, positions, offsets


# ----------------------------------------------------------------------------- experts tiled by expert
# Launch policy (shapes only; tests force them small): (pairs per tile, output columns per program, reduction
# chunk, warps) of each kernel. Not yet timed on a GPU.
TILED_GATE_UP = (16, 32, 128, 4)
TILED_DOWN = (16, 64, 128, 4)


@triton.jit
def _expert_rows(offsets_ptr, e):
    """The grouped order's rows ``[start, end)`` of expert ``e`` (``offsets``: each expert's end row)."""
    end = tl.load(offsets_ptr + e).to(tl.int64)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    return start, end


@triton.jit(do_not_specialize=["stride_xt"])
def _tiled_gate_up_kernel(x_ptr, perm_ptr, weights_ptr, offsets_ptr, w_ptr, h_ptr, stride_xt, stride_xh,
                          stride_we, stride_wn, stride_wk,
                          HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """Program (expert e, tile of BLOCK_N intermediate columns): for every BLOCK_M of e's pairs (grouped order),
    ``h = w * silu(x @ gate.T) * (x @ up.T)`` for the tile, rounded once into ``h`` ``[S, INTER]``. The expert's
    gate and up rows are read once per BLOCK_M pairs (once at decode sizes); an expert without pairs reads
    nothing."""
    e = tl.program_id(0).to(tl.int64)
    start, end = _expert_rows(offsets_ptr, e)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    gate_cols = w_ptr + e * stride_we + n[None, :] * stride_wn  # [1, BLOCK_N]: the gate half's rows as columns
    up_cols = gate_cols + INTER * stride_wn
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < end
        pair = tl.load(perm_ptr + rows, mask=r_ok, other=0)
        x_rows = x_ptr + (pair // TOP_K)[:, None] * stride_xt  # [BLOCK_M, 1]: each pair's token
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < HIDDEN
            x = tl.load(x_rows + k[None, :] * stride_xh, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            gate += dot(x, tl.load(gate_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0), IEEE, WIDEN)
            up += dot(x, tl.load(up_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0), IEEE, WIDEN)
        weight = tl.load(weights_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
        h = weight[:, None] * gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + rows[:, None] * INTER + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _tiled_down_kernel(h_ptr, offsets_ptr, d_ptr, out_ptr, stride_de, stride_dn, stride_dk,
                       HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """Program (expert e, tile of BLOCK_N hidden columns): ``h @ down.T`` for every BLOCK_M of e's pairs, in fp32
    rows ``[S, HIDDEN]`` of the grouped order (summed per token afterwards, `sum_by_token_triton`)."""
    e = tl.program_id(0).to(tl.int64)
    start, end = _expert_rows(offsets_ptr, e)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    down_cols = d_ptr + e * stride_de + n[None, :] * stride_dn
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < INTER
            h = tl.load(h_ptr + rows[:, None] * INTER + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            d = tl.load(down_cols + k[:, None] * stride_dk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += dot(h, d, IEEE, WIDEN)
        tl.store(out_ptr + rows[:, None] * HIDDEN + n[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])


def _tiles(value, default, name: str) -> tuple:
    tiles = tuple(value or default)
    if len(tiles) != 4 or any(t < 1 or t & (t - 1) for t in tiles) or min(tiles[:3]) < 16:
        raise ValueError(f"{name} must be (pairs, columns, chunk, warps), powers of two, the first three >= 16 "
                         f"(tl.dot's smallest); got {tiles}")
    return tiles


@on_device_of_first_tensor
def tiled_experts_triton(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor, transposed: bool = False, *,
                         gate_up_tiles: tuple | None = None, down_tiles: tuple | None = None) -> torch.Tensor:
    """`prompt_experts.tiled_experts_torch` in four launches: the pairs grouped by expert (`pair_order_triton`),
    the two kernels above, and the sum of each token's rows. ``gate_up_tiles`` / ``down_tiles`` override
    `TILED_GATE_UP` / `TILED_DOWN`."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    m_up, n_up, k_up, warps_up = _tiles(gate_up_tiles, TILED_GATE_UP, "gate_up_tiles")
    m_down, n_down, k_down, warps_down = _tiles(down_tiles, TILED_DOWN, "down_tiles")
    if num_tokens == 0 or top_k == 0 or inter == 0:
        return torch.zeros_like(hidden_states)
    perm, positions, offsets = pair_order_triton(top_k_index.reshape(-1), num_experts)
    # (expert, output row, reduction) strides of both layouts: the transposed one swaps the last two.
    w_e, w_n, w_k = gate_up_proj.stride()
    d_e, d_n, d_k = down_proj.stride()
    if transposed:
        w_n, w_k, d_n, d_k = w_k, w_n, d_k, d_n
    pairs = num_tokens * top_k
    ieee = hidden_states.dtype == torch.float32
    h = torch.empty(pairs, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    _tiled_gate_up_kernel[(num_experts, triton.cdiv(inter, n_up))](
        hidden_states, perm, top_k_weights.contiguous(), offsets, gate_up_proj, h,
        hidden_states.stride(0), hidden_states.stride(1), w_e, w_n, w_k,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, BLOCK_M=m_up, BLOCK_N=n_up, BLOCK_K=k_up, IEEE=ieee,
        WIDEN=INTERPRET, num_warps=warps_up,
    )
    rows = torch.empty(pairs, hidden, dtype=torch.float32, device=hidden_states.device)
    _tiled_down_kernel[(num_experts, triton.cdiv(hidden, n_down))](
        h, offsets, down_proj, rows, d_e, d_n, d_k,
        HIDDEN=hidden, INTER=inter, BLOCK_M=m_down, BLOCK_N=n_down, BLOCK_K=k_down, IEEE=ieee, WIDEN=INTERPRET,
        num_warps=warps_down,
    )
    return sum_by_token_triton(rows, positions, num_tokens, top_k, out_dtype=hidden_states.dtype)
