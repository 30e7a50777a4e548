"""Qwen4Exp's fused per-head RMS norm and rotary embedding (`hf_qsa_cache.ops.norm_rope`): the
written-out arithmetic against upstream's own functions, the model with the fused path on against the
default, and the Triton kernel against the torch function (as a script under the Triton interpreter)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, run_case_under_interpreter
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

from hf_qsa_cache.ops import norm_rope as ops


def _case(n, H, D, rot, dtype, seed=0):
    torch.manual_seed(seed)
    norm = Qwen4ExpTextRMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, D, generator=g) * 3).to(dtype)
    angle = torch.rand(n, rot // 2, generator=g) * 50
    angle = torch.cat([angle, angle], dim=-1)  # as a rotary module lays them out
    return norm.to(dtype), x, angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [8, 16])  # partial (half the head) and whole-head rotation
def test_written_out_arithmetic_is_upstreams(dtype, rot):
    norm, x, cos, sin = _case(5, 3, 16, rot, dtype)
    with torch.no_grad():
        want = ops.norm_rope_torch(norm, x, cos, sin)
        got = ops.norm_rope_written_out(x, norm.weight, norm.eps, cos, sin)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_generate_with_the_fused_path_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    _, model = make_pair(seed=8)
    ids, mask = left_pad(random_prompts([24, 10, 17], seed=9))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, ops, "norm", "norm_rope_written_out",
                                         atol=1e-5)


# bf16: the normed value, both products and their sum each round once.
DTYPES = {"fp32": (torch.float32, 2e-6), "bf16": (torch.bfloat16, 3.2e-2)}
SHAPES = {"1x3x24-rot12": (1, 3, 24, 12), "4x2x16-rot16": (4, 2, 16, 16), "3x1x20-rot8": (3, 1, 20, 8)}
KERNEL_CASES = [f"{d}-{shape}" for d in DTYPES for shape in SHAPES]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> None:
    """The kernel against the written-out norm and rotary at one dtype and shape, on a contiguous input and on the
    first half of each head's row of a wider projection (as a QSA query is laid out)."""
    from hf_qsa_cache.ops.norm_rope_triton import norm_rope_triton

    dtype_name, shape_name = case.split("-", 1)
    (dtype, tol), (n, H, D, rot) = DTYPES[dtype_name], SHAPES[shape_name]
    norm, x, cos, sin = _case(n, H, D, rot, dtype, seed=n + D)
    wide = torch.cat([x, torch.randn_like(x.float()).to(dtype)], dim=-1)
    for label, xs in (("contiguous", x), ("strided", torch.chunk(wide, 2, dim=-1)[0])):
        got = norm_rope_triton(xs, norm.weight.detach(), norm.eps, cos, sin)
        want = ops.norm_rope_written_out(x, norm.weight.detach(), norm.eps, cos, sin)
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous(), label
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{label} {m}")


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
