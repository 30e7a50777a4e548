"""GatedDeltaNet's elementwise work around the recurrence, one launch each where fused (``gdn`` in
`hf_qsa_cache.fusions`; on unless ``HF_QSA_FUSED`` leaves it out).

* `delta_gates`: the write strength ``beta = sigmoid(b)`` and the log decay
  ``g = -exp(A_log) * softplus(a + dt_bias)`` of every head, both zero on pad tokens (pads neither decay
  nor update the state). Upstream's ops are 8 launches.
* `conv_decode_step`: a one-token step's causal depthwise conv over ``[kept K-1 inputs | the new one]``,
  its activation, and the kept window shifted by one, in place (about five launches unfused:
  concatenation, state write, conv, activation, cast).
* `conv_prefill`: a step of any length's causal depthwise conv over ``[kept K-1 inputs | the step's
  inputs]`` (pads moved in front, `causal_window`), its activation, and the kept inputs updated in place. On
  CUDA the conv and activation are one kernel that never builds the window (unfused: a concatenation, a
  cuDNN conv, the activation and copies of the whole prompt chunk).
* `gated_rms_norm`: the output norm with its gate (transformers' ``Qwen4ExpTextRMSNormGated``: RMS norm
  in fp32, rounded, times the weight, times ``act(gate)``), 8 launches upstream.
* `chunked_rule`: transformers' chunked delta rule over a step of several tokens a row. Where it runs
  flash-linear-attention's kernel, the rows go in as one packed batch (``cu_seqlens``) with the queries' and keys'
  L2 norms taken here: that kernel's autotuned launches are keyed on the batch size and on the token count (its
  L2 norm's blocks), so rows of a shape not seen before would have it time its configurations again, about 0.7 s
  each on an H100, and a serving loop meets new shapes every few steps. Packed, every step has the same keys.
* `recurrent_step` (``gdn_step``, on top of ``gdn``): a one-token step after the
  conv, in one launch: the gates, the queries' and keys' L2 norms, the delta rule's update of the recurrent
  state in place in the cache, the output and its gated norm. Without it that is `delta_gates`, the recurrence
  (flash-linear-attention's kernel where installed, which returns a new state), the state's copy back into the
  cache and `gated_rms_norm`: four launches and the state read and written twice.

The torch functions are the specification (what the CPU runs, and CUDA unless fused); the Triton kernels
(`gated_delta_triton`) repeat their arithmetic and rounding points.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from . import fusions, keeps_own_forward, records_grad, use_triton

GATE_ACTIVATIONS = ("sigmoid", "silu")  # what the fused norm knows


def _fused(*tensors) -> bool:
    return fusions.enabled("gdn") and tensors[0].is_cuda and not records_grad(*tensors) and all(
        type(t.data) is torch.Tensor for t in tensors)


def delta_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta, g)`` of ``b``, ``a`` ``[B, L, H]`` with the per-head ``A_log``, ``dt_bias`` ``[H]`` and the real
    tokens ``valid`` ``[B, L]``: ``beta`` in ``b``'s dtype, ``g`` in fp32."""
    if _fused(b, a, A_log, dt_bias):
        from .gated_delta_triton import delta_gates_triton

        return delta_gates_triton(b, a, A_log, dt_bias, valid)
    return delta_gates_torch(b, a, A_log, dt_bias, valid)


