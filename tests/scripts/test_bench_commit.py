"""What the benchmarks record as the commit measured (`benchmarks/bench_generate.py` `commit`)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_generate  # noqa: E402


def _git(head: str, status: str):
    def run(args, **kwargs):
        return types.SimpleNamespace(stdout=head if "rev-parse" in args else status)
    return run


def test_commit_marks_a_tree_that_differs_from_head(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    monkeypatch.setattr(subprocess, "run", _git("abc1234\n", ""))
    assert bench_generate.commit() == "abc1234"
    monkeypatch.setattr(subprocess, "run", _git("abc1234\n", " M hf_qsa_cache/cache.py\n"))
    assert bench_generate.commit() == "abc1234+changes"
    monkeypatch.setattr(subprocess, "run", _git("", ""))
    assert bench_generate.commit() == "unknown"
    monkeypatch.setenv("BENCH_COMMIT", "def5678")
    assert bench_generate.commit() == "def5678"
