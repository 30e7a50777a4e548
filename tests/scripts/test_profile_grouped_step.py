"""benchmarks/profile_grouped_step.py on the CPU (``--tiny``): each kind of iteration runs the step shapes it
names, the prefilling rows start empty every time, and the decoding rows hold their past."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import profile_grouped_step as script  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("model", ["qwen4_exp", "inkling"])
def test_each_kind_runs_its_shapes_from_the_same_state(model, monkeypatch):
    steps, real = [], script.grouped_logits

    def spy(model_, cache, shape, counts, input_ids, keep):
        steps.append((list(shape), list(counts), list(cache.lengths[: len(counts)])))
        return real(model_, cache, shape, counts, input_ids, keep)

    monkeypatch.setattr(script, "grouped_logits", spy)
    rows, chunk, chunks, past, repeat = 3, 6, 2, 10, 2
    result = script.main(["--model", model, "--tiny", "--layers", "2", "--rows", str(rows), "--chunk", str(chunk),
                          "--chunks", str(chunks), "--past", str(past), "--repeat", str(repeat), "--block", "4"])
    assert all(result[f"{kind}_ms"] > 0 for kind in ("decode", "prefill", "grouped"))
    timed = [s for s in steps if s[0] != [(chunks, 1), (rows, past)]]  # (after the decoding rows' past)
    expected = {
        "decode": ([(chunks, 1), (rows, 1)], [0] * chunks + [1] * rows),
        "prefill": ([(chunks, chunk)], [chunk] * chunks),
        "grouped": ([(1, chunk)] * chunks + [(rows, 1)], [chunk] * chunks + [1] * rows),
    }
    assert [(shape, counts) for shape, counts, _ in timed] == [
        expected[kind] for kind in ("decode", "prefill", "grouped") for _ in range(repeat + 1)]
    for shape, counts, lengths in timed:
        assert lengths[:chunks] == [0] * chunks  # the prefilling rows start empty
        assert all(n >= past for n in lengths[chunks:])
