"""benchmarks/profile_loop_timeline.py: the GPU's idle gaps attributed to the host op running when each began
(synthetic intervals), and the script's CPU run on a tiny model (its host table)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import profile_loop_timeline as script  # noqa: E402


def test_gaps_go_to_the_innermost_host_op_running_when_they_begin():
    kernels = [(0, 10), (5, 12), (20, 30), (31, 40), (100, 110)]  # an overlap, gaps of 8, 1 and 60
    host = [(0, 200, "generate"), (11, 25, "step"), (39, 90, "argmax"), (41, 42, "cat")]
    busy, idle, by_op = script.gaps_by_host_op(kernels, host, min_gap_us=5)
    assert busy == 12 + 10 + 9 + 10 and idle == 8 + 1 + 60
    assert by_op == {"step": 8, "argmax": 60}  # the 1 us gap is under the threshold


@pytest.mark.parametrize("model", ["inkling", "qwen4_exp"])
def test_the_cpu_run_reports_host_time_per_token(model):
    result = script.main(["--model", model, "--device", "cpu", "--tiny", "--prompt", "30", "--tokens", "4"])
    assert result["wall_us_per_token"] > 0 and result["host_self_us_per_token"]
    assert "gpu_busy_us_per_token" not in result
