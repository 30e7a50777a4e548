"""Experts for prompts: transformers' ``grouped_mm`` path without its two full-width passes after the down
projection (the ``prompt_experts`` fusion, on by default).

For a prompt chunk of ``T`` tokens routed to ``k`` experts each, transformers' ``grouped_mm`` experts sort
the ``S = T * k`` (token, expert) pairs by expert, gather their inputs, run the gate/up and down projections
as grouped GEMMs, then multiply every ``[S, H]`` output row by its routing weight, put the rows back in token
order and sum each token's ``k`` rows: two passes over ``[S, H]`` (at a 16384-token chunk with k = 10 and
H = 2048, 0.67 GB each) after the GEMMs, besides the sum. Here the routing weight is applied to the
activation instead (``[S, I]``, a quarter of the width for Qwen4Exp), in the same pass as ``silu(gate) * up``,
and the sum reads each token's rows where they lie (`sum_by_token`): the same math, fewer bytes.

    h_s = w_s * silu(gate_s) * up_s          # fp32, rounded once to the activations' dtype
    out_t = sum_j down_{e_(t,j)} @ h_(t,j)   # the down projection's rows summed in fp32, rounded once

(transformers rounds ``silu(gate) * up`` and ``w * down @ h`` to bf16 before the sum: the results differ by
bf16 rounding, judged against fp32.) `grouped_experts_forward` runs it for an experts module `supports`
covers, under our default experts implementation (`hf_qsa_cache.ops.experts.OURS`: when
`hf_qsa_cache.ops.experts.grouped_path_applies`). The torch functions are the specification; `prompt_experts_triton` holds the kernels.

For few pairs (graph steps of more than 16 tokens, short prompts: up to `TILED_EXPERTS_MAX_PAIRS`) the grouped
GEMMs' tiles are mostly padding and their setup is launches of its own. The ``tiled_experts`` fusion (on by default:
checked and faster on the H200, `benchmarks/RESULTS.md`) runs them as two Triton kernels instead, one program per
(expert, tile of output columns) that reads its expert's weights once and multiplies them with all that
expert's pairs (16 at a time), the routing weight applied to the activation, the down projection's rows kept
in fp32 and summed per token by `sum_by_token`'s kernel; a block's shared experts run as more programs of
the same kernels (one row per token), where upstream runs them as modules of their own
(`tiled_experts_torch` is the specification, `hf_qsa_cache.ops.moe.runs_tiled` says when a block takes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations import moe

from . import use_triton
from .experts import OURS, SharedExpert, grouped_path_applies, tiles_pairs

def _tiled_applies(x: torch.Tensor, top_k: int) -> bool:
    return tiles_pairs(use_triton(x), x.shape[0] * top_k)


def tiled_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, shared: SharedExpert | None = None) -> torch.Tensor:
    """`tiled_experts_torch`'s math for a `supports`-ed experts ``module`` (and ``shared`` experts), by the Triton
    kernels."""
    from .prompt_experts_triton import tiled_experts_triton

    return tiled_experts_triton(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                                module.is_transposed, shared)


def grouped_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: the SiLU-gated experts ``top_k_index`` ``[T, k]`` weighted by ``top_k_weights`` for
    ``hidden_states`` ``[T, H]`` (module docstring), with transformers' grouped GEMMs, or for up to
    `TILED_EXPERTS_MAX_PAIRS` pairs on CUDA (graph steps of more than 16 tokens, short prompts) with the
    ``tiled_experts`` fusion on, `tiled_experts`' two kernels."""
    num_tokens, top_k = top_k_index.shape
    if _tiled_applies(hidden_states, top_k):
        return tiled_experts(module, hidden_states, top_k_index, top_k_weights)
    perm, positions, offsets = pair_order(top_k_index.reshape(-1), module.gate_up_proj.shape[0])
    inputs = hidden_states[perm // top_k]  # [S, H], grouped by expert
    gate_up = moe._grouped_linear(inputs, module.gate_up_proj, offsets, is_transposed=module.is_transposed)
    activation = weighted_silu_mul(gate_up, top_k_weights.reshape(-1)[perm])
    rows = moe._grouped_linear(activation, module.down_proj, offsets, is_transposed=module.is_transposed)
    return sum_by_token(rows, positions, num_tokens, top_k)


def pair_order(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(perm, positions, offsets)`` of the (token, expert) pairs' expert ids ``[S]``: `pair_order_torch`. On
    CUDA, up to `PAIR_ORDER_MAX_PAIRS` pairs (graph steps of more than 16 tokens) in one launch, where torch's
    sort, histogram, cumulative sum and scatter take six (the sort alone the longest of them)."""
    if expert_ids.is_cuda:
        from .prompt_experts_triton import PAIR_ORDER_MAX_PAIRS, pair_order_triton

        if expert_ids.numel() <= PAIR_ORDER_MAX_PAIRS:
            return pair_order_triton(expert_ids, num_experts)
    return pair_order_torch(expert_ids, num_experts)


def pair_order_torch(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs grouped by expert: ``perm`` (pair at each row of the grouped order: by expert, then by pair),
    ``positions`` (each pair's row: ``positions[perm] = arange``) and ``offsets`` (int32, each expert's end
    row, as the grouped GEMMs take them). Any order within an expert gives the same output; this one is
    stable."""
    expert_ids, perm = torch.sort(expert_ids, stable=True)
    # histc, not bincount (no host sync); CPU histc takes floats only, CUDA integers.
    counts = torch.histc(expert_ids.int() if expert_ids.is_cuda else expert_ids.float(), bins=num_experts, min=0,
                         max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    positions = torch.empty_like(perm)
    positions[perm] = torch.arange(perm.numel(), device=perm.device)
    return perm, positions, offsets


def weighted_silu_mul(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights[s] * silu(gate) * up`` for rows ``gate_up`` ``[S, 2I]`` (gate half first), in fp32, rounded
    once to ``gate_up``'s dtype: ``[S, I]``."""
    if gate_up.is_cuda:
        from .prompt_experts_triton import weighted_silu_mul_triton

        return weighted_silu_mul_triton(gate_up, weights)
    return weighted_silu_mul_torch(gate_up, weights)


def weighted_silu_mul_torch(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up * weights.float()[:, None]).to(gate_up.dtype)


def sum_by_token(rows: torch.Tensor, positions: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``[T, H]``: token ``t``'s sum of ``rows[positions[t * k + j]]`` over ``j < k``, in fp32, rounded once to
    ``rows``' dtype."""
    if rows.is_cuda:
        from .prompt_experts_triton import sum_by_token_triton

        return sum_by_token_triton(rows, positions, num_tokens, top_k)
    return sum_by_token_torch(rows, positions, num_tokens, top_k)


def sum_by_token_torch(rows: torch.Tensor, positions: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    return rows[positions].view(num_tokens, top_k, -1).float().sum(dim=1).to(rows.dtype)


def tiled_experts_torch(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up_proj: torch.Tensor, down_proj: torch.Tensor, transposed: bool = False,
                        shared: SharedExpert | None = None) -> torch.Tensor:
    """The specification of the ``tiled_experts`` fusion (`prompt_experts_triton.tiled_experts_triton`): the
    experts of the module docstring, each pair's gate and up projections in fp32 from the loaded weights (not
    rounded, where the grouped GEMMs round them), ``h_s`` rounded once to the activations' dtype, the down
    projections' rows kept in fp32 and summed per token, rounded once. Weights as in
    `hf_qsa_cache.ops.experts.selected_experts_torch` (``transposed``: ``[E, H, 2I]`` and ``[E, I, H]``);
    ``shared`` experts (`SharedExpert`) are more experts every token goes to, their weight (``sigmoid(x .
    gate_vector)`` or ``token_weights``) applied to ``h`` as a routing weight is."""
    num_tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1).long()
    x = hidden_states.float().repeat_interleave(top_k, dim=0)  # [S, H], pair s = t * k + j
    gate_up, down = gate_up_proj[ids].float(), down_proj[ids].float()
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = torch.bmm(gate_up, x[..., None])[..., 0].chunk(2, dim=-1)
    h = (F.silu(gate) * up * top_k_weights.reshape(-1, 1).float()).to(hidden_states.dtype)
    rows = torch.bmm(down, h.float()[..., None])[..., 0]  # [S, H]
    out = rows.view(num_tokens, top_k, -1).sum(dim=1)
    if shared is not None:
        xs = hidden_states.float()
        for s in range(shared.gate.shape[0]):
            weight = (torch.sigmoid(xs @ shared.gate_vector.float().mT) if shared.gate_vector is not None
                      else shared.token_weights[:, s: s + 1].float())
            h = (F.silu(xs @ shared.gate[s].float().mT) * (xs @ shared.up[s].float().mT) * weight)
            out = out + h.to(hidden_states.dtype).float() @ shared.down[s].float().mT
    return out.to(hidden_states.dtype)


def ours_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"hf_qsa"`` experts implementation (`OURS`): our grouped path where it applies (`grouped_path_applies`),
    else transformers' ``grouped_mm`` function (called directly: a user's change to the registry's
    ``grouped_mm`` entry is theirs, not ours)."""
    if grouped_path_applies(self, hidden_states):
        return grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


# Registered here, beside the path it runs (the experts module is imported by this one).
moe.ALL_EXPERTS_FUNCTIONS.register(OURS, ours_experts_forward)
