"""benchmarks/bench_speculative.py reports both draft-count schedules of prompt lookup (CPU, tiny Inkling).

With ``--lookup adaptive fixed`` every continuation gets one line per schedule: the passage continued
(``copy``) accepts every draft under both, in as many forwards; every second token (``skip``) rejects
every draft: transformers' fixed count drafts k tokens on every forward, the adaptive one on a few
(the lines say how many forwards drafted, and how many draft tokens they verified). Tokens equal
plain greedy throughout.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K = 3


@pytest.fixture(scope="module")
def rows():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_speculative as bench
    finally:
        sys.path.pop(0)
    args = bench.parse_args(["--device", "cpu", "--tiny", "--models", "inkling", "--draft-tokens", str(K),
                             "--lookup", "adaptive", "fixed"])
    assert bench.parse_args(["--device", "cpu", "--tiny"]).lookup == ["adaptive"]
    assert bench.parse_args([]).lookup == ["adaptive", "fixed"]
    found, failures = bench.bench_model("inkling", args, "test")
    assert not failures
    return found


def _line(rows, continuation, lookup):
    found = [r for r in rows if r["mode"] == "prompt_lookup" and r["continuation"] == continuation
             and r["lookup"] == lookup]
    assert len(found) == 1
    return found[0]


def test_each_schedule_has_its_line(rows):
    for kind in ("copy", "skip", "free"):
        assert len([r for r in rows if r["mode"] == "plain" and r["continuation"] == kind]) == 1
        for lookup in ("adaptive", "fixed"):
            row = _line(rows, kind, lookup)
            assert row["tokens_equal_plain"] and row["new_tokens"] == 12
            assert row["drafting_rounds"] + row["rounds_without_drafts"] == row["rounds"] + 1


def test_copy_accepts_every_draft_under_both(rows):
    adaptive, fixed = _line(rows, "copy", "adaptive"), _line(rows, "copy", "fixed")
    assert adaptive["acceptance_rate"] == fixed["acceptance_rate"] == 1
    assert adaptive["rounds"] == fixed["rounds"] < 12 / 2 and adaptive["proposed"] == fixed["proposed"]


def test_skip_rejects_every_draft_and_the_adaptive_count_backs_off(rows):
    adaptive, fixed = _line(rows, "skip", "adaptive"), _line(rows, "skip", "fixed")
    assert adaptive["acceptance_rate"] == fixed["acceptance_rate"] == 0
    assert adaptive["rounds"] == fixed["rounds"] == 11  # one token a forward either way
    # Every forward but the last (whose token is the last one: transformers drafts nothing there).
    assert fixed["drafting_rounds"] == 11 and fixed["proposed"] == K * 11
    # K drafts on the first forward, then one after pauses of 1, 2 and 4 forwards.
    assert adaptive["drafting_rounds"] == 4 and adaptive["proposed"] == K + 3
