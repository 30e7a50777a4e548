"""`benchmarks/bench_serving.py`'s Poisson-load run (`--load`) at tiny shapes on the CPU (its CUDA memory counters
stubbed): the maximum rate measured with every request at once, then Poisson arrivals at a fraction of it on
prompts of the same lengths and other tokens; every request served, the lines carry the rates and the stats."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import bench_serving  # noqa: E402
from profile_serving_host import tiny_config  # noqa: E402


def _tiny_run(monkeypatch, **settings):
    """A tiny Inkling's workload and manager on the CPU (the bench's CUDA memory counters stubbed)."""
    for name in ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: 0)
    from modeling import InklingForCausalLM

    config = tiny_config("inkling", 2, 64, 4096)
    torch.manual_seed(0)
    model = InklingForCausalLM(config).eval()
    args = types.SimpleNamespace(**{"min_prompt": 8, "arrival": "all", "rate": 8.0, "seed": 0, "rows": 4,
                                    "batch_tokens": 64, "page_size": 16, "num_blocks": None, "prefix_caching": "on",
                                    "min_output": 2, **settings})
    prompts, outputs, gaps = bench_serving.workload(args, config.vocab_size)
    return args, prompts, outputs, gaps, bench_serving.serving_manager(model, prompts, outputs, args)


def test_load_run_measures_the_maximum_rate_then_poisson_arrivals(monkeypatch):
    args, prompts, outputs, _, manager = _tiny_run(monkeypatch, requests=10, max_prompt=48, max_output=6, load=0.8)
    lines = []

    def record(row: dict) -> dict:  # as the bench's: the run's common fields (arrival "all"), then the row's own
        lines.append({"bench": "serving", "arrival": "all", "rate": None, **row})
        return row

    manager.start()
    try:
        bench_serving.loaded(manager, prompts, outputs, args, record)
    finally:
        manager.stop(block=True)
    saturated, poisson = lines
    assert saturated["arrival"] == "all" and poisson["arrival"] == "poisson"
    assert poisson["rate"] == 0.8 * poisson["max_rate"] and poisson["max_rate"] == len(prompts) / saturated["wall_s"]
    for line in lines:
        assert line["failed"] == 0 and line["output_tokens"] == sum(outputs)
        assert line["prefill_tokens"] > 0 and line["decode_s"] > 0 and line["outside_steps_s"] >= 0
        assert line["eager_prefill_steps"] == line["prefill_steps"]  # (no graphs on the CPU)
    assert poisson["tpot_p99_over_p50"] >= 1


def test_load_scales_the_arrival_rate(monkeypatch):
    """The Poisson run's gaps shrink with the load: at half the load each gap is twice as long (the same draws)."""
    taken = []

    def continuous(manager, prompts, outputs, gaps, prefix="r"):
        taken.append(list(gaps))
        return {"wall_s": 2.0, "tpot_p50_ms": 1.0, "tpot_p99_ms": 1.5}

    monkeypatch.setattr(bench_serving, "continuous", continuous)
    manager = types.SimpleNamespace(model=types.SimpleNamespace(config=tiny_config("inkling", 2, 64, 4096)))
    prompts, outputs = [[5] * n for n in (3, 9, 4, 7)], [2, 3, 2, 4]
    for load in (0.8, 0.4):
        args = types.SimpleNamespace(seed=0, load=load)
        bench_serving.loaded(manager, prompts, outputs, args, lambda row: row)
    full, heavy, _, light = taken  # (each load: the saturated run's gaps, then the Poisson run's)
    assert full == [0.0] * 4
    assert all(abs(b - 2 * a) < 1e-6 * b for a, b in zip(heavy, light))


