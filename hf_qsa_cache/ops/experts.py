"""Selected-experts MoE for decode and verify steps: torch reference and the registered experts function.

A step of few tokens routes each token to ``top_k`` experts; the work is one GEMV per selected expert
matrix. transformers' ``grouped_mm`` sorts the routing and counts tokens per expert (a host copy of
the counts off its CUTLASS path), and ``batched_mm`` gathers every selected expert's matrices into new
tensors before multiplying. `selected_experts_triton` (`hf_qsa_cache.ops.experts_triton`) reads the
selected experts' rows in place instead, in two launches of fixed shape (so it is captured into CUDA
graphs): gate/up projection and activation per (token, expert) pair, then down projection, routing
weight and sum over the token's experts.

The math, for token ``t`` and its experts ``e_j = top_k_index[t, j]``, weights ``w_j``::

    gate, up = (gate_up_proj[e_j] @ x_t).chunk(2)          # rows 0..I-1 are the gate, I..2I-1 the up half
    h_j = silu(gate) * up
    out_t = sum_j w_j * (down_proj[e_j] @ h_j)               # in fp32, cast to x's dtype at the end

An expert id outside ``[0, num_experts)`` (the sentinel of expert parallelism) contributes zero.
Everything runs in fp32 from the loaded values on; only the output is rounded.

`selected_experts_forward` is registered as the transformers experts implementation
``"hf_qsa_selected"`` when this module is imported: ``model.set_experts_implementation("hf_qsa_selected")``
after ``import hf_qsa_cache.ops.experts``. It runs the Triton kernels on CUDA tensors and
`selected_experts_torch` elsewhere (and when autograd records: the kernels have no backward). Experts it
does not cover (biases, a post-expert norm, interleaved gate/up columns, an activation other than SiLU,
a custom ``_apply_gate``, non-float weights) run transformers' ``batched_mm`` instead, so it is
correct for any experts module. CUDA-graph steps of few tokens run it (the ``experts`` fusion)
(`hf_qsa_cache.cuda_graphs.graph_experts`). Chosen for a whole model it also runs prompts: correctly,
but each (token, expert) pair reads its expert's rows again, where ``grouped_mm`` reads each expert once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations import moe

from ..fusions import fusion_enabled
from . import keeps_own_forward, records_grad

SELECTED_EXPERTS = "hf_qsa_selected"
# MoE blocks add their shared experts inside the selected-experts kernels (`shared_expert_to_fold`,
# `inkling_shared_experts_to_fold`).
FUSED_SHARED_EXPERT = fusion_enabled("shared_expert")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SharedExpert(NamedTuple):
    """Always-on SiLU-gated experts beside the routed ones: ``S`` of them (Qwen4Exp's ``shared_expert``:
    one; Inkling's ``shared_experts``: ``n_shared_experts``), each token weighting them either by
    ``sigmoid(x . gate_vector)`` (Qwen4Exp's ``shared_expert_gate``, ``S = 1``) or by ``token_weights``
    (Inkling's router's ``shared_gammas``)."""

    gate: torch.Tensor  # [S, Is, H]
    up: torch.Tensor  # [S, Is, H]
    down: torch.Tensor  # [S, H, Is]
    gate_vector: torch.Tensor | None = None  # [1, H]
    token_weights: torch.Tensor | None = None  # [T, S]


def selected_experts_torch(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                           transposed: bool = False, shared: SharedExpert | None = None) -> torch.Tensor:
    """``[T, H]`` output of the SiLU-gated experts ``top_k_index`` ``[T, k]`` weighted by ``top_k_weights``
    ``[T, k]``, for ``hidden_states`` ``[T, H]``, plus the ``shared`` expert where given.

    ``gate_up_proj`` is ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` (``transposed``: ``[E, H, 2I]`` and
    ``[E, I, H]``), gate rows before up rows. Ids outside ``[0, E)`` contribute zero. fp32 math, one
    rounding at the end::

        out_t = sum_j w_j * expert_{e_j}(x_t) + sum_s g_ts * shared_s(x_t)

    with ``g_ts = sigmoid(gate_vector . x_t)`` or ``token_weights[t, s]``.
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up_proj.shape[0]
    ids = top_k_index.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, 0)
    x = hidden_states.float().repeat_interleave(top_k, dim=0)  # [S, H], pair s = t * k + j
    gate_up = gate_up_proj[ids].float()
    down = down_proj[ids].float()
    if transposed:  # [S, H, 2I] and [S, I, H]: as the untransposed layout's views
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = torch.bmm(gate_up, x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)  # [S, I] each
    h = nn.functional.silu(gate) * up
    y = torch.bmm(down, h.unsqueeze(-1)).squeeze(-1)  # [S, H]
    weights = torch.where(valid, top_k_weights.reshape(-1).float(), 0.0)
    y = torch.where(valid[:, None], y * weights[:, None], 0.0)
    out = y.view(num_tokens, top_k, hidden).sum(dim=1)
    if shared is not None:
        xs = hidden_states.float()
        for s in range(shared.gate.shape[0]):
            h = nn.functional.silu(xs @ shared.gate[s].float().mT) * (xs @ shared.up[s].float().mT)
            weight = (torch.sigmoid(xs @ shared.gate_vector.float().mT) if shared.gate_vector is not None
                      else shared.token_weights[:, s: s + 1].float())
            out = out + weight * (h @ shared.down[s].float().mT)
    return out.to(hidden_states.dtype)


def supports(module: nn.Module) -> bool:
    """Whether ``module`` (built by transformers' ``use_experts_implementation``) computes exactly the math
    above, so that `selected_experts_forward` may run it: gated, concatenated [gate; up] halves, no biases,
    no post-expert norm, SiLU through the default ``_apply_gate``, float weights of matching shapes."""
    if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)):
        return False
    if getattr(module, "has_bias", True) or getattr(module, "has_post_expert_norm", True):
        return False
    if getattr(type(module), "_apply_gate", None) is not moe._default_apply_gate or "_apply_gate" in vars(module):
        return False
    if type(getattr(module, "act_fn", None)) not in (SiLUActivation, nn.SiLU):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.dtype not in _FLOAT_DTYPES or down.dtype != gate_up.dtype:
        return False
    if getattr(module, "is_transposed", False):
        (e, hidden, two_i), (e_down, i_down, h_down) = gate_up.shape, down.shape
    else:
        (e, two_i, hidden), (e_down, h_down, i_down) = gate_up.shape, down.shape
    return e == e_down and two_i % 2 == 0 and two_i == 2 * i_down and hidden == h_down


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def selected_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"hf_qsa_selected"`` experts implementation (an experts module's forward, as transformers calls
    it: ``hidden_states`` ``[T, H]``, ``top_k_index`` and ``top_k_weights`` ``[T, k]``)."""
    gate_up, down = getattr(self, "gate_up_proj", None), getattr(self, "down_proj", None)
    if (not supports(self) or hidden_states.dim() != 2 or not hidden_states.dtype.is_floating_point
            or hidden_states.shape[-1] != (gate_up.shape[1] if self.is_transposed else gate_up.shape[2])):
        return moe.batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return run_selected_experts(self, hidden_states, top_k_index, top_k_weights)


def run_selected_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, shared: SharedExpert | None = None) -> torch.Tensor:
    """The math above for a `supports`-ed experts ``module``: the Triton kernels on CUDA when autograd records
    nothing, else the torch specification."""
    args = (hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, module.is_transposed,
            shared)
    if _use_triton(hidden_states) and not records_grad(hidden_states, top_k_weights, *args[3:5], *(shared or ())):
        from .experts_triton import selected_experts_triton

        return selected_experts_triton(*args)
    return selected_experts_torch(*args)


def _routed_kernels_fold(experts: nn.Module, tiled: bool) -> bool:
    """Whether the routed experts run kernels that take shared experts: the selected experts'
    (``hf_qsa_selected``: graph steps of few tokens, or a model set to it) or the tiled ones (``tiled``:
    `hf_qsa_cache.ops.prompt_experts.runs_tiled_experts`), on a module `supports` covers."""
    return (FUSED_SHARED_EXPERT and (tiled or experts.config._experts_implementation == SELECTED_EXPERTS)
            and supports(experts))


def shared_expert_to_fold(block: nn.Module, x: torch.Tensor, tiled: bool = False) -> SharedExpert | None:
    """The weights of a Qwen4Exp MoE block's shared expert when the block may add it inside its routed
    experts' kernels (`run_selected_experts` or `prompt_experts.tiled_experts` with ``shared``) instead of
    running ``shared_expert`` and ``shared_expert_gate`` as modules: the ``shared_expert`` fusion on, the
    routed experts running such kernels (`_routed_kernels_fold`), a bias-free SiLU MLP and a one-output gate
    in the experts' dtype on ``x``'s device, no hooks on any of them, and autograd not recording. Else None:
    the block runs upstream's modules."""
    experts = block.experts
    if not _routed_kernels_fold(experts, tiled):
        return None
    mlp, gate = block.shared_expert, block.shared_expert_gate
    linears = (getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None), gate)
    if not all(isinstance(m, nn.Linear) and m.bias is None for m in linears):
        return None
    if type(getattr(mlp, "act_fn", None)) not in (SiLUActivation, nn.SiLU) or gate.out_features != 1:
        return None
    weights = [m.weight for m in linears]
    if any(w.dtype != experts.gate_up_proj.dtype or w.device != x.device for w in weights) or records_grad(x, *weights):
        return None
    if any(keeps_own_forward(m, *m.parameters(recurse=False)) for m in (experts, mlp, *linears)):
        return None
    return SharedExpert(*(w.unsqueeze(0) for w in weights[:3]), gate_vector=weights[3])


def inkling_shared_experts_to_fold(block: nn.Module, x: torch.Tensor, tiled: bool = False) -> SharedExpert | None:
    """As `shared_expert_to_fold`, for an Inkling MoE block: its ``shared_experts`` (stacked SiLU experts),
    without their weights (the router's ``shared_gammas``: the caller sets ``token_weights``)."""
    experts, shared = block.experts, block.shared_experts
    if not _routed_kernels_fold(experts, tiled):
        return None
    if type(getattr(shared, "act_fn", None)) not in (SiLUActivation, nn.SiLU):
        return None
    weights = [getattr(shared, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return None
    if any(w.dtype != experts.gate_up_proj.dtype or w.device != x.device for w in weights) or records_grad(x, *weights):
        return None
    if any(keeps_own_forward(m, *m.parameters(recurse=False)) for m in (experts, shared)):
        return None
    return SharedExpert(*weights)


moe.ALL_EXPERTS_FUNCTIONS.register(SELECTED_EXPERTS, selected_experts_forward)
