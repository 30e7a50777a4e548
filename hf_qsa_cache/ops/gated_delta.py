"""GatedDeltaNet's elementwise work around the recurrence, one launch each where fused (``gdn`` in
`hf_qsa_cache.fusions`; on unless ``HF_QSA_FUSED`` leaves it out).

* `delta_gates`: the write strength ``beta = sigmoid(b)`` and the log decay
  ``g = -exp(A_log) * softplus(a + dt_bias)`` of every head, both zero on pad tokens (pads neither decay
  nor update the state). Upstream's ops are 8 launches.
* `conv_decode_step`: a one-token step's causal depthwise conv over ``[kept K-1 inputs | the new one]``,
  its activation, and the kept window shifted by one, in place (about five launches unfused:
  concatenation, state write, conv, activation, cast).
* `gated_rms_norm`: the output norm with its gate (transformers' ``Qwen4ExpTextRMSNormGated``: RMS norm
  in fp32, rounded, times the weight, times ``act(gate)``), 8 launches upstream.

The torch functions are the specification (what the CPU runs, and CUDA unless fused); the Triton kernels
(`gated_delta_triton`) repeat their arithmetic and rounding points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..fusions import fusion_enabled
from . import keeps_own_forward, records_grad

FUSED_GDN = fusion_enabled("gdn")
GATE_ACTIVATIONS = ("sigmoid", "silu")  # what the fused norm knows


def _fused(*tensors) -> bool:
    return FUSED_GDN and tensors[0].is_cuda and not records_grad(*tensors) and all(
        type(t.data) is torch.Tensor for t in tensors)


def delta_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta, g)`` of ``b``, ``a`` ``[B, L, H]`` with the per-head ``A_log``, ``dt_bias`` ``[H]`` and the real
    tokens ``valid`` ``[B, L]``: ``beta`` in ``b``'s dtype, ``g`` in fp32."""
    if _fused(b, a, A_log, dt_bias):
        from .gated_delta_triton import delta_gates_triton

        return delta_gates_triton(b, a, A_log, dt_bias, valid)
    beta = torch.where(valid[..., None], b.sigmoid(), 0)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return beta, torch.where(valid[..., None], g, 0)


def gated_rms_norm(norm, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``norm(x, gate)`` for transformers' ``Qwen4ExpTextRMSNormGated`` ``norm`` over rows ``[N, D]``."""
    if (not FUSED_GDN or records_grad(x, gate, norm.weight) or norm.activation not in GATE_ACTIVATIONS
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


def conv_decode_step(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
                     ) -> torch.Tensor:
    """One token per row: ``x`` ``[B, C, 1]``, the rows' kept inputs ``conv_state`` ``[B, C, K-1]`` (updated in
    place to the last ``K-1`` inputs), depthwise ``weight`` ``[C, K]``; returns ``silu(conv)`` ``[B, 1, C]`` in
    ``out_dtype``. Rounding as the unfused path: the window in ``x``'s dtype, the conv output in the weight's,
    the activation in ``out_dtype``."""
    if x.is_cuda:
        from .gated_delta_triton import conv_decode_step_triton

        return conv_decode_step_triton(conv_state, x, weight, out_dtype)
    window = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    conv_state.copy_(window[..., 1:].to(conv_state.dtype))
    conv = (window.to(weight.dtype).float() * weight.float()).sum(-1).to(weight.dtype)  # [B, C]
    return F.silu(conv.float()).to(out_dtype)[:, None, :]


def fuses_conv_step(x: torch.Tensor, weight: torch.Tensor, activation: str, leading_pads, fresh: bool,
                    kept) -> bool:
    """Whether a GatedDeltaNet step takes `conv_decode_step`: one token per row, no pads, rows that hold
    state, no rollback history to record, SiLU, autograd not recording, a plain (not sharded) weight."""
    return (FUSED_GDN and x.shape[-1] == 1 and leading_pads is None and not fresh and kept is None
            and activation == "silu" and not records_grad(x, weight) and type(weight) is torch.Tensor)
