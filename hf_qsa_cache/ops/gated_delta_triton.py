"""Triton versions of `hf_qsa_cache.ops.gated_delta`'s fused ops (same arithmetic and rounding points)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import TL_DTYPES, on_device_of_first_tensor, pdl, pdl_begin


@triton.jit
def _softplus(x):
    # torch's softplus (beta 1, threshold 20): the identity above 20.
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit(do_not_specialize=["num_tokens"])
def _delta_gates_kernel(b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, valid_ptr, beta_ptr, g_ptr, num_tokens,
                        H: tl.constexpr, H_PAD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    ok = h < H
    real = tl.load(valid_ptr + t) != 0
    b = tl.load(b_ptr + t * H + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.where(real, tl.sigmoid(b), 0.0)
    # dt_bias in its own dtype, added to the fp32 `a` (as torch promotes); A_log widened before exp.
    a = tl.load(a_ptr + t * H + h, mask=ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(a_log_ptr + h, mask=ok, other=0.0).to(tl.float32))
    g = tl.where(real, -decay * _softplus(a + dt_bias), 0.0)
    tl.store(beta_ptr + t * H + h, beta.to(beta_ptr.dtype.element_ty), mask=ok)
    tl.store(g_ptr + t * H + h, g, mask=ok)


@on_device_of_first_tensor
def delta_gates_triton(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta.delta_gates` in one launch."""
    b, a = b.contiguous(), a.contiguous()
    H = b.shape[-1]
    tokens = b.numel() // max(H, 1)
    beta = torch.empty_like(b)
    g = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    if tokens:
        real = valid.reshape(-1) if valid.dtype == torch.bool else valid.reshape(-1) != 0
        # The mask as bytes (a bool tensor reinterpreted, no copy): one byte per token, no bool pointers.
        _delta_gates_kernel[(tokens,)](b, a, A_log, dt_bias, real.contiguous().view(torch.uint8), beta, g, tokens,
                                       H=H, H_PAD=triton.next_power_of_2(H), num_warps=1, **pdl(b))
    return beta, g


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, num_rows, eps,
                           D: tl.constexpr, D_PAD: tl.constexpr, SIGMOID: tl.constexpr, PRODUCT: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_begin(PDL)
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    ok = d < D
    x = tl.load(x_ptr + r * D + d, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + d, mask=ok, other=0.0)
    normed = (w.to(tl.float32) * normed.to(tl.float32)).to(PRODUCT)  # weight * x in torch's promoted dtype
    gate = tl.load(gate_ptr + r * D + d, mask=ok, other=0.0).to(tl.float32)
    act = tl.sigmoid(gate) if SIGMOID else gate * tl.sigmoid(gate)
    tl.store(out_ptr + r * D + d, (normed.to(tl.float32) * act).to(out_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          activation: str) -> torch.Tensor:
    """`gated_delta.gated_rms_norm_torch` in one launch, one program per row."""
    assert activation in ("sigmoid", "silu"), activation
    x, gate = x.contiguous(), gate.contiguous()
    D = x.shape[-1]
    rows = x.numel() // max(D, 1)
    out = torch.empty_like(x)
    # The product with the weight is rounded to the dtype torch promotes it to (fp32 rows stay fp32).
    product = TL_DTYPES[torch.promote_types(x.dtype, weight.dtype)]
    if rows:
        _gated_rms_norm_kernel[(rows,)](x, gate, weight, out, rows, float(eps), D=D,
                                        D_PAD=triton.next_power_of_2(D), SIGMOID=activation == "sigmoid",
                                        PRODUCT=product, num_warps=4 if D >= 512 else 1, **pdl(x))
    return out


@triton.jit
def _conv_decode_step_kernel(state_ptr, x_ptr, weight_ptr, residual_ptr, out_ptr, stride_sb, stride_sc, stride_sk,
                             stride_xb, stride_xc, stride_wc, stride_wk, stride_rb, stride_rc, channels,
                             K: tl.constexpr, K_PAD: tl.constexpr, DIL: tl.constexpr, S: tl.constexpr,
                             S_PAD: tl.constexpr, BLOCK_C: tl.constexpr, W_DTYPE: tl.constexpr,
                             RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (row, block of channels): the window [kept S = (K-1) * DIL inputs | x] in x's dtype, the
    conv over its inputs 0, DIL, .., S in fp32 rounded to the weight's dtype, silu rounded to the output's
    (plus the residual, rounded again); the kept inputs shift by one."""
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, K_PAD)
    ok = c < channels
    x_dtype = x_ptr.dtype.element_ty
    xv = tl.load(x_ptr + b * stride_xb + c * stride_xc, mask=ok, other=0.0)
    rows = state_ptr + b * stride_sb + c[:, None] * stride_sc
    kept = tl.load(rows + (k * DIL)[None, :] * stride_sk, mask=ok[:, None] & (k < K - 1)[None, :],
                   other=0.0).to(x_dtype)
    window = tl.where((k == K - 1)[None, :], xv[:, None], kept)  # [BLOCK_C, K_PAD], taps past K are zero weights
    w = tl.load(weight_ptr + c[:, None] * stride_wc + k[None, :] * stride_wk, mask=ok[:, None] & (k < K)[None, :],
                other=0.0).to(tl.float32)
    conv = tl.sum(window.to(W_DTYPE).to(tl.float32) * w, axis=1).to(W_DTYPE).to(tl.float32)
    out = (conv * tl.sigmoid(conv)).to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(residual_ptr + b * stride_rb + c * stride_rc, mask=ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + r).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * channels + c, out, mask=ok)
    # The kept inputs become the window's last S (read above, before this overwrites them).
    j = tl.arange(0, S_PAD)
    later = tl.load(rows + (j + 1)[None, :] * stride_sk, mask=ok[:, None] & (j + 1 < S)[None, :],
                    other=0.0).to(x_dtype)
    shifted = tl.where((j + 1 == S)[None, :], xv[:, None], later)
    tl.store(rows + j[None, :] * stride_sk, shifted.to(state_ptr.dtype.element_ty),
             mask=ok[:, None] & (j < S)[None, :])


@on_device_of_first_tensor
def conv_decode_step_triton(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            out_dtype: torch.dtype, dilation: int = 1,
                            residual: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_delta.conv_decode_step` in one launch (``conv_state`` is updated in place)."""
    B, C, _ = x.shape
    K = weight.shape[-1]
    out = torch.empty(B, 1, C, dtype=out_dtype, device=x.device)
    if B and C:
        block_c = 256
        r = residual if residual is not None else out  # (unread without a residual)
        _conv_decode_step_kernel[(B, triton.cdiv(C, block_c))](
            conv_state, x, weight, r, out, *conv_state.stride(), x.stride(0), x.stride(1), *weight.stride(),
            r.stride(0), r.stride(2), C, K=K, K_PAD=triton.next_power_of_2(K), DIL=dilation, S=(K - 1) * dilation,
            S_PAD=triton.next_power_of_2((K - 1) * dilation), BLOCK_C=block_c, W_DTYPE=TL_DTYPES[weight.dtype],
            RESIDUAL=residual is not None, num_warps=4, **pdl(conv_state),
        )
    return out


@triton.jit(do_not_specialize=["length"])  # channels stay specialized: aligned, vectorized accesses
def _conv_prefill_kernel(x_ptr, state_ptr, weight_ptr, pads_ptr, out_ptr, stride_xb, stride_xc, stride_xt,
                         stride_sb, stride_sc, stride_sk, stride_wc, stride_wk, length, channels,
                         K: tl.constexpr, HAS_PADS: tl.constexpr, FRESH: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr, W_DTYPE: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (block of columns, block of channels, row). Output column t reads window columns
    t .. t+K-1 of [kept K-1 inputs | x] with the row's pads moved in front (`causal_window`); each tap is
    loaded from where that column lives (nothing, the kept inputs, or x), never from a built window."""
    pdl_begin(PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    ok = (t < length)[:, None] & (c < channels)[None, :]
    x_dtype = x_ptr.dtype.element_ty
    pads = tl.load(pads_ptr + b).to(tl.int64) if HAS_PADS else 0
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        j = t + k  # window column
        from_x = (j >= pads + K - 1)[:, None] & ok
        tap = tl.load(x_ptr + b * stride_xb + (j - (K - 1))[:, None] * stride_xt + c[None, :] * stride_xc,
                      mask=from_x, other=0.0)
        if not FRESH:  # a fresh row's kept inputs are zeros, as is the fill in front of them
            from_state = ((j >= pads) & (j < pads + K - 1))[:, None] & ok
            kept = tl.load(state_ptr + b * stride_sb + c[None, :] * stride_sc + (j - pads)[:, None] * stride_sk,
                           mask=from_state, other=0.0).to(x_dtype)
            tap = tl.where(from_state, kept, tap)
        w = tl.load(weight_ptr + c * stride_wc + k * stride_wk, mask=c < channels, other=0.0).to(tl.float32)
        acc += tap.to(W_DTYPE).to(tl.float32) * w[None, :]
    conv = acc.to(W_DTYPE).to(tl.float32)
    tl.store(out_ptr + (b * length + t)[:, None] * channels + c[None, :],
             (conv * tl.sigmoid(conv)).to(out_ptr.dtype.element_ty), mask=ok)


CONV_PREFILL_BLOCK_T = 32
CONV_PREFILL_BLOCK_C = 128


@on_device_of_first_tensor
def conv_prefill_triton(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, leading_pads,
                        fresh: bool, out_dtype: torch.dtype, block_t: int = CONV_PREFILL_BLOCK_T,
                        block_c: int = CONV_PREFILL_BLOCK_C) -> torch.Tensor:
    """The conv and activation of `gated_delta.conv_prefill` in one launch, ``[B, L, C]`` (``conv_state`` is
    only read: the caller updates it after)."""
    B, C, L = x.shape
    K = weight.shape[-1]
    out = torch.empty(B, L, C, dtype=out_dtype, device=x.device)
    if B and C and L:
        pads = leading_pads if leading_pads is not None else out  # not read without pads
        _conv_prefill_kernel[(triton.cdiv(L, block_t), triton.cdiv(C, block_c), B)](
            x, conv_state, weight, pads, out, *x.stride(), *conv_state.stride(), *weight.stride(), L, C,
            K=K, HAS_PADS=leading_pads is not None, FRESH=fresh, BLOCK_T=block_t, BLOCK_C=block_c,
            W_DTYPE=TL_DTYPES[weight.dtype], num_warps=4, **pdl(x),
        )
    return out


@triton.jit
def _recurrent_step_kernel(state_ptr, q_ptr, k_ptr, v_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, valid_ptr,
                           gate_ptr, norm_w_ptr, out_ptr, stride_sb, stride_sh, stride_qb, stride_qh, stride_kb,
                           stride_kh, stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_ab, eps,
                           sqrt_dk, HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                           PRODUCT: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (row, value head), its whole ``[DK, DV]`` state: the gates, the L2 norms, the delta rule
    (state in place), the read, then the gated RMS norm over the head's DV outputs; rounding as the torch
    specification (`gated_delta.recurrent_step_torch`)."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // RATIO  # the key head serving this value head
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    k_ok, v_ok = dk < DK, dv < DV
    act_dtype = v_ptr.dtype.element_ty
    # Gates: beta in the activations' dtype, g in fp32; zero on a pad row (no decay, no write).
    real = tl.load(valid_ptr + row) != 0
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_bb + h).to(tl.float32)).to(b_ptr.dtype.element_ty).to(tl.float32)
    a = tl.load(a_ptr + row * stride_ab + h).to(tl.float32)
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * _softplus(a + tl.load(dt_bias_ptr + h).to(tl.float32))
    beta = tl.where(real, beta, 0.0)
    g = tl.where(real, g, 0.0)
    q = tl.load(q_ptr + row * stride_qb + kh * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kb + kh * stride_kh + dk, mask=k_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) / sqrt_dk
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + row * stride_vb + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
    cell = state_ptr + row * stride_sb + h * stride_sh + dk[:, None] * DV + dv[None, :]
    kv_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(cell, mask=kv_ok, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(cell, s, mask=kv_ok)
    out = tl.sum(s * q[:, None], axis=0).to(act_dtype).to(tl.float32)
    # The gated norm (`_gated_rms_norm_kernel`'s arithmetic) over the head's outputs.
    normed = (out * tl.rsqrt(tl.sum(out * out, axis=0) / DV + eps)).to(act_dtype)
    w = tl.load(norm_w_ptr + dv, mask=v_ok, other=0.0)
    normed = (w.to(tl.float32) * normed.to(tl.float32)).to(PRODUCT)
    z = tl.load(gate_ptr + row * stride_gb + h * stride_gh + dv, mask=v_ok, other=0.0).to(tl.float32)
    act = tl.sigmoid(z) if SIGMOID else z * tl.sigmoid(z)
    tl.store(out_ptr + (row * HV + h) * DV + dv, (normed.to(tl.float32) * act).to(act_dtype), mask=v_ok)


# Warps of a recurrent-step program: its [DK, DV] fp32 state (64 KB at 128 x 128) lives in registers.
RECURRENT_STEP_NUM_WARPS = 8


@on_device_of_first_tensor
def recurrent_step_triton(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          valid: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          activation: str) -> torch.Tensor:
    """`gated_delta.recurrent_step` in one launch (``state`` updated in place)."""
    assert activation in ("sigmoid", "silu"), activation
    assert state.dtype == torch.float32 and state.stride(3) == 1 and state.stride(2) == state.shape[3]
    B, Hv, Dk, Dv = state.shape
    Hk = key.shape[1]
    if Hv % Hk:
        raise ValueError(f"recurrent_step needs value heads ({Hv}) to be a multiple of key heads ({Hk})")
    for name, t in (("query", query), ("key", key), ("value", value), ("gate", gate)):
        if t.stride(-1) != 1:
            raise ValueError(f"recurrent_step reads {name}'s features contiguously; got strides {t.stride()}")
    b, a = b.contiguous(), a.contiguous()
    out = torch.empty(B, Hv, Dv, dtype=value.dtype, device=value.device)
    if B == 0 or Hv == 0:
        return out
    real = valid.reshape(-1) if valid.dtype == torch.bool else valid.reshape(-1) != 0
    product = TL_DTYPES[torch.promote_types(value.dtype, norm_weight.dtype)]
    _recurrent_step_kernel[(B, Hv)](
        state, query, key, value, b, a, A_log, dt_bias, real.contiguous().view(torch.uint8), gate, norm_weight, out,
        state.stride(0), state.stride(1), query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), gate.stride(0), gate.stride(1), b.stride(0), a.stride(0), float(eps),
        float(Dk ** 0.5), HV=Hv, RATIO=Hv // Hk, DK=Dk, DV=Dv, DK_PAD=triton.next_power_of_2(Dk),
        DV_PAD=triton.next_power_of_2(Dv),
        SIGMOID=activation == "sigmoid", PRODUCT=product, num_warps=RECURRENT_STEP_NUM_WARPS, **pdl(state),
    )
    return out
