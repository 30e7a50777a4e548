"""Inkling short convolution over a paged, position-addressed input store.

For token ``t`` (row ``b``, logical position ``p``) and a depthwise kernel of size ``K``::

    y[t, c] = x[t, c] + sum_j w[c, j] * tap(p - (K - 1) + j)[c]

where ``tap(s)`` is

* zero when ``s < 0`` (before the row's first token) or when ``t`` is a pad,
* the input of this forward when ``s >= prev_len[b]`` (the same row, ``K - 1 - j`` columns back),
* the store otherwise: slot ``table[b, s // bs] * bs + s % bs``.

Products and sums are fp32, the result is rounded once to ``x``'s dtype. The op also writes ``x``
into the store at each token's slot (``-1`` = pad: redirected to the null block, never read). Reads
never touch a slot this forward writes, so the order of read and write does not matter.

`short_conv_torch` is the specification; `short_conv` dispatches to the Triton kernel on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import records_grad


class ConvTaps(NamedTuple):
    """What a paged short conv reads and writes besides its input (the arguments of `short_conv_torch` after
    ``x``): its weight ``[C, K]``, its stream of the conv store ``[S, H, w]`` (``C = H * w``), the store's block
    table and block size, each token's slot (-1: pad), position (-1: pad), each row's length before the step,
    and the step's columns per row."""

    weight: torch.Tensor
    store: torch.Tensor
    table: torch.Tensor
    block_size: int
    slots: torch.Tensor
    position: torch.Tensor
    prev_len: torch.Tensor
    query_len: int


def short_conv_torch(
    x: torch.Tensor,  # [T, C] with T = B * L, row-major over [B, L]
    weight: torch.Tensor,  # [C, K]
    store: torch.Tensor,  # [S, H, w] stream view of the conv store, C = H * w
    table: torch.Tensor,  # [B, columns] int32 block table of the conv store
    block_size: int,
    slots: torch.Tensor,  # [T] int64, -1 for pads
    position: torch.Tensor,  # [T] int64, -1 for pads
    prev_len: torch.Tensor,  # [B]
    query_len: int,
) -> torch.Tensor:
    T, C = x.shape
    K = weight.shape[1]
    device = x.device
    t = torch.arange(T, device=device)
    row = t // query_len
    prev = prev_len.long()[row]
    valid = position >= 0
    xf = x.float()
    w = weight.float()
    acc = torch.zeros_like(xf)
    columns = table.shape[1]
    for j in range(K):
        back = K - 1 - j
        src = position - back
        in_x = valid & (src >= prev)
        in_store = valid & (src >= 0) & (src < prev)
        from_x = xf[(t - back).clamp_min(0)]
        safe = src.clamp_min(0)
        block = table[row, (safe // block_size).clamp_max(columns - 1)].long()
        from_store = store[block * block_size + safe % block_size].reshape(T, C).float()
        tap = torch.where(in_x[:, None], from_x, torch.where(in_store[:, None], from_store, 0.0))
        acc = acc + tap * w[:, j]
    y = (acc + xf).to(x.dtype)
    # The store keeps values, not autograd history (this step's taps come from x itself).
    store.index_copy_(0, slots.clamp_min(0), x.detach().view(T, store.shape[1], store.shape[2]).to(store.dtype))
    return y


def short_conv(x, weight, store, table, block_size, slots, position, prev_len, query_len):
    if x.is_cuda and not records_grad(x, weight):
        from .sconv_triton import short_conv_triton

        return short_conv_triton(x, weight, store, table, block_size, slots, position, prev_len, query_len)
    return short_conv_torch(x, weight, store, table, block_size, slots, position, prev_len, query_len)
