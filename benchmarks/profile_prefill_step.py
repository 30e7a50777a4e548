"""One eager prefill step as continuous batching runs it: is it bound by the host, and where does the host time go?

    python benchmarks/profile_prefill_step.py --model qwen4_exp --layers 40 --shapes 1x256 1x2048 4x2048  # GPU
    python benchmarks/profile_prefill_step.py --model qwen4_exp --layers 4 --shapes 2x16 --tiny           # CPU

For each ``ROWSxL`` shape a cache whose rows hold ``--past`` random tokens takes steps of ``L`` new tokens a row
through the model's forward with ``logits_to_keep=1`` (as `serving.runner` calls it). The whole sequence of steps runs
once first, then again from an empty cache at the same lengths, measured: a kernel that compiles or tunes for a new
length bucket does so in the first pass, not inside a measured step. Each step is timed three ways:

* ``host_ms``: until the forward returns (the host has queued every kernel; nothing waits for the GPU unless the
  step reads the device on the host);
* ``wall_ms``: until the GPU is done too;
* ``gpu_ms``: CUDA events around the step (the GPU's span, including its idle gaps);
* ``gpu_busy_ms``: the step's kernels' own times summed (torch's profiler; ``gpu_busy_top``: the 12 longest by
  kernel, ms);
* ``host_ops_top``: the 12 torch ops that took the most host time in a step (their self CPU time under torch's
  profiler, which adds its own overhead to each), ``[ms, calls]``.

``wall_ms`` close to ``host_ms`` and well above the GPU's busy time means the host sets the pace. Then the
step's host reads of the device (``syncs``: each call that waited for the GPU, counted by the first frame in this
project's code, from torch's sync debug mode), its Triton launches and the host time inside Triton's launchers
(``triton_launches``, ``triton_launch_ms``, ``triton_kernels``: launches by kernel, from `launch_census`; the rest of
``host_ms`` is torch's ops and Python) and a cProfile of one step (``--top`` functions by their own time) say where
it goes. One JSON line per shape (``--jsonl`` appends it to a file); the cProfile table is printed.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_grouped_step import add_shape_arguments, run_shapes, sync  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402

ROOT = str(Path(__file__).resolve().parent.parent)
PACKAGES = tuple(os.path.join(ROOT, name, "") for name in ("hf_qsa_cache", "modeling"))


def own_frame(stack) -> str:
    """The innermost frame of this project's packages (`hf_qsa_cache`, `modeling`) in ``stack``, as ``file:line
    function``."""
    for frame in reversed(stack):
        if frame.filename.startswith(PACKAGES):
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno} {frame.name}"
    return "outside this project"


def host_syncs(run) -> collections.Counter:
    """Where ``run()`` made the host wait for the device, counted by `own_frame` (CUDA only)."""
    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            seen[own_frame(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():  # (restores the warning filters and `showwarning` on exit)
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def _kernel_name(launcher) -> str:
    """The Python function behind a Triton launcher (a JIT function, or an autotuner or heuristics around one)."""
    fn = launcher
    while not callable(getattr(fn, "__code__", None)) and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", type(launcher).__name__)


def launch_census(run) -> tuple[collections.Counter, float]:
    """``(launches by kernel name, host seconds inside the launchers)`` of the Triton kernels ``run()`` launches.
    Each outermost launcher call counts once (an autotuner's call of the kernel it wraps is inside its own)."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: collections.Counter = collections.Counter()
    spent, depth = [0.0], [0]
    originals = {cls: cls.run for cls in (JITFunction, Autotuner, Heuristics, InterpretedFunction)}

    def counted(original):
        def run_counted(self, *args, **kwargs):
            if depth[0]:
                return original(self, *args, **kwargs)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
                depth[0] -= 1
                launches[_kernel_name(self)] += 1
        return run_counted

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        run()
    finally:
        for cls, original in originals.items():
            cls.run = original
    return launches, spent[0]


def gpu_busy(run) -> tuple[float, collections.Counter]:
    """The GPU's busy milliseconds during ``run()`` (its kernels' own times summed: one stream, so they do not
    overlap) and those milliseconds by kernel name, from torch's profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by_kernel = collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            by_kernel[event.key[:60]] += event.self_device_time_total / 1e3
    return sum(by_kernel.values()), by_kernel


def host_ops(run) -> tuple[collections.Counter, collections.Counter]:
    """The host's milliseconds by torch op during ``run()`` (their self CPU time: dispatch, launch, allocation) and
    each op's calls, from torch's profiler (CPU activity only: what an eager step's host time is made of besides
    Python and Triton's launchers)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ms, calls = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            ms[event.key[:60]] += event.self_cpu_time_total / 1e3
            calls[event.key[:60]] += event.count
    return ms, calls


def profile_shape(model, rows: int, length: int, args, device, dtype) -> dict:
    config, vocab = model.config, model.config.vocab_size
    steps = args.repeat + 6  # a first step (untimed), the timed ones, a sync check, the GPU's busy time, the host's
    # time by op, a census, a profiled one
    cache = QSAPagedCache(config, rows, args.past + steps * length, block_size=args.block, device=device,
                          dtype=dtype)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(2, vocab, (rows, args.past), generator=gen).to(device)
    chunks = [torch.randint(2, vocab, (rows, length), generator=gen).to(device) for _ in range(steps)]
    mask, fed = None, iter(())

    def forward(ids):
        return model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

    def start_over():  # the prompt again on an empty cache: the same steps follow, at the same lengths
        nonlocal mask, fed
        cache.reset()
        mask, fed = torch.ones(rows, args.past, dtype=torch.long, device=device), iter(chunks)
        forward(prompt)

    def next_chunk():
        nonlocal mask
        chunk = next(fed)
        mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
        return chunk

    host, wall, gpu = [], [], []
    with torch.no_grad():
        # A first pass takes every step once: kernels compile and tune for each step's lengths (a kernel specialised
        # on a length's reach meets a new value as the rows grow), so that no measured step below pays for that.
        start_over()
        for _ in chunks:
            forward(next_chunk())
        sync(device)
        start_over()
        for i in range(args.repeat + 1):
            chunk = next_chunk()
            sync(device)
            if device == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            start = time.perf_counter()
            forward(chunk)
            queued = time.perf_counter()
            if device == "cuda":
                end.record()
            sync(device)
            done = time.perf_counter()
            if i:
                host.append(1e3 * (queued - start))
                wall.append(1e3 * (done - start))
                if device == "cuda":
                    gpu.append(begin.elapsed_time(end))
        syncs = host_syncs(lambda: forward(next_chunk())) if device == "cuda" else collections.Counter()
        sync(device)
        chunk = next_chunk()
        busy, by_kernel = gpu_busy(lambda: forward(chunk)) if device == "cuda" else (None, collections.Counter())
        sync(device)
        chunk = next_chunk()
        by_op, op_calls = host_ops(lambda: forward(chunk))
        sync(device)
        chunk = next_chunk()
        launches, launch_s = launch_census(lambda: forward(chunk))
        sync(device)
        chunk = next_chunk()
        profiler = cProfile.Profile()
        profiler.enable()
        forward(chunk)
        sync(device)
        profiler.disable()
    table = io.StringIO()
    pstats.Stats(profiler, stream=table).sort_stats("tottime").print_stats(args.top)
    median = (lambda xs: round(statistics.median(xs), 3) if xs else None)
    return {"rows": rows, "length": length, "past": args.past, "host_ms": median(host), "wall_ms": median(wall),
            "gpu_ms": median(gpu), "steps": args.repeat, "syncs": dict(syncs.most_common()),
            "gpu_busy_ms": None if busy is None else round(busy, 3),
            "gpu_busy_top": {name: round(ms, 3) for name, ms in by_kernel.most_common(12)},
            "host_ops_top": {name: [round(ms, 3), op_calls[name]] for name, ms in by_op.most_common(12)},
            "triton_launches": sum(launches.values()), "triton_launch_ms": round(1e3 * launch_s, 3),
            "triton_kernels": dict(launches.most_common())}, table.getvalue()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, ["1x256", "1x2048", "4x2048"], block=64)
    parser.add_argument("--top", type=int, default=30, help="cProfile rows printed")
    args = parser.parse_args(argv)

    def measure(model, rows, length, device, dtype):
        result, table = profile_shape(model, rows, length, args, device, dtype)
        print(table, flush=True)
        return result

    return run_shapes(args, {"bench": "prefill_step"}, measure)


if __name__ == "__main__":
    main()
