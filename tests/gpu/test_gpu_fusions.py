"""The fused decode kernels inside whole bf16 models at the benchmark shapes (benchmarks/check_fusions.py, which
also times both runs): a prefill and 16 teacher-forced decode steps (CUDA graphs on) with every fusion off and
with all on, against an fp32 copy with them off; the fused run's mean |logit - fp32| may not exceed 1.1x the
unfused one's. Every token routed to every expert: with top-k routing a few router flips between bf16 and fp32
decide the ratio either way (see the script).

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_fusions.py
"""

from __future__ import annotations

import pytest

import check_fusions as script

pytestmark = pytest.mark.gpu

CASES = {
    "inkling-all-experts": ["--model", "inkling", "--all-experts", "--fusions", "all"],
    "qwen4_exp-4-layers-all-experts-1024": ["--model", "qwen4_exp", "--layers", "4", "--all-experts", "--prompt",
                                            "1024", "--fusions", "all"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_run_as_close_to_fp32_as_unfused(case):
    result = script.main(CASES[case])
    assert result["ok"], (f"mean |logit - fp32| fused {result['err_fused']:.3e} against unfused "
                          f"{result['err_unfused']:.3e} (limit 1.1x)")
