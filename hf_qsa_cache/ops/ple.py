"""Qwen4Exp's PLE layer with its n-gram lookup and its gating in one launch each (``ple`` in
`hf_qsa_cache.fusions`; on by default: the graphed decode step launches far fewer kernels and takes less time,
`benchmarks/RESULTS.md`).

transformers' PLE layer hashes each token's n-grams into rows of an embedding (the shifts that stop at an
end-of-sequence token, the multiply-xor hashes, one remainder per head, the lookup: about 50 launches a
step), projects the rows to one key per hyper-connection stream and one value, gates the value by each
normed key against its normed stream, norms the gated values and masks pads (about 40 more): about a hundred
kernels for the one PLE layer in a Qwen4Exp decode step (`benchmarks/profile_decode_step.py`). Here:

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
import torch.nn.functional as F

from . import fusions, keeps_own_forward, records_grad, use_triton
from .linears import project


def fuses_ple(layer, hidden_states: torch.Tensor) -> bool:
    """Whether ``layer`` (a PLE layer) runs the fused ops on ``hidden_states``: the fusion on, autograd not
    recording, and no hook or wrapper on the modules whose weights the fused ops read."""
    emb = layer.ple_embedding
    parts = ((layer, ()), (emb, ()), (emb.ngram_embedding, (emb.ngram_embedding.weight,)),
             (layer.norm_key, (layer.norm_key.weight,)), (layer.norm_query, (layer.norm_query.weight,)),
             (layer.norm_conv, (layer.norm_conv.weight,)), (layer.conv1d, (layer.conv1d.weight,)))
    weights = [w for _, ws in parts for w in ws]
    return (fusions.enabled("ple") and not records_grad(hidden_states, *weights)
            and not any(keeps_own_forward(module, *ws) for module, ws in parts)
            and all(w.device == hidden_states.device for w in weights))


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
    if use_triton(history):
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
    if use_triton(key):
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


def ple_layer(layer, history: torch.Tensor, hidden_states: torch.Tensor, valid: torch.Tensor, state, kept,
              meta) -> torch.Tensor:
    """Qwen4Exp's PLE layer on ``hidden_states`` ``[B, L, hc * H]`` (``layer``: transformers' module) given the n-gram
    ``history`` ``[B, W]`` of the step's ids: the n-gram embeddings, their gating by the streams and the dilated
    conv, its window kept in ``state`` (the layer's `LinearState`; ``kept``: the rollback ring, or None). Where
    `fuses_ple`, the lookup and the gating in one launch each (`ngram_embeddings`, `ple_gate`), and a decode step's
    conv, silu and sum in one more (the window shifted in place); else upstream's ops."""
    L = hidden_states.shape[1]
    fused = fuses_ple(layer, hidden_states)
    if fused:
        embeddings = ngram_embeddings(history, layer.ple_embedding, L).to(hidden_states.dtype)
        key, value = project(embeddings, layer.key_proj, layer.value_proj)
        gated_value, gated_value_normed = ple_gate(key, value, hidden_states, valid, layer)
    else:
        gated_value, gated_value_normed = _gated_values(layer, history, hidden_states, valid)
    leading_pads = meta.leading_pads()
    if fused and L == 1 and leading_pads is None and not meta.starts_fresh and kept is None:
        # The dilated conv's window shifts in place; the conv, silu and the sum in the same launch.
        return state.conv_step_in_place(gated_value_normed.transpose(1, 2), layer.conv1d.weight[:, 0],
                                        hidden_states.dtype, "ple_conv", layer.conv1d.dilation[0], gated_value)
    window = state.window("ple_conv", gated_value_normed.transpose(1, 2), leading_pads, meta.starts_fresh)
    state.write_window("ple_conv", window, kept)
    conv = F.silu(layer.conv1d(window)).transpose(1, 2)
    return gated_value + conv


def _gated_values(layer, history: torch.Tensor, hidden_states: torch.Tensor,
                  valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ple_layer`'s ``(gated_value, gated_value_normed)`` by upstream's modules and ops (the path unfused)."""
    emb = layer.ple_embedding
    ngram_ids = ngram_ids_torch(history, emb, hidden_states.shape[1])
    weight = emb.ngram_embedding.weight
    device = weight.device if weight.device.type != "meta" else ngram_ids.device
    embeddings = emb.ngram_embedding(ngram_ids.to(device)).to(history.device).flatten(-2)
    hc, hidden = layer.hc_count, layer.hidden_size
    key_normed = layer.norm_key(layer.key_proj(embeddings)).unflatten(-1, (hc, hidden))
    value = layer.value_proj(embeddings)
    query_normed = layer.norm_query(hidden_states).unflatten(-1, (hc, hidden))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / hidden**0.5
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = torch.sigmoid(gate) * value.unsqueeze(-2)
    gated_value_normed = layer.norm_conv(gated_value.flatten(-2))
    gated_value = gated_value.flatten(-2)
    gated_value = torch.where(valid[..., None], gated_value, 0)
    gated_value_normed = torch.where(valid[..., None], gated_value_normed, 0)
    return gated_value, gated_value_normed
