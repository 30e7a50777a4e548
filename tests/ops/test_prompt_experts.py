"""Prompts' experts (`hf_qsa_cache.ops.prompt_experts`): against transformers' ``grouped_mm`` experts on the
same modules, the models with the fusion on against the default, and the Triton kernels against the torch
functions (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter
from helpers.batches import family_prompts as _prompts
from transformers.integrations import moe

from hf_qsa_cache import fusions
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
        from helpers.qwen4 import make_pair

        model = make_pair(seed=3)[1]
    else:
        from helpers.inkling import make_config
        from helpers.inkling import make_pair as make_inkling_pair

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
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, prompt_experts, "prompt_experts",
                                         "weighted_silu_mul_torch", atol=1e-5)


def _experts_module(family: str, dtype=torch.float32):
    if family == "qwen4_exp":
        from helpers.qwen4 import make_pair

        model = make_pair(seed=3)[1]
    else:
        from helpers.inkling import make_config
        from helpers.inkling import make_pair as make_inkling_pair

        model = make_inkling_pair(make_config(), seed=3)[1]
    return next(m for m in model.to(dtype).modules() if hasattr(m, "gate_up_proj"))


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_tiled_experts_specification(family):
    """`tiled_experts_torch`: in fp32 the math of the selected-experts specification and of transformers'
    ``grouped_mm`` experts; in bf16 no further from fp32 than ``grouped_mm`` in bf16 (it rounds less)."""
    from hf_qsa_cache.ops.experts import selected_experts_torch

    experts = _experts_module(family)
    num_experts, hidden = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1]
    top_k = min(3, num_experts - 2)
    x = torch.randn(37, hidden, generator=torch.Generator().manual_seed(4))
    index, weights = _routing(37, top_k, num_experts, seed=5)
    args = (experts.gate_up_proj, experts.down_proj, experts.is_transposed)
    with torch.no_grad():
        want = moe.grouped_mm_experts_forward(experts, x, index, weights)
        got = prompt_experts.tiled_experts_torch(x, index, weights, *args)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got, selected_experts_torch(x, index, weights, *args), atol=2e-6, rtol=1e-5)
        half = _experts_module(family, torch.bfloat16)
        xb = x.bfloat16()
        theirs = moe.grouped_mm_experts_forward(half, xb, index, weights.bfloat16())
        ours = prompt_experts.tiled_experts_torch(xb, index, weights.bfloat16(), half.gate_up_proj, half.down_proj,
                                                  half.is_transposed)
        exact = prompt_experts.tiled_experts_torch(xb.float(), index, weights.bfloat16().float(),
                                                   half.gate_up_proj.float(), half.down_proj.float(),
                                                   half.is_transposed)
    assert (ours.float() - exact).abs().mean() <= (theirs.float() - exact).abs().mean() * 1.05


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_tiled_specification_with_shared_experts_equals_the_blocks(family):
    """fp32: `tiled_experts_torch` with a block's shared experts folded (`shared_expert_to_fold` with the tiled
    path: the block keeps ``grouped_mm``) equals transformers' grouped experts plus the block's shared experts run
    as upstream runs them (Qwen4Exp: gated by sigmoid(x . gate); Inkling: two experts weighted per token)."""
    from hf_qsa_cache.ops.experts import inkling_shared_experts_to_fold, shared_expert_to_fold

    block = next(m for m in _blocks(family) if getattr(m, "experts", None) is not None)
    experts = block.experts
    num_experts, hidden = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1]
    x = torch.randn(21, hidden, generator=torch.Generator().manual_seed(6))
    index, weights = _routing(21, 2, num_experts, seed=7)
    with torch.no_grad():
        routed = moe.grouped_mm_experts_forward(experts, x, index, weights)
        if family == "qwen4_exp":
            assert shared_expert_to_fold(block, x) is None  # the selected experts' kernels are not chosen
            shared = shared_expert_to_fold(block, x, tiled=True)
            want = routed + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        else:
            assert inkling_shared_experts_to_fold(block, x) is None
            gammas = torch.rand(21, block.shared_experts.n_shared_experts, generator=torch.Generator().manual_seed(8))
            shared = inkling_shared_experts_to_fold(block, x, tiled=True)._replace(token_weights=gammas)
            want = routed + block.shared_experts(x, gammas=gammas)
        got = prompt_experts.tiled_experts_torch(x, index, weights, experts.gate_up_proj, experts.down_proj,
                                                 experts.is_transposed, shared)
    torch.testing.assert_close(got, want, atol=5e-6, rtol=1e-5)


def _blocks(family: str):
    if family == "qwen4_exp":
        from helpers.qwen4 import make_pair

        return [layer.mlp for layer in make_pair(seed=3)[1].model.layers]
    from helpers.inkling import make_config
    from helpers.inkling import make_pair as make_inkling_pair

    return [layer.mlp for layer in make_inkling_pair(make_config(), seed=3)[1].model.layers]


def test_tiled_experts_run_only_with_the_fusion_on_a_gpu_and_few_pairs(monkeypatch):
    experts = _experts_module("inkling")
    num_experts, hidden = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1]
    calls = []
    from hf_qsa_cache.ops import prompt_experts_triton

    monkeypatch.setattr(prompt_experts_triton, "tiled_experts_triton",
                        lambda *a: calls.append(a[1].numel()) or prompt_experts.tiled_experts_torch(*a))
    from hf_qsa_cache.ops import experts as experts_ops

    monkeypatch.setattr(prompt_experts, "use_triton", lambda *x: True)
    monkeypatch.setattr(experts_ops, "TILED_EXPERTS_MAX_PAIRS", 8)
    for on in (False, True):
        monkeypatch.setitem(fusions.STATE, "tiled_experts", on)
        for tokens in (4, 5):  # 8 pairs, then 10
            x = torch.randn(tokens, hidden)
            index, weights = _routing(tokens, 2, num_experts, seed=tokens)
            with torch.no_grad():
                got = prompt_experts.grouped_experts_forward(experts, x, index, weights)
                torch.testing.assert_close(got, moe.grouped_mm_experts_forward(experts, x, index, weights),
                                           atol=2e-6, rtol=1e-5)
    assert calls == [8]


def _pair_order_case(pairs: int, experts: int, one_expert: bool) -> None:
    """The pairs' order by expert (permutation, positions, offsets) against `pair_order_torch`, with programs of 4
    and 64 ranked pairs and blocks of 4 and 32 compared ids: random experts (many pairs per expert: the stable order within one; experts with none: their
    offsets repeat) or every pair on the last expert."""
    from hf_qsa_cache.ops.prompt_experts_triton import pair_order_triton

    g = torch.Generator().manual_seed(pairs * 100 + experts)
    ids = torch.full((pairs,), experts - 1) if one_expert else torch.randint(0, experts, (pairs,), generator=g)
    want = prompt_experts.pair_order_torch(ids, experts)
    for block_i, block_j in ((4, 4), (4, 32), (64, 4), (64, 32)):
        got = pair_order_triton(ids, experts, block_i=block_i, block_j=block_j)
        for name, h, w in zip(("perm", "positions", "offsets"), got, want, strict=True):
            assert h.dtype == w.dtype and torch.equal(h, w), (block_i, block_j, name, h, w)


def _weighted_silu_case(dtype, tol, rows: int, inter: int) -> None:
    """`weighted_silu_mul_triton` (blocks of 4 columns: the second partial for 6) against the torch function."""
    from hf_qsa_cache.ops.prompt_experts_triton import weighted_silu_mul_triton

    g = torch.Generator().manual_seed(rows * 10 + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
    weights = torch.rand(rows, generator=g)
    got = weighted_silu_mul_triton(gate_up, weights, block=4)
    want = prompt_experts.weighted_silu_mul_torch(gate_up, weights)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _sum_by_token_case(dtype, tol, tokens: int, k: int, hidden: int) -> None:
    """`sum_by_token_triton` (blocks of 8 features: the last partial for 20) against the torch function."""
    from hf_qsa_cache.ops.prompt_experts_triton import sum_by_token_triton

    g = torch.Generator().manual_seed(tokens * 100 + k * 10 + hidden)
    rows = torch.randn(tokens * k, hidden, generator=g).to(dtype)
    positions = torch.randperm(tokens * k, generator=g)
    got = sum_by_token_triton(rows, positions, tokens, k, block=8)
    want = prompt_experts.sum_by_token_torch(rows, positions, tokens, k)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _generate_case(family: str) -> str | None:
    """The model with the fusion on (its CUDA dispatch on CPU tensors): prompts and decode steps through the tiled
    kernels, the shared experts folded into them."""
    import helpers.inkling as inkling
    from helpers.fusions import fused_generate_mismatch
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    from hf_qsa_cache.ops import moe, prompt_experts_triton

    launches: list = []
    count_launches(prompt_experts_triton, "_tiled_gate_up_kernel", launches)
    count_launches(prompt_experts_triton, "_tiled_down_kernel", launches)
    # The CUDA dispatch on CPU tensors: where the tiled path is chosen (the MoE block) and where it runs.
    moe.use_triton = prompt_experts.use_triton = lambda *x: True
    if family == "inkling":
        model = inkling.make_pair(inkling.make_config(), seed=3)[1]
        ids, mask = inkling.left_pad(inkling.make_prompts([7, 3], seed=4))
    else:
        model, (ids, mask) = make_pair(seed=3)[1], left_pad(random_prompts([9, 4], seed=4))
    error = fused_generate_mismatch(model, ids, mask, "tiled_experts", launches, atol=1e-4)
    if error:
        return error
    num_experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj")).gate_up_proj.shape[0]
    if not any(grid[0] > num_experts for grid in launches):
        return "the shared experts were not folded into the tiled kernels"
    return None


def _tiled_case(tokens: int, top_k: int, experts: int, hidden: int, inter: int, dtype, tol,
                transposed: bool) -> None:
    """`tiled_experts_triton` against `tiled_experts_torch`, tiles forced small (16 pairs, columns and chunk), with no
    shared experts, one gated by a vector and two weighted per token (`_shared_experts`)."""
    from hf_qsa_cache.ops.prompt_experts_triton import tiled_experts_triton

    g = torch.Generator().manual_seed(tokens * 10 + int(transposed) + 2 * (dtype == torch.bfloat16))
    index, weights = _routing(tokens, top_k, experts, seed=tokens)
    if tokens == 23:
        assert (index == 0).sum() > 16, "expert 0 should take more pairs than one tile"
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    for shared in _shared_experts(tokens, hidden, inter, dtype, g):
        args = (x, index, weights.to(dtype), gate_up, down, transposed, shared)
        want = prompt_experts.tiled_experts_torch(*args)
        got = tiled_experts_triton(*args, gate_up_tiles=(16, 16, 16, 1), down_tiles=(16, 16, 16, 2))
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                   msg=lambda m: f"shared experts {0 if shared is None else shared.gate.shape[0]}: {m}")


def _shared_experts(tokens: int, hidden: int, inter: int, dtype, g):
    """No shared experts; one gated by a vector, wider than the routed ones (the activations' rows as wide as
    the wider); two weighted per token."""
    from hf_qsa_cache.ops.experts import SharedExpert

    def rand(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    wide = inter + 16
    yield None
    yield SharedExpert(rand(1, wide, hidden), rand(1, wide, hidden), rand(1, hidden, wide),
                       gate_vector=rand(1, hidden))
    yield SharedExpert(rand(2, inter, hidden), rand(2, inter, hidden), rand(2, hidden, inter),
                       token_weights=torch.rand(tokens, 2, generator=g).to(dtype))


DTYPES = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 1.6e-2)}
# (tokens, top k, experts, hidden, intermediate) of the tiled experts: an expert with more pairs than a tile (two
# passes over its weights), experts with none, sizes the tiles do not divide, one token.
TILED_SHAPES = {"23tok-top2-5e-H40-I24": (23, 2, 5, 40, 24), "1tok-top3-6e-H16-I16": (1, 3, 6, 16, 16),
                "9tok-top4-7e-H24-I40": (9, 4, 7, 24, 40)}
# fp32 in both weight layouts, bf16 in one (strides: any dtype alike).
TILED_VARIANTS = {"fp32": (torch.float32, 2e-5, False), "fp32-transposed": (torch.float32, 2e-5, True),
                  "bf16": (torch.bfloat16, 2e-2, False)}
KERNEL_CASES = {
    # The pairs' order by expert: a pair count the compared blocks do not divide, one pair, an expert count that
    # is not a power of two.
    **{f"pair-order-{pairs}pairs-{experts}e-{kind}": partial(_pair_order_case, pairs, experts, kind == "one-expert")
       for pairs, experts in ((19, 8), (1, 4), (12, 6), (40, 64)) for kind in ("random", "one-expert")},
    **{f"weighted-silu-{d}-{rows}x{inter}-block4": partial(_weighted_silu_case, *DTYPES[d], rows, inter)
       for d in DTYPES for rows, inter in ((7, 6), (3, 8))},
    **{f"sum-by-token-{d}-{tokens}tok-top{k}-H{hidden}-block8": partial(_sum_by_token_case, *DTYPES[d], tokens, k,
                                                                         hidden)
       for d in DTYPES for tokens, k, hidden in ((5, 3, 20), (4, 1, 8))},
    **{f"tiled-{shape}-{v}-tiles16": partial(_tiled_case, *TILED_SHAPES[shape], *TILED_VARIANTS[v])
       for shape in TILED_SHAPES for v in TILED_VARIANTS},
    **{f"generate-{family}": partial(_generate_case, family) for family in ("inkling", "qwen4_exp")},
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_torch(case):
    run_case_under_interpreter(__file__, case)


if __name__ == "__main__":
    sys.exit(case_main(KERNEL_CASES))
