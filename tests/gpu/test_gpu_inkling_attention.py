"""Inkling's paged attention kernel against the torch op at real shapes (benchmarks/check_inkling_attention.py's
cases and bounds; that script also times them and sweeps the decode launch).

16 query heads over 4 KV heads of 128, d_rel 16; full layers with rel_extent 1024 and log scaling, sliding
layers with window 512; block size 64, shuffled physical blocks. Decode cases run the kernel both ways of
computing the relative bias. Error relative to the largest output within 1e-2 (bf16) or 1e-4 (fp32), the stores
written alike.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_inkling_attention.py
"""

from __future__ import annotations

import pytest
import torch

import check_inkling_attention as script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name, layer, rows, dtype", script.REAL_CASES,
                         ids=[f"{name.replace(' ', '-')}-{layer}-{str(dtype).removeprefix('torch.')}"
                              for name, layer, _, dtype in script.REAL_CASES])
def test_kernel_equals_torch_op(name, layer, rows, dtype):
    try:
        assert script.check(name, layer, rows, dtype, torch.device("cuda"), timed=False)
    finally:
        torch.cuda.empty_cache()
