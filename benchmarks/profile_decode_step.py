"""Where a decode step's GPU time goes, per layer kind, and how many kernels a graphed step launches.

    python benchmarks/profile_decode_step.py --model qwen4_exp --layers 40 --batch 1 --prompt 4096
    python benchmarks/profile_decode_step.py --model inkling --layers 6 --batch 32 --prompt 2048
    python benchmarks/profile_decode_step.py --model inkling --device cpu --tiny   # logic check (CI)
    HF_QSA_FUSED=none python benchmarks/profile_decode_step.py ...                # without the fused kernels

Two measurements on one prompt (bf16 on CUDA, the benchmark shapes of `bench_generate.py`):

* **By layer kind**: the decode step a CUDA graph records (`DecodeGraphs(record=False)`: static buffers,
  shapes sized for the step's reach, the experts implementation of graph steps), run eagerly under the
  torch profiler with a range around every decoder layer and each of its direct children (and the MoE
  block's router, experts and shared expert). The GPU is drained at each range's edges and a kernel counts
  for the ranges whose time it ran in (the profiler links Triton's launches to no range, so they are found
  by time; the drains cost the step time, not kernel time). Each kind's kernel count and GPU time per step; a layer's
  "own work" is its time outside its children (residual adds, hyper-connection mixing); "outside the
  layers" is the rest of the step (step metadata, the copy-aside of in-place rows, embedding, final
  norm, LM head). Kernel times are the graph's; launch gaps are not (a graph has none to speak of).
* **Graphed step**: one replay of the captured step under the profiler: kernels (and copies) per step and
  the share of the step's wall time (timed apart, without the profiler) the GPU is busy.

On the CPU (``--device cpu``) the same ranges report CPU time, kernels are estimated as the leaf aten ops
that compute (views and shape ops excluded; a Triton kernel is not counted, since the CPU runs the torch
specification instead), and the graphed part is skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import emit, graphed_step_stats  # noqa: E402
from bench_speculative import build  # noqa: E402

from hf_qsa_cache import QSAPagedCache, fusions  # noqa: E402
from hf_qsa_cache.cuda_graphs import graphs_of  # noqa: E402

PREFIX = "kind:"


def label_modules(model) -> list:
    """Profiler ranges around each decoder layer (``layer <type>``), its direct children (``<type>.<name>``)
    and the MoE block's children (``<type>.mlp.<name>``). Returns the hook handles.

    The hooks are global ones (`register_module_forward_pre_hook`), not hooks on the modules: a module with
    hooks of its own keeps its own forward (`hf_qsa_cache.ops.keeps_own_forward`), so per-module hooks would
    turn the fusions off in the very step being profiled. A child a fusion replaces is then not called, and
    its time counts as its layer's own work."""
    layers = model.model.layers if hasattr(model.model, "layers") else model.model.language_model.layers
    config = model.config.get_text_config(decoder=True)
    labels, open_ranges = {}, []
    for i, layer in enumerate(layers):
        kind = config.layer_types[i]
        labels[layer] = f"layer {kind}"
        for name, child in layer.named_children():
            labels[child] = f"{kind}.{name}"
            if name == "mlp":
                for sub, grandchild in child.named_children():
                    labels[grandchild] = f"{kind}.mlp.{sub}"

    def enter(module, *_):
        if module in labels:
            _drain()
            r = record_function(PREFIX + labels[module])
            r.__enter__()
            open_ranges.append(r)

    def leave(module, *_):
        if module in labels:
            _drain()
            open_ranges.pop().__exit__(None, None, None)

    return [torch.nn.modules.module.register_module_forward_pre_hook(enter),
            torch.nn.modules.module.register_module_forward_hook(leave)]


# Functions whose launches the table also lists per call (each fusion's unit of work), where the model calls them.
# Each name is patched in the module whose code calls it.
OPS = {"modeling.modeling_qwen4_exp": ("gated_residual", "norm_rope"),
       "hf_qsa_cache.ops.gated_delta": ("delta_gates", "gated_rms_norm"),
       "hf_qsa_cache.ops.rms_norm": ("add_rms_norm", "rms_norm"),
       "hf_qsa_cache.ops.qsa": ("selected_positions", "pool_groups")}


def label_functions() -> list:
    """Profiler ranges ``op <name>`` around the functions of `OPS`; returns what `unlabel_functions` restores."""
    import importlib

    saved = []
    for module_name, names in OPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            real = getattr(module, name)

            def labelled(*args, real=real, name=name, **kwargs):
                _drain()
                with record_function(f"{PREFIX}op {name}"):
                    out = real(*args, **kwargs)
                    _drain()
                    return out

            saved.append((module, name, real))
            setattr(module, name, labelled)
    return saved


