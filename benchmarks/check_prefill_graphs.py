"""Can a prefill-sized step run from a CUDA graph, and what would that save?

    python benchmarks/check_prefill_graphs.py --model qwen4_exp --layers 40 --shapes 1x256 4x256 1x2048   # GPU
    python benchmarks/check_prefill_graphs.py --model qwen4_exp --layers 4 --shapes 3x12 --tiny           # CPU

Why: an eager prefill step of Qwen4Exp at 40 layers is bound by host work (about 125-134 ms a step on an H100,
whatever its size up to a few thousand tokens: benchmarks/RESULTS.md, Continuous batching), and prefill steps are
most of the serving workload's time there. Decode and verify steps already replay graphs
(`hf_qsa_cache.cuda_graphs.DecodeGraphs`); its step takes any length, but only steps of up to ``MAX_STEP_LEN``
tokens are sent to it. This script sends it longer ones.

For each ``ROWSxL`` shape, two caches take the same ``--past`` random tokens a row, then ``--repeat`` + 1 steps of
``L`` new tokens a row (the same tokens for both): the ordinary forward on one cache (eager), `DecodeGraphs.step`
on the other (its first step of each shape runs eagerly on the graph's path and captures; later ones replay).
Reported per shape, as a JSON line: whether a graph was captured (else the error that stopped it), the median
eager step and the median replayed step in ms (synchronised), the replays, each capture's ms (what recording a new
shape costs, on top of that step run eagerly), and the largest difference between the two caches' logits (the last
column's: a prefill-sized recorded step computes that one alone). On the CPU (``--tiny``) nothing is recorded: the
graph's path runs eagerly from its static buffers, which checks that path against the forward at these lengths
(tests/scripts/test_check_prefill_graphs.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_grouped_step import add_shape_arguments, run_shapes, sync  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402
from hf_qsa_cache.cuda_graphs import capture_failures, graphs_of  # noqa: E402


def count_captures(runner) -> list[float]:
    """The milliseconds of each graph ``runner`` records from now on, one item per capture (a shape recorded more
    than once lost its graph between steps)."""
    took, capture = [], runner._capture

    def counted(entry):
        start = time.perf_counter()
        try:
            return capture(entry)
        finally:
            took.append(round(1e3 * (time.perf_counter() - start), 1))

    runner._capture = counted
    return took


def check_shape(model, rows: int, length: int, args, device, dtype) -> dict:
    config, vocab = model.config, model.config.vocab_size
    capacity = args.past + (args.repeat + 1) * length
    eager, static = (QSAPagedCache(config, rows, capacity, block_size=args.block, device=device, dtype=dtype)
                     for _ in range(2))
    runner = graphs_of(model, static, device, record=device == "cuda")
    captures = count_captures(runner)
    gen = torch.Generator().manual_seed(args.seed)
    past = torch.randint(2, vocab, (rows, args.past), generator=gen).to(device)
    mask = torch.ones_like(past)
    eager_ms, replay_ms, worst, scale = [], [], 0.0, 0.0
    with torch.no_grad():
        for cache in (eager, static):
            model(past, attention_mask=mask, past_key_values=cache)
        for i in range(args.repeat + 1):
            chunk = torch.randint(2, vocab, (rows, length), generator=gen).to(device)
            mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
            sync(device)
            start = time.perf_counter()
            want = model(chunk, attention_mask=mask, past_key_values=eager).logits
            sync(device)
            if i:  # (the first step of a shape compiles and tunes kernels)
                eager_ms.append(1e3 * (time.perf_counter() - start))
            replays = runner.replays
            start = time.perf_counter()
            got = runner.step(chunk, None, mask)
            sync(device)
            if runner.replays > replays:
                replay_ms.append(1e3 * (time.perf_counter() - start))
            want = want[:, -got.shape[1]:]  # (a prefill-sized recorded step computes its last column alone)
            worst = max(worst, (got.float() - want.float()).abs().max().item())
            scale = max(scale, want.float().abs().max().item())
    failures = [error for key, error in capture_failures(model).items() if key[3:5] == (runner.bucket(rows), length)]
    captured = any(b.graph is not None for b in runner.buckets.values())
    return {"rows": rows, "length": length, "past": args.past, "captured": captured,
            "capture_error": failures[0] if failures else None,
            "eager_ms": round(statistics.median(eager_ms), 3) if eager_ms else None,
            "replay_ms": round(statistics.median(replay_ms), 3) if replay_ms else None,
            "replays": runner.replays, "captures": len(captures), "capture_ms": captures, "steps": args.repeat + 1,
            "max_logit_diff": worst, "max_abs_logit": scale,
            "buckets": [list(k) for k in runner.buckets]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, ["1x256", "4x256", "1x2048"], block=256)
    args = parser.parse_args(argv)
    return run_shapes(args, {"check": "prefill_graphs"},
                      lambda model, rows, length, device, dtype: check_shape(model, rows, length, args, device, dtype))


if __name__ == "__main__":
    main()
