"""Triton kernel for `hf_qsa_cache.ops.selected_positions`: a QSA selection's token positions from its best groups,
one program per token (the ``qsa`` fusion)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, pdl, pdl_begin


@triton.jit(do_not_specialize=["num_tokens", "k"])
def _selected_positions_kernel(groups_ptr, visible_ptr, position_ptr, out_ptr, num_tokens, k,
                               stride_gn, stride_gk, stride_on,
                               RATIO: tl.constexpr, SELECTED: tl.constexpr, WIDTH: tl.constexpr,
                               W_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: its row of `selected_positions` (``SELECTED = block_topk * r`` group tokens,
    then ``r - 1`` tail tokens)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, W_PAD)
    p = tl.load(position_ptr + t).to(tl.int64)
    visible = tl.load(visible_ptr + t).to(tl.int64)
    # Group tokens: column c is token c % r of the (c // r)-th best group.
    j = c // RATIO
    listed = c < k * RATIO
    g = tl.load(groups_ptr + t * stride_gn + j * stride_gk, mask=listed, other=-1).to(tl.int64)
    group_token = tl.where(listed & (g >= 0) & (g < visible), g * RATIO + c % RATIO, -1)
    # Open-group tail: ((p + 1) // r) * r + i for i < r - 1, up to p.
    i = c - SELECTED
    tail = (tl.maximum(p, 0) + 1) // RATIO * RATIO + i
    tail = tl.where((tail <= p) & (p >= 0), tail, -1)
    out = tl.where(c < SELECTED, group_token, tail)
    tl.store(out_ptr + t * stride_on + c, out, mask=c < WIDTH)


@on_device_of_first_tensor
def selected_positions_triton(groups: torch.Tensor, visible: torch.Tensor, position: torch.Tensor, ratio: int,
                              block_topk: int) -> torch.Tensor:
    """`selected_positions.selected_positions_torch` in one launch."""
    n, k = groups.shape
    width = block_topk * ratio + ratio - 1
    out = torch.empty(n, width, dtype=torch.long, device=groups.device)
    if n and width:
        _selected_positions_kernel[(n,)](
            groups, visible.contiguous(), position.contiguous(), out, n, k,
            groups.stride(0), groups.stride(1) if k else 1, out.stride(0),
            RATIO=ratio, SELECTED=block_topk * ratio, WIDTH=width, W_PAD=triton.next_power_of_2(width),
            num_warps=4, **pdl(groups),
        )
    return out
