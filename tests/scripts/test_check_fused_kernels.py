"""benchmarks/check_fused_kernels.py compares every fused kernel with its torch specification; on the CPU it
runs under the Triton interpreter at small shapes (the GPU run is at the benchmark shapes)."""

from __future__ import annotations

import os

from helpers.interpreter import run_under_interpreter

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                      "check_fused_kernels.py")


def test_every_fused_kernel_matches_its_specification():
    run_under_interpreter(SCRIPT, "ALL FUSED KERNELS MATCH", args=("--device", "cpu", "--small", "--repeat", "1",
                                                                   "--tokens", "3"))


def test_the_conv_cases_fit_any_token_count():
    """The Inkling conv cases' block tables reach every row's position at the token counts the GPU runs use
    (32 rows once indexed past a table of 32 columns)."""
    import sys

    import torch

    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import check_fused_kernels as script
    finally:
        sys.path.pop(0)
    for tokens in (1, 32, 64):
        k_taps, _ = script._conv_taps_pair(tokens, 2, 8, lambda *shape, scale=1.0: torch.randn(*shape) * scale, "cpu")
        assert k_taps.slots.shape == (tokens,) and int(k_taps.slots.max()) < k_taps.store.shape[0]
