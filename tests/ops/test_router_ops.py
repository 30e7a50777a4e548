"""Qwen4Exp's fused MoE routing (`hf_qsa_cache.ops.router`): the spec against transformers' router, the
model with the fused path on against the default (and off again once router logits are recorded), and the
Triton kernels against the torch function (as a script under the Triton interpreter, `interpreter.py`): the
split projection with its tiling forced small and the GEMM path for prompts, fp32 and bf16."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, run_case_under_interpreter
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextTopKRouter

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import router


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spec_is_transformers_router(normalize, dtype):
    from helpers.qwen4 import tiny_config

    config = tiny_config(norm_topk_prob=normalize)
    module = Qwen4ExpTextTopKRouter(config).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=g))
        x = torch.randn(7, config.hidden_size, generator=g).to(dtype)
        _, want_weights, want_experts = module(x)
        weights, experts = router.route_torch(x, module.weight, module.top_k, normalize)
    assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)


def test_generate_with_the_fused_path_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    _, model = make_pair(seed=10)
    ids, mask = left_pad(random_prompts([21, 9, 14], seed=11))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, router, "router", "route_torch",
                                         atol=1e-5)
    # Recording router logits hooks the routers: from then on they run their own forward.
    monkeypatch.setitem(fusions.STATE, "router", True)
    with torch.no_grad():
        model(ids, attention_mask=mask, output_router_logits=True)
    assert not router.fuses_routing(model.model.layers[0].mlp.gate, ids.float())


# (tokens, hidden, experts, k): hidden not a multiple of the projection's chunk; 24 experts padded to 32 and past one
# block of router rows; k = E: all picked.
SHAPES = {"1x40-64e-top10": (1, 40, 64, 10), "5x72-24e-top3": (5, 72, 24, 3), "3x16-8e-top8": (3, 16, 8, 8)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KERNEL_CASES = [f"{shape}-{d}" for shape in SHAPES for d in DTYPES]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> None:
    """The routing kernels against `route_torch` at one shape and dtype: the split projection by the launch policy,
    with one chunk per range (several splits, the last short), with one range, and the GEMM path; normalised or
    not; and the ranges that read their weight rows before the early-launch wait."""
    from hf_qsa_cache.ops import router_triton
    from hf_qsa_cache.ops.router_triton import route_triton

    shape_name, dtype_name = case.rsplit("-", 1)
    (T, H, E, k), dtype = SHAPES[shape_name], DTYPES[dtype_name]
    g = torch.Generator().manual_seed(T * 100 + E + k)
    x = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(E, H, generator=g) * 0.5).to(dtype)
    tilings = ({"split": True}, {"split": True, "block_h": 16, "splits": H}, {"split": True, "block_h": 32,
                                                                               "splits": 1}, {"split": False})
    for normalize in (True, False):
        want = router.route_torch(x, weight, k, normalize)
        for tiling in tilings:
            got = route_triton(x, weight, k, normalize, **tiling)
            where = (T, H, E, k, dtype, normalize, tiling)
            if dtype == torch.float32:
                assert torch.equal(got[1], want[1]), (where, got[1], want[1])
                torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
            else:  # the interpreter truncates bf16 casts (the GPU rounds them): a logit may sit one step
                # lower, so compare the probability each pick carries, within that step's effect
                probs = torch.softmax((x.float() @ weight.float().T).to(dtype).float(), dim=-1)
                torch.testing.assert_close(probs.gather(1, got[1]), probs.gather(1, want[1]), atol=2e-2,
                                           rtol=0, msg=lambda m: f"{where}: {m}")
                torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=0)
    # Ranges of one chunk read their weight rows before the early-launch wait: the bits of the loop that reads them
    # after (the same products, summed in the same order).
    for block_h, splits in ((16, H), (8, None)):
        early = router_triton.router_partials(x, weight, block_h, splits)
        router_triton.PRELOAD_WEIGHTS = False
        late = router_triton.router_partials(x, weight, block_h, splits)
        router_triton.PRELOAD_WEIGHTS = True
        assert torch.equal(early, late), (T, H, E, dtype, block_h, splits)


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
