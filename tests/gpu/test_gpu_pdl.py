"""Programmatic dependent launch on the GPU: benchmarks/check_pdl.py's chain of a decode step's small kernels (bf16,
hidden 2048, a norm then four projections in one launch, 64 links) replayed from one CUDA graph gives the same
output bit for bit with the ``pdl`` setting on as off (that script also times both).

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_pdl.py
"""

from __future__ import annotations

import pytest
import torch

import check_pdl as script

pytestmark = pytest.mark.gpu


def test_chain_with_early_launch_equals_without():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("early launch needs compute capability 9 or more")
    from hf_qsa_cache.ops import linears_triton

    chain_inputs = script.inputs(torch.device("cuda"))
    _, off = script.variant(False, linears_triton.ONE_TOKEN_TILES, *chain_inputs)
    _, on = script.variant(True, linears_triton.ONE_TOKEN_TILES, *chain_inputs)
    assert torch.equal(on, off), f"largest difference {(on.float() - off.float()).abs().max().item():.3g}"