def unlabel_functions(saved: list) -> None:
    for module, name, real in saved:
        setattr(module, name, real)


def _drain() -> None:
    """On a GPU, wait for the work launched so far: a range's kernels then run inside the range's own time,
    which is how `by_kind` finds them (the profiler links Triton's launches to no range)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _within(event, device_events: list) -> list:
    """The device events that ran inside the time of ``event`` (a CPU range bracketed by `_drain`)."""
    start, end = event.time_range.start, event.time_range.end
    return [d for d in device_events if d.time_range.start >= start and d.time_range.end <= end]


# aten ops that only describe a tensor (views, shapes, dtype no-ops, allocation): no kernel on a GPU.
_NO_KERNEL = {"view", "reshape", "unsqueeze", "squeeze", "slice", "select", "expand", "as_strided", "t", "transpose",
              "permute", "flatten", "unflatten", "split", "chunk", "empty", "empty_like", "empty_strided", "detach",
              "alias", "contiguous", "_unsafe_view", "split_with_sizes", "narrow", "unbind", "lift_fresh", "view_as",
              "expand_as", "to", "_to_copy", "type_as", "resolve_conj", "resolve_neg", "result_type", "dim", "size",
              "stride", "movedim", "_reshape_alias", "set_", "resize_", "item", "_local_scalar_dense", "is_nonzero"}


def _launches(event) -> int:
    """On the CPU: the leaf aten ops inside ``event`` that would launch a kernel on a GPU (an estimate of the
    launches the range makes: one per op that computes; a Triton op counts as its launches)."""
    children = [c for c in event.cpu_children if c.name.startswith("aten::") or c.cpu_children]
    if event.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in event.cpu_children):
        return int(event.name[len("aten::"):] not in _NO_KERNEL)
    return sum(_launches(c) for c in children)


def by_kind(prof, steps: int, on_gpu: bool) -> dict[str, dict]:
    """``{label: {"kernels": per step, "us": per step}}`` over the labelled ranges (GPU time on CUDA, CPU
    time on the CPU)."""
    totals: dict[str, dict] = defaultdict(lambda: {"kernels": 0, "us": 0.0, "calls": 0})
    # (CUPTI also records each drain's wait on the device timeline: not a kernel)
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA and "ynchroniz" not in e.name]
    for event in prof.events():
        if not event.name.startswith(PREFIX) or event.device_type != DeviceType.CPU:
            continue
        row = totals[event.name[len(PREFIX):]]
        row["calls"] += 1 / steps
        kernels = _within(event, device) if on_gpu else []
        row["kernels"] += (len(kernels) if on_gpu else _launches(event)) / steps
        row["us"] += (sum(k.time_range.elapsed_us() for k in kernels) if on_gpu else event.cpu_time_total) / steps
    if on_gpu:  # every kernel of the profile, found under a range or not (a check that the ranges see all)
        totals["device total"] = {"kernels": len(device) / steps, "us": sum(e.time_range.elapsed_us() for e in device) / steps,
                                  "calls": 1}
    return dict(totals)


def _step_inputs(model, cache: QSAPagedCache, batch: int, gen: torch.Generator, device):
    ids = torch.randint(2, model.config.get_text_config(decoder=True).vocab_size, (batch, 1), generator=gen)
    mask = torch.ones(batch, cache.lengths[0] + 1, dtype=torch.long, device=device)
    return ids.to(device), mask


def prefilled_cache(model, batch: int, prompt: int, steps: int, device) -> QSAPagedCache:
    config = model.config.get_text_config(decoder=True)
    cache = QSAPagedCache(config, max_batch_size=batch, max_cache_len=prompt + steps + 4)
    ids = torch.randint(2, config.vocab_size, (batch, prompt), device=device)
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, logits_to_keep=1)
    return cache


def profile_by_kind(model, batch: int, prompt: int, steps: int, device) -> tuple[dict, float]:
    """Per-kind kernels and time of the recorded step run eagerly; also the step's total."""
    cache = prefilled_cache(model, batch, prompt, steps + 1, device)
    runner = graphs_of(model, cache, device, record=False)
    gen = torch.Generator().manual_seed(0)
    on_gpu = torch.device(device).type == "cuda"
    with torch.no_grad():
        ids, mask = _step_inputs(model, cache, batch, gen, device)
        runner.step(ids, None, mask)  # warm-up: kernels compiled, tuned
        handles = label_modules(model)
        functions = label_functions()
        try:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    ids, mask = _step_inputs(model, cache, batch, gen, device)
                    _drain()
                    with record_function(PREFIX + "step"):
                        runner.step(ids, None, mask)
                        _drain()
                if on_gpu:
                    torch.cuda.synchronize()
        finally:
            unlabel_functions(functions)
            for h in handles:
                h.remove()
    return by_kind(prof, steps, on_gpu)


