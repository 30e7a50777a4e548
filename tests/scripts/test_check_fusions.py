"""benchmarks/check_fusions.py runs a model with every fusion off and on in one process (CPU, tiny fp32 models):
both runs stay at the fp32 reference, the fused one within the script's limit."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("model, extra", [("qwen4_exp", []), ("inkling", []),
                                          ("inkling", ["--all-experts", "--fusions", "norm,experts"])])
def test_both_paths_match_the_reference(model, extra):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import check_fusions
    finally:
        sys.path.pop(0)
    result = check_fusions.main(["--model", model, "--device", "cpu", "--tiny", "--batch", "2", "--prompt", "18",
                                 "--steps", "3", *extra])
    assert result["ok"] and result["err_fused"] < 1e-5 and result["err_unfused"] < 1e-5
    assert result["experts_per_token"] == (4 if "--all-experts" in extra else 2)  # the tiny configs: top 2 of 4
