"""Inkling's MoE routing, projection included, in two launches where fused (``inkling_router`` in
`hf_qsa_cache.fusions`, on by default).

transformers' ``InklingTopkRouter`` projects the hidden state onto its routed and shared experts in fp32
(weights and activations cast to fp32 first), takes sigmoid scores, adds the correction bias to the
routed ones to choose the top ``k``, and weights the chosen and the shared experts by a softmax of their
log-sigmoid logits, scaled by ``route_scale`` and the learned ``global_scale``: 18 launches per MoE
layer besides the projection (`benchmarks/profile_decode_step.py --model inkling --device cpu --tiny`),
and in bf16 also copies of the router's weight and the activations to fp32. `route_inkling_torch` is
that arithmetic (the specification, and what the CPU runs); `inkling_router_triton` does it in two
launches (the projection split over many programs, then the routing per token), reading the weight as
stored and accumulating in fp32. Upstream's top-k does not
sort; here the chosen experts come best first, the lower expert first among equal scores (the same set,
weights following their experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fusions, keeps_own_forward, records_grad


def fuses_inkling_routing(router, x: torch.Tensor) -> bool:
    """Whether the MoE block routes ``x`` with `route_inkling` instead of calling ``router``: the fusion on,
    autograd not recording, no hook on the router (``output_router_logits`` records through one), and at
    least one shared expert (the arithmetic below assumes it, as upstream's slicing does)."""
    return (fusions.enabled("inkling_router") and router.n_shared_experts > 0 and not records_grad(x, router.weight)
            and not keeps_own_forward(router, router.weight, router.global_scale))


def route_inkling(router, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k], topk_indices [T, k], shared_gammas [T, S])`` of ``router`` (an
    ``InklingTopkRouter``) for ``hidden_states [..., H]``, as its forward returns them."""
    args = (hidden_states.reshape(-1, router.hidden_dim), router.weight, router.e_score_correction_bias,
            router.global_scale, router.top_k, router.n_shared_experts, router.route_scale)
    if hidden_states.is_cuda:
        from .inkling_router_triton import inkling_router_triton

        return inkling_router_triton(*args)
    return route_inkling_torch(*args)


def route_inkling_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, global_scale: torch.Tensor,
                        top_k: int, n_shared: int, route_scale: float):
    """``InklingTopkRouter.forward``'s arithmetic on ``x [T, H]`` (the specification), chosen experts best
    first."""
    logits = F.linear(x.float(), weight.float())
    routed, shared = logits[:, :-n_shared], logits[:, -n_shared:]
    choice = routed.sigmoid() + bias.float()
    indices = torch.topk(choice, top_k, dim=-1, sorted=True)[1]
    log_probs = F.logsigmoid(torch.cat([routed.gather(-1, indices), shared], dim=-1))
    weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
    weights = (weights * route_scale * global_scale.float()).to(x.dtype)
    return weights[:, :top_k].contiguous(), indices, weights[:, top_k:].contiguous()
