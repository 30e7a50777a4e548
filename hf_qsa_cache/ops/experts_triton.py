"""Triton version of `hf_qsa_cache.ops.experts.selected_experts_torch` (same arguments, same output).

Two launches, neither of which sorts, counts or gathers anything; each program reads the rows of the
one expert it works for, in place:

* `_gate_up_kernel`: one program per (token-expert pair ``s = t * top_k + j``, tile of ``BLOCK_N``
  intermediate columns) computes the gate and up rows of the tile against the token's hidden state
  (GEMVs: elementwise products accumulated over ``BLOCK_K`` chunks of the hidden size, summed along the
  chunk once at the end; ``tl.dot`` needs 16 rows and a pair has one token) and writes
  ``silu(gate) * up`` to an fp32 scratch ``[S, I]``.
* `_down_kernel`: one program per (token, tile of ``BLOCK_N`` hidden columns) runs the token's
  ``top_k`` experts one after the other, each the down rows of the tile against the pair's scratch row,
  scaled by its routing weight, and writes the fp32 sum cast to the input dtype. The sum over experts
  happens in registers: no atomics, a fixed order, the same result on every run.

With ``shared`` (`hf_qsa_cache.ops.experts.SharedExpert`: Qwen4Exp's shared expert, Inkling's shared
experts) the first kernel has ``S`` more pairs per token after the routed ones, reading the shared
experts' gate and up rows, and the second adds their down projections to each token's sum, weighted by
the given token weights or by ``sigmoid(x . gate_vector)`` (which every program of the token computes:
``HIDDEN`` values, a third launch saved). Upstream's block
runs the shared expert and its gate as seven launches of their own (the H200 profile), then weights and
adds the result. Launched early (the ``pdl`` setting), the programs of the shared experts ask for their weight
rows to be fetched into L2 before they wait for the kernel before them (`triton_common.prefetch_rows_l2`): those
weights, unlike a routed expert's, are known before the router has run.

A sentinel expert id (outside ``[0, num_experts)``: expert parallelism) runs no loop iterations in
either kernel and reads no expert weights: its scratch row is zeros and it adds nothing to its token's
output. Both weight layouts are the same kernels with other strides. The token count enters only the
grids (and per-token strides, not specialised), so a new batch size does not recompile. The tiles were
swept on the H200 at the benchmark shapes (hidden 2048, intermediate 512, 64 experts, top 10 or 6, shared
experts folded in; graph-timed, experts rotating so that L2 does not hold them): a one-token step (batch-1
decode) is fastest with wide reduction chunks and narrow down tiles, for both models; at 8 tokens the general
tiles stay best (`benchmarks/RESULTS.md`). ``block_n`` / ``block_k`` override both per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import l2_lines, on_device_of_first_tensor, pdl, pdl_begin, prefetch_rows_l2

# Launch policy (shapes only). Decode has few pairs, so narrow column tiles give the GPU enough programs.
GATE_UP_BLOCK_N = 16  # intermediate columns per program
DOWN_BLOCK_N = 16  # hidden columns per program
BLOCK_K = 128  # reduction chunk (hidden size in the first kernel, intermediate size in the second)
NUM_WARPS = 4
# One token: few programs, so each must keep more bytes in flight (gate-up columns, down columns, chunk, warps).
ONE_TOKEN_TILES = (16, 8, 512, 8)


@triton.jit
def _silu_gate_up(x_row, stride_xh, gate_rows, up_rows, stride_wk, n_ok, hi,
                  HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``silu(gate rows . x) * (up rows . x)`` for one tile of rows, reading ``hi`` (HIDDEN or 0) columns.
    Products accumulate elementwise over the chunks and are summed along the chunk once, at the end."""
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < HIDDEN
        x = tl.load(x_row + k * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_rows + k[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
        w_up = tl.load(up_rows + k[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
        gate += w_gate * x[None, :]
        up += w_up * x[None, :]
    g = tl.sum(gate, axis=1)
    return g * tl.sigmoid(g) * tl.sum(up, axis=1)


@triton.jit(do_not_specialize=["stride_xt", "stride_it", "stride_ht", "num_pairs"])
def _gate_up_kernel(
    x_ptr, idx_ptr, w_ptr, h_ptr, sg_ptr, su_ptr,
    stride_xt, stride_xh, stride_it, stride_ij,
    stride_we, stride_wn, stride_wk, stride_ht, stride_se, stride_sn, stride_sk,
    num_experts, num_pairs,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    SHARED_INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    s = tl.program_id(0).to(tl.int64)
    # Launched early: a shared pair's gate and up rows into L2 (a routed pair needs the router's ids first).
    if PDL and SHARED_INTER > 0 and LINES > 0:
        if s >= num_pairs:
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            expert = ((s - num_pairs) % SHARED) * stride_se
            prefetch_rows_l2(sg_ptr + expert, n, n < SHARED_INTER, stride_sn, HIDDEN, LINES)
            prefetch_rows_l2(su_ptr + expert, n, n < SHARED_INTER, stride_sn, HIDDEN, LINES)
    pdl_begin(PDL)
    if s < num_pairs:  # a routed (token, expert) pair
        t = s // TOP_K
        j = s % TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        e = tl.load(idx_ptr + t * stride_it + j * stride_ij).to(tl.int64)
        valid = (e >= 0) & (e < num_experts)
        # A sentinel reads no weights: no iterations, the accumulators stay 0, and silu(0) * 0 = 0.
        hi = tl.where(valid, HIDDEN, 0)
        e = tl.where(valid, e, 0)
        gate_rows = w_ptr + e * stride_we + n[:, None] * stride_wn  # [BLOCK_N, 1]: the gate half's rows
        up_rows = gate_rows + INTER * stride_wn  # the up half starts INTER rows further
        h = _silu_gate_up(x_ptr + t * stride_xt, stride_xh, gate_rows, up_rows, stride_wk, n_ok, hi,
                          HIDDEN, BLOCK_N, BLOCK_K)
    else:  # shared pair q = t * SHARED + shared expert (launched only with shared experts)
        q = s - num_pairs
        t = q // SHARED
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < SHARED_INTER
        rows = (q % SHARED) * stride_se + n[:, None] * stride_sn
        h = _silu_gate_up(x_ptr + t * stride_xt, stride_xh, sg_ptr + rows, su_ptr + rows, stride_sk, n_ok, HIDDEN,
                          HIDDEN, BLOCK_N, BLOCK_K)
    # fp32 scratch: the down projection reads exactly what was computed (the only rounding of the whole op
    # is the output's), and the scratch is small (pairs x intermediate size, next to megabytes of weights).
    tl.store(h_ptr + s * stride_ht + n, h, mask=n_ok)


@triton.jit
def _add_down(acc, h_row, weight, rows, stride_dk, n_ok, hi, INTER: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc`` plus one expert's down rows (a tile) times its scratch row scaled by ``weight``, over ``hi``
    (INTER or 0) columns; elementwise per chunk, summed by the caller once at the end."""
    for k0 in range(0, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < INTER
        h = tl.load(h_row + k, mask=k_ok, other=0.0) * weight
        mask = n_ok[:, None] & k_ok[None, :]
        d = tl.load(rows + k[None, :] * stride_dk, mask=mask, other=0.0).to(tl.float32)
        acc += d * h[None, :]
    return acc


@triton.jit(do_not_specialize=["stride_it", "stride_pt", "stride_ht", "stride_ot", "stride_xt", "num_pairs"])
def _down_kernel(
    h_ptr, idx_ptr, wt_ptr, d_ptr, out_ptr, x_ptr, sgate_ptr, sd_ptr, sw_ptr,
    stride_it, stride_ij, stride_pt, stride_pj, stride_ht,
    stride_de, stride_dn, stride_dk, stride_ot, stride_oh,
    stride_xt, stride_xh, stride_sde, stride_sdn, stride_sdk, stride_swt,
    num_experts, num_pairs,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    SHARED_INTER: tl.constexpr, GATE_VECTOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LINES: tl.constexpr, PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    if PDL and SHARED_INTER > 0 and LINES > 0:  # launched early: the tile's shared down rows into L2
        for si in tl.static_range(SHARED):
            prefetch_rows_l2(sd_ptr + si * stride_sde, n, n_ok, stride_sdn, SHARED_INTER, LINES)
    pdl_begin(PDL)
    # As in the first kernel, one sum along the chunk at the end, over all the token's experts: each
    # expert's scratch row is scaled by its routing weight as it is loaded.
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for j in range(TOP_K):
        e = tl.load(idx_ptr + t * stride_it + j * stride_ij).to(tl.int64)
        valid = (e >= 0) & (e < num_experts)
        w = tl.load(wt_ptr + t * stride_pt + j * stride_pj).to(tl.float32)
        hi = tl.where(valid, INTER, 0)  # a sentinel runs no iterations (its routing weight goes unused)
        e = tl.where(valid, e, 0)
        rows = d_ptr + e * stride_de + n[:, None] * stride_dn  # [BLOCK_N, 1]
        acc = _add_down(acc, h_ptr + (t * TOP_K + j) * stride_ht, w, rows, stride_dk, n_ok, hi, INTER, BLOCK_K)
    if SHARED_INTER > 0:
        gated = 0.0
        if GATE_VECTOR:
            # One shared expert weighted by sigmoid(x_t . gate): every program of the token computes that dot
            # product (HIDDEN values, read from L2 after the first) rather than a third launch.
            dot = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < HIDDEN
                x = tl.load(x_ptr + t * stride_xt + k * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
                dot += x * tl.load(sgate_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            gated = tl.sigmoid(tl.sum(dot, axis=0))
        for si in tl.static_range(SHARED):
            if GATE_VECTOR:
                w = gated
            else:  # the token's weight for this shared expert, given
                w = tl.load(sw_ptr + t * stride_swt + si).to(tl.float32)
            acc = _add_down(acc, h_ptr + (num_pairs + t * SHARED + si) * stride_ht, w,
                            sd_ptr + si * stride_sde + n[:, None] * stride_sdn, stride_sdk, n_ok, SHARED_INTER,
                            SHARED_INTER, BLOCK_K)
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t * stride_ot + n * stride_oh, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def _block(value: int | None, default: int, name: str) -> int:
    value = default if value is None else value
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


@on_device_of_first_tensor
def selected_experts_triton(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            gate_up_proj: torch.Tensor, down_proj: torch.Tensor, transposed: bool = False,
                            shared=None, *, block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """`hf_qsa_cache.ops.experts.selected_experts_torch` in two launches (see there for shapes, and for
    ``shared``: the shared expert's pairs follow the routed ones in the first kernel, and the second adds
    them to each token's sum). ``block_n`` / ``block_k`` (powers of two) override both kernels' column
    tile and reduction chunk."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    n_shared, shared_inter = (shared.gate.shape[0], shared.gate.shape[1]) if shared is not None else (0, 0)
    out = torch.empty_like(hidden_states)
    if num_tokens == 0 or hidden == 0:
        return out
    if (top_k == 0 or inter == 0) and not shared_inter:
        return out.zero_()
    assert top_k_index.shape == top_k_weights.shape == (num_tokens, top_k)
    # (expert, output row, reduction) strides of both layouts: the transposed one swaps the last two.
    w_e, w_n, w_k = gate_up_proj.stride()
    d_e, d_n, d_k = down_proj.stride()
    if transposed:
        w_n, w_k, d_n, d_k = w_k, w_n, d_k, d_n
    gate_vector = shared is not None and shared.gate_vector is not None
    if shared_inter:
        # One set of strides serves the gate and up rows; the gate vector is read with unit stride.
        shared_gate, shared_up, shared_down = shared.gate.contiguous(), shared.up.contiguous(), shared.down
        shared_vec = shared.gate_vector.reshape(-1).contiguous() if gate_vector else gate_up_proj
        token_weights = shared.token_weights.contiguous() if not gate_vector else top_k_weights
        assert gate_vector or token_weights.shape == (num_tokens, n_shared)
    else:  # unused pointers (never dereferenced: SHARED_INTER = 0 leaves their code out)
        shared_gate = shared_up = shared_down = shared_vec = gate_up_proj
        token_weights = top_k_weights
    gate_up_n, down_n, chunk, warps = (ONE_TOKEN_TILES if num_tokens == 1 else
                                       (GATE_UP_BLOCK_N, DOWN_BLOCK_N, BLOCK_K, NUM_WARPS))
    gate_up_n = _block(block_n, gate_up_n, "block_n")
    down_n = _block(block_n, down_n, "block_n")
    chunk = _block(block_k, chunk, "block_k")
    pairs = num_tokens * top_k
    rows = pairs + (num_tokens * n_shared if shared_inter else 0)
    scratch = torch.empty(rows, max(inter, shared_inter), dtype=torch.float32, device=hidden_states.device)
    _gate_up_kernel[(rows, triton.cdiv(max(inter, shared_inter), gate_up_n))](
        hidden_states, top_k_index, gate_up_proj, scratch, shared_gate, shared_up,
        hidden_states.stride(0), hidden_states.stride(1), top_k_index.stride(0), top_k_index.stride(1),
        w_e, w_n, w_k, scratch.stride(0), *shared_gate.stride()[-3:],
        num_experts, pairs,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED=max(n_shared, 1), SHARED_INTER=shared_inter,
        BLOCK_N=gate_up_n, BLOCK_K=chunk, LINES=l2_lines(hidden, shared_gate.dtype) if shared_inter else 0,
        num_warps=warps, **pdl(hidden_states),
    )
    _down_kernel[(num_tokens, triton.cdiv(hidden, down_n))](
        scratch, top_k_index, top_k_weights, down_proj, out, hidden_states, shared_vec, shared_down, token_weights,
        top_k_index.stride(0), top_k_index.stride(1), top_k_weights.stride(0), top_k_weights.stride(1),
        scratch.stride(0), d_e, d_n, d_k, out.stride(0), out.stride(1),
        hidden_states.stride(0), hidden_states.stride(1), *shared_down.stride()[-3:], token_weights.stride(0),
        num_experts, pairs,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED=max(n_shared, 1), SHARED_INTER=shared_inter,
        GATE_VECTOR=gate_vector, BLOCK_N=down_n, BLOCK_K=chunk,
        LINES=l2_lines(shared_inter, shared_down.dtype) if shared_inter and shared_down.stride(-1) == 1 else 0,
        num_warps=warps, **pdl(scratch),
    )
    return out
