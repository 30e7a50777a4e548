"""Expert-major selected experts (`hf_qsa_cache.ops.experts_by_expert_triton`): the kernels against the torch
specification and transformers' ``batched_mm``, the dispatch by token count and dtype, the ``experts_by_expert``
fusion in CUDA-graph step choices, and greedy generate() of both tiny models with it on.

The kernel comparison runs this file as a script under the Triton interpreter (`interpreter.py`): real
Qwen4Exp and Inkling experts modules whose sizes the forced tiles do not divide, both weight layouts, fp32
and bf16, 4 to 17 tokens with an expert-parallel sentinel id, an expert no token chose (its weights NaN:
reading them would poison the output), expert ranges that do not divide the experts, shared experts.
"""

from __future__ import annotations

import copy
import sys

import pytest
import test_inkling as inkling
import torch
from test_experts_kernel import _family, _generate, experts_module, routing, shared_expert, transposed
from torch import nn
from transformers.integrations import moe

from hf_qsa_cache import cuda_graphs
from hf_qsa_cache.cuda_graphs import experts_modules, graph_experts
from hf_qsa_cache.ops import experts as selected
from hf_qsa_cache.ops import experts_by_expert_triton as by_expert
from interpreter import count_launches, run_under_interpreter
from qwen4_helpers import make_pair

# (gate-up tiles, down tiles): the smallest tiles with one, two and three expert ranges (6 experts), and the
# module's defaults.
TILES = [((16, 16, 1), (16, 16, 1, 1)), ((16, 16, 2), (16, 32, 2, 2)), ((32, 16, 1), (16, 16, 4, 1)), (None, None)]


def test_kernels_match_reference_under_the_interpreter():
    run_under_interpreter(__file__, "all expert-major cases ok")


def _unchosen_expert(module: nn.Module, index: torch.Tensor) -> nn.Module:
    """A copy of ``module`` whose experts that ``index`` never names hold NaN weights."""
    other = copy.deepcopy(module)
    unused = sorted(set(range(module.num_experts)) - set(index.reshape(-1).tolist()))  # sentinels are out of range
    assert unused, "the routing must leave an expert out"
    with torch.no_grad():
        other.gate_up_proj[unused] = float("nan")
        other.down_proj[unused] = float("nan")
    return other


