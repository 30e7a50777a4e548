"""benchmarks/profile_serving_host.py: the real continuous-batching loop on a model whose layers are taken out,
with grouped steps and without (and mixed steps on the recorded steps' host path), every request streamed to the HTTP engine process's delta handler; each run
serves every request (the script raises otherwise) and reports its steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("model, grouped, graphs", [("inkling", "on", False), ("qwen4_exp", "off", False),
                                                    ("inkling", "off", True)])
def test_the_loop_serves_every_request_and_reports_its_steps(model, grouped, graphs):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "profile_serving_host.py"), "--model", model, "--layers",
         "2", "--rows", "4", "--requests", "12", "--min-prompt", "8", "--max-prompt", "64", "--min-output", "2",
         "--max-output", "8", "--page-size", "16", "--window", "16", "--batch-tokens", "32", "--no-profile",
         "--stream", "--grouped-steps", grouped] + (["--graph-steps", "--mixed-steps"] if graphs else []),
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    kind = "grouped step" if grouped == "on" else "prefill step"
    line = next(line for line in out.stdout.splitlines() if line.startswith(kind))
    assert "n/a" not in line, out.stdout
    if graphs:  # decode steps took the recorded step's host path, and mixed steps ran (a prompt beside decoding rows)
        decode = next(line for line in out.stdout.splitlines() if line.startswith("decode step"))
        assert int(decode.split("; ")[1].split()[0]) > 0, decode
        mixed = next(line for line in out.stdout.splitlines() if line.startswith("mixed step"))
        assert "n/a" not in mixed, out.stdout
    if grouped == "off":  # prompts of 8-64 tokens in units of 16: some prefill steps are short ones (graphs on a GPU)
        short, of = (int(x) for x in line.split("; ")[1].split(" short")[0].split(" of "))
        assert 0 < short <= of, line
