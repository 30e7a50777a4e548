"""`benchmarks/bench_prefix.py` at tiny shapes on the CPU: both workloads run with and without prefix caching,
write their lines, and with prefix caching turns after the first and prompts of a group hit cached prefixes."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import bench_prefix  # noqa: E402


@pytest.mark.parametrize("model, workload", [("qwen4_exp", "chat"), ("inkling", "shared")])
def test_smoke_run_writes_both_sides_and_hits(tmp_path, model, workload):
    path = tmp_path / "prefix.jsonl"
    rows = bench_prefix.main([
        "--tiny", "--device", "cpu", "--model", model, "--layers", "4" if model == "qwen4_exp" else "6",
        "--workload", workload, "--conversations", "3", "--turns", "3", "--system-tokens", "24",
        "--user-tokens", "5", "--groups", "2", "--group-size", "3", "--prefix-tokens", "30",
        "--question-tokens", "4", "--answer-tokens", "6", "--rows", "3", "--batch-tokens", "32",
        "--page-size", "4", "--num-blocks", "120", "--jsonl", str(path)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["impl"] for line in lines] == ["with prefix caching", "without prefix caching", "ratio"]
    with_, without = rows["with"], rows["without"]
    assert with_["output_tokens"] == without["output_tokens"] > 0
    assert with_["hit_rate"] > 0.2 and with_["snapshots"] > 0 and with_["snapshot_bytes"] > 0
    assert "hit_rate" not in without and lines[-1]["ttft_p50_lower_x"] > 0
    for side in (with_, without):  # (no graphs on the CPU: every prefill step of the workload ran eagerly)
        assert 0 < side["eager_prefill_steps"] <= side["prefill_steps"] and side["eager_prefill_cells"] > 0
        assert side["graph_recordings"] == 0 and side["graph_recording_s"] == 0  # (nothing records on the CPU)


def test_shared_prompts_can_arrive_at_a_fixed_rate(tmp_path):
    """``--shared-rate``: prompt i is sent i / rate seconds in (the line records the rate); 0 sends them all at once."""
    def run(rate):
        path = tmp_path / f"rate{rate}.jsonl"
        rows = bench_prefix.main([
            "--tiny", "--device", "cpu", "--model", "inkling", "--layers", "6", "--workload", "shared",
            "--groups", "2", "--group-size", "3", "--prefix-tokens", "30", "--question-tokens", "4",
            "--answer-tokens", "3", "--rows", "3", "--batch-tokens", "32", "--page-size", "4", "--num-blocks", "120",
            "--only", "with", "--shared-rate", str(rate), "--jsonl", str(path)])
        return rows["with"], json.loads(path.read_text().splitlines()[0])

    spread, line = run(10.0)
    assert line["rate"] == 10.0 and spread["last_sent_s"] >= 0.5 - 0.01  # six prompts: the last at 5 / 10 s
    at_once, line = run(0)
    assert line["rate"] == 0 and at_once["last_sent_s"] < 0.5
    assert spread["output_tokens"] == at_once["output_tokens"] == 6 * 3
