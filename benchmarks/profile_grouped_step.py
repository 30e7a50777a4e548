"""One grouped step against the two rectangular steps it replaces: wall time, and where it goes.

    python benchmarks/profile_grouped_step.py --model qwen4_exp --layers 40 --rows 63 --chunk 2048      # GPU
    python benchmarks/profile_grouped_step.py --model qwen4_exp --layers 40 --rows 63 --chunk 64 --tiny  # CPU

``--rows`` rows hold ``--past`` tokens each and decode one token; ``--chunks`` more rows (the first rows) each
prefill a chunk of ``--chunk`` tokens from empty. Three ways to run one such iteration, each timed over
``--repeat`` iterations (the prefilling rows emptied after each; the decoding rows keep their tokens, a few more
each time, so every iteration sees nearly the same state; the cache keeps no rollback history, as continuous
batching's without drafts):

* ``decode``: the decoding rows alone (one eager rectangular step, no CUDA graph);
* ``prefill``: the prefilling rows' chunks alone (one rectangular step);
* ``grouped``: one grouped step of every chunk (a rectangle each) and the decoding rows
  (`hf_qsa_cache.grouped.grouped_logits`).

A grouped step should cost about ``decode + prefill`` of GPU time, less what the two share (the weights read
once). With ``--trace`` torch profiler tables of the prefill and the grouped step (top ops by self CPU and, on a
GPU, by device time) follow. On the CPU use ``--tiny`` (widths of `profile_serving_host.tiny_config`): what is
left is mostly host work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import inkling_config, qwen4_exp_config  # noqa: E402
from profile_serving_host import tiny_config  # noqa: E402

from hf_qsa_cache import QSAPagedCache  # noqa: E402
from hf_qsa_cache.grouped import grouped_logits  # noqa: E402


def build_model(args):
    """``(model, device, dtype)``: ``args.model`` at ``args.layers`` layers, random weights; the benchmark's widths
    in bf16 on the GPU, or with ``args.tiny`` `profile_serving_host.tiny_config`'s in fp32 on the CPU."""
    if args.tiny:
        config = tiny_config(args.model, args.layers, window=getattr(args, "window", 512), max_len=1 << 21)
    else:
        config = (qwen4_exp_config if args.model == "qwen4_exp" else inkling_config)(args.layers)
    if args.model == "inkling":
        from modeling import InklingForCausalLM as Model
    else:
        from modeling import Qwen4ExpForCausalLM as Model
    torch.manual_seed(0)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    return Model(config).to(device=device, dtype=dtype).eval(), device, dtype


def add_shape_arguments(parser, shapes: list[str], block: int) -> None:
    """The arguments of the scripts that time steps of ``ROWSxL`` shapes on a model of `build_model` (`run_shapes`)."""
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--shapes", nargs="+", default=shapes, help="ROWSxL step shapes")
    parser.add_argument("--past", type=int, default=1024, help="tokens each row holds before the timed steps")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--block", type=int, default=block)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (fp32)")
    parser.add_argument("--window", type=int, default=512, help="--tiny Inkling's sliding window")
    parser.add_argument("--jsonl", default=None, help="also append the lines to this file")


def run_shapes(args, key: dict, measure) -> list[dict]:
    """`build_model`, then for each of ``args.shapes`` one JSON line: ``key``, the model, its device and
    ``measure(model, rows, length, device, dtype)`` (a dict); printed, appended to ``args.jsonl`` if given, returned."""
    if args.tiny:
        torch.set_num_threads(1)
    model, device, dtype = build_model(args)
    out = []
    for shape in args.shapes:
        rows, length = (int(x) for x in shape.split("x"))
        line = {**key, "model": args.model, "layers": args.layers,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                **measure(model, rows, length, device, dtype)}
        print(json.dumps(line), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(line) + "\n")
        out.append(line)
    return out


def build(args):
    model, device, dtype = build_model(args)
    config = model.config
    rows = args.rows + args.chunks
    length = args.past + 3 * (args.repeat + 1) + args.chunks * args.chunk + 8  # (what the decoding rows take)
    cache = QSAPagedCache(config, rows, length, block_size=args.block, device=device, dtype=dtype)
    return model, cache, device


def step(model, cache, shape, counts, device, vocab):
    ids = torch.randint(2, vocab, (1, sum(r * q for r, q in shape)), device=device)
    keep = torch.tensor([sum(r * q for r, q in shape) - 1], device=device)
    with torch.no_grad():
        return grouped_logits(model, cache, shape, counts, ids, keep)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--rows", type=int, default=63, help="decoding rows")
    parser.add_argument("--past", type=int, default=1024, help="tokens each decoding row holds")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=1, help="prefilling rows' chunks, one row each")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)
    model, cache, device = build(args)
    vocab, R, C, K = model.config.vocab_size, args.rows, args.chunk, args.chunks
    cache.move_rows([-1] * (K + R))  # the prefilling rows first, then the decoding rows
    # The decoding rows' past, prefilled in pieces of at most 8192 tokens.
    done = 0
    while done < args.past:
        n = min(max(8192 // R, 1), args.past - done)
        step(model, cache, [(K, 1), (R, n)], [0] * K + [n] * R, device, vocab)
        done += n
    shapes = {  # (groups, counts) of each kind of iteration
        "decode": ([(K, 1), (R, 1)], [0] * K + [1] * R),
        "prefill": ([(K, C)], [C] * K),
        "grouped": ([(1, C)] * K + [(R, 1)], [C] * K + [1] * R),
    }

    def run(kind):
        step(model, cache, *shapes[kind], device, vocab)

    def undo():  # the prefilling rows fresh (the decoding rows keep what they took)
        cache.move_rows([-1] * K + list(range(K, K + R)))

    result = {"model": args.model, "layers": args.layers, "rows": R, "past": args.past, "chunk": C, "chunks": K,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for kind in ("decode", "prefill", "grouped"):
        run(kind)
        undo()
        times = []
        for _ in range(args.repeat):
            sync(device)
            t0 = time.perf_counter()
            run(kind)
            sync(device)
            times.append(time.perf_counter() - t0)
            undo()
        result[f"{kind}_ms"] = round(1e3 * min(times), 2)
    result["grouped_over_sum"] = round(result["grouped_ms"] / (result["decode_ms"] + result["prefill_ms"]), 3)
    print(json.dumps(result), flush=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        for kind in ("prefill", "grouped"):
            with profile(activities=activities) as prof:
                run(kind)
                sync(device)
            undo()
            print(f"--- {kind}: top by self CPU", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
            if device == "cuda":
                print(f"--- {kind}: top by device time", flush=True)
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25), flush=True)
    return result


if __name__ == "__main__":
    main()
