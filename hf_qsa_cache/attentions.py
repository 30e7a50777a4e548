"""Attention weights as transformers returns them (``output_attentions``): ``[batch, heads, query_len, kv_len]``
over the caller's key columns.

The attention ops address keys by each row's logical position (pads are never stored), and their
probability functions give the weights by key position. Position ``p`` of row ``b`` sits in the caller's
column that holds the row's ``(p+1)``-th real token: the ``(p+1)``-th 1 of its 2-D attention mask row
(without a mask, column ``p``). So ``kv_len`` is the mask's width (past columns and this step's), and a
pad column gets zeros.
"""

from __future__ import annotations

import torch


def by_key_column(by_position: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``[B, H, L, P]`` weights by key position -> ``[B, H, L, W]`` by the caller's key columns, ``W`` the
    width of the 2-D ``attention_mask`` ``[B, W]`` (without a mask the columns are the positions)."""
    if attention_mask is None:
        return by_position
    real = attention_mask != 0
    position = real.long().cumsum(dim=1) - 1  # [B, W]: at a real column, the position it holds
    P = by_position.shape[-1]
    holds_key = real & (position < P)
    index = position.clamp(0, P - 1)[:, None, None, :].expand(*by_position.shape[:3], -1)
    return by_position.gather(-1, index).masked_fill(~holds_key[:, None, None, :], 0)
