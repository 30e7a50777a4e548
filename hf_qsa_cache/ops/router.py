"""Qwen4Exp's MoE routing after the router's projection in one launch where fused (``router`` in
`hf_qsa_cache.fusions`; on unless ``HF_QSA_FUSED`` leaves it out).

transformers' ``Qwen4ExpTextTopKRouter`` turns the router logits into routing weights with a softmax in
fp32, a top-k, a renormalisation over the k picked and a cast: five launches per MoE block. `route_topk`
does them in one pass per token (`router_triton`), with the same arithmetic; the projection stays
upstream's ``F.linear``. Among equal probabilities the lower expert wins (torch's top-k leaves that order
open; equal probabilities do not occur with real logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fusions import fusion_enabled
from . import keeps_own_forward, records_grad

FUSED_ROUTER = fusion_enabled("router")


def fuses_routing(router, x: torch.Tensor) -> bool:
    """Whether the MoE block routes ``x`` with `route_topk` instead of calling ``router``: the fusion on,
    autograd not recording, and no hook on the router (``output_router_logits`` records its outputs through one)."""
    return FUSED_ROUTER and not records_grad(x, router.weight) and not keeps_own_forward(router, router.weight)


def route_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in the logits' dtype, experts [T, k] int64)`` from router logits ``[T, E]``, best
    first: softmax in fp32, top ``k``, divided by their sum when ``normalize``."""
    if logits.is_cuda:
        from .router_triton import route_topk_triton

        return route_topk_triton(logits, top_k, normalize)
    return route_topk_torch(logits, top_k, normalize)


def route_topk_torch(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of ``Qwen4ExpTextTopKRouter.forward`` after its projection (the specification)."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts
