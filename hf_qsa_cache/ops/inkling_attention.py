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

import torch

from . import fusions, records_grad, use_triton
from .fp8 import dequantize_fp8, write_fp8_rows

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
    key_scales: torch.Tensor | None = None,  # [slots, Hkv] fp32: an fp8 store's scales (`fp8`)
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns the attention output ``[B, L, Hq * hd]`` in ``q``'s dtype. With ``key_scales`` / ``value_scales``
    the stores are fp8: earlier keys and values are widened to ``k``'s dtype as read (exact), this step's are
    quantized as written (`fp8.write_fp8_rows`) and attended unquantized, from ``k`` and ``v``."""
    B, L, Hq, hd = q.shape
    Hkv = k.shape[2]
    cslot, cpos = _cached_slots(table, block_size, prev_len, host_prev_len, window)
    k_cached = _read(key_store, key_scales, cslot, k.dtype)  # [B, n_cached, Hkv, hd]
    v_cached = _read(value_store, value_scales, cslot, v.dtype)

    # The stores keep values, not autograd history: this step's keys reach the scores from k and v directly.
    at = slots.clamp_min(0)
    if key_scales is not None:
        write_fp8_rows(key_store, key_scales, at, k.detach().reshape(B * L, Hkv, hd))
        write_fp8_rows(value_store, value_scales, at, v.detach().reshape(B * L, Hkv, hd))
    else:
        key_store.index_copy_(0, at, k.detach().reshape(B * L, Hkv, hd).to(key_store.dtype))
        value_store.index_copy_(0, at, v.detach().reshape(B * L, Hkv, hd).to(value_store.dtype))

    outputs = []
    for c0, c1, k0, probs, _, _ in _rel_softmax(q, k, r, proj, k_cached, cpos, position, scaling, window,
                                                 log_scaling):
        values = torch.cat([v_cached, v[:, k0:c1]], dim=1).float()
        out = torch.einsum("bqhgs,bshd->bqhgd", probs, values)
        outputs.append(out.reshape(B, c1 - c0, Hq * hd).to(q.dtype))
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]


def paged_rel_attention_probs(
    q: torch.Tensor,  # [B, L, Hq, hd], normed
    k: torch.Tensor,  # [B, L, Hkv, hd], normed
    r: torch.Tensor,  # [B, L, Hq, d_rel]
    proj: torch.Tensor,  # [d_rel, E]
    key_store: torch.Tensor,  # [slots, Hkv, hd]: keys of earlier forwards
    table: torch.Tensor,  # [B, columns] int32
    block_size: int,
    position: torch.Tensor,  # [B*L] int64, -1 pads
    prev_len: torch.Tensor,  # [B]
    host_prev_len: list[int],
    max_len: int,
    scaling: float,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,  # (n_floor, alpha)
    key_scales: torch.Tensor | None = None,  # [slots, Hkv]: an fp8 store's scales
) -> torch.Tensor:
    """The attention probabilities of `paged_rel_attention_torch` by key position: ``[B, L, Hq, max_len]``
    in ``q``'s dtype, zero at every position a query does not attend (later, outside the window, pads;
    a pad query's row is all zeros). Reads the store only below each row's ``prev_len``."""
    B, L, Hq, _ = q.shape
    cslot, cpos = _cached_slots(table, block_size, prev_len, host_prev_len, window)
    # One extra column takes the keys that are no position (-1), then is dropped.
    out = torch.zeros(B, L, Hq, max_len + 1, dtype=torch.float32, device=q.device)
    for c0, c1, _, probs, kpos, allowed in _rel_softmax(q, k, r, proj, _read(key_store, key_scales, cslot, k.dtype),
                                                         cpos, position, scaling, window, log_scaling):
        probs = probs.masked_fill(~allowed[:, :, None, None, :], 0.0).flatten(2, 3)  # [B, Lq, Hq, S]
        column = torch.where(kpos >= 0, kpos, max_len)[:, None, None, :].expand_as(probs)
        out[:, c0:c1].scatter_add_(-1, column, probs)
    return out[..., :max_len].to(q.dtype)


def _read(store: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``store[slots]``; of an fp8 store (``scales`` given) widened to ``dtype`` (`fp8.dequantize_fp8`)."""
    if scales is None:
        return store[slots]
    return dequantize_fp8(store[slots], scales[slots], dtype)


def _cached_slots(table: torch.Tensor, block_size: int, prev_len: torch.Tensor, host_prev_len: list[int],
                  window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Store rows ``[B, n_cached]`` and positions (-1: none) of the keys of earlier forwards a query of
    this step may see: the last ``n_cached`` positions before each row's ``prev_len``."""
    if window is None:
        n_cached = max(host_prev_len, default=0)
    else:
        n_cached = max((min(p, window - 1) for p in host_prev_len), default=0)
    cpos = prev_len.long()[:, None] - n_cached + torch.arange(n_cached, device=table.device)
    safe = cpos.clamp_min(0)
    block = table.gather(1, (safe // block_size).clamp_max(table.shape[1] - 1)).long()
    return block * block_size + safe % block_size, torch.where(cpos >= 0, cpos, -1)


def _rel_softmax(q, k, r, proj, k_cached, cpos, position, scaling, window, log_scaling):
    """Per chunk of queries ``c0:c1``: ``(c0, c1, k0, probs, kpos, allowed)``: the fp32 softmax ``probs
    [B, Lq, Hkv, G, S]`` over the keys ``[cached | this step's k0:c1]`` at positions ``kpos [B, S]``, and
    which of them each query may see (``allowed [B, Lq, S]``). What `paged_rel_attention_torch` and its
    probabilities share."""
    B, L, Hq, hd = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    E = proj.shape[1]
    pos = position.view(B, L)
    n_cached = k_cached.shape[1]

    tau = None
    if log_scaling is not None:
        tau = log_scaling_tau(pos, *log_scaling)  # [B, L]
        q = (q.float() * tau[:, :, None, None]).to(q.dtype)

    span = (window - 1 if window is not None else L) + n_cached
    chunk = max(1, min(L, SCORE_BUDGET // max(1, B * Hq * (span + 1))))
    neg = torch.finfo(torch.float32).min
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        k0 = 0 if window is None else max(0, c0 - window + 1)
        keys = torch.cat([k_cached, k[:, k0:c1]], dim=1).float()
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
        yield c0, c1, k0, torch.softmax(scores, dim=-1), kpos, allowed


def paged_rel_attention(q, *args, **kwargs) -> torch.Tensor:
    """`paged_rel_attention_torch`'s op: on CUDA its Triton kernel (`inkling_attention_triton`, tested against it),
    which with the ``rel_bias`` fusion computes a decode step's bias ``r @ P`` per key tile instead of a matmul
    before it (one launch a layer less); elsewhere, or where autograd records, the torch function."""
    if use_triton(q) and not records_grad(q, *args[:4]):
        from .inkling_attention_triton import paged_rel_attention_triton

        return paged_rel_attention_triton(q, *args, bias_in_kernel=fusions.enabled("rel_bias"), **kwargs)
    return paged_rel_attention_torch(q, *args, **kwargs)
