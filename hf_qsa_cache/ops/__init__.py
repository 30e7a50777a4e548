"""Triton kernels used by the cache (each tested against a torch specification)."""

import numpy as np
import torch
from transformers.utils.output_capturing import _active_collector


def records_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors. The Triton kernels have no backward, so such calls
    (training, fine-tuning) run the torch specification, which autograd differentiates."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def keeps_own_forward(module, *weights: torch.Tensor) -> bool:
    """Whether a fused op must leave ``module`` to its own forward rather than read ``weights`` directly: a
    hook that must see it run (`sees_forward`), accelerate's offloading wrapper (the weights are loaded only
    inside its forward), or weights that are not plain tensors (tensor parallel's DTensors)."""
    return (sees_forward(module) or hasattr(module, "_hf_hook")
            or any(type(w.data) is not torch.Tensor for w in weights))


def sees_forward(module) -> bool:
    """Whether a hook must see ``module``'s forward run: a user's hook, or transformers' output recorder while a
    call collects outputs (it stays installed after a call that asked for router logits or hidden states, idle
    in the calls that do not: those may still run the fused path)."""
    if module._forward_pre_hooks:
        return True
    hooks = module._forward_hooks.values()
    if any(getattr(hook, "__name__", "") != "output_capturing_hook" for hook in hooks):
        return True
    return bool(hooks) and _active_collector.get() is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op on these tensors runs its Triton kernels: they all live on a CUDA device (elsewhere the torch
    specification runs). Here, not in `triton_common`, so that the dispatch modules import without Triton."""
    for t in tensors:
        if not t.is_cuda:
            return False
    return True


_NUMPY_INTS = {torch.int32: np.int32, torch.int64: np.int64}


def int_tensor(values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of the ints in ``values`` (a list, or a list of equal-length lists), made through numpy: on a
    short list a third of what ``torch.tensor`` costs, which the host part of every step pays a few times."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_INTS[dtype]))