def _check(label, launches, args, want, upstream, tiles, shared_count: int, atol=1e-5) -> str | None:
    tokens = args[0].shape[0]
    for gate_up_tiles, down_tiles in tiles:
        where = f"{label} T={tokens} tiles={gate_up_tiles},{down_tiles}"
        launches.clear()
        have = by_expert.selected_experts_by_expert_triton(*args, gate_up_tiles=gate_up_tiles, down_tiles=down_tiles)
        experts = args[3].shape[0]
        ranges = (down_tiles or by_expert.DOWN_TILES)[2]
        per_range = -(-experts // ranges)
        expect = 2 if -(-experts // per_range) == 1 else 3
        if len(launches) != expect or launches[0][0] != experts + shared_count:
            return f"{where}: launches {launches}"
        try:
            assert have.dtype == args[0].dtype and have.shape == args[0].shape
            torch.testing.assert_close(have, want, atol=atol, rtol=atol)
            if upstream is not None:
                torch.testing.assert_close(have, upstream, atol=atol, rtol=atol)
        except AssertionError as err:
            return f"{where}: {err}"
    return None


def _routed_cases(launches) -> str | None:
    for family in ("qwen4_exp", "inkling"):
        base = experts_module(family, seed=11)
        for layout, module in (("normal", base), ("transposed", transposed(base))):
            for num_tokens in (4, 7, 17):
                x, index, weights = routing(module, num_tokens, seed=num_tokens, sentinel=num_tokens != 7)
                if num_tokens == 4:  # the last expert chosen by no token, its weights NaN
                    gen = torch.Generator().manual_seed(4)
                    last = module.num_experts - 1
                    index = torch.stack([torch.randperm(last, generator=gen)[:3] for _ in range(num_tokens)])
                    index[num_tokens // 2, -1] = module.num_experts  # the sentinel, as `routing` puts it
                    module_used = _unchosen_expert(module, index)
                else:
                    module_used = module
                args = (x, index, weights, module_used.gate_up_proj.detach(), module_used.down_proj.detach(),
                        module.is_transposed)
                want = selected.selected_experts_torch(x, index, weights, module.gate_up_proj.detach(),
                                                       module.down_proj.detach(), module.is_transposed)
                with torch.no_grad():
                    upstream = moe.batched_mm_experts_forward(module, x, index, weights)
                error = _check(f"{family} {layout} fp32", launches, args, want, upstream, TILES, 0)
                if error:
                    return error
                if layout == "transposed":
                    continue
                # bf16: every output within one bf16 step of the fp32 math on the same values (the interpreter
                # rounds output casts towards zero, a GPU to nearest: 1 step, not half of one).
                half = copy.deepcopy(module).to(torch.bfloat16)
                xh, wh = x.to(torch.bfloat16), weights.to(torch.bfloat16)
                exact = selected.selected_experts_torch(xh.float(), index, wh.float(), half.gate_up_proj.float(),
                                                        half.down_proj.float())
                have = by_expert.selected_experts_by_expert_triton(
                    xh, index, wh, half.gate_up_proj.detach(), half.down_proj.detach(),
                    gate_up_tiles=(16, 16, 1), down_tiles=(16, 16, 2, 1))
                step = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))
                try:
                    assert have.dtype == torch.bfloat16
                    # plus the two-term operand's 16 bits, relative to the outputs' scale (a near-zero output
                    # is a cancellation of larger terms)
                    excess = ((have.float() - exact).abs() - step - 2 ** -16 * exact.abs().max()).max()
                    assert excess <= 0, f"an output further than one bf16 step from the fp32 math (by {excess})"
                except AssertionError as err:
                    return f"{family} T={num_tokens} bf16: {err}"
    return None


def _shared_cases(launches) -> str | None:
    """Qwen4Exp's gated shared expert (narrower and wider than the routed experts) and Inkling's two
    router-weighted shared experts, in the last expert range."""
    module = experts_module("qwen4_exp", seed=3)  # hidden 40, intermediate 24
    for shared_inter in (20, 40):
        mlp, gate = shared_expert(40, shared_inter, seed=shared_inter)
        shared = selected.SharedExpert(mlp.gate_proj.weight.detach()[None], mlp.up_proj.weight.detach()[None],
                                       mlp.down_proj.weight.detach()[None], gate_vector=gate.weight.detach())
        x, index, weights = routing(module, 5, seed=5, sentinel=True)
        args = (x, index, weights, module.gate_up_proj.detach(), module.down_proj.detach(), False, shared)
        with torch.no_grad():
            upstream = moe.batched_mm_experts_forward(module, x, index, weights) + torch.sigmoid(gate(x)) * mlp(x)
        error = _check(f"qwen4_exp shared {shared_inter}", launches, args, selected.selected_experts_torch(*args),
                       upstream, TILES, 1)
        if error:
            return error
    from transformers.models.inkling.modeling_inkling import InklingSharedExperts

    module = experts_module("inkling", seed=4)  # hidden 24, intermediate 40
    shared_experts = InklingSharedExperts(inkling.make_config(hidden_size=24, moe_intermediate_size=40,
                                                              n_shared_experts=2))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in shared_experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    x, index, weights = routing(module, 6, seed=9, sentinel=True)
    gammas = torch.rand(6, 2, generator=gen) + 0.1
    shared = selected.SharedExpert(shared_experts.gate_proj.detach(), shared_experts.up_proj.detach(),
                                   shared_experts.down_proj.detach(), token_weights=gammas)
    args = (x, index, weights, module.gate_up_proj.detach(), module.down_proj.detach(), False, shared)
    with torch.no_grad():
        upstream = moe.batched_mm_experts_forward(module, x, index, weights) + shared_experts(x, gammas=gammas)
    return _check("inkling 2 shared", launches, args, selected.selected_experts_torch(*args), upstream, TILES, 2)


def _main() -> int:
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.fusions import fused

    torch.set_num_threads(1)
    if not isinstance(by_expert._by_expert_gate_up_kernel, InterpretedFunction):
        print("TRITON_INTERPRET was not honoured")
        return 1
    launches: list = []
    for name in ("_by_expert_gate_up_kernel", "_by_expert_down_kernel", "_sum_ranges_kernel"):
        count_launches(by_expert, name, launches)
    error = _routed_cases(launches) or _shared_cases(launches)
    if error:
        print(error)
        return 1
    # Every MoE layer of both tiny models, with the shared experts folded: prompts (3 rows, more than 4
    # tokens) run expert-major; generate() equals the default experts within fp32 rounding.
    selected._use_triton = lambda x: True  # the CUDA dispatch, on CPU tensors
    for family in ("qwen4_exp", "inkling"):
        model, ids, mask = _family(family)
        want = _generate(model, ids, mask)
        launches.clear()
        model.set_experts_implementation(selected.SELECTED_EXPERTS)
        with fused(("experts_by_expert", "shared_expert")):
            have = _generate(model, ids, mask)
        model.set_experts_implementation("grouped_mm")
        if not launches or not torch.equal(have.sequences, want.sequences):
            print(f"{family} generate: {len(launches)} launches, tokens {have.sequences.tolist()} != "
                  f"{want.sequences.tolist()}")
            return 1
        for step, (h, w) in enumerate(zip(have.logits, want.logits)):
            try:
                torch.testing.assert_close(h, w, atol=1e-4, rtol=0)
            except AssertionError as err:
                print(f"{family} generate step {step}: {err}")
                return 1
    print("all expert-major cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(_main())


# ----------------------------------------------------------------------------- dispatch and limits (no kernels)
def test_dispatch_by_token_count_and_dtype():
    module = experts_module("qwen4_exp")
    weights = module.gate_up_proj.detach()
    assert not by_expert.by_expert_applies(torch.zeros(by_expert.BY_EXPERT_MIN_TOKENS - 1, 40), weights)
    assert by_expert.by_expert_applies(torch.zeros(by_expert.BY_EXPERT_MIN_TOKENS, 40), weights)
    assert by_expert.by_expert_applies(torch.zeros(by_expert.BY_EXPERT_MAX_TOKENS, 40), weights)
    assert not by_expert.by_expert_applies(torch.zeros(by_expert.BY_EXPERT_MAX_TOKENS + 1, 40), weights)
    assert not by_expert.by_expert_applies(torch.zeros(8, 40, dtype=torch.bfloat16), weights)  # tl.dot: one dtype


@pytest.mark.parametrize("case", ["tokens", "dtype", "tile"])
def test_bad_input_is_refused_with_the_limit(case):
    module = experts_module("qwen4_exp")
    tokens = by_expert.BY_EXPERT_MAX_TOKENS + 1 if case == "tokens" else 5
    x, index, weights = routing(module, tokens, seed=0, sentinel=False)
    if case == "dtype":
        x = x.to(torch.bfloat16)
    tiles = (8, 16, 4) if case == "tile" else None
    message = {"tokens": "at most 64 tokens, got 65", "dtype": "must have the experts' dtype",
               "tile": "power of two >= 16"}[case]
    with pytest.raises(ValueError, match=message):
        by_expert.selected_experts_by_expert_triton(x, index, weights, module.gate_up_proj.detach(),
                                                    module.down_proj.detach(), gate_up_tiles=tiles)


def test_graph_steps_take_selected_experts_up_to_the_expert_major_limit(monkeypatch):
    _, model = make_pair(seed=7)
    experts = experts_modules(model)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cuda_graphs, "FUSED_EXPERTS", True)
    monkeypatch.setattr(selected, "FUSED_EXPERTS_BY_EXPERT", False)
    most = selected.PAIR_MAJOR_MAX_TOKENS
    assert graph_experts(model, experts, cuda, most) == "hf_qsa_selected"
    assert graph_experts(model, experts, cuda, most + 1) == "batched_mm"
    monkeypatch.setattr(selected, "FUSED_EXPERTS_BY_EXPERT", True)
    assert graph_experts(model, experts, cuda, by_expert.BY_EXPERT_MAX_TOKENS) == "hf_qsa_selected"
    assert graph_experts(model, experts, cuda, by_expert.BY_EXPERT_MAX_TOKENS + 1) == "batched_mm"


def test_run_selected_experts_dispatches_by_the_fusion(monkeypatch):
    """On the Triton path: expert-major from BY_EXPERT_MIN_TOKENS tokens with the fusion on, pair-major
    otherwise (the kernels themselves replaced by recorders)."""
    from hf_qsa_cache.ops import experts_triton

    module = experts_module("qwen4_exp")
    calls = []
    monkeypatch.setattr(selected, "_use_triton", lambda x: True)
    monkeypatch.setattr(by_expert, "selected_experts_by_expert_triton", lambda *a, **k: calls.append("experts"))
    monkeypatch.setattr(experts_triton, "selected_experts_triton", lambda *a, **k: calls.append("pairs"))
    with torch.no_grad():
        for on in (False, True):
            monkeypatch.setattr(selected, "FUSED_EXPERTS_BY_EXPERT", on)
            for tokens in (by_expert.BY_EXPERT_MIN_TOKENS - 1, by_expert.BY_EXPERT_MIN_TOKENS):
                x, index, weights = routing(module, tokens, seed=1, sentinel=False)
                selected.run_selected_experts(module, x, index, weights)
    assert calls == ["pairs", "pairs", "pairs", "experts"]
