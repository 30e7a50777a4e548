"""Expert-major Triton version of `hf_qsa_cache.ops.experts.selected_experts_torch`, for steps of several
tokens (same arguments, same output).

The pair-major kernels (`experts_triton`) read one expert's rows per (token, expert) pair, so a step of
``T`` tokens reads ``T * top_k`` expert matrices. From a few tokens on that is more than every expert the
step touches: Qwen4Exp's 8-token step has 80 pairs over about 47 distinct experts of 64, Inkling's 32-row
decode step 192 pairs over about 61. transformers' ``grouped_mm`` reads each expert once, but first sorts
the pairs and counts them per expert (at 32 tokens the sort alone took 27 us a layer on the H200, beside a
gather and an unsort). Here, three launches and no sort:

* `_by_expert_gate_up_kernel`: one program per (expert, tile of intermediate columns) finds the tokens
  routed to its expert by comparing the ``[T, top_k]`` routing table with its id, runs the gate and up rows
  of its tile against all ``T`` tokens at once (``tl.dot``, tokens padded to 16) and stores
  ``silu(gate) * up`` of the routed tokens in their pairs' fp32 scratch rows (``t * top_k + j``, as the
  pair-major kernels). An expert no token chose reads no weights. Shared experts are programs after the
  routed ones, with every token routed to them. The programs of the first column tile also write the
  expert's row of a slot table (each token's scratch row, or -1), which the next kernel reads.
* `_by_expert_down_kernel`: one program per (tile of hidden columns, range of experts) adds, over its
  experts, ``routing weight * scratch rows @ down rows`` for all tokens at once into an fp32 sum; the
  shared experts' terms go to the last range. With one range it writes the output itself.
* `_sum_ranges_kernel`: the ranges' sums added in a fixed order and rounded once to the output dtype.

No atomics: the same result on every run. Precision: the gate-up products are exact (bf16 times bf16 in an
fp32 accumulator; fp32 inputs use IEEE fp32 dots). The down projection's left operand, an fp32 scratch
value times its routing weight, is passed to a bf16/fp16 ``tl.dot`` as two terms of the weights' dtype
(the value rounded, then the rest rounded): about 16 bits of the fp32 value, far below the output's own
rounding, where one term would round it to bf16 first as transformers' experts do.

Used for ``T`` from `BY_EXPERT_MIN_TOKENS` to `BY_EXPERT_MAX_TOKENS` tokens when the hidden states have
the weights' dtype (`by_expert_applies`); the ``experts_by_expert`` fusion switches it
(`hf_qsa_cache.ops.experts`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, dot, on_device_of_first_tensor, pow2

BY_EXPERT_MIN_TOKENS = 4  # below, the pairs read fewer bytes than the experts they touch (top 6-10 of 64)
BY_EXPERT_MAX_TOKENS = 64  # the tokens of a step sit in one tile of registers
# Launch policy (shapes only): gate-up columns, reduction chunk, warps; down columns, chunk, expert ranges, warps.
GATE_UP_TILES = (32, 128, 4)
DOWN_TILES = (32, 128, 4, 4)


@triton.jit
def _gate_up_tile(x_ptr, stride_xt, stride_xh, t, t_ok, gate_rows, up_rows, stride_wk, n_ok, hi,
                  HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """``silu(x @ gate_rows.T) * (x @ up_rows.T)`` ``[BLOCK_T, BLOCK_N]`` in fp32 over ``hi`` (HIDDEN or 0)
    reduction columns; ``gate_rows`` / ``up_rows`` point at the tile's rows ``[BLOCK_N]``."""
    gate = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < HIDDEN
        x = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :] * stride_xh, mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(gate_rows[None, :] + k[:, None] * stride_wk, mask=mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(up_rows[None, :] + k[:, None] * stride_wk, mask=mask, other=0.0)
        gate += dot(x, w_gate, IEEE, WIDEN)
        up += dot(x, w_up, IEEE, WIDEN)
    return gate * tl.sigmoid(gate) * up


@triton.jit(do_not_specialize=["num_tokens", "num_pairs", "stride_xt", "stride_it", "stride_ht"])
def _by_expert_gate_up_kernel(
    x_ptr, idx_ptr, w_ptr, h_ptr, slot_ptr, sg_ptr, su_ptr,
    stride_xt, stride_xh, stride_it, stride_ij, stride_we, stride_wn, stride_wk, stride_ht, stride_slot,
    stride_se, stride_sn, stride_sk,
    num_experts, num_tokens, num_pairs,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    SHARED_INTER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    if e < num_experts:
        j = tl.arange(0, BLOCK_J)
        ids = tl.load(idx_ptr + t[:, None] * stride_it + j[None, :] * stride_ij,
                      mask=t_ok[:, None] & (j[None, :] < TOP_K), other=-1)
        hit = ids == e  # a token chooses an expert at most once; a sentinel id matches no expert
        routed = tl.sum(hit.to(tl.int32), axis=1) > 0
        rows = t * TOP_K + tl.sum(tl.where(hit, j[None, :], 0), axis=1)  # the pair's scratch row
        if tl.program_id(1) == 0:
            tl.store(slot_ptr + e * stride_slot + t, tl.where(routed, rows, -1), mask=t_ok)
        n_ok = n < INTER
        gate_rows = w_ptr + e.to(tl.int64) * stride_we + n * stride_wn
        # An expert no token chose runs no iterations: its weights are not read.
        hi = tl.where(tl.max(routed.to(tl.int32), axis=0) > 0, HIDDEN, 0)
        h = _gate_up_tile(x_ptr, stride_xt, stride_xh, t, t_ok, gate_rows, gate_rows + INTER * stride_wn,
                          stride_wk, n_ok, hi, HIDDEN, BLOCK_T, BLOCK_N, BLOCK_K, IEEE, WIDEN)
        tl.store(h_ptr + rows[:, None] * stride_ht + n[None, :], h, mask=(routed & t_ok)[:, None] & n_ok[None, :])
    else:  # shared expert s: every token, scratch rows after the routed pairs (row = pairs + t * SHARED + s)
        s = e - num_experts
        n_ok = n < SHARED_INTER
        rows = num_pairs + t * SHARED + s
        offset = s * stride_se + n * stride_sn
        h = _gate_up_tile(x_ptr, stride_xt, stride_xh, t, t_ok, sg_ptr + offset, su_ptr + offset, stride_sk,
                          n_ok, HIDDEN, HIDDEN, BLOCK_T, BLOCK_N, BLOCK_K, IEEE, WIDEN)
        tl.store(h_ptr + rows[:, None] * stride_ht + n[None, :], h, mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _add_down_tile(acc, h_ptr, rows, stride_ht, use, weight, down_rows, stride_dk, n_ok, hi,
                   INTER: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """``acc`` plus ``(weight * scratch rows) @ down_rows.T`` over ``hi`` (INTER or 0) reduction columns; rows
    where ``use`` is false add nothing. Non-IEEE: the fp32 left operand as two terms of the weights' dtype."""
    for k0 in range(0, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < INTER
        h = tl.load(h_ptr + rows[:, None] * stride_ht + k[None, :], mask=use[:, None] & k_ok[None, :], other=0.0)
        h = h * weight[:, None]
        d = tl.load(down_rows[None, :] + k[:, None] * stride_dk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += dot(h, d, IEEE, WIDEN)
        else:
            high = h.to(d.dtype)
            low = (h - high.to(tl.float32)).to(d.dtype)
            acc += dot(high, d, IEEE, WIDEN) + dot(low, d, IEEE, WIDEN)
    return acc


@triton.jit(do_not_specialize=["num_tokens", "num_pairs", "stride_ht", "stride_pt", "stride_xt", "stride_swt",
                               "stride_rt"])
def _by_expert_down_kernel(
    h_ptr, slot_ptr, wt_ptr, d_ptr, sum_ptr, x_ptr, sgate_ptr, sd_ptr, sw_ptr,
    stride_ht, stride_slot, stride_pt, stride_pj, stride_de, stride_dn, stride_dk,
    stride_rr, stride_rt, stride_rh, stride_xt, stride_xh, stride_sde, stride_sdn, stride_sdk, stride_swt,
    num_experts, num_tokens, num_pairs, experts_per_range,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    SHARED_INTER: tl.constexpr, GATE_VECTOR: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    r = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    first = r * experts_per_range
    for e in range(first, tl.minimum(first + experts_per_range, num_experts)):
        rows = tl.load(slot_ptr + e * stride_slot + t, mask=t_ok, other=-1)
        routed = rows >= 0
        rows = tl.where(routed, rows, 0)
        j = rows - t * TOP_K
        w = tl.load(wt_ptr + t * stride_pt + j * stride_pj, mask=routed, other=0.0).to(tl.float32)
        hi = tl.where(tl.max(routed.to(tl.int32), axis=0) > 0, INTER, 0)  # no token routed here: no reads
        acc = _add_down_tile(acc, h_ptr, rows, stride_ht, routed, w, d_ptr + tl.cast(e, tl.int64) * stride_de
                             + n * stride_dn, stride_dk, n_ok, hi, INTER, BLOCK_K, IEEE, WIDEN)
    if SHARED_INTER > 0:
        if r == tl.num_programs(1) - 1:  # the shared experts' terms, once: in the last range
            gated = tl.zeros([BLOCK_T], tl.float32)
            if GATE_VECTOR:  # one shared expert weighted by sigmoid(x_t . gate_vector)
                dots = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
                for k0 in range(0, HIDDEN, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = k < HIDDEN
                    x = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :] * stride_xh,
                                mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    dots += x * tl.load(sgate_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                gated = tl.sigmoid(tl.sum(dots, axis=1))
            for si in tl.static_range(SHARED):
                if GATE_VECTOR:
                    w = gated
                else:  # the token's given weight for this shared expert
                    w = tl.load(sw_ptr + t * stride_swt + si, mask=t_ok, other=0.0).to(tl.float32)
                acc = _add_down_tile(acc, h_ptr, num_pairs + t * SHARED + si, stride_ht, t_ok, w,
                                     sd_ptr + si * stride_sde + n * stride_sdn, stride_sdk, n_ok, SHARED_INTER,
                                     SHARED_INTER, BLOCK_K, IEEE, WIDEN)
    tl.store(sum_ptr + r * stride_rr + t[:, None] * stride_rt + n[None, :] * stride_rh,
             acc.to(sum_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["stride_rt", "stride_ot"])
def _sum_ranges_kernel(sum_ptr, out_ptr, stride_rr, stride_rt, stride_ot, stride_oh,
                       HIDDEN: tl.constexpr, RANGES: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < HIDDEN
    total = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(RANGES):
        total += tl.load(sum_ptr + r * stride_rr + t * stride_rt + n, mask=n_ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + n * stride_oh, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def by_expert_applies(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """Whether a step of these hidden states ``[T, H]`` runs expert-major: ``T`` within
    [`BY_EXPERT_MIN_TOKENS`, `BY_EXPERT_MAX_TOKENS`] and the weights' dtype (``tl.dot`` takes one dtype)."""
    return (BY_EXPERT_MIN_TOKENS <= hidden_states.shape[0] <= BY_EXPERT_MAX_TOKENS
            and hidden_states.dtype == gate_up_proj.dtype)


def _tile(value: int, name: str) -> int:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value}")
    return value


@on_device_of_first_tensor
def selected_experts_by_expert_triton(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                      top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                                      down_proj: torch.Tensor, transposed: bool = False, shared=None, *,
                                      gate_up_tiles: tuple | None = None,
                                      down_tiles: tuple | None = None) -> torch.Tensor:
    """`hf_qsa_cache.ops.experts.selected_experts_torch` expert-major, in two or three launches (see the
    module's docstring). ``gate_up_tiles`` ``(columns, chunk, warps)`` and ``down_tiles`` ``(columns, chunk,
    ranges, warps)`` override `GATE_UP_TILES` / `DOWN_TILES` (columns and chunks powers of two >= 16)."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    n_shared, shared_inter = (shared.gate.shape[0], shared.gate.shape[1]) if shared is not None else (0, 0)
    if num_tokens > BY_EXPERT_MAX_TOKENS:
        raise ValueError(f"the expert-major kernels take at most {BY_EXPERT_MAX_TOKENS} tokens, got {num_tokens}")
    if hidden_states.dtype != gate_up_proj.dtype:
        raise ValueError(f"hidden states ({hidden_states.dtype}) must have the experts' dtype ({gate_up_proj.dtype})")
    out = torch.empty_like(hidden_states)
    if num_tokens == 0 or hidden == 0:
        return out
    if (top_k == 0 or inter == 0) and not shared_inter:
        return out.zero_()
    assert top_k_index.shape == top_k_weights.shape == (num_tokens, top_k)
    w_e, w_n, w_k = gate_up_proj.stride()
    d_e, d_n, d_k = down_proj.stride()
    if transposed:  # (expert, output row, reduction) strides of both layouts: the transposed one swaps the last two
        w_n, w_k, d_n, d_k = w_k, w_n, d_k, d_n
    gate_vector = shared is not None and shared.gate_vector is not None
    if shared_inter:
        shared_gate, shared_up, shared_down = shared.gate.contiguous(), shared.up.contiguous(), shared.down
        shared_vec = shared.gate_vector.reshape(-1).contiguous() if gate_vector else gate_up_proj
        token_weights = shared.token_weights.contiguous() if not gate_vector else top_k_weights
        assert gate_vector or token_weights.shape == (num_tokens, n_shared)
    else:  # unused pointers (never dereferenced: SHARED_INTER = 0 leaves their code out)
        shared_gate = shared_up = shared_down = shared_vec = gate_up_proj
        token_weights = top_k_weights
    gate_up_n, gate_up_k, gate_up_warps = gate_up_tiles or GATE_UP_TILES
    down_n, down_k, ranges, down_warps = down_tiles or DOWN_TILES
    gate_up_n, gate_up_k = _tile(gate_up_n, "gate-up columns"), _tile(gate_up_k, "gate-up chunk")
    down_n, down_k = _tile(down_n, "down columns"), _tile(down_k, "down chunk")
    ranges = max(1, min(ranges, num_experts))
    per_range = triton.cdiv(num_experts, ranges)
    ranges = triton.cdiv(num_experts, per_range)  # no empty range
    ieee = gate_up_proj.dtype == torch.float32
    block_t, block_j = pow2(num_tokens), triton.next_power_of_2(top_k)
    device = hidden_states.device
    pairs = num_tokens * top_k
    scratch = torch.empty(pairs + num_tokens * n_shared, max(inter, shared_inter), dtype=torch.float32, device=device)
    slots = torch.empty(num_experts, num_tokens, dtype=torch.int32, device=device)
    programs = num_experts + (n_shared if shared_inter else 0)
    _by_expert_gate_up_kernel[(programs, triton.cdiv(max(inter, shared_inter), gate_up_n))](
        hidden_states, top_k_index, gate_up_proj, scratch, slots, shared_gate, shared_up,
        hidden_states.stride(0), hidden_states.stride(1), top_k_index.stride(0), top_k_index.stride(1),
        w_e, w_n, w_k, scratch.stride(0), slots.stride(0), *shared_gate.stride()[-3:],
        num_experts, num_tokens, pairs,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED=max(n_shared, 1), SHARED_INTER=shared_inter,
        BLOCK_T=block_t, BLOCK_J=block_j, BLOCK_N=gate_up_n, BLOCK_K=gate_up_k, IEEE=ieee, WIDEN=INTERPRET,
        num_warps=gate_up_warps,
    )
    sums = out if ranges == 1 else torch.empty(ranges, num_tokens, hidden, dtype=torch.float32, device=device)
    sum_strides = (0, *out.stride()) if ranges == 1 else sums.stride()
    _by_expert_down_kernel[(triton.cdiv(hidden, down_n), ranges)](
        scratch, slots, top_k_weights, down_proj, sums, hidden_states, shared_vec, shared_down, token_weights,
        scratch.stride(0), slots.stride(0), top_k_weights.stride(0), top_k_weights.stride(1), d_e, d_n, d_k,
        *sum_strides, hidden_states.stride(0), hidden_states.stride(1), *shared_down.stride()[-3:],
        token_weights.stride(0),
        num_experts, num_tokens, pairs, per_range,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED=max(n_shared, 1), SHARED_INTER=shared_inter,
        GATE_VECTOR=gate_vector, BLOCK_T=block_t, BLOCK_N=down_n, BLOCK_K=down_k, IEEE=ieee, WIDEN=INTERPRET,
        num_warps=down_warps,
    )
    if ranges > 1:
        block = min(1024, triton.next_power_of_2(hidden))
        _sum_ranges_kernel[(num_tokens, triton.cdiv(hidden, block))](
            sums, out, sums.stride(0), sums.stride(1), out.stride(0), out.stride(1),
            HIDDEN=hidden, RANGES=ranges, BLOCK=block, num_warps=4,
        )
    return out
