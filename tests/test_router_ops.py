"""Qwen4Exp's fused MoE routing (`hf_qsa_cache.ops.router`): the spec against transformers' router, the
model with the fused path on against the default (and off again once router logits are recorded), and the
Triton kernel against the torch function (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys

import pytest
import torch
from fusion_helpers import assert_fused_generate_equals_default
from interpreter import run_under_interpreter
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextTopKRouter

from hf_qsa_cache.ops import router


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spec_is_transformers_router(normalize, dtype):
    from qwen4_helpers import tiny_config

    config = tiny_config(norm_topk_prob=normalize)
    module = Qwen4ExpTextTopKRouter(config).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=g))
        x = torch.randn(7, config.hidden_size, generator=g).to(dtype)
        _, want_weights, want_experts = module(x)
        weights, experts = router.route_topk_torch(torch.nn.functional.linear(x, module.weight), module.top_k, normalize)
    assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)


def test_generate_with_the_fused_path_equals_the_default(monkeypatch):
    from qwen4_helpers import left_pad, make_pair, random_prompts

    _, model = make_pair(seed=10)
    ids, mask = left_pad(random_prompts([21, 9, 14], seed=11))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, router, "FUSED_ROUTER", "route_topk_torch",
                                         atol=1e-5)
    # Recording router logits hooks the routers: from then on they run their own forward.
    monkeypatch.setattr(router, "FUSED_ROUTER", True)
    with torch.no_grad():
        model(ids, attention_mask=mask, output_router_logits=True)
    assert not router.fuses_routing(model.model.layers[0].mlp.gate, ids.float())


def test_triton_kernel_matches_torch():
    run_under_interpreter(__file__, "all router kernel cases ok")


def _main() -> int:
    from hf_qsa_cache.ops.router_triton import route_topk_triton

    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for T, E, k in ((1, 64, 10), (5, 24, 3), (3, 8, 8)):  # 24 experts: padded to 32; k = E: all picked
            for normalize in (True, False):
                g = torch.Generator().manual_seed(T * 100 + E + k)
                logits = (torch.randn(T, E, generator=g) * 3).to(dtype)
                got = route_topk_triton(logits, k, normalize)
                want = router.route_topk_torch(logits, k, normalize)
                assert torch.equal(got[1], want[1]), (T, E, k, dtype, got[1], want[1])
                tol = 1e-6 if dtype == torch.float32 else 8e-3
                torch.testing.assert_close(got[0].float(), want[0].float(), atol=tol, rtol=tol)
                cases += 1
    print(f"all router kernel cases ok ({cases})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
