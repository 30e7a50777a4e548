"""Qwen4Exp's per-head RMS norm followed by the rotary embedding, in one launch where fused (``norm`` in
`hf_qsa_cache.fusions`; on unless ``HF_QSA_FUSED`` leaves it out).

A QSA layer norms and rotates its queries, keys and index queries, and each closed group's compressed key:
upstream that is a ``Qwen4ExpTextRMSNorm`` and ``apply_rotary_pos_emb`` on the first ``rot`` features
(``rotate_half``'s negation and concatenation, two products, a sum, a concatenation): 11-12 launches per
tensor (`benchmarks/profile_decode_step.py`). `norm_rope` does both per token in one pass, with upstream's
rounding points: the normed value rounded to the input's dtype, then ``x * cos`` and
``rotate_half(x) * sin`` each rounded, then their sum.

The specification is upstream's own pair of functions (`norm_rope_torch`).
"""

from __future__ import annotations

import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream

from . import fusions, keeps_own_forward, records_grad


def norm_rope(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb(norm(x), cos=cos, sin=sin, unsqueeze_dim=1)`` for ``x`` ``[N, H, D]`` and
    ``cos``, ``sin`` ``[N, rot]`` (``rot`` even, at most ``D``), ``norm`` transformers' ``Qwen4ExpTextRMSNorm``."""
    if (not fusions.enabled("norm") or records_grad(x, norm.weight) or keeps_own_forward(norm, norm.weight)
            or norm.group_size is not None or not (x.dtype == cos.dtype == sin.dtype)):
        return norm_rope_torch(norm, x, cos, sin)
    if x.is_cuda:
        from .norm_rope_triton import norm_rope_triton

        return norm_rope_triton(x, norm.weight, norm.eps, cos, sin)
    return norm_rope_written_out(x, norm.weight, norm.eps, cos, sin)


def norm_rope_torch(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Upstream's ops (the specification, and the path when not fused)."""
    return upstream.apply_rotary_pos_emb(norm(x), cos=cos, sin=sin, unsqueeze_dim=1)


def norm_rope_written_out(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor:
    """`norm_rope_torch`'s arithmetic and rounding points written out as the kernel computes them (what
    the fused path runs on the CPU)."""
    widened = x.float()
    normed = (widened * torch.rsqrt(widened.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    rot = cos.shape[-1]
    half = rot // 2
    head, tail = normed[..., :rot], normed[..., rot:]
    turned = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    rotated = (head * cos[:, None]).to(x.dtype) + (turned * sin[:, None]).to(x.dtype)
    return torch.cat([rotated.to(x.dtype), tail], dim=-1)
