"""Graph-timed search for the tiles of the hyper-connection projections (``hc_proj``), beside the GEMMs they replace.

    python benchmarks/sweep_hc_tiles.py          # CUDA only; one JSON line per configuration tried
    python benchmarks/sweep_hc_tiles.py --gemv   # only the one-token search of the down projection's GEMV form

`hf_qsa_cache.ops.hyper_connection_triton.mix_projections_triton` takes a `MixTiles` (input splits, down
projection's column block / reduction block / warps, up projection's column block / low-rank chunk / warps).
Starting from `ONE_TOKEN_DOT_MIX_TILES`, each field in turn is set to each of its candidate values with the others
held, and the fastest is kept (coordinate descent, two passes at one token, one more at 8 and 32 tokens
starting from the one-token winner), then one pass at one token over the GEMV form of the down projection
(``gemv=True``, no tl.dot) from `ONE_TOKEN_MIX_TILES`. Shapes: hidden 2048, 4 streams, low rank 320 in bf16
(`bench_generate.py`'s Qwen4Exp). Each time is the mean of 16 calls recorded in one CUDA graph, replayed 5
times, each call on its own weights and inputs (the 170 MB they read do not stay in L2). Each line also
gives ``mix_with_linears`` (what ``hc`` runs without ``hc_proj``: three cuBLAS GEMMs around two kernels)
and the floor: the weights' bytes at 4.25 TB/s. ``max_diff`` is the largest difference of ``mixed`` from
the torch specification on the same inputs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep_experts_tiles import graph_us  # noqa: E402

from hf_qsa_cache.ops import hyper_connection as hc_ops  # noqa: E402
from hf_qsa_cache.ops import hyper_connection_triton as hct  # noqa: E402

HIDDEN, HC, RANK = 2048, 4, 320
CALLS = 16
CANDIDATES = dict(splits=(4, 8, 16, 32, 64), block_n=(16, 32, 64), block_k=(64, 128, 256, 512), down_warps=(2, 4, 8),
                  block_h=(4, 8, 16, 32), r_chunk=(32, 64, 128, 512), up_warps=(1, 2, 4, 8))
GEMV_CANDIDATES = dict(splits=(4, 8, 16, 32), block_n=(2, 4, 8), block_k=(256, 512, 1024, 2048),
                       down_warps=(2, 4, 8), block_h=(8, 16, 32), r_chunk=(64, 128, 512), up_warps=(4, 8))


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    K = HC * HIDDEN
    weights = [(rand(RANK, K, scale=0.02), rand(K, RANK, scale=0.1), rand(HC, K, scale=0.02)) for _ in range(CALLS)]
    floor_us = (2 * RANK + HC) * K * 2 / 4.25e12 * 1e6
    best = hct.ONE_TOKEN_DOT_MIX_TILES
    searches = [(1, 2, CANDIDATES), (8, 1, CANDIDATES), (32, 1, CANDIDATES), (1, 1, GEMV_CANDIDATES)]
    if "--gemv" in sys.argv[1:]:
        searches = searches[-1:]
    for tokens, passes, candidates in searches:
        if candidates is GEMV_CANDIDATES:
            best = hct.ONE_TOKEN_MIX_TILES
        xs = [rand(tokens, K) for _ in range(CALLS)]
        want = hc_ops.mix_projections(xs[0].cpu(), *(w.cpu() for w in weights[0]), HC)[0]
        linears_us = graph_us([lambda i=i: hc_ops.mix_with_linears(xs[i], *weights[i], HC) for i in range(CALLS)])
        seen: dict = {}

        def measure(tiles: hct.MixTiles) -> float:
            if tiles not in seen:
                calls = [lambda i=i: hct.mix_projections_triton(xs[i], *weights[i], HC, tiles) for i in range(CALLS)]
                us = graph_us(calls)
                got = calls[0]()[0].cpu()
                seen[tiles] = us
                print(json.dumps({"sweep": "hc_proj", "tokens": tokens, **dataclasses.asdict(tiles), "us": round(us, 2),
                                  "mix_with_linears_us": round(linears_us, 2), "floor_us": round(floor_us, 2),
                                  "max_diff": (got.float() - want.float()).abs().max().item()}), flush=True)
            return seen[tiles]

        if candidates is GEMV_CANDIDATES:
            measure(hct.ONE_TOKEN_DOT_MIX_TILES)  # the dot form's best, timed beside the search
        for _ in range(passes):
            for field, values in candidates.items():
                for value in values:
                    tiles = dataclasses.replace(best, **{field: value})
                    if measure(tiles) < measure(best):
                        best = tiles
        print(json.dumps({"sweep": "hc_proj best", "tokens": tokens, **dataclasses.asdict(best),
                          "us": round(seen[best], 2), "mix_with_linears_us": round(linears_us, 2),
                          "floor_us": round(floor_us, 2)}), flush=True)


if __name__ == "__main__":
    main()
