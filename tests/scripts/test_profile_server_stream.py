"""benchmarks/profile_server_stream.py: the HTTP app streams every token of every client (one SSE chunk each) from
the stand-in engine child, at tiny sizes."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("fastapi")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import profile_server_stream as script  # noqa: E402


def test_every_token_of_every_client_is_streamed():
    rows = script.main(["--clients", "1", "3", "--tokens", "4"])
    assert [(r["clients"], r["chunks"], r["engine_steps"]) for r in rows] == [(1, 4, 4), (3, 12, 4)]
    assert all(r["us_per_token"] > 0 for r in rows)
