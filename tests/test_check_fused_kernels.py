"""benchmarks/check_fused_kernels.py compares every fused kernel with its torch specification; on the CPU it
runs under the Triton interpreter at small shapes (the GPU run is at the benchmark shapes)."""

from __future__ import annotations

import os

from interpreter import run_under_interpreter

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "check_fused_kernels.py")


def test_every_fused_kernel_matches_its_specification():
    run_under_interpreter(SCRIPT, "ALL FUSED KERNELS MATCH", args=("--device", "cpu", "--small", "--repeat", "1",
                                                                   "--tokens", "3"))
