"""Programmatic dependent launch on the GPU, alone: a chain of a decode step's small kernels recorded in one CUDA
graph, timed with the ``pdl`` setting off and on, and the chain's output compared bit for bit.

    python benchmarks/check_pdl.py   # CUDA, compute capability 9 or more; one JSON line per variant

The chain (bf16, one token, hidden 2048): `add_rms_norm_triton`, then Inkling's four input projections in one
launch (`linears_triton`; each link its own weights, 13 MB, so that L2 does not keep them from the replay before),
the query's output feeding the next link's norm: 2 kernels a link, 64 links. Variants: ``pdl`` off; on (early
launch and the projections' weight prefetch); on with the projections' one-token dot tiles. ``us_per_kernel``
is a replay's time over its kernels; the gap early launch hides is the difference between the first two.
tests/gpu/test_gpu_pdl.py checks the first two variants' outputs equal.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_qsa_cache.fusions import fused  # noqa: E402
from hf_qsa_cache.ops import linears_triton, rms_norm_triton  # noqa: E402
from sweep_experts_tiles import graph_us  # noqa: E402

HIDDEN, ROWS, LINKS, REPLAYS = 2048, (2048, 512, 512, 256), 64, 10


def chain(x, norm_weight, weights):
    for link in weights:
        _, normed = rms_norm_triton.add_rms_norm_triton(x, None, norm_weight, 1e-6)
        x = linears_triton.linears_triton(normed, link)[0]
    return x


def timed(x, norm_weight, weights) -> tuple[float, torch.Tensor]:
    """Microseconds a kernel of the chain replayed in a CUDA graph, and the chain's output from the replays."""
    held = {}
    us = graph_us([lambda: held.__setitem__("out", chain(x, norm_weight, weights))], rounds=REPLAYS)
    return us / (2 * LINKS), held["out"].clone()


def inputs(device) -> tuple:
    """The chain's input, its norm weight and each link's four projection weights (bf16)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=gen).to(device, torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(device, torch.bfloat16)
    weights = [[(torch.randn(n, HIDDEN, generator=gen) * 0.02).to(device, torch.bfloat16) for n in ROWS]
               for _ in range(LINKS)]
    return x, norm_weight, weights


def variant(pdl: bool, tiles, *chain_inputs) -> tuple[float, torch.Tensor]:
    """`timed` with the ``pdl`` setting on or off and the projections' one-token tiles ``tiles``."""
    shipped = linears_triton.ONE_TOKEN_TILES
    linears_triton.ONE_TOKEN_TILES = tiles
    try:
        with fused(("pdl",), on=pdl):
            return timed(*chain_inputs)
    finally:
        linears_triton.ONE_TOKEN_TILES = shipped


def main() -> int:
    chain_inputs = inputs(torch.device("cuda"))
    shipped = linears_triton.ONE_TOKEN_TILES
    results = {}
    for name, pdl, tiles in [("pdl off", False, shipped), ("pdl on", True, shipped),
                             ("pdl on, dot tiles", True, linears_triton.ONE_TOKEN_DOT_TILES)]:
        us, out = variant(pdl, tiles, *chain_inputs)
        results[name] = out
        same = torch.equal(out, results["pdl off"]) if name != "pdl on, dot tiles" else None
        print(json.dumps({"variant": name, "us_per_kernel": round(us, 3), "kernels": 2 * LINKS,
                          "same_as_pdl_off": same}), flush=True)
    ok = torch.equal(results["pdl on"], results["pdl off"])
    print("PDL CHAIN MATCHES" if ok else "PDL CHAIN DIFFERS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
