"""Triton versions of `hf_qsa_cache.ops.prompt_experts`' two elementwise passes (same arithmetic and rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor


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
                        block: int = 1024) -> torch.Tensor:
    """`prompt_experts.sum_by_token_torch` in one launch, one program per (token, block of features)."""
    rows, positions = rows.contiguous(), positions.contiguous()
    H = rows.shape[-1]
    out = torch.empty(num_tokens, H, dtype=rows.dtype, device=rows.device)
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
