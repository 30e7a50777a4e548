"""Triton versions of `hf_qsa_cache.ops.ple`'s n-gram lookup and gating (the torch functions there are the spec).

* `_ngram_embeddings_kernel`: one program per (token, head): the token's shifted ids from the window (an
  end-of-sequence id ends the look back), the n-gram's multiply-xor mix in int64 (wrapping as torch's does),
  the head's remainder (made non-negative, as ``torch.remainder``), then the embedding row copied out.
* `_ple_gate_kernel`: one program per token, its ``hc`` streams as an ``[HC_PAD, BLOCK_H]`` tile (as
  `hyper_connection_triton`'s norm): both grouped norms, the gate, the gated value (rounded as stored, then
  normed), zero on pads; fp32 throughout, each output rounded once.

Token counts are not specialised (a new batch or step length does not recompile).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_common import grouped_norm, on_device_of_first_tensor, pdl, pdl_begin


@triton.jit(do_not_specialize=["length", "width", "stride_hb"])
def _ngram_embeddings_kernel(hist_ptr, mult_ptr, sizes_ptr, offsets_ptr, weight_ptr, out_ptr, length,
                             width, stride_hb, eos, NGRAM: tl.constexpr, PER_NGRAM: tl.constexpr, DIM: tl.constexpr,
                             D_PAD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    b = t // length
    p = width - length + t % length  # the token's column in the window
    row = hist_ptr + b * stride_hb
    ngram = head // PER_NGRAM + 2  # heads are grouped by n-gram: bigrams first
    mixed = tl.load(row + p).to(tl.int64) * tl.load(mult_ptr).to(tl.int64)
    clean = p >= 1  # no end-of-sequence id between the shifted token and this one (yet)
    for s in tl.static_range(1, NGRAM):
        src = p - s
        token = tl.load(row + tl.maximum(src, 0)).to(tl.int64)
        shifted = tl.where(clean & (src >= 0), token, eos)
        term = shifted * tl.load(mult_ptr + s).to(tl.int64)
        mixed = tl.where(s < ngram, mixed ^ term, mixed)
        clean = clean & (src >= 1) & (token != eos)
    size = tl.load(sizes_ptr + head).to(tl.int64)
    index = mixed % size
    index = tl.where(index < 0, index + size, index) + tl.load(offsets_ptr + head).to(tl.int64)
    d = tl.arange(0, D_PAD)
    rows = tl.load(weight_ptr + index * DIM + d, mask=d < DIM)
    tl.store(out_ptr + t * (tl.num_programs(1) * DIM) + head * DIM + d, rows, mask=d < DIM)


@on_device_of_first_tensor
def ngram_embeddings_triton(history: torch.Tensor, emb, length: int) -> torch.Tensor:
    """`ple.ngram_embeddings` in one launch: ``[B, length, heads * dim]`` from the window ``history`` ``[B, W]``."""
    B, width = history.shape
    weight = emb.ngram_embedding.weight.contiguous()
    heads, dim = emb.ngram_heads, weight.shape[1]
    out = torch.empty(B, length, heads * dim, dtype=weight.dtype, device=history.device)
    if B * length:
        history = history.contiguous()
        _ngram_embeddings_kernel[(B * length, heads)](
            history, emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets, weight, out,
            length, width, history.stride(0), int(emb.eos_token_id), NGRAM=emb.ngram_size,
            PER_NGRAM=emb.heads_per_ngram, DIM=dim, D_PAD=triton.next_power_of_2(dim), num_warps=1, **pdl(history))
    return out


@triton.jit
def _ple_gate_kernel(key_ptr, value_ptr, streams_ptr, valid_ptr, wk_ptr, wq_ptr, wc_ptr, gated_ptr, normed_ptr,
                     eps, inv_sqrt_h, HC: tl.constexpr, H: tl.constexpr, HC_PAD: tl.constexpr,
                     BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HC_PAD)
    h = tl.arange(0, BLOCK_H)
    ok = (c < HC)[:, None] & (h < H)[None, :]
    offsets = t * HC * H + c[:, None] * H + h[None, :]
    key = grouped_norm(tl.load(key_ptr + offsets, mask=ok, other=0.0).to(tl.float32), wk_ptr, c, h, ok, H, eps)
    query = grouped_norm(tl.load(streams_ptr + offsets, mask=ok, other=0.0).to(tl.float32), wq_ptr, c, h, ok, H,
                          eps)
    gate = tl.sum(key * query, axis=1) * inv_sqrt_h  # [HC_PAD]
    sign = tl.where(gate > 0, 1.0, tl.where(gate < 0, -1.0, 0.0))
    gate = tl.sqrt(tl.maximum(tl.abs(gate), 1e-6)) * sign
    value = tl.load(value_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32)
    gated = (tl.sigmoid(gate)[:, None] * value[None, :]).to(gated_ptr.dtype.element_ty)
    normed = grouped_norm(gated.to(tl.float32), wc_ptr, c, h, ok, H, eps)  # the norm reads it as stored
    keep = tl.load(valid_ptr + t) != 0
    tl.store(gated_ptr + offsets, tl.where(keep, gated, 0.0).to(gated_ptr.dtype.element_ty), mask=ok)
    tl.store(normed_ptr + offsets, tl.where(keep, normed, 0.0).to(normed_ptr.dtype.element_ty), mask=ok)


@on_device_of_first_tensor
def ple_gate_triton(key: torch.Tensor, value: torch.Tensor, streams: torch.Tensor, valid: torch.Tensor,
                    key_weight: torch.Tensor, query_weight: torch.Tensor, conv_weight: torch.Tensor, hc: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ple.ple_gate_torch` in one launch."""
    key, value, streams = key.contiguous(), value.contiguous(), streams.contiguous()
    valid = valid.reshape(-1).contiguous()
    H = value.shape[-1]
    gated = torch.empty_like(streams)
    normed = torch.empty_like(streams)
    tokens = valid.numel()
    if tokens:
        hc_pad, block_h = triton.next_power_of_2(hc), triton.next_power_of_2(H)
        _ple_gate_kernel[(tokens,)](key, value, streams, valid, key_weight, query_weight, conv_weight, gated, normed,
                                    float(eps), 1.0 / math.sqrt(H), HC=hc, H=H, HC_PAD=hc_pad, BLOCK_H=block_h,
                                    num_warps=8 if hc_pad * block_h >= 4096 else 4, **pdl(key))
    return gated, normed
