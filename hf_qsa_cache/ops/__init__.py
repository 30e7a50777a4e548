"""Triton kernels used by the cache (each tested against a torch specification)."""

import torch


def records_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors. The Triton kernels have no backward, so such calls
    (training, fine-tuning) run the torch specification, which autograd differentiates."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def keeps_own_forward(module, *weights: torch.Tensor) -> bool:
    """Whether a fused op must leave ``module`` to its own forward rather than read ``weights`` directly: a
    hook on it (a user's, an output recorder's), accelerate's offloading wrapper (the weights are loaded only
    inside its forward), or weights that are not plain tensors (tensor parallel's DTensors)."""
    return (bool(module._forward_hooks or module._forward_pre_hooks) or hasattr(module, "_hf_hook")
            or any(type(w.data) is not torch.Tensor for w in weights))


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op on these tensors runs its Triton kernels: they all live on a CUDA device (elsewhere the torch
    specification runs). Here, not in `triton_common`, so that the dispatch modules import without Triton."""
    for t in tensors:
        if not t.is_cuda:
            return False
    return True
