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

    def kept(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(script, "QSAPagedCache", kept)
    (line,) = script.main(["--model", "qwen4_exp", "--tiny", "--layers", "2", "--shapes", "2x8", "--past", "20",
                           "--repeat", "2", "--top", "5"])
    assert (line["rows"], line["length"], line["steps"]) == (2, 8, 2)
    assert line["host_ms"] > 0 and line["wall_ms"] >= line["host_ms"] and line["gpu_ms"] is None
    # the first prompt, 1 + 2 timed steps, the sync check's and the profiled one's (the check runs on CUDA only)
    assert seen[0].get_seq_length() == 20 + 4 * 8


def test_own_frame_names_the_projects_innermost_frame():
    here = traceback.extract_stack()
    root_file = os.path.join(script.ROOT, "hf_qsa_cache", "cache.py")
    fake = traceback.FrameSummary(root_file, 12, "update")
    assert script.own_frame([*here, fake]) == "hf_qsa_cache/cache.py:12 update"
    assert script.own_frame(here) == "outside this project"  # (tests and benchmarks are not the project's code)
