"""benchmarks/plot.py reads the results file: the newest line of a case wins, labels follow impl/graphs."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import plot  # noqa: E402


def _line(impl, graphs, prompt_len, decode, batch=1):
    return json.dumps({"model": "m", "layers": 2, "impl": impl, "graphs": graphs, "batch": batch,
                       "prompt_len": prompt_len, "prefill_s": 0.5, "decode_ms_per_step": decode})


def test_newest_line_of_a_case_wins_and_plots(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([
        _line("paged", True, 1024, 9.0), _line("paged", True, 1024, 3.0), _line("paged", False, 1024, 20.0),
        _line("upstream", False, 1024, 50.0), _line("upstream", False, 4096, None),
    ]) + "\n")
    series = plot.load(str(path))
    lines = series[("m", 2)]
    assert lines[("ours, graphs", 1)][1024]["decode_ms_per_step"] == 3.0
    assert lines[("ours, eager", 1)][1024]["decode_ms_per_step"] == 20.0
    assert sorted(lines[("upstream", 1)]) == [1024, 4096]
    pytest.importorskip("matplotlib")
    written = plot.plot(series, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["m_2_layers.png"] and os.path.getsize(written[0]) > 0


def test_serving_lines_are_kept_apart_and_plotted(tmp_path):
    serving = {"bench": "serving", "model": "m", "layers": 2, "requests": 8, "prompt_tokens": 4000, "rows": 4}
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([
        _line("paged", True, 1024, 3.0),
        json.dumps({**serving, "impl": "ours continuous", "tokens_per_s": 10.0}),
        json.dumps({**serving, "impl": "ours continuous", "tokens_per_s": 12.0}),
        json.dumps({**serving, "impl": "upstream static", "tokens_per_s": 1.0, "status": "extrapolated"}),
    ]) + "\n")
    assert list(plot.load(str(path))[("m", 2)]) == [("ours, graphs", 1)]  # serving lines are not decode cases
    runs = plot.load_serving(str(path))
    assert runs[("m", 2, 8, 4000, 4)]["ours continuous"]["tokens_per_s"] == 12.0
    pytest.importorskip("matplotlib")
    written = plot.plot_serving(runs, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["serving.png"] and os.path.getsize(written[0]) > 0