def delta_gates_torch(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_gates`' specification: upstream's two lines, then zero on pads."""
    beta = torch.where(valid[..., None], b.sigmoid(), 0)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return beta, torch.where(valid[..., None], g, 0)


def gated_rms_norm(norm, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``norm(x, gate)`` for transformers' ``Qwen4ExpTextRMSNormGated`` ``norm`` over rows ``[N, D]``."""
    if (not fusions.enabled("gdn") or records_grad(x, gate, norm.weight) or norm.activation not in GATE_ACTIVATIONS
            or keeps_own_forward(norm, norm.weight)):
        return norm(x, gate)
    if x.is_cuda:
        from .gated_delta_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, norm.weight, norm.variance_epsilon, norm.activation)
    return gated_rms_norm_torch(x, gate, norm.weight, norm.variance_epsilon, norm.activation)


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                         activation: str) -> torch.Tensor:
    """The arithmetic of ``Qwen4ExpTextRMSNormGated.forward``, written out (the kernels' specification)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * normed.to(x.dtype)
    return (normed * ACT2FN[activation](gate.float())).to(x.dtype)


def conv_decode_step(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                     dilation: int = 1, residual: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row: ``x`` ``[B, C, 1]``, the rows' kept inputs ``conv_state`` ``[B, C, (K-1) * dilation]``
    (updated in place to the last ones), depthwise ``weight`` ``[C, K]`` whose taps lie ``dilation`` inputs
    apart; returns ``silu(conv)`` ``[B, 1, C]`` in ``out_dtype``, plus ``residual`` ``[B, 1, C]`` when given (the
    PLE layer's gated value). Rounding as the unfused path: the window in ``x``'s dtype, the conv output in
    the weight's, the activation in ``out_dtype``, the sum with the residual in ``out_dtype``."""
    if x.is_cuda:
        from .gated_delta_triton import conv_decode_step_triton

        return conv_decode_step_triton(conv_state, x, weight, out_dtype, dilation, residual)
    window = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    conv_state.copy_(window[..., 1:].to(conv_state.dtype))
    taps = window[..., ::dilation]  # the K inputs the conv reads, the last one x
    conv = (taps.to(weight.dtype).float() * weight.float()).sum(-1).to(weight.dtype)  # [B, C]
    out = F.silu(conv.float()).to(out_dtype)[:, None, :]
    return out if residual is None else (residual.float() + out.float()).to(out_dtype)


def causal_window(previous: torch.Tensor, x: torch.Tensor, leading_pads: torch.Tensor | None, fresh: bool = False,
                  fill=0) -> torch.Tensor:
    """``[previous | x]`` along the last dim: ``previous`` ``[B, ..., W]`` (the rows' kept inputs; with
    ``fresh`` the rows start empty and it is all ``fill``, not read), ``x`` ``[B, ..., L]`` (a row's real
    columns are its last ones). ``leading_pads`` (``[B]``, None when no row has pads) moves a row's pad
    columns in front of its kept inputs, filled as a fresh window is, so the window reaches the row's real
    inputs unbroken."""
    previous = torch.full_like(previous, fill, dtype=x.dtype) if fresh else previous.to(x.dtype)
    window = torch.cat([previous, x], dim=-1)
    if leading_pads is None:
        return window
    kept, width = previous.shape[-1], window.shape[-1]
    col = torch.arange(width, device=x.device)
    pads = leading_pads.view(-1, 1)
    # Column j takes: a fresh value before the row's kept window, the kept window next, then x as is.
    src = torch.where(col < pads + kept, (col - pads).clamp_min(0), col)
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [width]
    src = src.view(shape).expand(window.shape)
    return torch.where((col < pads).view(shape), fill, window.gather(-1, src))


def conv_prefill(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, leading_pads, fresh: bool,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """A step's conv: ``x`` ``[B, C, L]`` (any strides), the rows' kept inputs ``conv_state`` ``[B, C, K-1]``
    (read unless ``fresh``; updated in place to the window's last ``K-1`` inputs), depthwise ``weight``
    ``[C, K]``, ``leading_pads`` as `causal_window`; returns ``silu(conv)`` ``[B, L, C]`` in ``out_dtype``."""
    if x.is_cuda:
        from .gated_delta_triton import conv_prefill_triton

        out = conv_prefill_triton(conv_state, x, weight, leading_pads, fresh, out_dtype)
        keep_last_inputs(conv_state, x, leading_pads, fresh)  # after the kernel, which reads them
        return out
    return conv_prefill_torch(conv_state, x, weight, leading_pads, fresh, out_dtype)


def conv_prefill_torch(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, leading_pads, fresh: bool,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """`conv_prefill`'s specification: the window built, its tail kept, the conv, the activation. Rounding as
    `conv_decode_step`: the window in ``x``'s dtype, the conv in the weight's, the activation in
    ``out_dtype``."""
    window = causal_window(conv_state, x, leading_pads, fresh)
    conv_state.copy_(window[..., -conv_state.shape[-1]:])
    conv = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), None, groups=window.shape[1])
    return F.silu(conv).to(out_dtype).transpose(1, 2)


def keep_last_inputs(conv_state: torch.Tensor, x: torch.Tensor, leading_pads, fresh: bool) -> None:
    """``conv_state`` ``[B, C, W]`` becomes the last ``W`` columns of ``causal_window(conv_state, x, ...)``
    without building it: only the step's last ``min(L, W)`` inputs reach those columns (and the kept inputs,
    when a row has fewer real ones), so the window of that tail, its pads shifted, ends the same."""
    tail = min(x.shape[-1], conv_state.shape[-1])
    # The pads that fall in the tail (a negative count, a row whose tail is all real, moves nothing there).
    pads = None if leading_pads is None else leading_pads - (x.shape[-1] - tail)
    window = causal_window(conv_state, x[..., x.shape[-1] - tail:], pads, fresh)
    conv_state.copy_(window[..., -conv_state.shape[-1]:])


def fuses_conv_prefill(x: torch.Tensor, weight: torch.Tensor, activation: str, kept) -> bool:
    """Whether a GatedDeltaNet step takes `conv_prefill`: no rollback history to record, SiLU, autograd not
    recording, a plain (not sharded) weight."""
    return (fusions.enabled("gdn") and kept is None and activation == "silu" and not records_grad(x, weight)
            and type(weight) is torch.Tensor)


def fuses_conv_step(x: torch.Tensor, weight: torch.Tensor, activation: str, leading_pads, fresh: bool,
                    kept) -> bool:
    """Whether a GatedDeltaNet step takes `conv_decode_step`: one token per row, no pads, rows that hold
    state, no rollback history to record, SiLU, autograd not recording, a plain (not sharded) weight."""
    return (fusions.enabled("gdn") and x.shape[-1] == 1 and leading_pads is None and not fresh and kept is None
            and activation == "silu" and not records_grad(x, weight) and type(weight) is torch.Tensor)


def fuses_recurrent_step(norm, x: torch.Tensor, conv_fused: bool, *weights: torch.Tensor) -> bool:
    """Whether a GatedDeltaNet step takes `recurrent_step` after its fused conv (``conv_fused``: one token per row,
    no pads, rows that hold state, no rollback history): the ``gdn_step`` fusion on, autograd not recording, a
    gated norm whose activation the kernel knows and which keeps no forward of its own (hooks), plain weights."""
    return (fusions.enabled("gdn_step") and conv_fused and norm.activation in GATE_ACTIVATIONS
            and not records_grad(x, *weights)
            and not keeps_own_forward(norm, norm.weight) and all(type(w.data) is torch.Tensor for w in weights))


def recurrent_step(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, b: torch.Tensor,
                   a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, valid: torch.Tensor,
                   gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    """One token per row after the conv: ``query``, ``key`` ``[B, Hk, Dk]``, ``value``, ``gate`` ``[B, Hv, Dv]`` (any
    row strides), ``b``, ``a`` ``[B, Hv]``, ``valid`` ``[B]`` (bool), the rows' recurrent ``state`` ``[B, Hv, Dk, Dv]``
    (fp32, updated in place). Returns the gated, normed output ``[B, Hv, Dv]`` in ``value``'s dtype: what
    `delta_gates`, upstream's recurrent delta rule (L2-normed queries and keys, each key head serving ``Hv / Hk``
    consecutive value heads) and `gated_rms_norm` give, in one launch on CUDA (`recurrent_step_torch`)."""
    if use_triton(state):
        from .gated_delta_triton import recurrent_step_triton

        return recurrent_step_triton(state, query, key, value, b, a, A_log, dt_bias, valid, gate, norm_weight, eps,
                                     activation)
    return recurrent_step_torch(state, query, key, value, b, a, A_log, dt_bias, valid, gate, norm_weight, eps,
                                activation)


def recurrent_step_torch(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         valid: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         activation: str) -> torch.Tensor:
    """`recurrent_step`'s specification, upstream's ops in its order and dtypes: the gates (``beta`` in the
    activations' dtype, ``g`` in fp32; both zero on pads, which neither decay nor update the state), then in
    fp32 the L2 norms (eps 1e-6) and the query's ``1/sqrt(Dk)``, the decay, the delta rule's write and the read;
    the output rounded to the activations' dtype before the gated norm."""
    ratio = value.shape[1] // key.shape[1]
    beta, g = (x[:, 0] for x in delta_gates_torch(b[:, None], a[:, None], A_log, dt_bias, valid[:, None]))
    q = query.float().repeat_interleave(ratio, dim=1)
    k = key.float().repeat_interleave(ratio, dim=1)
    q = l2_normed(q) / q.shape[-1] ** 0.5
    k = l2_normed(k)
    s = state * g.exp()[..., None, None]
    remembered = (s * k[..., None]).sum(-2)  # [B, Hv, Dv]
    delta = (value.float() - remembered) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    state.copy_(s)
    out = (s * q[..., None]).sum(-2).to(value.dtype)
    return gated_rms_norm_torch(out, gate, norm_weight, eps, activation)


def chunked_rule(rule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, initial_state: torch.Tensor, meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rule(query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
    use_qk_l2norm_in_kernel=True)`` (transformers' chunked gated delta rule, ``[B, L, ...]`` in, the output and
    the final state out), with the rows packed into one sequence batch where ``rule`` takes them so (see the
    module doc). ``meta``: the step's metadata, on which the packed bounds are made once for all its layers."""
    if not takes_packed_sequences(rule) or records_grad(query, key, value, g, beta):
        return rule(query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    B, L = query.shape[:2]
    cu_seqlens, chunk_indices = packed_rows(B, L, query.device, meta)

    def packed(x):
        return x.reshape(1, B * L, *x.shape[2:])

    query, key = l2_normed(query).to(query.dtype), l2_normed(key).to(key.dtype)  # (rounded as the kernel's own)
    core, state = rule(packed(query), packed(key), packed(value), g=packed(g),
                       beta=packed(beta), initial_state=initial_state, output_final_state=True,
                       use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    return core.reshape(B, L, *core.shape[2:]), state


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in fp32 (the delta rule's query and key norm)."""
    wide = x.float()
    return wide * torch.rsqrt(wide.square().sum(-1, keepdim=True) + eps)


@functools.lru_cache(maxsize=None)
def takes_packed_sequences(rule) -> bool:
    """Whether transformers bound ``rule`` to a kernel that takes packed sequences (flash-linear-attention's)
    rather than its torch reference, which refuses them: read from the argument names its wrapper passes on."""
    try:
        names = inspect.getclosurevars(rule).nonlocals.get("applicable_params", ())
    except (TypeError, ValueError):
        return False
    return "cu_seqlens" in names and "chunk_indices" in names


def packed_rows(rows: int, length: int, device: torch.device, meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of ``length`` tokens, one after the other: their bounds (``cu_seqlens``) and the kernel's
    64-token chunks as (sequence, chunk) pairs (``chunk_indices``), made on ``device`` without a host copy; once a
    step when ``meta`` (the step's metadata) is given, shared by its layers.

    Never kept past the step: a CUDA graph that records a step records the launches that make them, so it owns
    what it reads. A pair kept beside the graph (once per shape, say) would be freed when its keeper moved on, and
    so would the chunk offsets flash-linear-attention memoizes from ``cu_seqlens`` (by identity, four deep); the
    replays would then read memory reused by other tensors (in serving: an illegal memory access)."""
    if meta is None:
        return _make_packed_rows(rows, length, device)
    return meta.derived(("packed_rows", rows, length, device), lambda: _make_packed_rows(rows, length, device))


def _make_packed_rows(rows: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = -(-length // 64)
    bounds = torch.arange(0, (rows + 1) * length, length, dtype=torch.long, device=device)
    pair = torch.arange(rows * chunks, dtype=torch.long, device=device)
    return bounds, torch.stack([pair // chunks, pair % chunks], 1)


def short_conv(state, x: torch.Tensor, weight: torch.Tensor, activation: str, leading_pads, fresh: bool, kept,
               dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A GatedDeltaNet step's causal depthwise conv over ``[last K-1 inputs | this step's real inputs]`` of ``x``
    ``[B, C, L]`` (pads are zero and moved in front of the kept inputs), its window kept in ``state`` (the layer's
    `LinearState`; ``kept``: the rollback ring, or None). Returns ``(out [B, L, C] in dtype, one_step)``, with
    ``one_step`` True where the step took `conv_decode_step`'s path (what `recurrence` needs to know). The paths:
    one token a row (`fuses_conv_step`, the window shifted in place), a prompt (`fuses_conv_prefill`), or the
    torch ops."""
    if fuses_conv_step(x, weight, activation, leading_pads, fresh, kept):
        return state.conv_step_in_place(x, weight, dtype), True
    if fuses_conv_prefill(x, weight, activation, kept):
        return state.conv_prefill_in_place(x, weight, leading_pads, fresh, dtype), False
    window = state.window("conv", x, leading_pads, fresh)
    state.write_window("conv", window, kept)
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), None, groups=window.shape[1])
    return ACT2FN[activation](out).to(dtype).transpose(1, 2), False


def recurrence(state, norm, x: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, valid: torch.Tensor,
               z: torch.Tensor, one_step: bool, delta_rule) -> torch.Tensor:
    """A GatedDeltaNet step after its conv: the gated, normed output ``[B, L, Hv * Dv]`` for ``query``, ``key``
    ``[B, L, Hk, Dk]``, ``value``, ``z`` ``[B, L, Hv, Dv]``, ``b``, ``a`` ``[B, L, Hv]`` and the real tokens ``valid``
    (``x``: the layer's input, for autograd's check). One launch where `fuses_recurrent_step` (one token a row after
    `short_conv`'s one-step path: gates, recurrence with ``state``'s recurrent state in place, gated norm); else
    `delta_gates`, ``delta_rule(g, beta)`` (the model's recurrence over the step, which keeps the state: ``[B, L, Hv,
    Dv]``) and `gated_rms_norm`."""
    B, L = value.shape[:2]
    if fuses_recurrent_step(norm, x, one_step, A_log, dt_bias):
        core = state.recurrent_step_in_place(query[:, 0], key[:, 0], value[:, 0], b[:, 0], a[:, 0], A_log, dt_bias,
                                             valid[:, 0], z[:, 0], norm)
        return core.reshape(B, L, -1)
    beta, g = delta_gates(b, a, A_log, dt_bias, valid)  # zero on pads: no decay, no update
    core = delta_rule(g, beta)
    head_v_dim = value.shape[-1]
    core = gated_rms_norm(norm, core.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))
    return core.reshape(B, L, -1)
