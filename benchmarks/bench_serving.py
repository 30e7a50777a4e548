"""Serving a stream of requests: our continuous batching vs our static generate() batches vs upstream's
generate() batches, side by side in one run, same random weights, bf16, one GPU.

    python benchmarks/bench_serving.py --model qwen4_exp --layers 40 --requests 256 --arrival all
    python benchmarks/bench_serving.py --model inkling --layers 6 --requests 256 --arrival poisson --rate 8
    python benchmarks/bench_serving.py --model qwen4_exp --layers 40 --requests 256 --load 0.8

The workload is seeded: prompt lengths log-uniform in [--min-prompt, --max-prompt], output lengths
uniform in [--min-output, --max-output], random tokens, no eos (each request generates exactly its
length). Requests arrive all at once or at a Poisson rate. Reported, as JSON lines appended to
``benchmarks/results/h200.jsonl`` (key ``bench: "serving"``):

* ours continuous (`generate_batch`'s engine: `init_continuous_batching`): output tokens/s, time to first
  token and time per output token (p50 / p99, from per-token timestamps), latency, peak memory, the loop's step
  counts, and the prefill steps that ran eagerly rather than replaying a CUDA graph (``eager_prefill_steps``:
  at released depths each costs far more host work than a replay);
* ours static: `generate()` in batches of --static-batch in arrival order; a batch runs until its
  longest request is done (only each request's own tokens count), a request's latency is its batch's end;
* upstream static: the same batches through transformers' own class under --upstream-limit seconds; if a
  batch does not finish, the throughput is extrapolated from the tokens it made and marked so.

``--passes N`` measures the continuous run N times on one engine (later passes: the same lengths, other tokens),
each line with its ``pass`` and the Triton kernels compiled while it ran (``kernel_compiles``, by name in
``compiled``; autotuning that re-times already compiled configurations is not counted): a first pass that is
slower than the second pays for shapes met for the first time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import threading
import time

import torch
import transformers
import triton
from bench_generate import RESULTS, commit, inkling_config, qwen4_exp_config, run
from percentiles import pct
from transformers import ContinuousBatchingConfig, GenerationConfig
from hf_qsa_cache import cuda_graphs


def workload(args, vocab: int):
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = math.log(args.min_prompt), math.log(args.max_prompt)
    lengths = [int(math.exp(lo + (hi - lo) * float(u))) for u in torch.rand(args.requests, generator=gen)]
    outputs = torch.randint(args.min_output, args.max_output + 1, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
    gaps = [0.0] * args.requests
    if args.arrival == "poisson":
        gaps = torch.empty(args.requests).exponential_(args.rate, generator=gen).tolist()
    return prompts, outputs, gaps


def retokened(prompts, vocab: int, gen: torch.Generator):
    """``prompts``' lengths with other random tokens (none of them found cached from a run on ``prompts``)."""
    return [torch.randint(2, vocab, (len(p),), generator=gen).tolist() for p in prompts]


def measured_passes(manager, prompts, outputs, gaps, args, record) -> dict:
    """The continuous run ``args.passes`` times on one manager (later passes on `retokened` prompts), each line with
    its ``pass`` and the kernels compiled while it ran (`kernel_builds`); returns the first pass's row."""
    vocab = manager.model.config.get_text_config().vocab_size
    first = None
    for k in range(args.passes):
        tokens = prompts if k == 0 else retokened(prompts, vocab, torch.Generator().manual_seed(args.seed + k))
        with kernel_builds() as builds:
            row = continuous(manager, tokens, outputs, gaps, prefix=f"p{k}r")
        row = record({**row, "pass": k + 1, **builds})
        first = first or row
    return first


def progress(message: str) -> None:
    """Where a long run is (stderr, at once): a run stopped by a time limit still says how far it got."""
    print(f"[bench_serving] {message}", file=sys.stderr, flush=True)


