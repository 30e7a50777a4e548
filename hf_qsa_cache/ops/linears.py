"""Several projections of the same few tokens in one launch (``projections`` in `hf_qsa_cache.fusions`).

`project` is what the layers call with the ``nn.Linear`` modules that read one input: it returns each
module's output. With the fusion on, on CUDA, for a step of at most `MAX_FUSED_TOKENS` tokens, it runs
`hf_qsa_cache.ops.linears_triton.linears_triton` (one program per tile of output rows of any weight, the
weights read in place); otherwise each module's own forward (upstream's ops, hooks and all). The torch
specification beside the kernel is `linears_torch`.

On by default: in the graphed batch-1 decode step the GPU is busy for less time than with cuBLAS's projections,
with fewer kernels and the same largest error against fp32 (benchmarks/RESULTS.md).

The fused path applies when autograd records nothing, every module is a bias-free ``nn.Linear`` with a plain,
contiguous weight of the input's dtype on its device, and none has hooks or an offloading wrapper
(`keeps_own_forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import fusions, keeps_own_forward, records_grad, use_triton

MAX_FUSED_TOKENS = 16  # decode and verify steps; prompts keep cuBLAS's GEMMs
# A projection alone (o_proj, GatedDeltaNet's out_proj) goes to the kernel for steps of at most this many tokens
# (`project_alone`; 0: never), else to cuBLAS. One token: the kernel's GEMV form beats cuBLAS on a 2048-wide
# reduction and ties it on a 4096-wide one (where cuBLAS adds a split-K reduction launch), and the whole step is
# faster with it (`benchmarks/sweep_projections.py`, benchmarks/RESULTS.md). More tokens: cuBLAS, faster than the
# kernel's best dot tiles.
ALONE_MAX_TOKENS = 1


def linears_torch(x: torch.Tensor, weights: list[torch.Tensor], keep: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The specification: ``[x @ w.T for w in weights]`` for ``x`` ``[T, K]``, tokens that ``keep`` ``[T]``
    marks False zeroed first."""
    if keep is not None:
        x = torch.where(keep[:, None], x, 0)
    return [F.linear(x, w) for w in weights]


def fuses_projections(x: torch.Tensor, modules) -> bool:
    """Whether `project` runs ``modules`` on ``x`` in one launch (see the module's docstring)."""
    if not (fusions.enabled("projections") and use_triton(x)) or x.numel() > MAX_FUSED_TOKENS * x.shape[-1]:
        return False
    from .linears_triton import MAX_WEIGHTS

    if not 1 <= len(modules) <= MAX_WEIGHTS:
        return False
    for m in modules:
        if type(m) is not nn.Linear or m.bias is not None or keeps_own_forward(m, m.weight):
            return False
        w = m.weight
        if w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
            return False
    return not records_grad(x, *(m.weight for m in modules))


def project(x: torch.Tensor, *modules: nn.Module, keep: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``, in one launch where `fuses_projections`. ``keep`` (bool, ``x``'s shape without
    its last dim): tokens it marks False are zeroed first (in the kernel's loads where fused: no launch)."""
    if not fuses_projections(x, modules):
        if keep is not None:
            x = torch.where(keep[..., None], x, 0)
        return [m(x) for m in modules]
    from .linears_triton import linears_triton

    outs = linears_triton(x.reshape(-1, x.shape[-1]), [m.weight for m in modules],
                          None if keep is None else keep.reshape(-1))
    return [o.view(*x.shape[:-1], o.shape[-1]) for o in outs]


def project_alone(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``module(x)`` for a projection that has no sibling to share a launch with: through `project` (the kernel,
    where `fuses_projections`) for steps of at most `ALONE_MAX_TOKENS` tokens, else the module's own forward."""
    if not ALONE_MAX_TOKENS or x.numel() > ALONE_MAX_TOKENS * x.shape[-1]:
        return module(x)
    return project(x, module)[0]
