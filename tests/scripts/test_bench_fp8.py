"""benchmarks/bench_fp8.py on the CPU with tiny configs: every section writes its lines, bf16 and fp8 side by
side; the fp8 pages cost less than bf16's per token (scales included) and the error lines are finite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_fp8.py")


def test_bench_fp8_smoke(tmp_path):
    out = tmp_path / "fp8.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", BENCH_COMMIT="test",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--forced", "3", "--greedy-tokens", "3",
           "--cases", "1x24", "--jsonl", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for model in ("qwen4_exp", "inkling"):
        mine = {r["section"]: r for r in rows if r["model"] == model}
        assert set(mine) == {"error", "memory", "speed"}, rows
        assert mine["memory"]["bytes_per_token_fp8"] < mine["memory"]["bytes_per_token_bf16"]
        assert all(math.isfinite(mine["error"][k]) and mine["error"][k] > 0
                   for k in ("err_bf16_model_bf16_cache", "err_bf16_model_fp8_cache"))
        assert mine["speed"]["decode_ms_per_step_bf16"] > 0 and mine["speed"]["decode_ms_per_step_fp8"] > 0
