"""The MoE blocks of both models: which of the routing's and the experts' paths a block's step takes.

A block's routing runs fused where `router.fuses_routing` (Qwen4Exp) or `inkling_router.fuses_inkling_routing`
says so (the routing is no part of the experts implementation). Its routed experts run the implementation the
model's config names, through the experts module (transformers' ``eager``, ``batched_mm``, ``grouped_mm``, ... as
registered: a user's choice is honoured), except that under our default (`experts.OURS`) they may run the tiled
kernels with the block's shared experts folded in (`experts.shared_expert_to_fold`); ``hf_qsa_selected`` folds
them too. With neither fused routing nor folding, the block runs upstream's forward (``upstream_forward``),
which calls the experts module the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import use_triton
from .experts import (
    grouped_path_applies, inkling_shared_experts_to_fold, run_selected_experts, runs_ours, shared_expert_to_fold,
    tiles_pairs,
)
from .inkling_router import fuses_inkling_routing, route_inkling
from .prompt_experts import tiled_experts
from .router import fuses_routing, route


def runs_tiled(experts, x: torch.Tensor) -> bool:
    """Whether our default experts (`experts.OURS`) run ``x`` ``[T, H]`` through the tiled kernels (CUDA, few
    (token, expert) pairs, the ``tiled_experts`` fusion on): then a block's shared experts may run in them too."""
    return (runs_ours(experts) and tiles_pairs(use_triton(x), x.shape[0] * experts.config.num_experts_per_tok)
            and grouped_path_applies(experts, x))


def qwen4_exp_moe(block, hidden_states: torch.Tensor, upstream_forward) -> torch.Tensor:
    """A Qwen4Exp MoE block (transformers' modules) on ``hidden_states`` ``[..., H]``."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    fused_routing = fuses_routing(block.gate, hidden_states)
    tiled = runs_tiled(block.experts, x)
    folded = shared_expert_to_fold(block, hidden_states, tiled)
    if not fused_routing and folded is None:
        return upstream_forward(hidden_states)
    if fused_routing:
        weights, experts = route(x, block.gate.weight, block.gate.top_k, block.gate.norm_topk_prob)
    else:
        _, weights, experts = block.gate(x)
    if folded is not None:
        run = tiled_experts if tiled else run_selected_experts
        out = run(block.experts, x, experts, weights, folded)
    else:
        out = block.experts(x, experts, weights) + F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out.reshape(hidden_states.shape)


def inkling_moe(block, hidden_states: torch.Tensor, upstream_forward) -> torch.Tensor:
    """An Inkling MoE block (transformers' modules) on ``hidden_states`` ``[..., H]``."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    fused_routing = fuses_inkling_routing(block.gate, hidden_states)
    tiled = runs_tiled(block.experts, flat)
    folded = inkling_shared_experts_to_fold(block, hidden_states, tiled)
    if not fused_routing and folded is None:
        return upstream_forward(hidden_states)
    if fused_routing:
        weights, indices, gammas = route_inkling(block.gate, hidden_states)
    else:
        _, weights, indices, gammas = block.gate(hidden_states)
    if folded is not None:
        shared = folded._replace(token_weights=gammas.reshape(flat.shape[0], -1))
        run = tiled_experts if tiled else run_selected_experts
        return run(block.experts, flat, indices, weights, shared).view(hidden_states.shape)
    routed = block.experts(flat, indices, weights)
    return routed.view(hidden_states.shape) + block.shared_experts(hidden_states, gammas=gammas)
