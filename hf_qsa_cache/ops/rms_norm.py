"""Inkling's residual add and RMS norm in one launch where fused (``norm`` in `hf_qsa_cache.fusions`; on unless
``HF_QSA_FUSED`` leaves it out).

transformers' ``InklingRMSNorm`` is six elementwise launches (widen, square, mean, rsqrt, scale, round and
weight); with the residual add before it, seven. `add_rms_norm` does both in one pass over each token's
features, and `rms_norm` the norm alone (the layer norms and the per-head query and key norms), with the
same rounding points: the sum rounded to the activations' dtype (the residual stream as stored), the
normed value rounded before the weight multiplies it, as upstream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fusions, keeps_own_forward, records_grad


def add_rms_norm(norm, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, norm(h))`` with ``h = residual + x`` (``h = x`` without a residual) for transformers'
    ``InklingRMSNorm`` ``norm``."""
    if (not fusions.enabled("norm") or records_grad(x, residual, norm.weight) or keeps_own_forward(norm, norm.weight)
            or (residual is not None and residual.dtype != x.dtype)):
        h = x if residual is None else residual + x
        return h, norm(h)
    if x.is_cuda:
        from .rms_norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, norm.weight, norm.variance_epsilon)
    return add_rms_norm_torch(x, residual, norm.weight, norm.variance_epsilon)


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` (transformers' ``InklingRMSNorm`` over the last dim), one launch where fused."""
    return add_rms_norm(norm, x)[1]


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic of ``residual + x`` and ``InklingRMSNorm.forward``, written out (the kernel's spec)."""
    h = x if residual is None else residual + x
    widened = h.float()
    normed = widened * torch.rsqrt(widened.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * normed.to(h.dtype)


def defers_residual(layer, hidden_states: torch.Tensor) -> bool:
    """Whether Inkling's layer loop leaves ``layer``'s MLP conv and last residual add to the next norm's fused pass
    (two launches a layer less with ``conv_norm``, one without): with the ``norm`` fusion on, autograd not recording
    (activation checkpointing tracks only a layer's tensor arguments), and no hook on the layer (accelerate's, a
    user's) that must see its output whole."""
    return fusions.enabled("norm") and not records_grad(hidden_states) and not keeps_own_forward(layer)


def normed_embedding(embed, norm, input_ids: torch.Tensor) -> torch.Tensor:
    """``norm(embed(input_ids))`` for an embedding module ``embed`` and its ``InklingRMSNorm`` ``norm``: the rows
    looked up directly and normed by `rms_norm` (one launch where fused), or the embedding's own forward where it
    must run (a hook, an offloading wrapper: `keeps_own_forward`)."""
    if keeps_own_forward(embed, embed.weight):
        return embed(input_ids)
    rows = F.embedding(input_ids, embed.weight, embed.padding_idx, embed.max_norm, embed.norm_type,
                       embed.scale_grad_by_freq, embed.sparse)
    return rms_norm(norm, rows)
