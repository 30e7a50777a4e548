"""Inkling's fused MoE routing (`hf_qsa_cache.ops.inkling_router`): the spec against transformers' router, the
block and generate() with the fused path on against upstream's, and the Triton kernel against the torch
function (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys

import pytest
import helpers.inkling as inkling
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, run_case_under_interpreter
from transformers.models.inkling.modeling_inkling import InklingTopkRouter

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import inkling_router


def router_module(seed: int, dtype=torch.float32, **overrides) -> InklingTopkRouter:
    """A router with random weights, a non-zero correction bias and global scale."""
    module = InklingTopkRouter(inkling.make_config(**overrides)).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=g))
        module.e_score_correction_bias.copy_(torch.rand(module.num_experts, generator=g) * 0.2)
        module.global_scale.fill_(1.3)
    return module


def as_sets(weights, indices, gammas):
    """Chosen experts best first here, unsorted upstream: compare (expert, weight) pairs sorted by expert."""
    order = indices.argsort(dim=-1)
    return indices.gather(-1, order), weights.gather(-1, order), gammas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spec_is_transformers_router(dtype):
    module = router_module(0, dtype)
    x = torch.randn(7, module.hidden_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        _, want_weights, want_indices, want_gammas = module(x)
        have = inkling_router.route_inkling_torch(x, module.weight, module.e_score_correction_bias, module.global_scale,
                                                  module.top_k, module.n_shared_experts, module.route_scale)
    for a, b in zip(as_sets(*have), as_sets(want_weights, want_indices, want_gammas)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_block_and_generate_with_the_fused_path_equal_upstreams(monkeypatch):
    _, model = inkling.make_pair(inkling.make_config(), seed=5)
    ids, mask = inkling.left_pad(inkling.make_prompts([11, 4, 8], seed=6))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, inkling_router, "inkling_router",
                                         "route_inkling_torch", atol=1e-5)
    # Recording router logits hooks the routers: from then on they run their own forward.
    monkeypatch.setitem(fusions.STATE, "inkling_router", True)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(block(x), type(block).__mro__[1].forward(block, x), atol=1e-5, rtol=1e-5)
        model(ids, attention_mask=mask, output_router_logits=True)
    assert not inkling_router.fuses_inkling_routing(block.gate, x)


# (tokens, hidden, routed experts, shared, top k): hidden not a multiple of the chunk; experts + shared padded to a
# power of two; k = routed experts (all chosen); two shared; router rows past one block of the projection (BLOCK_E),
# the last block full or partial.
SHAPES = {"1x40-6e1s-top2": (1, 40, 6, 1, 2), "5x72-13e2s-top4": (5, 72, 13, 2, 4), "3x16-4e2s-top4": (3, 16, 4, 2, 4),
          "1x40-19e1s-top3": (1, 40, 19, 1, 3), "2x48-30e2s-top6": (2, 48, 30, 2, 6)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KERNEL_CASES = [f"{shape}-{d}" for shape in SHAPES for d in DTYPES]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    """The kernel against `route_inkling_torch` at one shape and dtype, with the projection's tiling by the launch
    policy, then hidden ranges of one chunk each (several splits, the last one short), then one range."""
    from hf_qsa_cache.ops.inkling_router_triton import inkling_router_triton

    torch.set_num_threads(1)
    shape_name, dtype_name = case.rsplit("-", 1)
    (T, H, E, S, k), dtype = SHAPES[shape_name], DTYPES[dtype_name]
    module = router_module(T + H, dtype, hidden_size=H, n_routed_experts=E, n_shared_experts=S,
                           num_experts_per_tok=k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
    args = (x, module.weight.detach(), module.e_score_correction_bias, module.global_scale.detach(), k, S,
            module.route_scale)
    want = inkling_router.route_inkling_torch(*args)
    for tiling in ({}, {"block_h": 16, "splits": H}, {"block_h": 32, "splits": 1}):
        error = _mismatch(inkling_router_triton(*args, **tiling), want, dtype)
        if error:
            return f"{tiling}: {error}"
    return None


def _mismatch(have, want, dtype) -> str | None:
    """What differs between the kernel's routing and the spec's, or None."""
    try:
        assert torch.equal(have[1], want[1]), f"experts {have[1].tolist()} != {want[1].tolist()}"
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(have[0], want[0], atol=tol, rtol=tol)
        torch.testing.assert_close(have[2], want[2], atol=tol, rtol=tol)
    except AssertionError as err:
        return str(err)
    return None


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
