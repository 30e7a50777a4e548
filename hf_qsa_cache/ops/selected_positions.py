"""The token positions a QSA selection attends: its best groups' tokens, then the open group's tail (the
specification, and the dispatch to `selected_positions_triton`)."""

from __future__ import annotations

import torch

from . import fusions


def selected_positions(groups: torch.Tensor, visible: torch.Tensor, position: torch.Tensor, ratio: int,
                       block_topk: int) -> torch.Tensor:
    """A token's selected positions ``[N, block_topk*r + r - 1]`` from its best groups ``groups`` ``[N, k]``
    (``k <= block_topk``, ascending): each group's ``r`` tokens (-1 for a group at or past the token's
    ``visible`` count), -1 up to ``block_topk`` groups, then the open-group tail ``((p+1)//r)*r .. p`` of its
    ``position`` ``p`` (-1 where shorter, and everywhere for a pad, ``p = -1``). One launch where fused
    (the ``qsa`` fusion, `selected_positions_triton`)."""
    if fusions.enabled("qsa") and groups.is_cuda:
        from .selected_positions_triton import selected_positions_triton

        return selected_positions_triton(groups, visible, position, ratio, block_topk)
    return selected_positions_torch(groups, visible, position, ratio, block_topk)


def selected_positions_torch(groups: torch.Tensor, visible: torch.Tensor, position: torch.Tensor, ratio: int,
                             block_topk: int) -> torch.Tensor:
    """`selected_positions`' specification (what the CPU runs)."""
    n, k = groups.shape
    device = groups.device
    blocks = torch.where(groups < visible.long()[:, None], groups, -1)
    tokens = blocks[:, :, None] * ratio + torch.arange(ratio, device=device)
    tokens = torch.where(blocks[:, :, None] >= 0, tokens, -1).reshape(n, k * ratio)
    pad = torch.full((n, (block_topk - k) * ratio), -1, dtype=torch.long, device=device)
    tail = ((position.clamp_min(0) + 1) // ratio * ratio)[:, None] + torch.arange(ratio - 1, device=device)
    tail = torch.where((tail <= position[:, None]) & (position[:, None] >= 0), tail, -1)
    return torch.cat([tokens, pad, tail], dim=1)
