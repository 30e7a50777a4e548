"""Qwen4Exp's MoE routing, projection included, in two launches where fused (``router`` in
`hf_qsa_cache.fusions`; on unless ``HF_QSA_FUSED`` leaves it out).

transformers' ``Qwen4ExpTextTopKRouter`` projects the hidden state onto the experts, then turns the logits
into routing weights with a softmax in fp32, a top-k, a renormalisation over the k picked and a cast: six
launches per MoE block. `route` does the projection (split over many programs for a decode step's few
tokens, the GEMM for a prompt's) and then the rest in one pass per token (`router_triton`), with the same
arithmetic: the logits are rounded to the model's dtype, as the projection's output is. Among equal
probabilities the lower expert wins (torch's top-k leaves that order open; equal probabilities do not
occur with real logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fusions, keeps_own_forward, records_grad


def fuses_routing(router, x: torch.Tensor) -> bool:
    """Whether the MoE block routes ``x`` with `route` instead of calling ``router``: the fusion on,
    autograd not recording, and no hook on the router (``output_router_logits`` records its outputs through one)."""
    return (fusions.enabled("router") and not records_grad(x, router.weight)
            and not keeps_own_forward(router, router.weight))


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in x's dtype, experts [T, k] int64)`` of the router with ``weight [E, H]`` for
    ``x [T, H]``, best first: `route_torch`, in two launches on CUDA."""
    if x.is_cuda:
        from .router_triton import route_triton

        return route_triton(x, weight, top_k, normalize)
    return route_torch(x, weight, top_k, normalize)


def route_torch(x: torch.Tensor, weight: torch.Tensor, top_k: int,
                normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qwen4ExpTextTopKRouter.forward``'s weights and experts (the specification)."""
    return route_topk_torch(F.linear(x, weight), top_k, normalize)


def route_topk_torch(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of ``Qwen4ExpTextTopKRouter.forward`` after its projection (the specification)."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts
