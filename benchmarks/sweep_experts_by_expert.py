"""Graph-timed: the expert-major experts kernels' tiles against the pair-major kernels and transformers'
``grouped_mm``, at the benchmark shapes, for steps of 4 to 64 tokens.

    python benchmarks/sweep_experts_by_expert.py   # CUDA only; one JSON line per (case, path)

Shapes of `bench_generate.py`'s configs (hidden 2048, intermediate 512, 64 experts, bf16): Qwen4Exp's top 10
with its gated shared expert, Inkling's top 6 with two router-weighted shared experts. Each time is the mean
of 8 calls recorded in one CUDA graph, each call on other inputs and routings (a call of 4 tokens already
reads about 200 MB of experts: L2 does not keep them). ``grouped_mm`` is transformers' function on the routed
experts only (the shared experts would cost it more launches). ``floor_us`` is the bytes of the distinct
experts a call routes to, plus the shared ones, at 4.25 TB/s (the copy bandwidth `bench_generate.py`
measured). ``max_err`` is each path's largest difference from the torch specification in fp32 on the same
bf16 values (`selected_experts_torch`), for the first call.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import qwen4_exp_config  # noqa: E402
from transformers.integrations import moe  # noqa: E402
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextExperts  # noqa: E402

from hf_qsa_cache.ops import experts  # noqa: E402
from hf_qsa_cache.ops import experts_by_expert_triton as be  # noqa: E402
from hf_qsa_cache.ops import experts_triton as et  # noqa: E402
from sweep_experts_tiles import graph_us  # noqa: E402

HIDDEN, INTER, EXPERTS = 2048, 512, 64
CALLS = 8
BANDWIDTH = 4.25e12
# (gate-up columns, chunk, warps), (down columns, chunk, expert ranges, warps): the defaults first.
CONFIGS = [
    (be.GATE_UP_TILES, be.DOWN_TILES),
    ((64, 128, 4), be.DOWN_TILES),
    ((32, 64, 4), (32, 64, 4, 4)),
    ((32, 128, 8), (64, 128, 4, 8)),
    (be.GATE_UP_TILES, (16, 128, 8, 4)),
    (be.GATE_UP_TILES, (32, 128, 1, 4)),
    ((16, 256, 4), (32, 256, 2, 4)),
]


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    gate_up, down = rand(EXPERTS, 2 * INTER, HIDDEN, scale=0.02), rand(EXPERTS, HIDDEN, INTER, scale=0.02)
    with torch.device("meta"):  # transformers' experts module, holding the weights above
        module = Qwen4ExpTextExperts(qwen4_exp_config(4))
    module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down, requires_grad=False)
    expert_bytes = 3 * INTER * HIDDEN * 2
    for name, top_k, shared_kind, token_counts in (("qwen", 10, "vec", (4, 8, 16, 32)),
                                                   ("inkling", 6, "two", (8, 32, 64))):
        for tokens in token_counts:
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
            distinct = sum(len(set(i.reshape(-1).tolist())) for i in index) / CALLS
            floor = (distinct + shared.gate.shape[0]) * expert_bytes / BANDWIDTH * 1e6
            spec = experts.selected_experts_torch(xs[0].float(), index[0], weights[0].float(), gate_up.float(),
                                                  down.float(), False, shared._replace(
                                                      gate=shared.gate.float(), up=shared.up.float(),
                                                      down=shared.down.float(),
                                                      gate_vector=None if shared.gate_vector is None
                                                      else shared.gate_vector.float(),
                                                      token_weights=None if shared.token_weights is None
                                                      else shared.token_weights.float()))
            case = {"case": f"{name} T={tokens} k={top_k}", "distinct_experts": round(distinct, 1),
                    "floor_us": round(floor, 1)}

            def report(path, fn, with_shared=True, **extra):
                us = graph_us([lambda i=i: fn(i) for i in range(CALLS)])
                out = fn(0).float()
                err = (out - spec).abs().max().item() if with_shared else None
                print(json.dumps({**case, "path": path, **extra, "us": round(us, 1),
                                  "x_floor": round(us / floor, 2), "max_err": err}), flush=True)

            report("pair-major", lambda i: et.selected_experts_triton(xs[i], index[i], weights[i], gate_up, down,
                                                                         False, shared))
            for gate_up_tiles, down_tiles in CONFIGS:
                report("expert-major", lambda i, g=gate_up_tiles, d=down_tiles: be.selected_experts_by_expert_triton(
                    xs[i], index[i], weights[i], gate_up, down, False, shared, gate_up_tiles=g, down_tiles=d),
                    gate_up_tiles=gate_up_tiles, down_tiles=down_tiles)
            try:
                report("grouped_mm (routed only)", lambda i: moe.grouped_mm_experts_forward(
                    module, xs[i], index[i], weights[i]), with_shared=False)
            except Exception as err:  # noqa: BLE001 - a reference path; its failure is reported, not fatal
                print(json.dumps({**case, "path": "grouped_mm", "error": repr(err)[:200]}), flush=True)


if __name__ == "__main__":
    main()
