"""Where a plain generate() call's decode steps spend their time: the GPU's idle gaps and what the host was
running in them.

    python benchmarks/profile_loop_timeline.py --model inkling --layers 6 --prompt 16384
    python benchmarks/profile_loop_timeline.py --model inkling --device cpu --tiny --prompt 40   # logic check (CI)

A batch-1 step can take twice its graph's GPU time (Inkling 6 layers at 1 x 16384: 1.05 ms a step end to end,
the GPU busy 0.54 ms of it; benchmarks/RESULTS.md). This profiles ``--tokens`` greedy tokens of one row in the
loop generate() runs (bf16 and CUDA graphs on a GPU), continuing a prompt the cache already holds (as
`bench_generate.py`'s end-to-end figure does), under the torch profiler with CPU and CUDA activities, and
prints per token:

* the wall time, the GPU's busy time (the union of its kernels' intervals) and its idle time;
* the idle time by the innermost host op running when each gap of the GPU began (the host work the GPU
  waited for), gaps of at least ``--min-gap-us``;
* the host ops with the most self time.

On the CPU (no CUDA activity) only the host table is printed. ``--trace`` writes the chrome trace.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_generate import prefilled  # noqa: E402
from bench_speculative import build  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402


def gaps_by_host_op(kernels: list[tuple[float, float]], host: list[tuple[float, float, str]],
                    min_gap_us: float) -> tuple[float, float, Counter]:
    """(GPU busy us, GPU idle us between its first and last kernel, idle us by the innermost host op running at
    the start of each gap of at least ``min_gap_us``) from kernel intervals ``(start, end)`` and host ops
    ``(start, end, name)``."""
    busy = idle = 0.0
    end, by_op = None, Counter()
    for start, stop in sorted(kernels):
        if end is None or start >= end:
            if end is not None:
                gap = start - end
                idle += gap
                if gap >= min_gap_us:
                    running = [h for h in host if h[0] <= end < h[1]]
                    innermost = min(running, key=lambda h: h[1] - h[0], default=None)
                    by_op[innermost[2] if innermost is not None else "(no host op)"] += gap
            busy += stop - start
            end = stop
        else:  # overlaps what ran before: only its part past the end counts
            busy += max(0.0, stop - end)
            end = max(end, stop)
    return busy, idle, by_op


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="inkling")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the test suite's small fp32 configs")
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--trace", default=None, help="write the chrome trace here")
    args = parser.parse_args(argv)

    on_gpu = torch.device(args.device).type == "cuda"
    model, layers = build(args.model, args.layers, args.device, args.tiny)  # bf16 unless tiny
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(2, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    mask = torch.ones_like(ids)
    cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=args.prompt + 2 * args.tokens + 8)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    with torch.no_grad():
        first, more = prefilled(model, ids, mask, cache)
        model.generate(first, attention_mask=more, past_key_values=cache, max_new_tokens=args.tokens, **kwargs)
        first, more = prefilled(model, ids, mask, cache)  # warmed up (graphs captured): the profiled call
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            model.generate(first, attention_mask=more, past_key_values=cache, max_new_tokens=args.tokens, **kwargs)
            if on_gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    events = list(prof.events())
    per_token = 1e6 / args.tokens
    result = {"model": args.model, "layers": layers, "prompt_len": args.prompt, "tokens": args.tokens,
              "device": args.device, "wall_us_per_token": round(wall * per_token, 1)}
    print(f"{args.model} {layers} layers, 1 x {args.prompt}, {args.tokens} tokens: {wall * per_token:.0f} us a token "
          "(under the profiler)")
    if on_gpu:
        kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        host = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CPU]
        busy, idle, by_op = gaps_by_host_op(kernels, host, args.min_gap_us)
        result.update(gpu_busy_us_per_token=round(busy / args.tokens, 1), gpu_idle_us_per_token=round(idle / args.tokens, 1))
        print(f"GPU busy {busy / args.tokens:.0f} us a token, idle {idle / args.tokens:.0f} us between kernels")
        print("| host op running when the GPU went idle | idle us a token |\n|---|---|")
        for name, us in by_op.most_common(15):
            print(f"| {name[:90]} | {us / args.tokens:.1f} |")
    self_time = Counter()
    for e in events:
        if e.device_type == DeviceType.CPU:
            self_time[e.name] += e.self_cpu_time_total
    result["host_self_us_per_token"] = {name: round(us / args.tokens, 1) for name, us in self_time.most_common(15)}
    print("| host op | self us a token |\n|---|---|")
    for name, us in self_time.most_common(15):
        print(f"| {name[:90]} | {us / args.tokens:.1f} |")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return result


if __name__ == "__main__":
    main()
