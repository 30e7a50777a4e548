"""Host time of the continuous-batching loop per iteration, with the model's layers taken out (CPU).

    python benchmarks/profile_serving_host.py --model inkling --layers 6 --rows 64 --requests 256
    python benchmarks/profile_serving_host.py --model qwen4_exp --layers 8 --rows 64 --requests 256

The real manager loop runs (`init_continuous_batching`: admission, `_make_room`, row moves, prefill and decode
steps, sampling, results) on a tiny model whose layers are replaced by the identity: every step still runs
the model's forward around them (embedding, the padding reorder, ``cache.step``: validation, the step
transaction, block reservation, the step's metadata and block tables, the token log, commit) and the LM
head, so what is left is the host work of scheduling and of the cache's step bookkeeping, plus a few small
CPU ops. The stores are allocated up front (tiny widths), so row moves and the transaction's copies run
as they do on a device. The cache geometry (page size, window, layer schedule) follows bench_serving.py.

Reported: host microseconds per loop iteration, split into decode-only iterations and iterations that run a
prefill step (a prefill step and most often a decode step; a grouped step with ``--grouped-steps on``), and
per step (`ModelRunner.decode` / `grouped` / `prefill`: the forward with its cache step, and sampling) and how many
prefill steps are short ones a GPU replays from CUDA graphs (`cuda_graphs.short_prefill_length`), and per new row
with prefix caching on, its prefix lookup (`ModelRunner._restore`: the cached prefix and the requests in flight or
waiting that share its start, the whole queue there when all requests arrive at once); then a cProfile
top-20 of a second, profiled run. With ``--graph-steps`` the steps a GPU replays from graphs (decode and short
prefill steps) take the recorded step's host path, their replay launching nothing (`IdleGraphs`): the host work a
GPU's step costs, where the default runs every step on the eager forward's host path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402  (its workload and manager settings)

from hf_qsa_cache import cuda_graphs  # noqa: E402
from hf_qsa_cache.cuda_graphs import recorded_length  # noqa: E402


def tiny_config(model: str, layers: int, window: int, max_len: int):
    if model == "inkling":
        from transformers.models.inkling.configuration_inkling import InklingTextConfig

        return InklingTextConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=layers,
            layer_types=["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(layers)],
            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8,
            sliding_window_size=window, d_rel=4, rel_extent=16, conv_kernel_size=4,
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            max_position_embeddings=max_len, pad_token_id=0, eos_token_id=None,
        )
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=layers,
        layer_types=["linear_attention" if (i + 1) % 4 else "indexed_attention" for i in range(layers)],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        hc_count=2, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=16, ple_conv_kernel_size=2, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=31, make_ngram_vocab_size_divisible_by=8,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=64, indexer_compress_ratio=4,
        eos_token_id=1, pad_token_id=0, bos_token_id=None, output_gate_type="sigmoid",  # the loop runs without eos
        max_position_embeddings=max_len,
    )


class IdleGraph:
    """Stands in for a captured CUDA graph: its replay launches nothing (the GPU's part of the step)."""

    def replay(self) -> None:
        pass


class IdleGraphs(cuda_graphs.DecodeGraphs):
    """`DecodeGraphs` on the CPU whose first run of a bucket runs the body once (its static buffers and logits
    take their shapes) and whose later runs replay an `IdleGraph`."""

    def _run_and_capture(self, entry):
        logits = self._eager(entry)
        entry.logits = logits.clone()
        entry.graph = IdleGraph()
        return logits


def idle_graphs_for(model, cache, input_ids, inputs_embeds, extra_outputs: bool, logits_to_keep=0):
    """`cuda_graphs.decode_graphs_for` as on a GPU, with `IdleGraphs`: the steps a GPU replays from graphs take
    the recorded step's host path (its transaction, the static buffers' fill, a replay that launches nothing)."""
    if not cuda_graphs.takes_graph_step(cache, input_ids, inputs_embeds, extra_outputs, logits_to_keep):
        return None
    runner = cache.graph_runners.get(model)
    if runner is None:
        runner = cache.graph_runners[model] = IdleGraphs(model, cache, "cpu", record=True)
    return runner


def idle_recorded_steps(model, cache):
    """`cuda_graphs.recorded_steps` (the serving loop's mixed steps) as on a GPU, with `IdleGraphs`."""
    runner = cache.graph_runners.get(model)
    if runner is None:
        runner = cache.graph_runners[model] = IdleGraphs(model, cache, "cpu", record=True)
    return runner


def stubbed_model(args):
    from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

    config = tiny_config(args.model, args.layers, args.window, args.max_prompt + args.max_output)
    model = (InklingForCausalLM if args.model == "inkling" else Qwen4ExpForCausalLM)(config).eval()

    def identity_layers(inputs_embeds, *rest, **kwargs):  # every layer and the final norm: not run
        return inputs_embeds

    model.model.run_layers = identity_layers
    for layer in model.model.layers:  # a grouped step's layers (`forward_grouped`): not run either
        layer.forward_grouped = lambda hidden_states, *rest, **kwargs: (hidden_states, None)
    # nor the final norm after them (and Inkling's last MLP conv before it), which `run_layers` holds
    import modeling.modeling_inkling as inkling_module
    import modeling.modeling_qwen4_exp as qwen_module

    if args.model == "inkling":
        inkling_module.conv_add_norm = lambda conv, hidden_states, *rest: (hidden_states, hidden_states)
    else:
        width = config.hidden_size  # the final mixer's output: the first stream stands for it
        qwen_module.gated_residual = lambda module, streams, residual=None: (streams[..., :width], streams, None)
    model.use_cuda_graphs = False
    if args.graph_steps:  # the host path a GPU takes for decode and short prefill steps (`idle_graphs_for`)
        import hf_qsa_cache.serving.runner as runner_module  # (the serving runner takes such steps straight there)

        inkling_module.decode_graphs_for = qwen_module.decode_graphs_for = idle_graphs_for
        runner_module.decode_graphs_for = idle_graphs_for
        runner_module.recorded_steps = idle_recorded_steps
        cuda_graphs.graphs_device = lambda model: torch.device("cpu")  # (the scheduler plans for those replays too)
    return model


def workload(args, vocab: int):
    """bench_serving.py's seeded workload, all requests at once."""
    prompts, outputs, _ = bench_serving.workload(argparse.Namespace(**vars(args), arrival="all", rate=0.0), vocab)
    return prompts, outputs


def make_manager(model, prompts, outputs, args):
    manager = bench_serving.serving_manager(model, prompts, outputs, args, args.grouped_steps == "on",
                                            args.mixed_steps)
    for layer in manager.cache.layers:  # the layers never run: allocate their state as their first step would
        for store in layer.stores.values():
            if not store.allocated:
                store.allocate(torch.device("cpu"), torch.float32)
    return manager


class Timings:
    """Wraps the manager's iteration and the runner's steps with timers."""

    def __init__(self, manager):
        # (seconds, ran a prefill or grouped step, ran a decode step)
        self.iterations: list[tuple[float, bool, bool]] = []
        self.steps = {"prefill": [], "decode": [], "grouped": [], "mixed": [], "restore": []}
        iteration, runner = manager._iteration, manager.runner

        def timed_iteration():
            before = dict(manager.stats)
            start = time.perf_counter()
            iteration()
            took = time.perf_counter() - start
            prefill = sum(manager.stats[k] - before[k] for k in ("prefill_steps", "grouped_steps", "mixed_steps"))
            prefill = prefill > 0
            self.iterations.append((took, prefill, manager.stats["decode_steps"] > before["decode_steps"]))

        def timed(kind, step):
            def run(*a, **k):
                start = time.perf_counter()
                try:
                    return step(*a, **k)
                finally:
                    self.steps[kind].append(time.perf_counter() - start)
            return run

        def counted(step):
            def run(chunks):  # (before the step: the rows' lengths decide)
                if recorded_length(manager.cache, len(chunks), max(chunks)) is not None:
                    self.short_prefills += 1
                else:
                    self.eager_cells.append(len(chunks) * max(chunks))
                return step(chunks)
            return run

        self.short_prefills = 0  # prefill steps a GPU replays from graphs (`cuda_graphs.short_prefill_length`)
        self.eager_cells: list[int] = []  # rows x length of each other prefill step (eager on a GPU)
        manager._iteration = timed_iteration
        runner.prefill = timed("prefill", counted(runner.prefill))
        runner.decode = timed("decode", runner.decode)
        runner.grouped = timed("grouped", runner.grouped)
        runner.mixed = timed("mixed", runner.mixed)
        runner._restore = timed("restore", runner._restore)  # (a new row's prefix lookup, prefix caching on)


def drive(manager, prompts, outputs, prefix: str, stream: bool = False) -> None:
    """The manager's own loop, in this thread, until every request is done. ``stream``: each request streams to
    the result handler the HTTP server's engine process registers (`engine_process.Outbox`, its sender not
    running: what the engine thread does per token is measured, not the pipe)."""
    from hf_qsa_cache.server.engine_process import Outbox

    outbox = Outbox(conn=None)
    ids = []
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        if stream:
            manager.register_result_handler(f"{prefix}{i}", outbox.put, deltas=True)
        ids.append(manager.add_request(p, request_id=f"{prefix}{i}", max_new_tokens=n, streaming=stream))
    manager._stop = "flush"
    manager._loop()
    results = {}
    while (result := manager.get_result(timeout=0)) is not None:  # the loop ended: what it delivered
        results[result.request_id] = result
    for request_id, tokens, _, finished, error in outbox.news.take():
        if finished:
            results[request_id] = GenerationOutput(request_id=request_id, generated_tokens=tokens, error=error)
    bad = [r.error for r in results.values() if r.error]
    if len(results) != len(ids) or bad:
        raise RuntimeError(f"{len(results)}/{len(ids)} results, {len(bad)} failed: {bad[:1]}")
    if manager.fatal_error is not None:
        raise manager.fatal_error


def us(values) -> str:
    if not values:
        return "n/a"
    return (f"mean {1e6 * statistics.fmean(values):7.0f} us  p50 {1e6 * statistics.median(values):7.0f} us  "
            f"(n={len(values)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["inkling", "qwen4_exp"], default="inkling")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--window", type=int, default=512, help="Inkling's sliding window")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=None, help="main pool (small: preemption)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--grouped-steps", choices=["on", "off"], default="off",
                        help="prefill chunks and decoding rows in one step (on) or prefill and decode steps (off, the "
                             "engine's default)")
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                        help="the engine's prefix caching (on by default; its snapshot points stop prefill chunks)")
    parser.add_argument("--graph-steps", action="store_true",
                        help="steps a GPU replays from CUDA graphs take the recorded step's host path, their replay "
                             "launching nothing (else every step runs the eager forward's host path)")
    parser.add_argument("--mixed-steps", action="store_true",
                        help="the engine's mixed steps (with --graph-steps: a short prefill chunk beside the decoding "
                             "rows in one recorded step)")
    parser.add_argument("--stream", action="store_true",
                        help="stream every request to the HTTP engine process's result handler")
    parser.add_argument("--short-prefill-tokens", type=int, default=None,
                        help="as bench_serving.py's: the largest prefill step that replays a CUDA graph "
                             f"(default {cuda_graphs.SHORT_PREFILL_TOKENS})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.short_prefill_tokens is not None:
        cuda_graphs.SHORT_PREFILL_TOKENS = args.short_prefill_tokens

    model = stubbed_model(args)
    prompts, outputs = workload(args, model.config.vocab_size)
    manager = make_manager(model, prompts, outputs, args)
    with torch.no_grad():
        drive(manager, prompts[: args.rows], outputs[: args.rows], "warm", args.stream)  # first-use costs out of the way
        timings = Timings(manager)
        before = dict(manager.stats)
        start = time.perf_counter()
        drive(manager, prompts, outputs, "r", args.stream)
        wall = time.perf_counter() - start
    stats = {k: v - before[k] if k != "most_rows" else v for k, v in manager.stats.items()}
    decode_only = [t for t, p, d in timings.iterations if not p]
    with_prefill = [t for t, p, d in timings.iterations if p]
    print(f"{args.model}, {args.layers} layers (identity), {args.rows} rows{', streamed' if args.stream else ''}, {args.requests} requests, page "
          f"{args.page_size}, prompts {args.min_prompt}..{args.max_prompt}, outputs {args.min_output}.."
          f"{args.max_output}; {len(timings.iterations)} iterations in {wall:.2f} s, stats {stats}")
    print(f"decode-only iteration : {us(decode_only)}")
    print(f"iteration with prefill: {us(with_prefill)}")
    replays = sum(runner.replays for runner in manager.cache.graph_runners.values())
    print(f"decode step           : {us(timings.steps['decode'])}"
          + (f"; {replays} steps replayed recorded steps (both runs)" if args.graph_steps else ""))
    print(f"prefill step          : {us(timings.steps['prefill'])}; {timings.short_prefills} of "
          f"{len(timings.steps['prefill'])} short (a GPU replays them from graphs)")
    bounds = (512, 2048, 4096, 8192)
    sizes = [sum(lo < c <= hi for c in timings.eager_cells) for lo, hi in zip((0, *bounds), (*bounds, 1 << 62))]
    print("eager prefill steps by rows x length: " + ", ".join(
        [f"<= {b}: {n}" for b, n in zip(bounds, sizes)] + [f"more: {sizes[-1]}"]))
    print(f"grouped step          : {us(timings.steps['grouped'])}")
    print(f"mixed step            : {us(timings.steps['mixed'])}")
    print(f"new row's prefix restore: {us(timings.steps['restore'])} (queued: {args.requests} at once)")
    if args.no_profile:
        return
    profile = cProfile.Profile()
    with torch.no_grad():
        profile.enable()
        drive(manager, prompts, outputs, "p", args.stream)
        profile.disable()
    print(f"\ncProfile of a second run (top {args.top} by own time, then by cumulative time):")
    stats = pstats.Stats(profile).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
