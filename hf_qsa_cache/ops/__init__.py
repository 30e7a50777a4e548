"""Triton kernels used by the cache (each tested against a torch specification)."""

import torch


def records_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors. The Triton kernels have no backward, so such calls
    (training, fine-tuning) run the torch specification, which autograd differentiates."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
