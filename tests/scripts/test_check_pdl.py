"""`benchmarks/check_pdl.py`'s chain (a norm, then four projections in one launch, the query feeding the next link)
is what its torch specifications compose to: run under the Triton interpreter on small shapes (the GPU run times
it in a CUDA graph with and without early launch)."""

from __future__ import annotations

import os
import sys

import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def test_the_chain_composes_the_kernels_specifications():
    from helpers.interpreter import run_under_interpreter

    run_under_interpreter(__file__, "pdl chain ok")


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.path.insert(0, BENCHMARKS)
    import check_pdl

    from hf_qsa_cache.ops import linears, rms_norm

    gen = torch.Generator().manual_seed(0)
    x, norm_weight = torch.randn(1, 40, generator=gen), 1 + 0.1 * torch.randn(40, generator=gen)
    weights = [[torch.randn(n, 40, generator=gen) * 0.2 for n in (40, 9, 3)] for _ in range(3)]
    want = x
    for link in weights:
        _, normed = rms_norm.add_rms_norm_torch(want, None, norm_weight, 1e-6)
        want = linears.linears_torch(normed, link)[0]
    torch.testing.assert_close(check_pdl.chain(x, norm_weight, weights), want, atol=1e-4, rtol=1e-4)
    print("pdl chain ok")
