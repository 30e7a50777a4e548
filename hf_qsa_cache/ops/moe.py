"""The MoE blocks of both models: which of the routing's and the experts' paths a block's step takes.

A block's routing runs fused where `router.fuses_routing` (Qwen4Exp) or `inkling_router.fuses_inkling_routing`
says so; its routed experts run the tiled kernels (`prompt_experts.runs_tiled_experts`), the grouped path
(`prompt_experts.uses_prompt_experts`) or the experts module itself; its shared experts run inside the routed
experts' kernels where folded (`experts.shared_expert_to_fold`), else as modules. With none of that, the block runs
upstream's forward (``upstream_forward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts import inkling_shared_experts_to_fold, run_selected_experts, shared_expert_to_fold
from .inkling_router import fuses_inkling_routing, route_inkling
from .prompt_experts import grouped_experts_forward, runs_tiled_experts, tiled_experts, uses_prompt_experts
from .router import fuses_routing, route


def qwen4_exp_moe(block, hidden_states: torch.Tensor, upstream_forward) -> torch.Tensor:
    """A Qwen4Exp MoE block (transformers' modules) on ``hidden_states`` ``[..., H]``."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    fused_routing = fuses_routing(block.gate, hidden_states)
    tiled = runs_tiled_experts(block.experts, x)
    folded = shared_expert_to_fold(block, hidden_states, tiled)
    prompt = folded is None and (tiled or uses_prompt_experts(block.experts, x))
    if not fused_routing and folded is None and not prompt:
        return upstream_forward(hidden_states)
    if fused_routing:
        weights, experts = route(x, block.gate.weight, block.gate.top_k, block.gate.norm_topk_prob)
    else:
        _, weights, experts = block.gate(x)
    if folded is not None:
        run = tiled_experts if tiled else run_selected_experts
        out = run(block.experts, x, experts, weights, folded)
    else:
        routed = (grouped_experts_forward(block.experts, x, experts, weights) if prompt
                  else block.experts(x, experts, weights))
        out = routed + F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out.reshape(hidden_states.shape)


def inkling_moe(block, hidden_states: torch.Tensor, upstream_forward) -> torch.Tensor:
    """An Inkling MoE block (transformers' modules) on ``hidden_states`` ``[..., H]``."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    fused_routing = fuses_inkling_routing(block.gate, hidden_states)
    tiled = runs_tiled_experts(block.experts, flat)
    folded = inkling_shared_experts_to_fold(block, hidden_states, tiled)
    prompt = folded is None and (tiled or uses_prompt_experts(block.experts, flat))
    if not fused_routing and folded is None and not prompt:
        return upstream_forward(hidden_states)
    if fused_routing:
        weights, indices, gammas = route_inkling(block.gate, hidden_states)
    else:
        _, weights, indices, gammas = block.gate(hidden_states)
    if folded is not None:
        shared = folded._replace(token_weights=gammas.reshape(flat.shape[0], -1))
        run = tiled_experts if tiled else run_selected_experts
        return run(block.experts, flat, indices, weights, shared).view(hidden_states.shape)
    routed = (grouped_experts_forward(block.experts, flat, indices, weights) if prompt
              else block.experts(flat, indices, weights))
    return routed.view(hidden_states.shape) + block.shared_experts(hidden_states, gammas=gammas)
