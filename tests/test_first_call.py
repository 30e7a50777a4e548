"""benchmarks/first_call.py times a new process's first and second generate() (CPU, tiny model, one child)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
