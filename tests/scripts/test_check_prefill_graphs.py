"""benchmarks/check_prefill_graphs.py on the CPU (``--tiny``): steps of 40 tokens a row (past the lengths decode
and verify steps send to the graphs), over rows whose QSA selection is active and whose Inkling windows evict, run
on the graph's path from its static buffers and give the ordinary forward's logits."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import check_prefill_graphs as script  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("model", ["qwen4_exp", "inkling"])
def test_long_steps_on_the_graph_path_equal_the_forward(model):
    lines = script.main(["--model", model, "--tiny", "--layers", "4", "--shapes", "3x40", "--past", "300",
                         "--repeat", "2", "--block", "4", "--window", "16"])
    (line,) = lines
    assert line["buckets"] == [[3, 40, 420, False]]  # every step went through the graph's path, one shape
    assert not line["captured"] and line["replays"] == 0  # (nothing is recorded on the CPU)
    assert line["eager_ms"] > 0 and line["max_abs_logit"] > 0
    assert line["max_logit_diff"] <= 1e-5 * line["max_abs_logit"], line
