"""The first call of Qwen4Exp's chunked GatedDeltaNet at each new batch size against the calls after it, on the
rectangle (transformers' bound kernel as is) and packed (`hf_qsa_cache.ops.gated_delta.chunked_rule`), bf16, one
GPU. flash-linear-attention autotunes per batch size, so on the rectangle each new size costs its first call a
round of timings (716-736 ms against 0.9-1.6 ms after, H100, at 6525d61: a probe that called
flash-linear-attention's function directly as this script's rectangle half does, 16 heads of 128, 64 tokens);
packed, every size has the same autotuning keys (this script itself not yet run on a GPU).

    python benchmarks/check_first_shapes.py --sizes 1 2 3 5 8 13 --length 64

Prints one JSON line per (way, batch size): ``first_ms``, ``again_ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_qsa_cache.ops.gated_delta import chunked_rule, takes_packed_sequences  # noqa: E402


def timed(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 5, 8, 13])
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    from transformers.models.qwen4_exp.modeling_qwen4_exp import torch_chunk_gated_delta_rule as rule

    if not takes_packed_sequences(rule):
        sys.exit("transformers did not bind flash-linear-attention's kernel (not installed?)")
    H, D = args.heads, args.head_dim

    def inputs(B):
        q, k, v = (torch.randn(B, args.length, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g = -torch.rand(B, args.length, H, device="cuda")
        beta = torch.rand(B, args.length, H, device="cuda", dtype=torch.bfloat16)
        return q, k, v, g, beta, torch.zeros(B, H, D, D, device="cuda")

    ways = {
        "rectangle": lambda q, k, v, g, beta, s: rule(q, k, v, g=g, beta=beta, initial_state=s,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True),
        "packed": lambda q, k, v, g, beta, s: chunked_rule(rule, q, k, v, g, beta, s),
    }
    for way, call in ways.items():
        for B in args.sizes:
            x = inputs(B)
            first = timed(lambda: call(*x))
            again = timed(lambda: call(*x))
            print(json.dumps({"bench": "first_shapes", "way": way, "batch": B, "length": args.length,
                              "first_ms": round(first, 2), "again_ms": round(again, 2),
                              "gpu": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
