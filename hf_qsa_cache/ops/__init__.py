"""Triton kernels used by the cache (each tested against a torch specification)."""

import os

import torch

from ..fusions import FLAGS, UNMEASURED


def records_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors. The Triton kernels have no backward, so such calls
    (training, fine-tuning) run the torch specification, which autograd differentiates."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Which fusions run, read at import from HF_QSA_FUSED: unset means every one measured on the H200 (exact
# in fp32 and faster, benchmarks/RESULTS.md), that is all but `UNMEASURED`; "all" adds those; "none" (or
# empty) turns all off; a comma list turns on only those: "hc" (Qwen4Exp hyper-connection mixing), "gdn"
# (GatedDeltaNet gates, output norm, one-token conv), "norm" (RMS norms with their neighbours: Inkling's
# residual add, Qwen4Exp's rotary embedding), "experts" (graph steps' experts read only the selected
# experts' weights), "router" (Qwen4Exp's MoE routing), "qsa" (QSA's group pooling and selected
# positions), "shared_expert" (the shared experts inside the selected-experts kernels),
# "inkling_router" (Inkling's MoE routing with its projection).
FUSION_NAMES = tuple(FLAGS)  # `hf_qsa_cache.fusions` says which flag each name sets
_SETTING = os.environ.get("HF_QSA_FUSED")
_FUSED = ({name for name in FUSION_NAMES if name not in UNMEASURED} if _SETTING is None
          else {name.strip() for name in _SETTING.split(",") if name.strip()} - {"none"})
if _FUSED - {*FUSION_NAMES, "all"}:
    raise ValueError(f"HF_QSA_FUSED names unknown fusion(s) {sorted(_FUSED - {*FUSION_NAMES, 'all'})}; "
                     f"known: {', '.join(FUSION_NAMES)}, all or none")


def fusion_enabled(name: str) -> bool:
    return name in _FUSED or "all" in _FUSED


def keeps_own_forward(module, *weights: torch.Tensor) -> bool:
    """Whether a fused op must leave ``module`` to its own forward rather than read ``weights`` directly: a
    hook on it (a user's, an output recorder's), accelerate's offloading wrapper (the weights are loaded only
    inside its forward), or weights that are not plain tensors (tensor parallel's DTensors)."""
    return (bool(module._forward_hooks or module._forward_pre_hooks) or hasattr(module, "_hf_hook")
            or any(type(w.data) is not torch.Tensor for w in weights))
