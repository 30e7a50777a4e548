"""Qwen4Exp's gated hyper-connections with their elementwise work fused (``hc`` in `hf_qsa_cache.fusions`).

Each decoder layer mixes its ``hc`` residual streams twice (before the attention or GatedDeltaNet block,
before the MoE block) with transformers' ``Qwen4ExpTextGatedResidual``, and adds each block's output
back into the streams. Upstream that is 16 small kernels per mixing besides its three projections (a
grouped RMS norm, scalings and activations; counted with `benchmarks/profile_decode_step.py`), among the
most of a decode step's launches. Here one mixing is three elementwise launches around the same three
projections (transformers' ``nn.Linear`` weights, read as they are):

* `hc_norm`: the grouped RMS norm of the streams; with ``residual=(out, inject)`` it first adds the
  previous block's output into the streams (``streams + out * inject`` per stream), so the residual
  add and the next norm are one pass;
* `scaled_silu`: ``silu(x / hc)`` on the low-rank projection;
* `mix_streams`: ``mean_c(sigmoid(up_c) * normed_c)`` and the injection weights ``2 sigmoid(w / hc)``.

With ``hc_proj`` as well (on by default), a step of at most `HC_PROJ_MAX_TOKENS` tokens runs everything
after `hc_norm` in two launches, `mix_projections`: the down and injection projections as one split-K pass
over the normed streams, then the up projection with the gating and the mean over streams; the low-rank
activations stay in fp32 between them (one token: the down projection without tl.dot).

Each computes in fp32 and rounds its outputs once (upstream rounds after every op in bf16: the results
differ by bf16 rounding and are judged against fp32). The torch functions here are the specification
(and what the CPU runs); `hyper_connection_triton` holds the kernels, tested against them.

The fused path applies when the ``hc`` fusion is on (the default), autograd records nothing, the
module's weights sit on the activations' device as plain tensors, and neither the module nor its parts
has hooks (a user's, accelerate's offloading: `keeps_own_forward`);
otherwise the module runs upstream's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fusions, keeps_own_forward, records_grad, use_triton

# ``hc_proj``: on top of ``hc``, a mixing's three projections inside two launches (`mix_projections`)
# for steps of at most `HC_PROJ_MAX_TOKENS` tokens (decode and verify steps; prompts keep the GEMMs).
# The two launches beat the GEMMs' path at 8 tokens and lose at 32 (benchmarks/sweep_hc_tiles.py); the switch
# sits between.
HC_PROJ_MAX_TOKENS = 16


def use_fused(module, x: torch.Tensor) -> bool:
    submodules = (module, module.hc_norm, module.input_mix_weight_down, module.input_mix_weight_up,
                  module.block_inject_weight)  # (no injection weight in the final mixer)
    return (fusions.enabled("hc") and not records_grad(x) and module.hc_norm.weight.device == x.device
            and not any(keeps_own_forward(m, *m.parameters(recurse=False)) for m in submodules if m is not None))


def add_injection(streams: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """Upstream's residual: each of the ``hc`` streams ``[..., hc * H]`` plus ``out [..., H]`` times its
    injection weight ``inject [..., hc]``. With the ``hc`` fusion on, one pass (``addcmul``, rounded once) where
    upstream writes the product, then reads it back for the sum: at a 16384-token prompt chunk that is 0.3 GB
    written and read again per layer, and at a decode step one launch less per layer."""
    if not fusions.enabled("hc"):
        return streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
    grouped = streams.unflatten(-1, (inject.shape[-1], -1))
    return torch.addcmul(grouped, out.unsqueeze(-2), inject.unsqueeze(-1)).flatten(-2)


def gated_residual(module, streams: torch.Tensor, residual: tuple | None = None):
    """``(block_input, streams, inject)`` as ``module(streams)`` returns them (transformers'
    ``Qwen4ExpTextGatedResidual`` with its injection), after adding ``residual = (out, inject)`` of the
    previous block into ``streams`` when given. Fused when `use_fused`, else upstream's own ops. The final
    mixer (no injection weight) gives ``(mixed, streams, None)``."""
    if not use_fused(module, streams):
        if residual is not None:
            streams = add_injection(streams, *residual)
        out = module(streams)
        return out if module.block_inject_weight is not None else (out, streams, None)
    hc = module.hc_count
    inject = module.block_inject_weight
    weights = (module.input_mix_weight_down.weight, module.input_mix_weight_up.weight,
               inject.weight if inject is not None else None)
    few_tokens = streams.numel() <= HC_PROJ_MAX_TOKENS * streams.shape[-1]
    streams, normed = hc_norm(streams, module.hc_norm.weight, hc, module.hc_norm.eps, residual)
    mix = mix_projections if fusions.enabled("hc_proj") and few_tokens else mix_with_linears
    block_input, inject = mix(normed, *weights, hc)
    return block_input, streams, inject


def mix_with_linears(normed: torch.Tensor, down: torch.Tensor, up: torch.Tensor, inject_weight: torch.Tensor | None,
                     hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(mixed, inject)`` from the normed streams with the three projections as GEMMs (rounded to the
    activations' dtype) around `scaled_silu` and `mix_streams`: the ``hc`` fusion without ``hc_proj``
    (``inject`` None without an injection weight)."""
    low = scaled_silu(F.linear(normed, down), 1.0 / hc)
    logits = F.linear(normed, inject_weight) if inject_weight is not None else None
    return mix_streams(F.linear(low, up), normed, logits, hc)


