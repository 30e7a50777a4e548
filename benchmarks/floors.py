"""The bytes floor of the results file's decode lines, recomputed: no GPU needed.

    python benchmarks/floors.py                  # the latest graphed line of each case
    python benchmarks/floors.py --all            # every line with a floor

Lines written before ``floor_lookup_rows`` existed counted the token embedding and Qwen4Exp's PLE n-gram
embedding whole (131 MB and 410 MB at the benchmark shapes), where a decode step reads only its tokens' rows.
Each such line's copy bandwidth is recovered from its recorded floor (the bytes as then counted over that
floor), and its floor recomputed from the bytes as `bench_generate.decode_bytes` counts them now. The models
are built on the meta device: shapes only, no weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate  # noqa: E402


def meta_model(family: str, layers: int):
    from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

    if family == "qwen4_exp":
        config, cls = bench_generate.qwen4_exp_config(layers), Qwen4ExpForCausalLM
    else:
        config, cls = bench_generate.inkling_config(layers), InklingForCausalLM
    with torch.device("meta"):
        return cls(config).to(torch.bfloat16), config


def corrected(line: dict, models: dict) -> dict:
    """``line`` with ``floor_ms`` as counted now (and the recorded one as ``floor_ms_recorded``)."""
    if line.get("floor_lookup_rows"):
        return dict(line, floor_ms_recorded=line["floor_ms"])
    key = (line["model"], line["layers"])
    if key not in models:
        models[key] = meta_model(*key)
    model, config = models[key]
    batch, length = line["batch"], line["prompt_len"]
    then = bench_generate.decode_bytes(model, config, batch, length, whole_tables=True)
    now = bench_generate.decode_bytes(model, config, batch, length)
    return dict(line, floor_ms=line["floor_ms"] * now / then, floor_ms_recorded=line["floor_ms"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", default=bench_generate.RESULTS)
    parser.add_argument("--all", action="store_true", help="every line with a floor, not the latest of each case")
    args = parser.parse_args(argv)
    with open(args.jsonl) as f:
        lines = [json.loads(text) for text in f if text.strip()]
    lines = [x for x in lines if x.get("impl") == "paged" and x.get("floor_ms") and x.get("graphs")]
    if not args.all:  # the latest line of each case and loop
        latest = {}
        for x in lines:
            latest[(x["model"], x["layers"], x["batch"], x["prompt_len"], x.get("loop"))] = x
        lines = list(latest.values())
    models = {}
    print("model layers batch x prompt | commit | loop | ms/step: timed, end to end | floor ms: recorded -> now "
          "| x floor (end to end, else timed): recorded -> now")
    for x in lines:
        y = corrected(x, models)
        step = x.get("decode_ms_end_to_end") or x["decode_ms_per_step"]
        print(f"{x['model']} {x['layers']} {x['batch']}x{x['prompt_len']} | {x['commit']} | {x.get('loop', '-')} | "
              f"{x['decode_ms_per_step']:.3f}, {x.get('decode_ms_end_to_end') or float('nan'):.3f} | "
              f"{y['floor_ms_recorded']:.3f} -> {y['floor_ms']:.3f} | "
              f"{step / y['floor_ms_recorded']:.2f}x -> {step / y['floor_ms']:.2f}x")


if __name__ == "__main__":
    main()
