"""Qwen4Exp's PLE layer with its n-gram lookup and its gating in one launch each (``ple`` in
`hf_qsa_cache.fusions`; on by default: in the graphed decode step of Qwen4Exp 8 layers at 1 x 16384 on the H200,
with `conv_norm`, 244 kernels against 339 and 1.28 ms a step against 1.46, `benchmarks/RESULTS.md`).

transformers' PLE layer hashes each token's n-grams into rows of an embedding (the shifts that stop at an
end-of-sequence token, the multiply-xor hashes, one remainder per head, the lookup: about 50 launches a
step), projects the rows to one key per hyper-connection stream and one value, gates the value by each
normed key against its normed stream, norms the gated values and masks pads (about 40 more): 102 kernels
for the one PLE layer in a Qwen4Exp decode step on the H200 (`benchmarks/profile_decode_step.py`). Here:

* `ngram_embeddings`: each token's hashed rows looked up from the window of ids the cache keeps (one
  launch; integer arithmetic, so the same rows as upstream's);
* the key and value projections in one launch where the ``projections`` fusion applies (`linears.project`);
* `ple_gate`: the grouped RMS norms of keys and streams, the signed-root gate, the gated value and its
  norm, zero on pads (one launch), in fp32 with each output rounded once (upstream rounds after every op:
  the results differ by bf16 rounding and are judged against fp32, as the other fusions' are).

A one-token step without pads or rollback history runs the dilated conv over the gated values, its window's
shift, the silu and the sum with the gated value in one more launch (`gated_delta.conv_decode_step` with
its dilation and residual); other steps keep the window ops. The torch functions are the specification
(and what the CPU runs); `ple_triton` holds the kernels, tested against them.
"""

from __future__ import annotations

import math

import torch

from ..fusions import fusion_enabled
from . import keeps_own_forward, records_grad

FUSED_PLE = fusion_enabled("ple")


def fuses_ple(layer, hidden_states: torch.Tensor) -> bool:
    """Whether ``layer`` (a PLE layer) runs the fused ops on ``hidden_states``: the fusion on, autograd not
    recording, and no hook or wrapper on the modules whose weights the fused ops read."""
    emb = layer.ple_embedding
    parts = ((layer, ()), (emb, ()), (emb.ngram_embedding, (emb.ngram_embedding.weight,)),
             (layer.norm_key, (layer.norm_key.weight,)), (layer.norm_query, (layer.norm_query.weight,)),
             (layer.norm_conv, (layer.norm_conv.weight,)), (layer.conv1d, (layer.conv1d.weight,)))
    weights = [w for _, ws in parts for w in ws]
    return (FUSED_PLE and not records_grad(hidden_states, *weights)
            and not any(keeps_own_forward(module, *ws) for module, ws in parts)
            and all(w.device == hidden_states.device for w in weights))


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def ngram_ids_torch(history: torch.Tensor, emb, length: int) -> torch.Tensor:
    """``[B, length, heads]`` embedding rows of the last ``length`` tokens of ``history`` ``[B, W]`` (the ids the
    cache keeps before this step's, then this step's), as ``emb`` (transformers' ``Qwen4ExpTextNGramEmbedding``)
    hashes them: token ``p`` shifted by ``s`` is ``history[p - s]``, or the end-of-sequence id where ``p - s < 0``
    or that id lies in ``history[p - s .. p - 1]``; n-gram ``n`` mixes shifts ``0 .. n - 1`` by multiply and
    xor; each head takes the mix modulo its vocabulary, plus its offset."""
    ids = history.long()
    shifted = [emb._shift_right_ignore_eos(ids, s) for s in range(emb.ngram_size)]
    blocks = []
    for ngram in range(2, emb.ngram_size + 1):
        heads = slice((ngram - 2) * emb.heads_per_ngram, (ngram - 1) * emb.heads_per_ngram)
        mixed = shifted[0] * emb.layer_multipliers[0]
        for j in range(1, ngram):
            mixed = torch.bitwise_xor(mixed, shifted[j] * emb.layer_multipliers[j])
        ngram_ids = torch.remainder(mixed.unsqueeze(-1), emb.ngram_heads_vocab_sizes[heads].view(1, 1, -1))
        blocks.append(ngram_ids + emb.ngram_heads_offsets[heads].view(1, 1, -1))
    return torch.cat(blocks, dim=-1)[:, -length:]


def ngram_embeddings(history: torch.Tensor, emb, length: int) -> torch.Tensor:
    """``[B, length, heads * dim]``: the embedding rows of `ngram_ids_torch`, concatenated per token. One launch
    on CUDA (`ple_triton.ngram_embeddings_triton`)."""
    if _use_triton(history):
        from .ple_triton import ngram_embeddings_triton

        return ngram_embeddings_triton(history, emb, length)
    return emb.ngram_embedding(ngram_ids_torch(history, emb, length)).flatten(-2)


def ple_gate(key: torch.Tensor, value: torch.Tensor, streams: torch.Tensor, valid: torch.Tensor, layer,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gated_value, gated_value_normed)`` ``[..., hc * H]`` of PLE layer ``layer`` from its key projection
    ``[..., hc * H]``, value projection ``[..., H]``, the hyper-connection ``streams`` ``[..., hc * H]`` and the
    tokens' ``valid`` mask (both outputs zero where False). One launch on CUDA."""
    args = (key, value, streams, valid, layer.norm_key.weight, layer.norm_query.weight, layer.norm_conv.weight,
            layer.hc_count, layer.norm_key.eps)
    if _use_triton(key):
        from .ple_triton import ple_gate_triton

        return ple_gate_triton(*args)
    return ple_gate_torch(*args)


def ple_gate_torch(key: torch.Tensor, value: torch.Tensor, streams: torch.Tensor, valid: torch.Tensor,
                   key_weight: torch.Tensor, query_weight: torch.Tensor, conv_weight: torch.Tensor, hc: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ple_gate`'s arithmetic (the specification): transformers' ``Qwen4ExpTextPLELayer.forward`` from its
    projections to the conv's input, in fp32; the gated value is rounded to the streams' dtype before its norm
    (the norm reads it as stored), each output rounded once."""
    dtype = streams.dtype
    H = value.shape[-1]

    def grouped_norm(x, weight):
        x = x.float().unflatten(-1, (hc, H))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float().view(hc, H))

    gate = (grouped_norm(key, key_weight) * grouped_norm(streams, query_weight)).sum(-1, keepdim=True) / math.sqrt(H)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value.float().unsqueeze(-2)).flatten(-2).to(dtype)
    normed = grouped_norm(gated, conv_weight).flatten(-2).to(dtype)
    keep = valid[..., None]
    return torch.where(keep, gated, 0), torch.where(keep, normed, 0)