def serving_manager(model, prompts, outputs, args, grouped: bool = False, mixed: bool = False):
    """One manager for the warm-up and the measured run: CUDA graphs live on its cache. ``grouped``: its grouped
    steps (decoding rows beside prefill chunks, no pads) on or off; ``mixed``: its mixed steps."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = ContinuousBatchingConfig(page_size=args.page_size, max_requests_per_batch=args.rows,
                                      max_batch_tokens=args.batch_tokens, num_blocks=args.num_blocks,
                                      allow_block_sharing=args.prefix_caching == "on")
    gen_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(outputs))
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(outputs),
                          num_requests=len(prompts))
    return model.init_continuous_batching(gen_config, config, hints, grouped_steps=grouped, mixed_steps=mixed)


@contextlib.contextmanager
def eager_prefills_counted(manager):
    """While open, the rows x length of each prefill step the manager's runner runs eagerly (the others replay
    recorded graphs: `ModelRunner.replays_prefill`) go into the list it yields."""
    eager, runner = [], manager.runner
    prefill, wrapped = runner.prefill, "prefill" in vars(runner)  # (another wrapper's, e.g. a profiler's, stays)

    def counted(chunks):
        if not runner.replays_prefill(len(chunks), max(chunks)):
            eager.append(len(chunks) * max(chunks))
        return prefill(chunks)

    runner.prefill = counted  # (the loop looks it up at each step)
    try:
        yield eager
    finally:
        if wrapped:
            runner.prefill = prefill
        else:
            del runner.prefill


def continuous(manager, prompts, outputs, gaps, prefix="r") -> dict:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    submitted = {}
    stats_before = dict(manager.stats)
    replays_before = graph_replays(manager)
    recordings_before = graph_recordings(manager)
    start = time.perf_counter()

    def feed():
        for i, (prompt, n, gap) in enumerate(zip(prompts, outputs, gaps)):
            time.sleep(gap)
            submitted[manager.add_request(prompt, request_id=f"{prefix}{i}", max_new_tokens=n,
                                          record_timestamps=True)] = time.perf_counter()

    feeder = threading.Thread(target=feed)
    results = {}
    with eager_prefills_counted(manager) as eager_prefills:
        feeder.start()
        while len(results) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
        end = time.perf_counter()
        feeder.join()
    stats = {k: v - stats_before.get(k, 0) if k != "most_rows" else v for k, v in manager.stats.items()}
    failed = [r.error for r in results.values() if r.error]
    tokens = sum(len(r.generated_tokens) for r in results.values())
    ttft = [r.timestamps[0] - submitted[k] for k, r in results.items() if r.timestamps]
    tpot = [(r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1) for r in results.values()
            if r.timestamps and len(r.timestamps) > 1]
    latency = [r.timestamps[-1] - submitted[k] for k, r in results.items() if r.timestamps]
    return {"impl": "ours continuous", "wall_s": end - start, "output_tokens": tokens,
            "tokens_per_s": tokens / (end - start), "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "tpot_p50_ms": 1e3 * pct(tpot, 0.5), "tpot_p99_ms": 1e3 * pct(tpot, 0.99),
            "latency_p50_s": pct(latency, 0.5), "latency_p99_s": pct(latency, 0.99),
            "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,  # beyond the cache, allocated at warm-up
            "cache_gib": sum(manager.cache.memory_stats()["bytes"].values()) / 2**30, "failed": len(failed),
            # decode steps recorded as CUDA graphs (one per batch bucket), i.e. replayed by the loop
            "graph_buckets": sum(b.graph is not None for r in manager.cache.graph_runners.values()
                                 for b in r.buckets.values()),
            "graph_replays": graph_replays(manager) - replays_before,  # decode and short prefill steps
            # prefill steps that ran eagerly (the others replayed graphs), and their rows x length
            "eager_prefill_steps": len(eager_prefills), "eager_prefill_cells": sum(eager_prefills),
            # steps that met a new shape and recorded its graph during this pass, and their host seconds
            **{k: v - recordings_before[k] for k, v in graph_recordings(manager).items()},
            "first_error": failed[0] if failed else None, **prefix_stats(manager), **stats,
            # the loop's time outside its steps (host work between them, waiting for arrivals)
            "outside_steps_s": (end - start) - stats["prefill_s"] - stats["decode_s"] - stats["grouped_s"]}


@contextlib.contextmanager
def kernel_builds():
    """Triton kernels compiled while the block runs (autotuning compiles each config it times), counted in the
    dict it yields (``kernel_compiles``, and by kernel in ``compiled``); where Triton has no compile hook (before
    its ``knobs``), ``kernel_compiles`` stays None."""
    counts = {"kernel_compiles": None, "compiled": {}}
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        yield counts
        return
    counts["kernel_compiles"] = 0
    saved = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(getattr(fn, "__name__", fn))
        counts["kernel_compiles"] += 1
        counts["compiled"][name] = counts["compiled"].get(name, 0) + 1
        progress(f"compiled {name} (#{counts['compiled'][name]})")
        return saved(*args, **kwargs) if saved is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        runtime.jit_post_compile_hook = saved


def prefix_stats(manager) -> dict:
    """Prefix caching (on by default in continuous batching): its hit rate and the memory its snapshots take
    (cumulative over the manager's life, warm-up included)."""
    prefix = manager.cache.memory_stats().get("prefix_cache")
    if prefix is None:
        return {"prefix_caching": False}
    return {"prefix_caching": True, "prefix_hit_rate": prefix["hit_rate"], "prefix_snapshots": prefix["snapshots"],
            "prefix_snapshot_gib": prefix["bytes"] / 2**30}


def graph_replays(manager) -> int:
    return sum(r.replays for r in manager.cache.graph_runners.values())


def graph_recordings(manager) -> dict:
    runners = list(manager.cache.graph_runners.values())  # (a weak dictionary's values: a one-pass iterator)
    return {"graph_recordings": sum(r.recordings for r in runners),
            "graph_recording_s": sum(r.recording_s for r in runners)}


def static(model, prompts, outputs, args, limit_s=None, name="ours static", batch_size=None) -> dict:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    tokens, latency, status = 0, [], None
    batch_size = batch_size or args.static_batch
    for b in range(0, len(prompts), batch_size):
        batch, wants = prompts[b: b + batch_size], outputs[b: b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        left = None if limit_s is None else limit_s - (time.perf_counter() - start)
        out = run(model, ids.cuda(), mask.cuda(), max(wants), limit_s=left)
        made = 0 if "tokens" not in out else out["tokens"].shape[1]
        tokens += sum(min(made, n) for n in wants)
        latency += [time.perf_counter() - start] * len(batch)
        if "status" in out or made < max(wants):
            status = f"batch {b // batch_size} of {len(batch)}: {out.get('status', 'stopped')}"
            break
    wall = time.perf_counter() - start
    row = {"impl": name, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
           "latency_p50_s": pct(latency, 0.5), "latency_p99_s": pct(latency, 0.99),
           "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
    if status is not None:
        row["status"] = f"extrapolated from {tokens} of {sum(outputs)} tokens: {status}"
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--arrival", choices=["all", "poisson"], default="all")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (poisson)")
    parser.add_argument("--load", type=float, default=None,
                        help="measure the maximum rate first (every request at once: requests / wall time), then "
                             "Poisson arrivals at this fraction of it (other tokens, the same lengths); continuous "
                             "batching only")
    parser.add_argument("--rows", type=int, default=64, help="requests in flight (max_requests_per_batch)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--static-batch", type=int, default=32)
    parser.add_argument("--upstream-limit", type=float, default=None)
    parser.add_argument("--static-limit", type=float, default=None,
                        help="stop our static batches after this many seconds (throughput from what they made)")
    parser.add_argument("--upstream-batch", type=int, default=None, help="upstream's batch (default --static-batch)")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grouped-steps", choices=["on", "off", "both"], default="off",
                        help="decoding rows beside prefill chunks in one step (on), prefill and decode steps apart "
                             "(off, the engine's default), or each in turn on the same workload")
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                        help="the engine's prefix caching (on by default; its snapshot points stop prefill chunks)")
    parser.add_argument("--passes", type=int, default=1,
                        help="measure the workload this many times on one manager: later passes meet no shape for "
                             "the first time (no kernel compiled or autotuned while they run)")
    parser.add_argument("--short-prefill-tokens", type=int, default=None,
                        help="largest rows x length (rounded up) of a prefill step that replays a CUDA graph "
                             f"(default {cuda_graphs.SHORT_PREFILL_TOKENS}); set once, before the model runs")
    parser.add_argument("--jsonl", default=RESULTS)
    args = parser.parse_args()
    if args.short_prefill_tokens is not None:
        cuda_graphs.SHORT_PREFILL_TOKENS = args.short_prefill_tokens

    torch.manual_seed(0)
    if args.model == "qwen4_exp":
        from modeling import Qwen4ExpForCausalLM as Ours

        config, Upstream = qwen4_exp_config(args.layers), transformers.Qwen4ExpForCausalLM
    else:
        from modeling import InklingForCausalLM as Ours

        config, Upstream = inkling_config(args.layers), transformers.InklingForCausalLM
    started = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        ours = Ours(config).eval()
    torch.set_default_dtype(torch.float32)
    progress(f"model built in {time.perf_counter() - started:.0f} s")
    prompts, outputs, gaps = workload(args, config.vocab_size)
    common = {"bench": "serving", "model": args.model, "layers": args.layers, "requests": args.requests,
              "arrival": args.arrival, "rate": args.rate if args.arrival == "poisson" else None,
              "prompt_tokens": sum(map(len, prompts)), "wanted_tokens": sum(outputs), "rows": args.rows,
              "batch_tokens": args.batch_tokens, "static_batch": args.static_batch, "commit": commit(),
              "short_prefill_tokens": cuda_graphs.SHORT_PREFILL_TOKENS}

    def warm_manager(grouped: bool):
        # The manager's own warm-up (`ContinuousBatchingManager.warmup`): the kernels of a whole prefill chunk, and
        # a CUDA graph of the decode step at every row count, at the shortest reach and beside the longest row.
        started = time.perf_counter()
        manager = serving_manager(ours, prompts, outputs, args, grouped)
        manager.warmup()
        manager.start()
        run(ours, torch.randint(2, 100, (2, 40), device="cuda"), torch.ones(2, 40, dtype=torch.long, device="cuda"),
            4)
        common["warmup_s"] = time.perf_counter() - started
        progress(f"grouped steps {'on' if grouped else 'off'}: warmed up in {common['warmup_s']:.0f} s, measuring")
        return manager

    os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.grouped_steps]

    def record(row: dict) -> dict:  # each result is written as soon as it is measured
        line = {**common, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}}
        print(json.dumps(line), flush=True)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(line) + "\n")
        return row

    rows = []
    for grouped in modes:  # one manager at a time: each holds its own cache
        common["grouped_steps"] = grouped
        manager = warm_manager(grouped)
        if args.load is not None:
            loaded(manager, prompts, outputs, args, record)
        else:
            rows.append(measured_passes(manager, prompts, outputs, gaps, args, record))
        manager.stop()
        manager.destroy()
    if args.load is not None:
        return
    common.pop("grouped_steps")
    common.pop("warmup_s", None)
    if not args.skip_static:
        rows.append(record(static(ours, prompts, outputs, args, limit_s=args.static_limit)))
    if args.upstream_limit:
        del ours
        torch.cuda.empty_cache()
        torch.set_default_dtype(torch.bfloat16)
        torch.manual_seed(0)
        with torch.device("cuda"):
            reference = Ours(config).eval()  # the same seeded init: the weights ours ran with
            upstream = Upstream(config).eval()
        upstream.load_state_dict(reference.state_dict(), strict=True)
        del reference
        torch.set_default_dtype(torch.float32)
        rows.append(record(static(upstream, prompts, outputs, args, limit_s=args.upstream_limit,
                                  name="upstream static", batch_size=args.upstream_batch)))
    ours_cb = rows[0]["tokens_per_s"]  # (the first mode's)
    print("throughput ratios: " + ", ".join(
        f"{r['impl']} {ours_cb / r['tokens_per_s']:.2f}x" if r["tokens_per_s"] else f"{r['impl']} made no token"
        for r in rows[1:]))


def loaded(manager, prompts, outputs, args, record) -> None:
    """The Poisson target: the maximum rate (every request at once: requests over the wall time), then Poisson
    arrivals at ``args.load`` times it, on prompts of the same lengths and other tokens (none found cached from
    the first run); TPOT p99 against p50 and TTFT p99 reported beside. Each row names its arrivals itself (``record``
    writes the run's common fields under it)."""
    saturated = record({"arrival": "all", "rate": None,
                        **continuous(manager, prompts, outputs, [0.0] * len(prompts), prefix="max")})
    max_rate = len(prompts) / saturated["wall_s"]
    gen = torch.Generator().manual_seed(args.seed + 1)
    others = retokened(prompts, manager.model.config.get_text_config().vocab_size, gen)
    gaps = torch.empty(len(prompts)).exponential_(args.load * max_rate, generator=gen).tolist()
    row = {"arrival": "poisson", "rate": args.load * max_rate, "load": args.load, "max_rate": max_rate,
           **continuous(manager, others, outputs, gaps, prefix="load")}
    row["tpot_p99_over_p50"] = row["tpot_p99_ms"] / row["tpot_p50_ms"] if row["tpot_p50_ms"] else None
    record(row)


if __name__ == "__main__":
    main()
