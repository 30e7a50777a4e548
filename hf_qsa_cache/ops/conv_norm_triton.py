"""Triton kernels for `hf_qsa_cache.ops.conv_norm` (same arguments and results as its torch specifications).

`_attention_inputs_kernel` runs one program per (token, head): the first ``Hq`` heads of a token norm the query,
the next ``Hkv`` convolve and norm the key, the last ``Hkv`` convolve the value. `_conv_add_rms_norm_kernel` runs
one program per token over all its channels: the conv, the residual add, the norm. A conv's taps come from this
step's input (positions at or past the row's earlier length) or from the paged store (earlier positions), as in
`hf_qsa_cache.ops.sconv_triton`; each program also writes its token's input to the store. Taps read from
the store belong to earlier steps, which no program of this launch writes: with the step metadata and the conv
weights they are read before the kernel's early-launch wait (`_conv_history`), the rest after it (`_conv_taps`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import TL_DTYPES, norm_weight, on_device_of_first_tensor, pdl, pdl_begin


@triton.jit
def _conv_history(t, c, cm, w_ptr, store_ptr, store_s0, store_s1, width, table_ptr, table_s0, table_cols, pos_ptr,
                  prev_ptr, query_len, block_size, K: tl.constexpr):
    """Token ``t``'s conv over its taps from the paged store (positions before the row's earlier length) at
    channels ``c`` (``cm``: real ones), in fp32 (a tap from this step's input adds 0 here: `_conv_taps` adds it);
    with the token's position and its row's earlier length (per lane). Reads only step metadata, weights and what
    earlier steps stored: safe before `pdl_begin` (see there)."""
    row = t // query_len
    lanes = tl.zeros(c.shape, dtype=tl.int32)  # the token's scalars loaded per lane: masks stay vectors
    p = tl.load(pos_ptr + t + lanes)
    prev = tl.load(prev_ptr + row + lanes).to(tl.int64)
    store_col = (c // width) * store_s1 + c % width
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(K):
        src = p - (K - 1 - j)
        in_store = (p >= 0) & (src >= 0) & (src < prev)
        w = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        safe = tl.maximum(src, 0)
        col = tl.minimum(safe // block_size, table_cols - 1)
        block = tl.load(table_ptr + row * table_s0 + col, mask=cm & in_store, other=0).to(tl.int64)
        slot = block * block_size + safe % block_size
        tap = tl.load(store_ptr + slot * store_s0 + store_col, mask=cm & in_store, other=0.0)
        acc = acc + tap.to(tl.float32) * w
    return acc, p, prev


@triton.jit
def _conv_taps(history, x_ptr, t, c, cm, x_row, w_ptr, store_ptr, store_s0, store_s1, width, slots_ptr,
               K: tl.constexpr):
    """`_conv_history` plus the taps from this step's input ``x`` and the input itself (the conv's residual), in
    fp32; writes the input to the token's slot (a pad's slot -1 goes to the null block). The sum runs in tap
    order as one loop over all taps would: a token's store taps all precede its input taps."""
    acc, p, prev = history
    t64 = t.to(tl.int64)
    lanes = tl.zeros(c.shape, dtype=tl.int32)
    x_raw = tl.load(x_ptr + t64 * x_row + c, mask=cm, other=0.0)
    for j in tl.static_range(K):
        back = K - 1 - j
        in_x = (p >= 0) & (p - back >= prev)
        w = tl.load(w_ptr + c * K + j, mask=cm & in_x, other=0.0).to(tl.float32)
        tap = tl.load(x_ptr + (t64 - back) * x_row + c, mask=cm & in_x, other=0.0)
        acc = acc + tap.to(tl.float32) * w
    out_slot = tl.maximum(tl.load(slots_ptr + t + lanes), 0)
    tl.store(store_ptr + out_slot * store_s0 + (c // width) * store_s1 + c % width,
             x_raw.to(store_ptr.dtype.element_ty), mask=cm)
    return acc + x_raw.to(tl.float32)


@triton.jit
def _rms_normed(h, w, n, eps, PRODUCT: tl.constexpr):
    """``w * norm(h)`` over ``h``'s ``n`` real lanes (masked lanes hold 0; ``w`` from `norm_weight`), with
    `add_rms_norm_torch`'s rounding: the normed value in ``h``'s dtype, the product in ``PRODUCT``."""
    widened = h.to(tl.float32)
    normed = (widened * tl.rsqrt(tl.sum(widened * widened, axis=0) / n + eps)).to(h.dtype)
    return (w * normed.to(tl.float32)).to(PRODUCT)


@triton.jit(do_not_specialize=["table_s0", "table_cols", "query_len"])
def _attention_inputs_kernel(
    q_ptr, k_ptr, v_ptr, q_out, k_out, v_out, q_norm_ptr, k_norm_ptr, q_eps, k_eps,
    k_conv_ptr, k_store, k_s0, k_s1, k_width, v_conv_ptr, v_store, v_s0, v_s1, v_width,
    table_ptr, table_s0, table_cols, slots_ptr, pos_ptr, prev_ptr, query_len, block_size,
    HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr, K: tl.constexpr,
    Q_PRODUCT: tl.constexpr, K_PRODUCT: tl.constexpr, PDL: tl.constexpr = False,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    t64 = t.to(tl.int64)
    d = tl.arange(0, HD_PAD)
    dm = d < HD
    # Before the wait, the conv's store taps (a key head's, a value head's, none for a query head) and the norm's
    # weight (a query head's, a key head's).
    if g < HQ:
        w = norm_weight(q_norm_ptr, d, dm)
    elif g < HQ + HKV:
        w = norm_weight(k_norm_ptr, d, dm)
    else:  # (a value head has no norm)
        w = tl.zeros([HD_PAD], tl.float32)
    if g < HQ + HKV:
        c = (g - HQ) * HD + d
        history = _conv_history(t, c, dm & (d * 0 + g >= HQ), k_conv_ptr, k_store, k_s0, k_s1, k_width, table_ptr,
                                table_s0, table_cols, pos_ptr, prev_ptr, query_len, block_size, K)
    else:
        c = (g - HQ - HKV) * HD + d
        history = _conv_history(t, c, dm, v_conv_ptr, v_store, v_s0, v_s1, v_width, table_ptr, table_s0, table_cols,
                                pos_ptr, prev_ptr, query_len, block_size, K)
    pdl_begin(PDL)
    if g < HQ:
        x = tl.load(q_ptr + t64 * (HQ * HD) + g * HD + d, mask=dm, other=0.0)
        tl.store(q_out + t64 * (HQ * HD) + g * HD + d, _rms_normed(x, w, HD, q_eps, Q_PRODUCT),
                 mask=dm)
    elif g < HQ + HKV:
        key = _conv_taps(history, k_ptr, t, c, dm, HKV * HD, k_conv_ptr, k_store, k_s0, k_s1, k_width, slots_ptr,
                         K).to(k_ptr.dtype.element_ty)
        tl.store(k_out + t64 * (HKV * HD) + c, _rms_normed(key, w, HD, k_eps, K_PRODUCT), mask=dm)
    else:
        value = _conv_taps(history, v_ptr, t, c, dm, HKV * HD, v_conv_ptr, v_store, v_s0, v_s1, v_width, slots_ptr,
                           K)
        tl.store(v_out + t64 * (HKV * HD) + c, value.to(v_out.dtype.element_ty), mask=dm)


@triton.jit(do_not_specialize=["table_s0", "table_cols", "query_len"])
def _conv_add_rms_norm_kernel(
    x_ptr, residual_ptr, h_ptr, out_ptr, norm_ptr, eps, conv_ptr, store_ptr, store_s0, store_s1, width,
    table_ptr, table_s0, table_cols, slots_ptr, pos_ptr, prev_ptr, query_len, block_size,
    C: tl.constexpr, C_PAD: tl.constexpr, K: tl.constexpr, RESIDUAL: tl.constexpr, PRODUCT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    c = tl.arange(0, C_PAD)
    cm = c < C
    history = _conv_history(t, c, cm, conv_ptr, store_ptr, store_s0, store_s1, width, table_ptr, table_s0, table_cols,
                            pos_ptr, prev_ptr, query_len, block_size, K)
    w = norm_weight(norm_ptr, c, cm)
    pdl_begin(PDL)
    h = _conv_taps(history, x_ptr, t, c, cm, C, conv_ptr, store_ptr, store_s0, store_s1, width, slots_ptr,
                   K).to(h_ptr.dtype.element_ty)
    if RESIDUAL:
        # As torch adds two tensors of the activations' dtype: in fp32, rounded once.
        h = (tl.load(residual_ptr + t64 * C + c, mask=cm, other=0.0).to(tl.float32) + h.to(tl.float32))
        h = h.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + t64 * C + c, h, mask=cm)
    tl.store(out_ptr + t64 * C + c, _rms_normed(h, w, C, eps, PRODUCT), mask=cm)


def _shared_step_args(*taps) -> list:
    """The block table, slots, positions, lengths and columns the convs of one launch share (refused otherwise)."""
    first = taps[0]
    for other in taps[1:]:
        if not all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(first[2:], other[2:])):
            raise ValueError("the convs of one fused launch must share the conv store's table and step metadata")
    table = first.table.contiguous()
    return [table, table.stride(0), table.shape[1], first.slots.contiguous(), first.position.contiguous(),
            first.prev_len.contiguous(), first.query_len, first.block_size]


def _stream_args(taps) -> list:
    store = taps.store
    if store.stride(2) != 1:
        raise ValueError("the conv store's channel dim must be contiguous")
    return [taps.weight.contiguous(), store, store.stride(0), store.stride(1), store.shape[2]]


@on_device_of_first_tensor
def attention_inputs_triton(q, k, v, k_taps, v_taps, q_norm_weight, q_eps, k_norm_weight, k_eps, head_dim, *,
                            num_warps: int = 1):
    """`conv_norm.attention_inputs_torch` in one launch (``num_warps`` a program: a head's features)."""
    T = q.shape[0]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    hq, hkv = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out = torch.empty(T, hq, head_dim, dtype=torch.promote_types(q.dtype, q_norm_weight.dtype), device=q.device)
    k_out = torch.empty(T, hkv, head_dim, dtype=torch.promote_types(k.dtype, k_norm_weight.dtype), device=k.device)
    v_out = torch.empty(T, hkv, head_dim, dtype=v.dtype, device=v.device)
    if T:
        _attention_inputs_kernel[(T, hq + 2 * hkv)](
            q, k, v, q_out, k_out, v_out, q_norm_weight, k_norm_weight, float(q_eps), float(k_eps),
            *_stream_args(k_taps), *_stream_args(v_taps), *_shared_step_args(k_taps, v_taps),
            HQ=hq, HKV=hkv, HD=head_dim, HD_PAD=triton.next_power_of_2(head_dim), K=k_taps.weight.shape[1],
            Q_PRODUCT=TL_DTYPES[q_out.dtype], K_PRODUCT=TL_DTYPES[k_out.dtype], num_warps=num_warps, **pdl(q),
        )
    return q_out, k_out, v_out


@on_device_of_first_tensor
def conv_add_rms_norm_triton(x, taps, residual, norm_weight, eps, *, num_warps: int | None = None):
    """`conv_norm.conv_add_rms_norm_torch` in one launch, one program per token (``num_warps`` a program;
    default one warp per 128 channels, at most 16: the widest setting was the fastest at one and at 32 tokens,
    `benchmarks/check_fused_kernels.py --conv-norm-sweep`)."""
    T, C = x.shape
    x = x.contiguous()
    h = torch.empty_like(x)
    out = torch.empty(T, C, dtype=torch.promote_types(x.dtype, norm_weight.dtype), device=x.device)
    if T:
        _conv_add_rms_norm_kernel[(T,)](
            x, x if residual is None else residual.contiguous(), h, out, norm_weight, float(eps),
            *_stream_args(taps), *_shared_step_args(taps),
            C=C, C_PAD=triton.next_power_of_2(C), K=taps.weight.shape[1], RESIDUAL=residual is not None,
            PRODUCT=TL_DTYPES[out.dtype], num_warps=num_warps or min(16, max(1, C // 128)), **pdl(x),
        )
    return h, out