def test_passes_run_the_workload_again_on_other_tokens(monkeypatch):
    """``--passes 2``: two lines on one manager, the second on prompts of the same lengths and other tokens, each
    with its pass number and compile count; every request served both times."""
    args, prompts, outputs, gaps, manager = _tiny_run(monkeypatch, requests=6, max_prompt=40, max_output=5, passes=2)
    fed, lines = [], []
    continuous = bench_serving.continuous

    def recording(manager, tokens, *rest, **kwargs):
        fed.append(tokens)
        return continuous(manager, tokens, *rest, **kwargs)

    monkeypatch.setattr(bench_serving, "continuous", recording)
    manager.start()
    try:
        first = bench_serving.measured_passes(manager, prompts, outputs, gaps, args, lambda row: lines.append(row) or row)
    finally:
        manager.stop(block=True)
    assert [line["pass"] for line in lines] == [1, 2] and first is lines[0]
    assert fed[0] == prompts and [len(p) for p in fed[1]] == [len(p) for p in prompts] and fed[1] != prompts
    for line in lines:
        assert line["failed"] == 0 and line["output_tokens"] == sum(outputs)
        assert line["kernel_compiles"] in (0, None) and line["compiled"] == {}


def test_kernel_builds_counts_compilations_by_kernel_and_puts_the_hook_back():
    triton = bench_serving.triton
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook (kernel_compiles stays None, as the bench says)")
    before = runtime.jit_post_compile_hook
    with bench_serving.kernel_builds() as builds:
        hook = runtime.jit_post_compile_hook
        for name in ("a_kernel", "b_kernel", "a_kernel"):
            hook(fn=types.SimpleNamespace(name=name))
    assert builds == {"kernel_compiles": 3, "compiled": {"a_kernel": 2, "b_kernel": 1}}
    assert runtime.jit_post_compile_hook is before


def test_a_pass_counts_the_prefill_steps_that_ran_eagerly(monkeypatch):
    """Routed as on a GPU, short prefill steps replay recorded graphs: the line counts the others
    (``eager_prefill_steps``, their rows x length in ``eager_prefill_cells``), and the runner's own prefill is back
    after the pass."""
    from helpers.serving import steps_routed_as_on_a_gpu

    args, prompts, outputs, gaps, manager = _tiny_run(monkeypatch, requests=8, max_prompt=600, max_output=4,
                                                      batch_tokens=512)
    with steps_routed_as_on_a_gpu():
        manager.start()
        try:
            line = bench_serving.continuous(manager, prompts, outputs, gaps)
        finally:
            manager.stop(block=True)
    assert line["failed"] == 0
    assert 0 < line["eager_prefill_steps"] < line["prefill_steps"]  # steps past 256 tokens run eagerly
    # the eager steps' rows x length are a part of every prefill step's (their tokens and pads)
    assert 0 < line["eager_prefill_cells"] < line["prefill_tokens"] + line["pad_tokens"]
    assert "prefill" not in vars(manager.runner)


def test_the_eager_count_puts_back_a_wrapper_it_found():
    """A runner whose prefill another tool wrapped (a profiler's timer) keeps that wrapper after the count; the
    count sees every step, replayed ones left out."""
    class Runner:
        def replays_prefill(self, rows, length):
            return length <= 4

        def prefill(self, chunks):
            return "class"

    runner = Runner()
    timed = []
    runner.prefill = lambda chunks: timed.append(chunks) or "timed"
    manager = types.SimpleNamespace(runner=runner)
    with bench_serving.eager_prefills_counted(manager) as eager:
        assert runner.prefill([3, 2]) == runner.prefill([8]) == "timed"
    assert eager == [8] and timed == [[3, 2], [8]] and runner.prefill([1]) == "timed"
    del runner.prefill
    with bench_serving.eager_prefills_counted(manager):
        pass
    assert "prefill" not in vars(runner) and runner.prefill([1]) == "class"


def test_graph_recordings_sum_every_runner_for_both_counts():
    """The cache keeps its graph runners in a weak dictionary, whose values are a one-pass iterator: both sums
    must see every runner (the seconds read 0 for every run while the count did not)."""
    import weakref

    class Model:
        pass

    models = [Model(), Model()]
    runners = weakref.WeakKeyDictionary()
    runners[models[0]] = types.SimpleNamespace(recordings=3, recording_s=1.5)
    runners[models[1]] = types.SimpleNamespace(recordings=2, recording_s=0.25)
    manager = types.SimpleNamespace(cache=types.SimpleNamespace(graph_runners=runners))
    assert bench_serving.graph_recordings(manager) == {"graph_recordings": 5, "graph_recording_s": 1.75}
