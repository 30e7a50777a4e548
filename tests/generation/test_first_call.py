"""benchmarks/first_call.py times a new process's first and second generate() (CPU, tiny model, one child)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_child_process_reports_both_calls():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import first_call
    finally:
        sys.path.pop(0)
    rows = first_call.main(["--model", "qwen4_exp", "--device", "cpu", "--tiny", "--batch", "2", "--prompt", "12",
                            "--new-tokens", "3", "--processes", "1"])
    assert len(rows) == 1 and rows[0]["process"] == 0 and rows[0]["batch"] == 2
    assert rows[0]["first_call_s"] > 0 and rows[0]["second_call_s"] > 0 and rows[0]["import_s"] > 0


def _autotuning_cached(env_value):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_AUTOTUNING"}
    if env_value is not None:
        env["TRITON_CACHE_AUTOTUNING"] = env_value
    script = "import hf_qsa_cache, triton; print(triton.knobs.autotuning.cache)"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_the_package_keeps_triton_autotuning_on_disk_unless_the_user_said_no():
    # A new process would otherwise time every configuration of fla's autotuned kernels again.
    assert _autotuning_cached(None) == "True"
    assert _autotuning_cached("0") == "False"
