"""`benchmarks/profile_prefix_eviction.py` at a small size: it runs, every step got its block, and the eviction
frees a 64th of the pool beyond each pass's need (not one entry a step)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_prefix_eviction  # noqa: E402


def test_script_runs_and_evicts_in_passes():
    result = profile_prefix_eviction.main(["--entries", "640", "--steps", "30"])
    assert result["ms_per_step"] > 0
    # 30 blocks taken, in passes of 1 + 640 // 64 blocks: three passes, 33 entries.
    assert result["evicted"] == 33, result