def profile_graphed_step(model, batch: int, prompt: int, device, top: int = 12) -> dict:
    """Kernels of one replayed graph step (the ``top`` by GPU time), and the GPU's busy share of a step (CUDA
    only)."""
    return graphed_step_stats(model, prefilled_cache(model, batch, prompt, 8, device), top=top)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen4_exp", "inkling"], default="qwen4_exp")
    parser.add_argument("--layers", type=int, default=None, help="default: 8 (Qwen4Exp), 6 (Inkling)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (averaged)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the test suite's small fp32 configs")
    parser.add_argument("--jsonl", default=None, help="append the result as one JSON line here")
    parser.add_argument("--top-kernels", type=int, default=12,
                        help="the graphed step's kernels listed, by GPU time (a large number lists them all)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    if torch.device(args.device).type == "cuda" and not args.tiny:
        torch.set_default_dtype(torch.bfloat16)  # build in bf16 on the GPU: no fp32 copy of the model
    model, layers = build(args.model, args.layers, args.device, args.tiny)
    torch.set_default_dtype(torch.float32)
    kinds = profile_by_kind(model, args.batch, args.prompt, args.steps, args.device)
    result = {"model": args.model, "layers": layers, "batch": args.batch, "prompt_len": args.prompt,
              "device": args.device, "fused": fusions.active(), "kinds": {k: {"kernels": round(v["kernels"], 1), "us": round(v["us"], 1)}
                                               for k, v in sorted(kinds.items())}}
    if torch.device(args.device).type == "cuda":
        result.update(profile_graphed_step(model, args.batch, args.prompt, args.device, args.top_kernels))

    step = kinds.get("step", {"us": 0.0, "kernels": 0})
    unit = "GPU" if torch.device(args.device).type == "cuda" else "CPU"
    print(f"{args.model} {layers} layers, {args.batch} x {args.prompt}: recorded step run eagerly, {unit} "
          f"time per step {step['us']:.0f} us, {step['kernels']:.0f} kernels")
    if "device total" in kinds:
        total = kinds.pop("device total")
        print(f"  every kernel the profile saw: {total['us']:.0f} us, {total['kernels']:.0f} kernels per step")
    layers_us = sum(v["us"] for k, v in kinds.items() if k.startswith("layer "))
    rows = [("outside the layers", step["kernels"] - sum(v["kernels"] for k, v in kinds.items()
                                                          if k.startswith("layer ")), step["us"] - layers_us)]
    for kind in sorted({k.split(" ", 1)[1] for k in kinds if k.startswith("layer ")}):
        layer = kinds[f"layer {kind}"]
        children = {k: v for k, v in kinds.items() if k.startswith(kind + ".") and k.count(".") == 1}
        rows.append((f"layer {kind}", layer["kernels"], layer["us"]))
        rows.append((f"  {kind}: own work", layer["kernels"] - sum(v["kernels"] for v in children.values()),
                     layer["us"] - sum(v["us"] for v in children.values())))
        for name, v in sorted(children.items(), key=lambda kv: -kv[1]["us"]):
            rows.append((f"  {name}", v["kernels"], v["us"]))
            for sub, w in sorted(((k, w) for k, w in kinds.items() if k.startswith(name + ".")),
                                 key=lambda kv: -kv[1]["us"]):
                rows.append((f"    {sub}", w["kernels"], w["us"]))
    ops = {k: v for k, v in kinds.items() if k.startswith("op ")}
    if ops:
        print("| function (where the fusions apply) | calls / step | kernels / call | " + unit + " us / call |")
        print("|---|---|---|---|")
        for name, v in sorted(ops.items()):
            print(f"| {name[3:]} | {v['calls']:.0f} | {v['kernels'] / v['calls']:.1f} | {v['us'] / v['calls']:.1f} |")
    print(f"| kind | kernels / step | {unit} us / step | share |")
    print("|---|---|---|---|")
    for name, kernels, us in rows:
        print(f"| {name} | {kernels:.0f} | {us:.1f} | {us / step['us']:.1%} |" if step["us"] else
              f"| {name} | {kernels:.0f} | {us:.1f} | - |")
    if "graph_kernels" in result:
        print(f"graphed step: {result['graph_kernels']} kernels + {result['graph_copies']} copies, GPU busy "
              f"{result['graph_busy_us']:.0f} of {result['step_wall_us']:.0f} us ({result['gpu_busy_share']:.0%})")
        print("| graphed step's kernel (by GPU time) | launches | GPU us |\n|---|---|---|")
        for name, count, us in result["graph_top_kernels"]:
            print(f"| {name} | {count} | {us:.1f} |")
    emit(result, args.jsonl)
    return result


if __name__ == "__main__":
    main()
