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

Two transformers experts implementations are ours:

* ``"hf_qsa"`` (`OURS`, `hf_qsa_cache.ops.prompt_experts.ours_experts_forward`, registered there): our models' default (`default_experts_implementation`). A
  block's steps run the fused routing and our experts paths where they apply (`hf_qsa_cache.ops.moe`: the grouped
  path of `hf_qsa_cache.ops.prompt_experts`, its tiled kernels, the shared experts folded in), CUDA-graph steps
  `graph_experts`' choice; where none applies (autograd recording, experts it does not cover), transformers'
  ``grouped_mm`` function itself.
* ``"hf_qsa_selected"`` (`selected_experts_forward`, registered when this module is imported), below.

A name the user chooses (the config's ``experts_implementation``, ``from_pretrained(experts_implementation=...)``,
``model.set_experts_implementation(...)``) is honoured: ``eager``, ``batched_mm``, ``grouped_mm`` run
transformers' implementation registered under that name, in every step (graph steps included).

``model.set_experts_implementation("hf_qsa_selected")`` runs the selected experts everywhere. It runs the Triton kernels on CUDA tensors and
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

from . import fusions, keeps_own_forward, records_grad, use_triton

SELECTED_EXPERTS = "hf_qsa_selected"
OURS = "hf_qsa"
# MoE blocks add their shared experts inside the selected-experts kernels (`shared_expert_to_fold`,
# `inkling_shared_experts_to_fold`).
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


def selected_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"hf_qsa_selected"`` experts implementation (an experts module's forward, as transformers calls
    it: ``hidden_states`` ``[T, H]``, ``top_k_index`` and ``top_k_weights`` ``[T, k]``)."""
    gate_up = getattr(self, "gate_up_proj", None)
    if (not supports(self) or hidden_states.dim() != 2 or not hidden_states.dtype.is_floating_point
            or hidden_states.shape[-1] != (gate_up.shape[1] if self.is_transposed else gate_up.shape[2])):
        return moe.batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return run_selected_experts(self, hidden_states, top_k_index, top_k_weights)


def default_experts_implementation(requested: str | None) -> str | None:
    """Our models' experts implementation for what the user ``requested``: `OURS` when nothing was (transformers'
    own default would be ``grouped_mm``), else None: transformers checks and applies the request (and refuses an
    unknown name as for its own models)."""
    return OURS if requested is None or requested == OURS else None


def runs_ours(experts: nn.Module) -> bool:
    """Whether an experts module runs `OURS` (the model's default, not a user's choice)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) == OURS


def grouped_path_applies(experts: nn.Module, x: torch.Tensor) -> bool:
    """Whether `OURS` runs ``x`` ``[T, H]`` through `hf_qsa_cache.ops.prompt_experts.grouped_experts_forward` (the
    ``prompt_experts`` fusion on, an experts module `supports` covers, no expert parallelism, plain weights in
    ``x``'s dtype, autograd not recording); else transformers' ``grouped_mm``."""
    if not (fusions.enabled("prompt_experts") and supports(experts) and x.dim() == 2):
        return False
    gate_up, down = experts.gate_up_proj, experts.down_proj
    return (not getattr(experts, "_is_expert_parallel", False) and x.dtype == gate_up.dtype
            and type(gate_up.data) is torch.Tensor and type(down.data) is torch.Tensor
            and not records_grad(x, gate_up, down))


def run_selected_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, shared: SharedExpert | None = None) -> torch.Tensor:
    """The math above for a `supports`-ed experts ``module``: the Triton kernels on CUDA when autograd records
    nothing, else the torch specification."""
    args = (hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, module.is_transposed,
            shared)
    if use_triton(hidden_states) and not records_grad(hidden_states, top_k_weights, *args[3:5], *(shared or ())):
        from .experts_triton import selected_experts_triton

        return selected_experts_triton(*args)
    return selected_experts_torch(*args)


