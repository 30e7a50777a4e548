"""Draw the benchmark results: decode ms/step and prefill tokens/s against context length.

    pip install -e ".[bench]" && python benchmarks/plot.py [--results benchmarks/results/h200.jsonl]

One PNG per (model, layers) next to the results file, e.g. ``benchmarks/results/qwen4_exp_8_layers.png``.
Each line is one implementation (upstream; ours with and without CUDA graphs) at one batch size;
the x axis is the prompt length. When a case was measured more than once, the newest line counts.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path: str) -> dict:
    """(model, layers) -> {(impl label, batch) -> {prompt_len: row}}, the newest row per case."""
    series: dict = defaultdict(lambda: defaultdict(dict))
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "mode" in row or row.get("bench") == "serving":  # bench_speculative / bench_serving lines
                continue
            label = "upstream" if row["impl"] == "upstream" else ("ours, graphs" if row["graphs"] else "ours, eager")
            series[(row["model"], row["layers"])][(label, row["batch"])][row["prompt_len"]] = row
    return series


def plot(series: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    styles = {"upstream": "o--", "ours, eager": "s:", "ours, graphs": "^-"}
    for (model, layers), lines in sorted(series.items()):
        fig, (decode_ax, prefill_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for (label, batch), points in sorted(lines.items()):
            lengths = sorted(points)
            decode = [(n, points[n].get("decode_ms_per_step")) for n in lengths]
            decode = [(n, v) for n, v in decode if v]
            if decode:
                decode_ax.plot(*zip(*decode), styles[label], label=f"{label}, batch {batch}")
            # Prefill does not depend on graphs: ours from the eager runs where there are any (the graphed
            # run of a case may include kernel compilation), else from the graphed ones.
            if label == "ours, graphs" and ("ours, eager", batch) in lines:
                points = {**points, **lines[("ours, eager", batch)]}
            elif label == "ours, eager":
                continue
            prefill = [(n, batch * n / points[n]["prefill_s"]) for n in sorted(points) if points[n].get("prefill_s")]
            if prefill:
                name = "upstream" if label == "upstream" else "ours"
                prefill_ax.plot(*zip(*prefill), styles[label], label=f"{name}, batch {batch}")
        for ax, title in ((decode_ax, "decode ms/step (median)"), (prefill_ax, "prefill tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt length (tokens per row)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{model}, {layers} layers, bf16, one H200")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{model}_{layers}_layers.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def load_serving(path: str) -> dict:
    """(model, layers, requests, prompt tokens, rows) -> {impl: row}, the newest row per impl (bench_serving)."""
    runs: dict = defaultdict(dict)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("bench") == "serving" and row.get("tokens_per_s"):
                runs[(row["model"], row["layers"], row["requests"], row["prompt_tokens"], row["rows"])][row["impl"]] = row
    return runs


def plot_serving(runs: dict, out_dir: str) -> list[str]:
    """One PNG, ``serving.png``: output tokens/s of each implementation, one group of bars per workload."""
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ["ours continuous", "ours static", "upstream static"]
    fig, ax = plt.subplots(figsize=(9, 4))
    keys = sorted(runs)
    for i, impl in enumerate(impls):
        xs = [k + (i - 1) * 0.27 for k in range(len(keys))]
        ys = [runs[key].get(impl, {}).get("tokens_per_s", 0) for key in keys]
        bars = ax.bar(xs, ys, width=0.27, label=impl)
        for bar, key in zip(bars, keys):
            if "status" in runs[key].get(impl, {}):
                bar.set_hatch("//")  # extrapolated (did not finish in its time limit)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{m} {layers}L\n{n} requests, {rows} rows\n{tokens // 1000}k prompt tokens"
                        for m, layers, n, tokens, rows in keys], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("output tokens/s")
    ax.set_title("serving a stream of requests, bf16, one H200 (hatched: extrapolated)")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "serving.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", default=os.path.join(HERE, "results", "h200.jsonl"))
    args = parser.parse_args()
    out_dir = os.path.dirname(os.path.abspath(args.results))
    for path in plot(load(args.results), out_dir) + plot_serving(load_serving(args.results), out_dir):
        print(path)


if __name__ == "__main__":
    main()
