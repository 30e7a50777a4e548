"""Graph-timed: several projections of the same tokens in one launch (`hf_qsa_cache.ops.linears_triton`) against
cuBLAS's one GEMV per weight, at the benchmark models' decode shapes, with the kernel's tiles swept.

    python benchmarks/sweep_projections.py   # CUDA only; one JSON line per (case, path)

Cases (bf16, hidden 2048, `bench_generate.py`'s configs): Qwen4Exp's GatedDeltaNet input projections (qkv
8192, z 4096, b 32, a 32 rows), its QSA layer's (q with gate 8192, k 512, v 512, indexer 4224), Inkling's
attention (q 2048, k 512, v 512, relative 256), and one projection alone (GatedDeltaNet's out_proj, 4096 ->
2048; Inkling's o_proj, 2048 -> 2048), at 1, 8 and 16 tokens; at one token also the kernel's GEMV form (no
tl.dot). Each time is the mean of 16 calls recorded in one CUDA graph, the calls rotating over 4 to 16 copies
of the weights (about 150 MB or more in all, so that L2 does not keep them). ``floor_us``: the weights' bytes at
4.25 TB/s (the copy bandwidth `bench_generate.py` measured). ``max_err``: the largest difference from the fp32 math on
the same bf16 values, first call.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_qsa_cache.ops import linears_triton as lt  # noqa: E402
from sweep_experts_tiles import graph_us  # noqa: E402

CASES = {"gdn_in": (2048, [8192, 4096, 32, 32]), "qsa_in": (2048, [8192, 512, 512, 4224]),
         "inkling_in": (2048, [2048, 512, 512, 256]), "out_proj": (4096, [2048]), "inkling_o_proj": (2048, [2048])}
TILES = [lt.TILES, lt.ONE_TOKEN_DOT_TILES, (16, 128, 4), (16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 512, 8),
         (64, 128, 4), (64, 256, 8)]
# The GEMV form (no tl.dot), one token only: rows per program x chunk x warps.
GEMV_TILES = [lt.ONE_TOKEN_TILES, lt.ONE_TOKEN_WIDE_TILES, (8, 512, 4, True), (16, 1024, 8, True), (2, 1024, 2, True),
              (2, 2048, 4, True), (4, 2048, 4, True), (4, 2048, 8, True), (8, 2048, 8, True), (4, 512, 2, True)]
CALLS, BANDWIDTH = 16, 4.25e12
# Each call reads other weights: enough copies (at most one a call) that a replay reads about 3 x the H200's 50 MB of
# L2 (4 copies of Inkling's o_proj, 34 MB, stayed in L2 and timed faster than DRAM allows).
L2_BYTES = 50 << 20


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    for name, (K, rows) in CASES.items():
        copies = min(CALLS, max(4, -(-3 * L2_BYTES // (sum(rows) * K * 2))))
        weights = [[(torch.randn(n, K, generator=gen) * 0.02).to(device, torch.bfloat16) for n in rows]
                   for _ in range(copies)]
        floor = sum(rows) * K * 2 / BANDWIDTH * 1e6
        for tokens in (1, 8, 16):
            xs = [torch.randn(tokens, K, generator=gen).to(device, torch.bfloat16) for _ in range(CALLS)]
            exact = [xs[0].float() @ w.float().T for w in weights[0]]
            case = {"case": name, "rows": rows, "K": K, "tokens": tokens, "floor_us": round(floor, 1),
                    "copies": copies}

            def report(path, fn, **extra):
                us = graph_us([lambda i=i: fn(xs[i], weights[i % copies]) for i in range(CALLS)])
                err = max((o.float() - e).abs().max().item() for o, e in zip(fn(xs[0], weights[0]), exact))
                print(json.dumps({**case, "path": path, **extra, "us": round(us, 2), "x_floor": round(us / floor, 2),
                                  "max_err": err}), flush=True)

            report("cublas", lambda x, ws: [F.linear(x, w) for w in ws])
            for tiles in TILES + (GEMV_TILES if tokens == 1 else []):
                report("one launch", lambda x, ws, t=tiles: lt.linears_triton(x, ws, tiles=t), tiles=tiles)


if __name__ == "__main__":
    main()
