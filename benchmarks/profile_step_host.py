"""Host time of a graphed decode step in a plain greedy generate(), with the graph's work taken out (CPU).

    python benchmarks/profile_step_host.py --model inkling --layers 6 --rows 1 --prompt 4096
    python benchmarks/profile_step_host.py --model qwen4_exp --layers 40 --rows 1 --prompt 4096
    python benchmarks/profile_step_host.py --model inkling --layers 6 --rows 32 --prompt 2048 --profile

A graphed decode step on a GPU costs the host our loop's work (`decode_loop.decode`), the forward around the graph
(the step's checks, the cache's step transaction, the rows' inputs copied into the graph's buffers) and the
replay's launch; when that host work takes longer than the GPU's, the host sets the pace of decoding. Here the
real loop and the real forward run on the CPU at the benchmark's layer schedule and cache geometry (widths are
tiny: the host work does not depend on them) with a graph stand-in whose replay does nothing, so what is timed
is the host work of a step
and a few small CPU ops (the embedding and LM head of the prefill are outside the timed steps). Reported:
microseconds of host work per decode step (the better of three generate() calls of ``--tokens`` tokens, less
one of a single token: its prefill and setup), and with ``--profile`` a cProfile top-25 of one call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import decode_ms_end_to_end, prefilled  # noqa: E402
# (IdleGraph: tests/scripts/test_profile_step_host.py patches it here)
from profile_serving_host import IdleGraph, idle_graphs_for, tiny_config  # noqa: E402, F401

from hf_qsa_cache import QSAPagedCache  # noqa: E402


def build(model_name: str, layers: int, rows: int, length: int):
    config = tiny_config(model_name, layers, window=512, max_len=1 << 21)
    if model_name == "inkling":
        from modeling import InklingForCausalLM as Model
    else:
        from modeling import Qwen4ExpForCausalLM as Model
    torch.manual_seed(0)
    model = Model(config).eval()
    ids = torch.randint(2, config.vocab_size, (rows, length))
    return model, ids


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["inkling", "qwen4_exp"], default="inkling")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build(args.model, args.layers, args.rows, args.prompt)
    mask = torch.ones_like(ids)
    cache = QSAPagedCache(model.config, args.rows, args.prompt + args.tokens + 1)
    module = sys.modules[type(model).__module__]
    real = module.decode_graphs_for
    module.decode_graphs_for = idle_graphs_for  # the stand-in graphs where a GPU would take them
    try:
        with torch.no_grad():
            step_us = decode_ms_end_to_end(model, ids, mask, args.tokens, cache) * 1e3
            result = {"model": args.model, "layers": args.layers, "rows": args.rows, "prompt": args.prompt,
                      "host_us_per_step": round(step_us, 1)}
            print(result, flush=True)
            if args.profile:
                first, more = prefilled(model, ids, mask, cache)
                profiler = cProfile.Profile()
                profiler.enable()
                model.generate(first, attention_mask=more, past_key_values=cache, max_new_tokens=args.tokens,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    finally:
        module.decode_graphs_for = real
    return result


if __name__ == "__main__":
    main()