# ----------------------------------------------------------------------------- the three fused ops
def hc_norm(streams: torch.Tensor, weight: torch.Tensor, hc: int, eps: float,
            residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(streams, normed)``: ``streams [..., hc * H]`` (plus ``out [..., H] * inject [..., hc]`` per stream
    when ``residual = (out, inject)``, rounded to the streams' dtype), and its RMS norm over each stream's
    ``H`` features times ``1 + weight``, rounded to the streams' dtype."""
    if use_triton(streams):
        from .hyper_connection_triton import hc_norm_triton

        return hc_norm_triton(streams, weight, hc, eps, residual)
    if residual is not None:
        out, inject = residual
        grouped = streams.float().unflatten(-1, (hc, -1)) + out.float().unsqueeze(-2) * inject.float().unsqueeze(-1)
        streams = grouped.flatten(-2).to(streams.dtype)
    x = streams.float().unflatten(-1, (hc, -1))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return streams, (normed.flatten(-2) * (1.0 + weight.float())).to(streams.dtype)


def scaled_silu(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``silu(x * scale)`` in fp32, rounded to ``x``'s dtype."""
    if use_triton(x):
        from .hyper_connection_triton import scaled_silu_triton

        return scaled_silu_triton(x, scale)
    return F.silu(x.float() * scale).to(x.dtype)


def mix_streams(up: torch.Tensor, normed: torch.Tensor, inject_logits: torch.Tensor | None,
                hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(mixed [..., H], inject [..., hc])``: the mean over streams of ``sigmoid(up) * normed`` (both
    ``[..., hc * H]``) and ``2 sigmoid(inject_logits / hc)`` (None without logits), each rounded to
    ``normed``'s dtype."""
    if use_triton(normed):
        from .hyper_connection_triton import mix_streams_triton

        return mix_streams_triton(up, normed, inject_logits, hc)
    gates = torch.sigmoid(up.float()).unflatten(-1, (hc, -1))
    mixed = (gates * normed.float().unflatten(-1, (hc, -1))).mean(-2)
    if inject_logits is None:
        return mixed.to(normed.dtype), None
    inject = 2 * torch.sigmoid(inject_logits.float() / hc)
    return mixed.to(normed.dtype), inject.to(normed.dtype)


def mix_projections(normed: torch.Tensor, down: torch.Tensor, up: torch.Tensor, inject_weight: torch.Tensor | None,
                    hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(mixed, inject)`` from the normed streams ``[..., hc * H]``: what the three projections, `scaled_silu`
    and `mix_streams` give, in fp32 from the loaded values on (one rounding per output, none between):
    ``low = silu(normed @ down.T / hc)``, ``mixed = mean_c(sigmoid(low @ up.T) * normed)`` over the streams,
    ``inject = 2 sigmoid(normed @ inject_weight.T / hc)``. Two launches on CUDA (the ``hc_proj`` fusion)."""
    if use_triton(normed):
        from .hyper_connection_triton import mix_projections_triton

        return mix_projections_triton(normed, down, up, inject_weight, hc)
    x = normed.float()  # the same ops as `mix_with_linears`, with fp32 between them
    low = scaled_silu(x @ down.float().mT, 1.0 / hc)
    logits = x @ inject_weight.float().mT if inject_weight is not None else None
    return mix_streams(low @ up.float().mT, normed, logits, hc)


def defers_residual(layer, streams: torch.Tensor, output_seen) -> bool:
    """Whether Qwen4Exp's layer loop leaves ``layer``'s MoE residual for the next layer's fused norm to add (one
    launch a layer less): with the ``hc`` fusion on, autograd not recording (the fused norm runs only then, and
    activation checkpointing tracks only a layer's tensor arguments), and nothing outside that must see the layer's
    output whole (``output_seen(layer)``: a hook, an output recorder collecting hidden states)."""
    return fusions.enabled("hc") and not records_grad(streams) and not output_seen(layer)
