"""benchmarks/profile_prefill_step.py on the CPU (``--tiny``): its steps feed the cache as a prefill chunk does (each
timed step adds its tokens to every row), and its sync counter attributes a host read of the device to the frame of
this project's code that made it."""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import profile_prefill_step as script  # noqa: E402

sys.path.pop(0)


def test_steps_feed_the_rows_and_report_times(monkeypatch):
    seen = []
    original = script.QSAPagedCache

    resets = []  # the cache's length at each reset

    def kept(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        reset = seen[-1].reset
        seen[-1].reset = lambda *a, **k: resets.append(seen[0].get_seq_length()) or reset(*a, **k)
        return seen[-1]

    monkeypatch.setattr(script, "QSAPagedCache", kept)
    (line,) = script.main(["--model", "qwen4_exp", "--tiny", "--layers", "2", "--shapes", "2x8", "--past", "20",
                           "--repeat", "2", "--top", "5"])
    assert (line["rows"], line["length"], line["steps"]) == (2, 8, 2)
    assert line["host_ms"] > 0 and line["wall_ms"] >= line["host_ms"] and line["gpu_ms"] is None
    assert line["triton_launches"] == 0 and line["triton_kernels"] == {}  # (the CPU runs the torch specifications)
    # the first prompt, 1 + 2 timed steps, the sync check's, the host-ops profile's, the launch census's and the
    # profiled one's (the sync check runs on CUDA only)
    assert seen[0].get_seq_length() == 20 + 6 * 8
    # Before them, a first pass took all 8 steps (every length the measured ones meet), then the cache started over.
    assert resets == [0, 20 + 8 * 8]
    # The host's time by torch op, each op's calls counted.
    ops = line["host_ops_top"]
    assert 0 < len(ops) <= 12 and all(ms > 0 and calls > 0 for ms, calls in ops.values())
    assert any(name.startswith("aten::") for name in ops)


def test_the_launch_census_counts_each_outermost_launch_once_and_restores_the_launchers(monkeypatch):
    import triton
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def plain_kernel(x):
        pass

    def tuned_kernel(x):
        pass

    launched = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: launched.append(self.fn.__name__))
    monkeypatch.setattr(Autotuner, "run", lambda self, *args, **kw: self.fn.run(*args, **kw))  # (no tuning)
    stubs = JITFunction.run, Autotuner.run
    plain = triton.jit(plain_kernel)
    tuned = triton.autotune([triton.Config({})], key=[])(triton.jit(tuned_kernel))

    def step():
        plain[(1,)](1)
        tuned[(1,)](1)
        tuned[(2,)](1)

    launches, seconds = script.launch_census(step)
    assert launched == ["plain_kernel", "tuned_kernel", "tuned_kernel"]  # each launcher still ran
    assert launches == {"plain_kernel": 1, "tuned_kernel": 2} and seconds >= 0  # the autotuner's inner run: once
    assert (JITFunction.run, Autotuner.run) == stubs


def test_own_frame_names_the_projects_innermost_frame():
    here = traceback.extract_stack()
    root_file = os.path.join(script.ROOT, "hf_qsa_cache", "cache.py")
    fake = traceback.FrameSummary(root_file, 12, "update")
    assert script.own_frame([*here, fake]) == "hf_qsa_cache/cache.py:12 update"
    assert script.own_frame(here) == "outside this project"  # (tests and benchmarks are not the project's code)
