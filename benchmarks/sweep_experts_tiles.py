"""Graph-timed sweep of the selected-experts kernels' tiles at the benchmark shapes, and the Inkling router.

    python benchmarks/sweep_experts_tiles.py   # CUDA only; one JSON line per configuration

`hf_qsa_cache.ops.experts_triton` takes its tiles from module constants (gate-up columns, down columns,
reduction chunk, warps); this sets them one configuration at a time, starting from the general tiles and
changing one at a time, then a few combinations. Shapes: hidden 2048, intermediate 512, 64 experts in bf16
(`bench_generate.py`'s configs), Qwen4Exp's top 10 with its gated shared expert and Inkling's top 6 with two
router-weighted shared experts, at 1 and 8 tokens. Each time is the mean of 16 calls recorded in one CUDA
graph, replayed 5 times, each call on other experts and inputs (the 60 MB a call reads do not stay in L2
from one call to the next). ``diff_vs_first`` is the largest output difference from the first
configuration (bf16 rounding of another summation order). Then the Inkling router (`inkling_router_triton`,
its projection's splits) beside its torch specification, at 1 and 32 tokens.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_qsa_cache.ops import experts, inkling_router, inkling_router_triton  # noqa: E402
from hf_qsa_cache.ops import experts_triton as et  # noqa: E402

HIDDEN, INTER, EXPERTS = 2048, 512, 64
CALLS = 16


def graph_us(calls: list, rounds: int = 5) -> float:
    """Mean microseconds per call of ``calls`` recorded in one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (rounds * len(calls))


def graph_time_us(fn, calls: int = 20) -> float:
    """Microseconds of one ``fn()`` replayed in a CUDA graph of ``calls`` calls (no launch gaps of the host,
    as in a graphed decode step)."""
    return graph_us([fn] * calls)


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    gate_up, down = rand(EXPERTS, 2 * INTER, HIDDEN, scale=0.02), rand(EXPERTS, HIDDEN, INTER, scale=0.02)
    general = dict(gu=et.GATE_UP_BLOCK_N, dn=et.DOWN_BLOCK_N, bk=et.BLOCK_K, w=et.NUM_WARPS)
    configs = ([general] + [dict(general, bk=v) for v in (64, 256, 512)] + [dict(general, w=v) for v in (2, 8)]
               + [dict(general, gu=v) for v in (8, 32)] + [dict(general, dn=v) for v in (4, 8, 32)]
               + [dict(gu=16, dn=8, bk=256, w=4), dict(gu=16, dn=8, bk=512, w=8), dict(gu=8, dn=8, bk=256, w=4),
                  dict(gu=32, dn=8, bk=256, w=8), dict(gu=16, dn=4, bk=512, w=4)]
               # few rows a program and long chunks, as the projections' one-token GEMV form
               + [dict(gu=8, dn=4, bk=1024, w=4), dict(gu=4, dn=4, bk=1024, w=4), dict(gu=8, dn=8, bk=1024, w=8),
                  dict(gu=4, dn=8, bk=512, w=4), dict(gu=8, dn=4, bk=512, w=4), dict(gu=4, dn=4, bk=512, w=2)])
    one_token = et.ONE_TOKEN_TILES
    for name, tokens, top_k, shared_kind in (("qwen", 1, 10, "vec"), ("qwen", 8, 10, "vec"),
                                             ("inkling", 1, 6, "two"), ("inkling", 8, 6, "two")):
        xs = [rand(tokens, HIDDEN) for _ in range(CALLS)]
        index = [torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
                 for _ in range(CALLS)]
        weights = [torch.rand(tokens, top_k, generator=gen).to(device, torch.bfloat16) for _ in range(CALLS)]
        if shared_kind == "vec":
            shared = experts.SharedExpert(rand(1, INTER, HIDDEN, scale=0.02), rand(1, INTER, HIDDEN, scale=0.02),
                                          rand(1, HIDDEN, INTER, scale=0.02), gate_vector=rand(1, HIDDEN, scale=0.02))
        else:
            shared = experts.SharedExpert(rand(2, INTER, HIDDEN, scale=0.02), rand(2, INTER, HIDDEN, scale=0.02),
                                          rand(2, HIDDEN, INTER, scale=0.02), token_weights=torch.rand(
                                              tokens, 2, generator=gen).to(device, torch.bfloat16))
        first = None
        try:
            # The sweep sets the general tiles; ONE_TOKEN_TILES is set to each configuration too, so that
            # one-token cases run the configuration swept rather than the one-token policy.
            for c in configs:
                et.GATE_UP_BLOCK_N, et.DOWN_BLOCK_N, et.BLOCK_K, et.NUM_WARPS = c["gu"], c["dn"], c["bk"], c["w"]
                et.ONE_TOKEN_TILES = (c["gu"], c["dn"], c["bk"], c["w"])
                calls = [lambda i=i: et.selected_experts_triton(xs[i], index[i], weights[i], gate_up, down, False,
                                                                shared) for i in range(CALLS)]
                us = graph_us(calls)
                out = calls[0]()
                first = out if first is None else first
                print(json.dumps({"sweep": "experts", "case": f"{name} T={tokens} k={top_k}", **c, "us": round(us, 2),
                                  "diff_vs_first": (out.float() - first.float()).abs().max().item()}), flush=True)
        finally:
            et.GATE_UP_BLOCK_N, et.DOWN_BLOCK_N, et.BLOCK_K, et.NUM_WARPS = (general["gu"], general["dn"],
                                                                             general["bk"], general["w"])
            et.ONE_TOKEN_TILES = one_token
        if tokens == 1:  # the selected experts' bytes at the copy bandwidth measured by bench_generate.py
            print(json.dumps({"case": f"{name} T=1", "floor_us_approx": round(
                top_k * 3 * INTER * HIDDEN * 2 / 4.25e12 * 1e6, 2)}))

    for tokens in (1, 32):
        x, w = rand(tokens, HIDDEN), rand(EXPERTS + 2, HIDDEN, scale=0.02)
        args = (x, w, torch.rand(EXPERTS, generator=gen).to(device) * 0.1, torch.ones(1, device=device), 6, 2, 2.5)
        for splits in (None, 1, 4, 8):
            us = graph_us([lambda: inkling_router_triton.inkling_router_triton(*args, splits=splits)] * 8)
            print(json.dumps({"sweep": "inkling_router", "T": tokens, "splits": splits, "us": round(us, 2)}), flush=True)
        us = graph_us([lambda: inkling_router.route_inkling_torch(*args)] * 8)
        print(json.dumps({"sweep": "inkling_router torch spec", "T": tokens, "us": round(us, 2)}), flush=True)


if __name__ == "__main__":
    main()
