"""benchmarks/bench_speculative.py on the CPU with the tiny configs: the benchmark's own logic.

One run of the script for both families (a subprocess, as CI would run it): every line has the
keys the results file expects; with the passage continued (``copy``) prompt lookup's drafts are
accepted, with every second token (``skip``) none is; the drafted tokens equal the plain ones in
every case; one verify step of k + 1 tokens and the decode steps are timed per family.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_speculative.py")
MODELS = ["qwen4_exp", "inkling"]
K = 3
KEYS = {"model", "layers", "impl", "graphs", "mode", "draft_tokens", "batch", "prompt_len", "new_tokens", "commit"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "spec.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", BENCH_COMMIT="test",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--draft-tokens", str(K), "--jsonl", str(out),
           "--models", *MODELS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, rows


def _row(rows, model, mode, continuation=None, draft_tokens=None):
    found = [r for r in rows if r["model"] == model and r["mode"] == mode
             and (continuation is None or r.get("continuation") == continuation)
             and (draft_tokens is None or r["draft_tokens"] == draft_tokens)]
    assert len(found) == 1, (model, mode, continuation, found)
    return found[0]


def test_script_runs_and_writes_every_line(run):
    proc, rows = run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "drafted tokens equal plain tokens (forced continuations): yes" in proc.stdout
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert printed == rows
    # Per family: plain and prompt lookup for 3 continuations, 2 decode steps, 1 verify step.
    assert [r["model"] for r in rows] == [m for m in MODELS for _ in range(9)]
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert row["impl"] == "paged" and row["batch"] == 1 and row["commit"] == "test" and row["graphs"] is False
        if row["mode"] in ("plain", "prompt_lookup"):
            assert row["tokens_per_s"] > 0 and row["new_tokens"] == 12
            assert row["draft_tokens"] == (K if row["mode"] == "prompt_lookup" else 0)
        else:
            assert row["mode"] in ("decode_step", "verify_step") and row["step_ms"] > 0
    for model in MODELS:
        verify = _row(rows, model, "verify_step")
        assert verify["new_tokens"] == K + 1 and verify["draft_tokens"] == K and verify["verify_over_decode"] > 0
        decode = _row(rows, model, "decode_step", draft_tokens=K)
        assert decode["new_tokens"] == 1
        assert verify["verify_over_decode"] == pytest.approx(verify["step_ms"] / decode["step_ms"], rel=1e-2)
        _row(rows, model, "decode_step", draft_tokens=0)


@pytest.mark.parametrize("model", MODELS)
def test_forced_continuations_set_the_acceptance(run, model):
    _, rows = run
    copy = _row(rows, model, "prompt_lookup", "copy")
    assert copy["acceptance_rate"] > 0.5 and copy["proposed"] >= K
    # Accepted drafts mean fewer forwards than tokens: 12 tokens in far fewer than 11 rounds.
    assert copy["rounds"] < _row(rows, model, "plain", "copy")["rounds"] / 2
    skip = _row(rows, model, "prompt_lookup", "skip")
    # Every draft rejected: the first round proposes K, then the adaptive budget backs off (DraftBudget).
    assert skip["acceptance_rate"] == 0 and K <= skip["proposed"] < K * (skip["rounds"] - 1) / 2
    for kind in ("copy", "skip", "free"):  # fp32 on the CPU: even the model's own tokens agree
        row = _row(rows, model, "prompt_lookup", kind)
        assert row["tokens_equal_plain"] and row["greedy_tokens_agreeing"] == 12
        assert row["accepted"] <= row["proposed"]


def test_results_file_only_by_default_on_cuda():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import bench_speculative as bench
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    assert bench.parse_args(["--device", "cpu", "--tiny"]).jsonl is None
    full = bench.parse_args([])
    assert full.jsonl == bench.RESULTS and full.draft_tokens == 3 and full.models == MODELS
    assert (full.passage, full.repeat, full.new_tokens) == (512, 64, 128)
