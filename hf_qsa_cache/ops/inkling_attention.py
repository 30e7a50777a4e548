"""Inkling attention over paged K/V with a relative-position bias gathered per selected key.

Query ``t`` (row ``b``, position ``p_t``) attends to the keys ``s`` of its row with
``0 <= p_t - p_s`` (and ``p_t - p_s < window`` on sliding layers)::

    logit(t, s) = tau_t * (q_t . k_s) * scaling + tau_t * B_t[h, p_t - p_s]
    B_t[h, d]   = (r_t[h] @ P)[d]   for 0 <= d < E, else 0

``tau_t = 1 + alpha * ln(max(1, (p_t + 1) / n_floor))`` on full layers with log scaling, else 1;
positions are the row's real (unpadded) positions. Keys of earlier forwards come from the paged
store, keys of this forward from ``k``/``v`` (which this op then writes to the store).

Memory: the bias is gathered as ``[B, Lq, Hq, S]`` for the ``S`` keys a query chunk can see (the
window on sliding layers), ``(r @ P)`` is ``[B, Lq, Hq, E]`` per query; queries are processed in
chunks so a long prefill never builds a ``[T, T]`` tensor for all heads at once.
"""

from __future__ import annotations

import os

import torch

from . import records_grad

# Upper bound on elements of one chunk's score tensor.
SCORE_BUDGET = 1 << 25


def log_scaling_tau(position: torch.Tensor, n_floor: float, alpha: float) -> torch.Tensor:
    """fp32 ``tau`` per token; pads (position -1) get 1."""
    n = (position.clamp_min(0) + 1).float()
    return 1.0 + alpha * torch.log((n / n_floor).clamp(min=1.0))


def paged_rel_attention_torch(
    q: torch.Tensor,  # [B, L, Hq, hd], normed
    k: torch.Tensor,  # [B, L, Hkv, hd], normed
    v: torch.Tensor,  # [B, L, Hkv, hd]
    r: torch.Tensor,  # [B, L, Hq, d_rel]
    proj: torch.Tensor,  # [d_rel, E]
    key_store: torch.Tensor,  # [slots, Hkv, hd]
    value_store: torch.Tensor,  # [slots, Hkv, hd]
    table: torch.Tensor,  # [B, columns] int32
    block_size: int,
    slots: torch.Tensor,  # [B*L] int64, -1 pads
    position: torch.Tensor,  # [B*L] int64, -1 pads
    prev_len: torch.Tensor,  # [B]
    host_prev_len: list[int],
    scaling: float,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,  # (n_floor, alpha)
) -> torch.Tensor:
    """Returns the attention output ``[B, L, Hq * hd]`` in ``q``'s dtype."""
    B, L, Hq, hd = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    E = proj.shape[1]
    device = q.device
    pos = position.view(B, L)
    prev = prev_len.long()

    # Keys of earlier forwards: the last n_cached positions before each row's prev_len.
    if window is None:
        n_cached = max(host_prev_len, default=0)
    else:
        n_cached = max((min(p, window - 1) for p in host_prev_len), default=0)
    cpos = prev[:, None] - n_cached + torch.arange(n_cached, device=device)
    safe = cpos.clamp_min(0)
    columns = table.shape[1]
    block = table.gather(1, (safe // block_size).clamp_max(columns - 1)).long()
    cslot = block * block_size + safe % block_size
    k_cached = key_store[cslot]  # [B, n_cached, Hkv, hd]
    v_cached = value_store[cslot]
    cpos = torch.where(cpos >= 0, cpos, -1)

    # The stores keep values, not autograd history: this step's keys reach the scores from k and v directly.
    key_store.index_copy_(0, slots.clamp_min(0), k.detach().reshape(B * L, Hkv, hd).to(key_store.dtype))
    value_store.index_copy_(0, slots.clamp_min(0), v.detach().reshape(B * L, Hkv, hd).to(value_store.dtype))

    tau = None
    if log_scaling is not None:
        tau = log_scaling_tau(pos, *log_scaling)  # [B, L]
        q = (q.float() * tau[:, :, None, None]).to(q.dtype)

    span = (window - 1 if window is not None else L) + n_cached
    chunk = max(1, min(L, SCORE_BUDGET // max(1, B * Hq * (span + 1))))
    neg = torch.finfo(torch.float32).min
    outputs = []
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        k0 = 0 if window is None else max(0, c0 - window + 1)
        keys = torch.cat([k_cached, k[:, k0:c1]], dim=1).float()
        values = torch.cat([v_cached, v[:, k0:c1]], dim=1).float()
        kpos = torch.cat([cpos, pos[:, k0:c1]], dim=1)  # [B, S]
        qpos = pos[:, c0:c1]  # [B, Lq]
        Lq, S = c1 - c0, keys.shape[1]

        rel = r[:, c0:c1] @ proj  # [B, Lq, Hq, E]
        if tau is not None:
            rel = (rel.float() * tau[:, c0:c1, None, None]).to(rel.dtype)
        dist = qpos[:, :, None] - kpos[:, None, :]  # [B, Lq, S]
        allowed = (kpos[:, None, :] >= 0) & (dist >= 0)
        if window is not None:
            allowed &= dist < window
        in_extent = (dist >= 0) & (dist < E)
        bias = rel.gather(-1, dist.clamp(0, E - 1)[:, :, None, :].expand(B, Lq, Hq, S))
        bias = torch.where(in_extent[:, :, None, :], bias, 0.0).float()

        q5 = q[:, c0:c1].reshape(B, Lq, Hkv, G, hd).float()
        scores = torch.einsum("bqhgd,bshd->bqhgs", q5, keys) * scaling
        scores = scores + bias.view(B, Lq, Hkv, G, S)
        # Finite fill: a pad query with no visible key gets a harmless uniform average.
        scores = scores.masked_fill(~allowed[:, :, None, None, :], neg)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bqhgs,bshd->bqhgd", probs, values)
        outputs.append(out.reshape(B, Lq, Hq * hd).to(q.dtype))
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]


# On CUDA the Triton kernel (`inkling_attention_triton`, tested against the function above);
# HF_QSA_TRITON_INKLING=0 in the environment keeps the torch op there too.
USE_TRITON = os.environ.get("HF_QSA_TRITON_INKLING", "1") == "1"


def paged_rel_attention(q, *args, **kwargs) -> torch.Tensor:
    if USE_TRITON and q.is_cuda and not records_grad(q, *args[:4]):
        from .inkling_attention_triton import paged_rel_attention_triton

        return paged_rel_attention_triton(q, *args, **kwargs)
    return paged_rel_attention_torch(q, *args, **kwargs)
