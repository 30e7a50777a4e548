"""Inkling's short convolutions together with the RMS norms beside them, one launch each where fused
(``conv_norm`` in `hf_qsa_cache.fusions`).

An Inkling attention layer runs, per token, a per-head norm of the query, a short conv then a per-head norm of
the key, and a short conv of the value (`attention_inputs`): four launches, one here. After attention, the
output's short conv, the residual add and the post-attention norm (`conv_add_rms_norm`): two launches, one
here. Each specification is the composition of the ops it fuses (`hf_qsa_cache.ops.sconv.short_conv_torch`,
`hf_qsa_cache.ops.rms_norm.add_rms_norm_torch`), so the rounding points are theirs: the conv's output rounded
to the activations' dtype, the residual sum rounded, the normed value rounded before the weight multiplies it.

The fused kernels run one program per token (and per head for `attention_inputs`): for steps of at most
`MAX_FUSED_TOKENS` tokens (decode and verify steps); a prompt keeps the tiled conv kernel and the norm kernel.

On by default: the graphed decode step launches fewer kernels and keeps the GPU busy for less time
(`benchmarks/RESULTS.md`), both kernels equal to their specifications in bf16 and the models within the fp32
tolerances of upstream.
"""

from __future__ import annotations

import torch

from . import fusions, keeps_own_forward, records_grad, use_triton
from .rms_norm import add_rms_norm, add_rms_norm_torch, rms_norm
from .sconv import ConvTaps, short_conv_torch

MAX_FUSED_TOKENS = 256


def attention_inputs_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_taps: ConvTaps, v_taps: ConvTaps,
                           q_norm_weight: torch.Tensor, q_eps: float, k_norm_weight: torch.Tensor, k_eps: float,
                           head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification: ``q`` ``[T, Hq * hd]`` normed per head; ``k`` ``[T, Hkv * hd]`` short-convolved, then
    normed per head; ``v`` short-convolved. Returns ``[T, heads, hd]`` each; writes ``k`` and ``v`` to their
    conv streams."""
    T = q.shape[0]
    query = add_rms_norm_torch(q.view(T, -1, head_dim), None, q_norm_weight, q_eps)[1]
    key = add_rms_norm_torch(short_conv_torch(k, *k_taps).view(T, -1, head_dim), None, k_norm_weight, k_eps)[1]
    value = short_conv_torch(v, *v_taps).view(T, -1, head_dim)
    return query, key, value


def conv_add_rms_norm_torch(x: torch.Tensor, taps: ConvTaps, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: ``(h, norm(h))`` with ``h = residual + short_conv(x)`` (``h = short_conv(x)`` without a
    residual), ``x`` ``[T, C]``; writes ``x`` to its conv stream."""
    return add_rms_norm_torch(short_conv_torch(x, *taps), residual, norm_weight, eps)


def fuses_conv_norm(x: torch.Tensor, *modules: torch.nn.Module) -> bool:
    """Whether a step on ``x`` (``[..., C]``) runs the ``modules`` (the convs and norms of one fused launch) fused:
    the fusion on, at most `MAX_FUSED_TOKENS` tokens, no autograd, and no module whose own forward must run (a
    hook, an offloading wrapper: `keeps_own_forward`). Off CUDA the fused functions run their specifications."""
    if not fusions.enabled("conv_norm") or x.numel() > MAX_FUSED_TOKENS * x.shape[-1]:
        return False
    params = [p for m in modules for p in m.parameters()]
    return not records_grad(x, *params) and not any(keeps_own_forward(m, *m.parameters())
                                                     for top in modules for m in top.modules())


def attention_inputs(q, k, v, k_taps: ConvTaps, v_taps: ConvTaps, q_norm, k_norm, head_dim: int):
    """`attention_inputs_torch` for transformers' ``InklingRMSNorm`` modules ``q_norm`` and ``k_norm``, in one
    launch on CUDA (callers check `fuses_conv_norm`); ``q``, ``k``, ``v`` ``[..., width]``."""
    args = (q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]), k_taps, v_taps,
            q_norm.weight, q_norm.variance_epsilon, k_norm.weight, k_norm.variance_epsilon, head_dim)
    if use_triton(q):
        from .conv_norm_triton import attention_inputs_triton

        return attention_inputs_triton(*args)
    return attention_inputs_torch(*args)


def conv_add_rms_norm(x: torch.Tensor, taps: ConvTaps, residual: torch.Tensor | None, norm):
    """`conv_add_rms_norm_torch` for transformers' ``InklingRMSNorm`` ``norm``, one launch on CUDA (callers check
    `fuses_conv_norm`); ``x`` and ``residual`` ``[..., C]``."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    res = None if residual is None else residual.reshape(flat.shape)
    if use_triton(x):
        from .conv_norm_triton import conv_add_rms_norm_triton

        h, normed = conv_add_rms_norm_triton(flat, taps, res, norm.weight, norm.variance_epsilon)
    else:
        h, normed = conv_add_rms_norm_torch(flat, taps, res, norm.weight, norm.variance_epsilon)
    return h.view(shape), normed.view(shape)


def normed_attention_inputs(query, key, value, q_norm, k_norm, k_conv, v_conv, cache, meta, head_dim: int):
    """An Inkling attention's ``(query, key, value)`` ``[B, L, heads, head_dim]`` from its projections
    ``[B, L, width]``: the query normed (``q_norm``), the key short-convolved (``k_conv``) and normed (``k_norm``),
    the value short-convolved (``v_conv``); the convs write their inputs to their streams of ``cache``. One launch
    where `fuses_conv_norm` (`attention_inputs`), else the convs' forwards and `rms_norm`."""
    B, L = query.shape[:2]
    heads = (B, L, -1, head_dim)
    if fuses_conv_norm(query, q_norm, k_norm, k_conv, v_conv):
        return tuple(t.view(heads) for t in attention_inputs(
            query, key, value, k_conv.taps(cache, meta, L), v_conv.taps(cache, meta, L), q_norm, k_norm, head_dim))
    query = rms_norm(q_norm, query.view(heads))
    key = rms_norm(k_norm, k_conv(key, cache, meta).view(heads))
    return query, key, v_conv(value, cache, meta).view(heads)


def conv_add_norm(conv, x: torch.Tensor, residual: torch.Tensor | None, norm, cache,
                  meta) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, norm(h))`` with ``h = residual + conv(x)`` (``conv`` None: ``residual + x``; no residual: ``conv(x)``),
    for an Inkling short conv module ``conv`` (its stream in ``cache``) and ``InklingRMSNorm`` ``norm``: one launch
    where `fuses_conv_norm`, else the conv's forward and `add_rms_norm` (itself one launch where fused)."""
    if conv is not None and fuses_conv_norm(x, conv, norm):
        return conv_add_rms_norm(x, conv.taps(cache, meta, x.shape[1]), residual, norm)
    return add_rms_norm(norm, x if conv is None else conv(x, cache, meta), residual)