def _routed_kernels_fold(experts: nn.Module, tiled: bool) -> bool:
    """Whether the routed experts run kernels that take shared experts: the selected experts'
    (``hf_qsa_selected``: graph steps of few tokens, or a model set to it) or the tiled ones (``tiled``:
    `hf_qsa_cache.ops.moe.runs_tiled`), on a module `supports` covers."""
    return (fusions.enabled("shared_expert") and (tiled or experts.config._experts_implementation == SELECTED_EXPERTS)
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


# ----------------------------------------------------------------------------- the experts of a graph step
# Most bytes of expert weights a graph step may gather for ``batched_mm`` (`graph_experts`); a bigger
# step keeps the model's own experts implementation (and runs eagerly if that cannot be captured).
BATCHED_EXPERTS_MAX_BYTES = 1 << 30
# Most tokens of a graph step that runs ``hf_qsa_selected`` experts (the ``experts`` fusion, `graph_experts`): its
# kernels read an expert's weights once per (token, selected expert) pair, though pairs of one expert running
# together share its rows in L2. Graph-timed against transformers' grouped GEMM (benchmarks/RESULTS.md), they won
# up to 16 tokens and lost at 32.
SELECTED_EXPERTS_MAX_TOKENS = 16
# Most (token, expert) pairs the tiled experts take (the pairs' grouping ranks them in one program, and past a
# few pairs per expert the grouped GEMMs' large tiles win).
TILED_EXPERTS_MAX_PAIRS = 1024


def tiles_pairs(on_cuda: bool, pairs: int) -> bool:
    """Whether a step of ``pairs`` (token, expert) pairs runs the tiled kernels (the ``tiled_experts`` fusion on,
    CUDA, few pairs): what `hf_qsa_cache.ops.prompt_experts` runs by, and graph steps choose their experts by."""
    return fusions.enabled("tiled_experts") and on_cuda and pairs <= TILED_EXPERTS_MAX_PAIRS


def grouped_mm_captures(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether transformers' ``grouped_mm`` experts can be captured in a CUDA graph.

    They call torch's ``grouped_mm`` with per-expert offsets computed on the device. On CUDA, torch runs
    its CUTLASS kernel only when inputs and output are bf16 on compute capability 9.x or 10.x
    (``_grouped_mm_cuda``); anything else takes ``_grouped_mm_fallback``, which copies the offsets to
    the host (``offs.cpu()``) and runs one matmul per expert. Inside a capture that copy raises
    ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is
    pinned"), and a graph could not hold it anyway: the group sizes (the routing) would be frozen at
    the captured step's. Off CUDA nothing is captured (False).
    """
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def graph_experts(model, experts: list, device: torch.device, tokens: int) -> str | None:
    """The experts implementation a graph step of ``tokens`` tokens runs instead of the model's own, or
    None to run the model's own (``experts``: ``(module, config)`` of each experts module).

    Only our default (`OURS`) is replaced; an implementation the user chose (``eager``, ``batched_mm``,
    ``grouped_mm``, ``hf_qsa_selected``, ...) runs as chosen (a ``grouped_mm`` that cannot be captured fails its
    capture once and its steps run eagerly; `generate()` on a GPU runs decode steps with ``batched_mm``, as
    transformers switches it). The same choice applies to the step's eager runs (the first one, and every one of
    a bucket that did not capture), so a graph and its eager run compute alike.

    * With the ``experts`` fusion on, a step of at most `SELECTED_EXPERTS_MAX_TOKENS` tokens on CUDA whose
      experts modules `supports` covers runs ``hf_qsa_selected``: fixed shapes, no host copy, no gathered weights.
    * Else our own (None) where its grouped GEMMs can be captured (`grouped_mm_captures`), or where it runs the
      ``tiled_experts`` kernels (`tiled_experts_run`): it reads each expert's weights once, where ``batched_mm``
      copies them per (token, expert) pair (benchmarks/RESULTS.md).
    * Else ``batched_mm``: it gathers each token's ``top_k`` expert matrices and runs batched matmuls, with
      fixed shapes and no host copy. The gather holds ``tokens * top_k`` expert matrices of one layer at a
      time; a step needing more than `BATCHED_EXPERTS_MAX_BYTES` keeps the model's own (its capture then
      fails once, and the step runs eagerly).
    """
    if not experts or any(config._experts_implementation != OURS for _, config in experts):
        return None
    if fusions.enabled("experts") and device.type == "cuda" and tokens <= SELECTED_EXPERTS_MAX_TOKENS:
        if all(supports(module) for module, _ in experts):
            return SELECTED_EXPERTS
    module = experts[0][0]
    weights = [w for w in (getattr(module, n, None) for n in ("gate_up_proj", "up_proj", "down_proj"))
               if isinstance(w, torch.Tensor)]
    if not weights:
        return None
    top_k = getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None) or len(weights[0])
    if grouped_mm_captures(weights[0].dtype, device) or tiled_experts_run(experts, device, tokens * top_k):
        return None
    per_pair = max(w[0].numel() for w in weights) * weights[0].element_size()
    return "batched_mm" if tokens * top_k * per_pair <= BATCHED_EXPERTS_MAX_BYTES else None


def tiled_experts_run(experts: list, device: torch.device, pairs: int) -> bool:
    """Whether our experts (`OURS`) run the ``tiled_experts`` kernels for a step of ``pairs`` (token, expert)
    pairs (`hf_qsa_cache.ops.prompt_experts`): captured in any dtype, where transformers' grouped GEMMs capture
    in bf16 on Hopper and Blackwell only."""
    return tiles_pairs(device.type == "cuda", pairs) and all(supports(m) for m, _ in experts)


moe.ALL_EXPERTS_FUNCTIONS.register(SELECTED_EXPERTS, selected_experts_forward)
