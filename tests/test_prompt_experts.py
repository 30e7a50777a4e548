"""Prompts' experts (`hf_qsa_cache.ops.prompt_experts`): against transformers' ``grouped_mm`` experts on the
same modules, the models with the fusion on against the default, and the Triton kernels against the torch
functions (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys

import pytest
import torch
from fusion_helpers import assert_fused_generate_equals_default
from interpreter import run_under_interpreter
from test_fault_injection import _prompts, ink, qwen  # noqa: F401 (fixtures)
from transformers.integrations import moe

from hf_qsa_cache.ops import prompt_experts


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # Distinct experts per token, some experts left unused, uneven counts (the low ids more often).
    scores = torch.rand(num_tokens, num_experts, generator=g) + torch.linspace(1, 0, num_experts)
    scores[:, -1] = -1  # the last expert gets no token
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=g)
    return index, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_equals_transformers_grouped_mm_experts(family):
    """fp32: transformers' `grouped_mm_experts_forward` on the same experts module and routing, to rounding."""
    if family == "qwen4_exp":
        from qwen4_helpers import make_pair

        model = make_pair(seed=3)[1]
    else:
        from test_inkling import make_config
        from test_inkling import make_pair as make_inkling_pair

        model = make_inkling_pair(make_config(), seed=3)[1]
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    num_experts = experts.gate_up_proj.shape[0]
    top_k = min(3, num_experts - 2)
    hidden = experts.gate_up_proj.shape[-1]
    x = torch.randn(37, hidden, generator=torch.Generator().manual_seed(4))
    index, weights = _routing(37, top_k, num_experts, seed=5)
    with torch.no_grad():
        want = moe.grouped_mm_experts_forward(experts, x, index, weights)
        got = prompt_experts.grouped_experts_forward(experts, x, index, weights)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_sum_by_token_sums_each_tokens_rows_where_they_lie():
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)
    positions = torch.tensor([5, 0, 2, 1, 4, 3])  # token 0: rows 5, 0, 2; token 1: rows 1, 4, 3
    got = prompt_experts.sum_by_token_torch(rows, positions, 2, 3)
    assert torch.equal(got, torch.stack([rows[[5, 0, 2]].sum(0), rows[[1, 4, 3]].sum(0)]))


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_generate_with_the_fused_path_equals_the_default(family, qwen, ink, monkeypatch):  # noqa: F811
    model = qwen if family == "qwen4_exp" else ink
    ids, mask = _prompts(family)
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, prompt_experts, "FUSED_PROMPT_EXPERTS",
                                         "weighted_silu_mul_torch", atol=1e-5)


def test_triton_kernels_match_torch():
    run_under_interpreter(__file__, "all prompt experts kernel cases ok")


def _main() -> int:
    from hf_qsa_cache.ops.prompt_experts_triton import (pair_order_triton, sum_by_token_triton,
                                                        weighted_silu_mul_triton)

    cases = 0
    # The pairs' order by expert: many pairs per expert (the stable order within one), experts with none (their
    # offsets repeat), a pair count the compared blocks do not divide, one pair, every pair on one expert, an
    # expert count that is not a power of two.
    g = torch.Generator().manual_seed(1)
    for pairs, experts in ((19, 8), (1, 4), (12, 6), (40, 64)):
        for ids in (torch.randint(0, experts, (pairs,), generator=g), torch.full((pairs,), experts - 1)):
            want = prompt_experts.pair_order_torch(ids, experts)
            for block_j in (4, 32):
                got = pair_order_triton(ids, experts, block_j=block_j)
                for name, h, w in zip(("perm", "positions", "offsets"), got, want, strict=True):
                    assert h.dtype == w.dtype and torch.equal(h, w), (pairs, experts, block_j, name, h, w)
                cases += 1
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)):
        g = torch.Generator().manual_seed(0)
        for rows, inter in ((7, 6), (3, 8)):  # blocks of 4 columns: the second partial for 6
            gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
            weights = torch.rand(rows, generator=g)
            got = weighted_silu_mul_triton(gate_up, weights, block=4)
            want = prompt_experts.weighted_silu_mul_torch(gate_up, weights)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            cases += 1
        for tokens, k, hidden in ((5, 3, 20), (4, 1, 8)):  # blocks of 8 features: the last partial for 20
            rows = torch.randn(tokens * k, hidden, generator=g).to(dtype)
            positions = torch.randperm(tokens * k, generator=g)
            got = sum_by_token_triton(rows, positions, tokens, k, block=8)
            want = prompt_experts.sum_by_token_torch(rows, positions, tokens, k)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            cases += 1
    print(f"all prompt experts kernel cases ok ({cases})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
