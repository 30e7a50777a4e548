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
activations stay in fp32 between them (one token: the down projection without tl.dot). With ``hc_norm_proj`` too
(off by default: slower on the H200, benchmarks/RESULTS.md),
`norm_mix_projections` also takes `hc_norm`'s work into those launches: the down projection adds the residual and
projects the streams before their norm, summing each range's squares; the up projection takes each stream's RMS
from those sums and scales the stream's share of the down projection by it. A mixing is two launches instead of
three.

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

from ..fusions import fusion_enabled
from . import keeps_own_forward, records_grad

FUSED_HC = fusion_enabled("hc")
# ``hc_proj``: on top of ``hc``, a mixing's three projections inside two launches (`mix_projections`)
# for steps of at most `HC_PROJ_MAX_TOKENS` tokens (decode and verify steps; prompts keep the GEMMs).
# On an H200 (benchmarks/sweep_hc_tiles.py) the two launches take 11.2 / 18.9 / 41.5 us at 1 / 8 / 32
# tokens against 16.9 / 22.7 / 23.8 us for the GEMMs' path: they win at 8 tokens and lose at 32; the switch
# sits between (16 tokens itself not timed).
FUSED_HC_PROJ = fusion_enabled("hc_proj")
HC_PROJ_MAX_TOKENS = 16
# ``hc_norm_proj``: on top of ``hc_proj``, the residual add and the grouped norm inside the first of those two
# launches (`norm_mix_projections`), one launch of `hc_norm` a mixing less (81 in a Qwen4Exp 40-layer step, 2.7
# us each on an H200). Slower on the H200 in both its forms: the first (each down-projection program reading its
# whole stream for the RMS first) made a 40-layer step 6.68 ms against 5.23, the present one 5.74 against 4.62.
FUSED_HC_NORM_PROJ = fusion_enabled("hc_norm_proj")


def use_fused(module, x: torch.Tensor) -> bool:
    submodules = (module, module.hc_norm, module.input_mix_weight_down, module.input_mix_weight_up,
                  module.block_inject_weight)  # (no injection weight in the final mixer)
    return (FUSED_HC and not records_grad(x) and module.hc_norm.weight.device == x.device
            and not any(keeps_own_forward(m, *m.parameters(recurse=False)) for m in submodules if m is not None))


def add_injection(streams: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """Upstream's residual: each of the ``hc`` streams ``[..., hc * H]`` plus ``out [..., H]`` times its
    injection weight ``inject [..., hc]``. With the ``hc`` fusion on, one pass (``addcmul``, rounded once) where
    upstream writes the product, then reads it back for the sum: at a 16384-token prompt chunk that is 0.3 GB
    written and read again per layer, and at a decode step one launch less per layer."""
    if not FUSED_HC:
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
    if FUSED_HC_PROJ and FUSED_HC_NORM_PROJ and few_tokens:
        return norm_mix_projections(streams, module.hc_norm.weight, module.hc_norm.eps, residual, *weights, hc)
    streams, normed = hc_norm(streams, module.hc_norm.weight, hc, module.hc_norm.eps, residual)
    mix = mix_projections if FUSED_HC_PROJ and few_tokens else mix_with_linears
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


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda


# ----------------------------------------------------------------------------- the three fused ops
def hc_norm(streams: torch.Tensor, weight: torch.Tensor, hc: int, eps: float,
            residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(streams, normed)``: ``streams [..., hc * H]`` (plus ``out [..., H] * inject [..., hc]`` per stream
    when ``residual = (out, inject)``, rounded to the streams' dtype), and its RMS norm over each stream's
    ``H`` features times ``1 + weight``, rounded to the streams' dtype."""
    if _triton(streams):
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
    if _triton(x):
        from .hyper_connection_triton import scaled_silu_triton

        return scaled_silu_triton(x, scale)
    return F.silu(x.float() * scale).to(x.dtype)


def mix_streams(up: torch.Tensor, normed: torch.Tensor, inject_logits: torch.Tensor | None,
                hc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(mixed [..., H], inject [..., hc])``: the mean over streams of ``sigmoid(up) * normed`` (both
    ``[..., hc * H]``) and ``2 sigmoid(inject_logits / hc)`` (None without logits), each rounded to
    ``normed``'s dtype."""
    if _triton(normed):
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
    if _triton(normed):
        from .hyper_connection_triton import mix_projections_triton

        return mix_projections_triton(normed, down, up, inject_weight, hc)
    x = normed.float()  # the same ops as `mix_with_linears`, with fp32 between them
    low = scaled_silu(x @ down.float().mT, 1.0 / hc)
    logits = x @ inject_weight.float().mT if inject_weight is not None else None
    return mix_streams(low @ up.float().mT, normed, logits, hc)


def norm_mix_projections(streams: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         residual: tuple[torch.Tensor, torch.Tensor] | None, down: torch.Tensor, up: torch.Tensor,
                         inject_weight: torch.Tensor | None,
                         hc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(mixed, streams, inject)``: `hc_norm` (the residual added when given), then `mix_projections` of the
    normed streams. On CUDA the same two launches as `mix_projections` (``hc_norm_proj``): the down projection
    projects the streams times the norm's weight before the division by their RMS, which the up projection applies
    to each stream's share: the same values but for fp32 summation order and, in bf16, where the projected values
    round (before the division, not after)."""
    if _triton(streams):
        from .hyper_connection_triton import norm_mix_projections_triton

        return norm_mix_projections_triton(streams, norm_weight, eps, residual, down, up, inject_weight, hc)
    streams, normed = hc_norm(streams, norm_weight, hc, eps, residual)
    mixed, inject = mix_projections(normed, down, up, inject_weight, hc)
    return mixed, streams, inject
