"""Each fusion's Triton kernel against its torch specification at the benchmark shapes, bf16
(benchmarks/check_fused_kernels.py's cases and tolerances; that script also times them and sweeps their tiles):
decode steps of 1, 8 and 32 tokens. A failure lists every kernel over its tolerance.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_fused_kernels.py
"""

from __future__ import annotations

import pytest
import torch

import check_fused_kernels as script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 8, 32], ids=lambda t: f"{t}-tokens")
def test_every_fused_kernel_matches_its_specification(tokens):
    compared = list(script.compared(torch.device("cuda"), torch.bfloat16, tokens, small=False))
    assert compared
    over = [f"{name}: max diff {diff:.3g} > {tol}" for name, _, diff, tol in compared if not diff <= tol]
    assert not over, "\n".join(over)
