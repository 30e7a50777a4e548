"""Selected-experts MoE (`hf_qsa_cache.ops.experts`): the Triton kernels against the torch reference and
transformers' ``batched_mm``, the registered ``"hf_qsa_selected"`` implementation in whole models, its
fallback for experts it does not cover, and when CUDA-graph steps choose it.

The Triton comparison runs this file as a script in a subprocess with TRITON_INTERPRET=1 (the
variable only counts if it is set before triton is first imported): real Qwen4Exp and Inkling experts
modules from tiny configs whose sizes the forced tiles do not divide, fp32 and bf16, both weight
layouts, 1, 3 and 5 tokens with experts repeated across tokens and an expert-parallel sentinel id, then
greedy generate() of both tiny models with the kernels in every MoE layer.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from functools import partial

import pytest
import helpers.inkling as inkling
import torch
from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import moe
from transformers.models.inkling.modeling_inkling import InklingExperts
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextExperts

from hf_qsa_cache import fusions
from hf_qsa_cache import cuda_graphs
from hf_qsa_cache.cuda_graphs import capture_key, experts_modules, graph_experts
from hf_qsa_cache.ops import experts as selected
from hf_qsa_cache.ops import prompt_experts
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter

NEW_TOKENS = 5


# ----------------------------------------------------------------------------- inputs
def experts_module(family: str, seed: int = 0) -> nn.Module:
    """A transformers experts module with random weights: hidden 40 / intermediate 24 (Qwen4Exp), 24 / 40
    (Inkling), 6 experts, top 3; neither size is a multiple of 16."""
    if family == "qwen4_exp":
        module = Qwen4ExpTextExperts(tiny_config(hidden_size=40, moe_intermediate_size=24, num_experts=6,
                                                 num_experts_per_tok=3))
    else:
        module = InklingExperts(inkling.make_config(hidden_size=24, moe_intermediate_size=40, n_routed_experts=6,
                                                    num_experts_per_tok=3))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    return module.eval()


def transposed(module: nn.Module) -> nn.Module:
    """The same experts stored in the transposed layout (``[E, H, 2I]`` and ``[E, I, H]``)."""
    other = copy.deepcopy(module)
    other.is_transposed = True
    other.gate_up_proj = nn.Parameter(module.gate_up_proj.detach().transpose(1, 2).contiguous())
    other.down_proj = nn.Parameter(module.down_proj.detach().transpose(1, 2).contiguous())
    return other


def routing(module: nn.Module, num_tokens: int, seed: int, sentinel: bool, dtype=torch.float32):
    """(hidden states, top-k index, top-k weights): distinct experts per token, the first token's first
    expert repeated by the last token, and with ``sentinel`` an expert-parallel sentinel id (with a
    non-zero weight, which must not count) in the middle token's last slot."""
    gen = torch.Generator().manual_seed(seed)
    num_experts, top_k = module.num_experts, 3
    hidden = module.gate_up_proj.shape[1 if module.is_transposed else 2]
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    if num_tokens > 1:
        first = index[0, 0]
        index[-1] = torch.cat([first.view(1), index[-1][index[-1] != first]])[:top_k]
    if sentinel:
        index[num_tokens // 2, -1] = num_experts
    weights = (torch.rand(num_tokens, top_k, generator=gen) + 0.1).to(dtype)
    module._is_expert_parallel = sentinel  # what batched_mm needs to read the sentinel
    return x, index, weights


def fp32_reference(module: nn.Module, x, index, weights) -> torch.Tensor:
    """The reference in fp32 on the module's (possibly bf16) values: what a bf16 result is judged against."""
    return selected.selected_experts_torch(x.float(), index, weights.float(), module.gate_up_proj.float(),
                                           module.down_proj.float(), module.is_transposed)


# ----------------------------------------------------------------------------- triton vs torch
def _interpreted(experts_triton) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(experts_triton._gate_up_kernel, InterpretedFunction)


def _counted_launches() -> list:
    """Under the interpreter: both kernels' launches counted, the registered implementation's CUDA dispatch taken
    on CPU tensors."""
    from hf_qsa_cache.ops import experts_triton

    launches: list = []
    count_launches(experts_triton, "_gate_up_kernel", launches)
    count_launches(experts_triton, "_down_kernel", launches)
    selected.use_triton = lambda *x: True
    return launches


def _routed_case(family: str, layout: str, num_tokens: int) -> str | None:
    """The kernels against the torch reference and batched_mm at one family, layout and token count (a sentinel
    id for 1 and 5 tokens): tiles smaller than and not dividing both sizes; also the default tiles (one reduction
    chunk) for one token, and narrow tiles with wide chunks for five; then, in the normal layout, bf16."""
    from hf_qsa_cache.ops import experts_triton

    launches = _counted_launches()
    base = experts_module(family, seed=1 if family == "qwen4_exp" else 2)
    module = transposed(base) if layout == "transposed" else base
    sentinel = num_tokens != 3
    x, index, weights = routing(module, num_tokens, seed=10 * num_tokens, sentinel=sentinel)
    args = (x, index, weights, module.gate_up_proj.detach(), module.down_proj.detach(), module.is_transposed)
    want = selected.selected_experts_torch(*args)
    with torch.no_grad():
        upstream = moe.batched_mm_experts_forward(module, x, index, weights)
    tiles = [(16, 16)] + [(None, None)] * (num_tokens == 1) + [(8, 32)] * (num_tokens == 5)
    for block_n, block_k in tiles:
        label = f"fp32 block_n={block_n} block_k={block_k}"
        launches.clear()
        have = experts_triton.selected_experts_triton(*args, block_n=block_n, block_k=block_k)
        if len(launches) != 2 or launches[0][0] != num_tokens * 3 or launches[1][0] != num_tokens:
            return f"{label}: launches {launches}"
        try:
            assert have.dtype == x.dtype and have.shape == x.shape
            torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(have, upstream, atol=1e-5, rtol=1e-5)
        except AssertionError as err:
            return f"{label}: {err}"
    if layout == "transposed":
        return None  # the layout is strides only: bf16 once is enough
    # bf16: within one bf16 step of the fp32 math on the same values (the interpreter rounds its output casts
    # towards zero, a GPU to nearest), and no further from it than batched_mm.
    half = copy.deepcopy(module).to(torch.bfloat16)
    xh, wh = x.to(torch.bfloat16), weights.to(torch.bfloat16)
    exact = fp32_reference(half, xh, index, wh)
    have = experts_triton.selected_experts_triton(
        xh, index, wh, half.gate_up_proj.detach(), half.down_proj.detach(), half.is_transposed, block_n=16,
        block_k=16)
    with torch.no_grad():
        upstream = moe.batched_mm_experts_forward(half, xh, index, wh)
    ours, theirs = (have.float() - exact).abs().max(), (upstream.float() - exact).abs().max()
    try:
        assert have.dtype == torch.bfloat16
        torch.testing.assert_close(have.float(), exact, atol=1e-6, rtol=2 ** -7)
        assert ours <= theirs, f"error {ours} vs batched_mm's {theirs}"
    except AssertionError as err:
        return f"bf16: {err}"
    return None


def _registered_case(family: str, layout: str) -> str | None:
    """The registered implementation takes the Triton path on (what it treats as) CUDA tensors: two launches, the
    result of batched_mm."""
    launches = _counted_launches()
    base = experts_module(family, seed=1 if family == "qwen4_exp" else 2)
    module = transposed(base) if layout == "transposed" else base
    x, index, weights = routing(module, 3, seed=99, sentinel=True)
    with torch.no_grad():
        have = selected.selected_experts_forward(module, x, index, weights)
        want = moe.batched_mm_experts_forward(module, x, index, weights)
    if len(launches) != 2:
        return f"launches {launches}"
    torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
    return None


def shared_expert(hidden: int, inter: int, seed: int):
    """Qwen4Exp's shared expert (transformers' MLP) and its one-output gate, random weights."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextMLP

    mlp = Qwen4ExpTextMLP(tiny_config(hidden_size=hidden), intermediate_size=inter)
    gate = nn.Linear(hidden, 1, bias=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (*mlp.parameters(), gate.weight):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    return mlp.eval(), gate


def _check_shared(launches, label, args, upstream, tiles) -> str | None:
    """The kernels on ``args`` (with a shared expert) against the torch specification and ``upstream``: two
    launches, the first over the routed and shared pairs, the second over the tokens."""
    from hf_qsa_cache.ops import experts_triton

    want = selected.selected_experts_torch(*args)
    tokens, top_k, shared = args[1].shape[0], args[1].shape[1], args[-1].gate.shape[0]
    for block_n, block_k in tiles:
        where = f"{label} T={tokens} block_n={block_n} block_k={block_k}"
        launches.clear()
        have = experts_triton.selected_experts_triton(*args, block_n=block_n, block_k=block_k)
        if len(launches) != 2 or launches[0][0] != tokens * (top_k + shared) or launches[1][0] != tokens:
            return f"{where}: launches {launches}"
        try:
            torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(have, upstream, atol=1e-5, rtol=1e-5)
        except AssertionError as err:
            return f"{where}: {err}"
    return None


def _qwen4_shared_case(shared_inter: int, num_tokens: int) -> str | None:
    """Qwen4Exp's one shared expert folded into both kernels, weighted by sigmoid(gate(x)), its width below or
    above the routed one (the scratch is as wide as the wider), tiles forced small, a sentinel id for 3 tokens:
    against the torch specification and upstream's modules (routed experts by batched_mm plus the shared one)."""
    launches = _counted_launches()
    module = experts_module("qwen4_exp", seed=3)  # hidden 40, intermediate 24
    mlp, gate = shared_expert(40, shared_inter, seed=shared_inter)
    shared = selected.SharedExpert(mlp.gate_proj.weight.detach()[None], mlp.up_proj.weight.detach()[None],
                                   mlp.down_proj.weight.detach()[None], gate_vector=gate.weight.detach())
    x, index, weights = routing(module, num_tokens, seed=5 + num_tokens, sentinel=num_tokens == 3)
    args = (x, index, weights, module.gate_up_proj.detach(), module.down_proj.detach(), False, shared)
    with torch.no_grad():
        upstream = moe.batched_mm_experts_forward(module, x, index, weights) + torch.sigmoid(gate(x)) * mlp(x)
    return _check_shared(launches, f"qwen4_exp shared {shared_inter}", args, upstream,
                         ((16, 16), (8, 32), (None, None)))


def _inkling_shared_case(num_tokens: int) -> str | None:
    """Inkling's two shared experts, weighted per token, folded into both kernels (tiles forced small, a sentinel
    id for 3 tokens), against the torch specification and upstream's modules."""
    from transformers.models.inkling.modeling_inkling import InklingSharedExperts

    launches = _counted_launches()
    module = experts_module("inkling", seed=4)  # hidden 24, intermediate 40
    shared_experts = InklingSharedExperts(inkling.make_config(hidden_size=24, moe_intermediate_size=40,
                                                              n_shared_experts=2))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in shared_experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    x, index, weights = routing(module, num_tokens, seed=8 + num_tokens, sentinel=num_tokens == 3)
    gammas = torch.rand(num_tokens, 2, generator=gen) + 0.1
    shared = selected.SharedExpert(shared_experts.gate_proj.detach(), shared_experts.up_proj.detach(),
                                   shared_experts.down_proj.detach(), token_weights=gammas)
    args = (x, index, weights, module.gate_up_proj.detach(), module.down_proj.detach(), False, shared)
    with torch.no_grad():
        upstream = moe.batched_mm_experts_forward(module, x, index, weights) + shared_experts(x, gammas=gammas)
    return _check_shared(launches, "inkling 2 shared", args, upstream, ((16, 16), (8, 32)))


def shared_module(model) -> nn.Module:
    """The first MoE block's shared expert(s) module: Qwen4Exp's ``shared_expert``, Inkling's ``shared_experts``."""
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    return getattr(block, "shared_expert", None) or block.shared_experts


def _generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                              eos_token_id=None)


def _family(family: str):
    """(our tiny model, left-padded prompts, attention mask)."""
    if family == "qwen4_exp":
        return make_pair(seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8))
    model = inkling.make_pair(inkling.make_config(), seed=9)[1]
    return model, *inkling.left_pad(inkling.make_prompts([7, 3, 5], seed=10))


def _compare_generate(model, ids, mask, atol: float, spy=None) -> str | None:
    """Greedy generate() with the model's default experts, then with ``hf_qsa_selected``: same tokens,
    logits within ``atol``. ``spy``: a context manager around the second generate() alone."""
    want = _generate(model, ids, mask)
    model.set_experts_implementation(selected.SELECTED_EXPERTS)
    try:
        with spy or contextlib.nullcontext():
            have = _generate(model, ids, mask)
    finally:
        model.set_experts_implementation(selected.OURS)
    if not torch.equal(have.sequences, want.sequences):
        return f"tokens {have.sequences.tolist()} != {want.sequences.tolist()}"
    for step, (h, w) in enumerate(zip(have.logits, want.logits)):
        try:
            torch.testing.assert_close(h, w, atol=atol, rtol=0)
        except AssertionError as err:
            return f"step {step}: {err}"
    return None


def _generate_case(family: str, fold: bool) -> str | None:
    """Every MoE layer of the tiny model through the kernels, prompts and decode steps; with the shared expert
    folded in, its modules must then never run."""
    from hf_qsa_cache.fusions import fused

    launches = _counted_launches()
    model, ids, mask = _family(family)
    mlp_type, calls = type(shared_module(model)), []

    @contextlib.contextmanager
    def counting_shared_calls():  # in the kernels' generate() only (the default experts run the module)
        real = mlp_type.forward
        mlp_type.forward = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
        try:
            yield
        finally:
            mlp_type.forward = real

    with fused(("shared_expert",), on=fold):
        error = _compare_generate(model, ids, mask, atol=1e-4, spy=counting_shared_calls() if fold else None)
    if fold and not error and calls:
        error = f"the shared expert module ran {len(calls)} times"
    return error or (None if launches else "no launches")


FAMILIES = ("qwen4_exp", "inkling")
LAYOUTS = ("normal", "transposed")
# Real experts modules from tiny configs whose sizes the forced tiles do not divide (`experts_module`), 1, 3 and 5
# tokens (1 and 5 with a sentinel id); shared experts folded in; generate() of both tiny models with the kernels.
KERNEL_CASES = {
    **{f"{family}-{layout}-T{tokens}": partial(_routed_case, family, layout, tokens)
       for family in FAMILIES for layout in LAYOUTS for tokens in (1, 3, 5)},
    **{f"{family}-{layout}-registered-forward": partial(_registered_case, family, layout)
       for family in FAMILIES for layout in LAYOUTS},
    **{f"qwen4_exp-shared-I{inter}-T{tokens}": partial(_qwen4_shared_case, inter, tokens)
       for inter in (20, 40) for tokens in (1, 3)},
    **{f"inkling-2-shared-T{tokens}": partial(_inkling_shared_case, tokens) for tokens in (1, 3)},
    **{f"generate-{family}{'-shared-folded' * fold}": partial(_generate_case, family, fold)
       for family in FAMILIES for fold in (False, True)},
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_reference_and_batched_mm(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    from hf_qsa_cache.ops import experts_triton

    if not _interpreted(experts_triton):
        return "TRITON_INTERPRET was not honoured"
    return KERNEL_CASES[case]()


# ----------------------------------------------------------------------------- the registered implementation
def test_registered_with_transformers():
    assert moe.ALL_EXPERTS_FUNCTIONS[selected.SELECTED_EXPERTS] is selected.selected_experts_forward


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
@pytest.mark.parametrize("layout", ["normal", "transposed"])
def test_torch_reference_matches_batched_mm(family, layout):
    module = experts_module(family)
    module = transposed(module) if layout == "transposed" else module
    for num_tokens, sentinel in ((1, True), (3, False), (5, True)):
        x, index, weights = routing(module, num_tokens, seed=num_tokens, sentinel=sentinel)
        with torch.no_grad():
            want = moe.batched_mm_experts_forward(module, x, index, weights)
            have = selected.selected_experts_forward(module, x, index, weights)
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_generate_with_selected_experts_equals_the_default(family, monkeypatch):
    """On the CPU the registered implementation runs the torch reference in every MoE layer."""
    calls = []
    reference = selected.selected_experts_torch
    monkeypatch.setattr(selected, "selected_experts_torch", lambda *a: (calls.append(1), reference(*a))[1])
    model, ids, mask = _family(family)
    assert model.config._experts_implementation == selected.OURS
    assert _compare_generate(model, ids, mask, atol=1e-5) is None
    assert calls and model.config._experts_implementation == selected.OURS


def _unsupported_variants(module: nn.Module):
    """Experts the kernels do not cover, each with what transformers' batched_mm then computes."""
    hidden, inter = module.gate_up_proj.shape[2], module.down_proj.shape[2]

    def variant(change):
        other = copy.deepcopy(module)
        change(other)
        return other

    def biases(m):
        m.has_bias = True
        m.gate_up_proj_bias = nn.Parameter(torch.randn(m.num_experts, 2 * inter))
        m.down_proj_bias = nn.Parameter(torch.randn(m.num_experts, hidden))

    def post_norm(m):
        m.has_post_expert_norm = True
        m.post_expert_norm = nn.LayerNorm(hidden)

    yield "gelu", variant(lambda m: setattr(m, "act_fn", ACT2FN["gelu_pytorch_tanh"]))
    yield "bias", variant(biases)
    yield "post-expert norm", variant(post_norm)
    yield "custom gate", variant(lambda m: setattr(m, "_apply_gate", lambda out: out[:, :inter] * out[:, inter:]))
    yield "interleaved", variant(lambda m: setattr(m, "is_concatenated", False))
    yield "no gate", variant(lambda m: setattr(m, "has_gate", False))


def test_experts_it_does_not_cover_run_batched_mm(monkeypatch):
    base = experts_module("qwen4_exp")
    assert selected.supports(base) and selected.supports(transposed(base))
    assert selected.supports(experts_module("inkling"))
    monkeypatch.setattr(selected, "selected_experts_torch", lambda *a: 1 / 0)
    monkeypatch.setattr(selected, "use_triton", lambda x: 1 / 0)
    for name, module in _unsupported_variants(base):
        assert not selected.supports(module), name
        if name == "no gate":
            continue  # batched_mm would need up_proj weights this module does not have
        x, index, weights = routing(module, 3, seed=4, sentinel=False)
        with torch.no_grad():
            have = selected.selected_experts_forward(module, x, index, weights)
            want = moe.batched_mm_experts_forward(module, x, index, weights)
        torch.testing.assert_close(have, want, atol=0, rtol=0, msg=name)
    # Weights that do not match the hidden states, and non-float weights, are not the kernels' either.
    x, index, weights = routing(base, 2, seed=5, sentinel=False)
    with pytest.raises(RuntimeError):
        selected.selected_experts_forward(base, x[:, :-1], index, weights)  # batched_mm's own error
    assert not selected.supports(variant_with_dtype(base, torch.int8))


def variant_with_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    other = copy.deepcopy(module)
    other.gate_up_proj = nn.Parameter(other.gate_up_proj.detach().to(dtype), requires_grad=False)
    return other


# ----------------------------------------------------------------------------- graph steps
def test_graph_steps_run_selected_experts_only_when_asked(monkeypatch):
    _, model = make_pair(seed=7)
    experts = experts_modules(model)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    most = selected.SELECTED_EXPERTS_MAX_TOKENS
    monkeypatch.setitem(fusions.STATE, "tiled_experts", False)  # on by default; its own case below
    monkeypatch.setitem(fusions.STATE, "experts", False)
    assert graph_experts(model, experts, cuda, 1) == "batched_mm"  # fp32: grouped_mm cannot be captured
    monkeypatch.setitem(fusions.STATE, "experts", True)  # HF_QSA_FUSED=experts
    assert graph_experts(model, experts, cuda, 1) == graph_experts(model, experts, cuda, most) == "hf_qsa_selected"
    assert graph_experts(model, experts, cuda, most + 1) == "batched_mm"  # too many tokens: as before
    monkeypatch.setitem(fusions.STATE, "tiled_experts", True)  # more tokens: the tiled kernels, any dtype
    assert graph_experts(model, experts, cuda, most + 1) is None  # our own experts: they run the tiled kernels
    assert graph_experts(model, experts, cuda, 1) == "hf_qsa_selected"
    monkeypatch.setitem(fusions.STATE, "tiled_experts", False)
    assert graph_experts(model, experts, cpu, 1) == "batched_mm"  # not on CUDA: as before
    key = capture_key(model, experts, cuda, graph_experts(model, experts, cuda, 1), 4, 1)
    assert key[2] == "hf_qsa_selected" and key != capture_key(model, experts, cuda, "batched_mm", 4, 1)
    model.to(torch.bfloat16)  # bf16 on Hopper: grouped GEMMs capture, but the fused experts still win for small steps
    assert graph_experts(model, experts, cuda, 1) == "hf_qsa_selected"
    assert graph_experts(model, experts, cuda, most + 1) is None
    for named in ("batched_mm", "grouped_mm"):  # a user's choice runs as chosen, graph steps included
        model.set_experts_implementation(named)
        assert graph_experts(model, experts, cuda, 1) is None and graph_experts(model, experts, cuda, most + 1) is None
    model.set_experts_implementation(selected.OURS)
    monkeypatch.setitem(fusions.STATE, "experts", False)
    assert graph_experts(model, experts, cuda, 1) is None  # our own grouped GEMMs capture in bf16 on Hopper
    model.to(torch.float32)
    monkeypatch.setitem(fusions.STATE, "experts", True)  # HF_QSA_FUSED=experts
    # Experts the kernels do not cover keep the earlier choice; so does an implementation the user chose.
    monkeypatch.setattr(experts[0][0], "act_fn", ACT2FN["gelu_pytorch_tanh"])
    assert graph_experts(model, experts, cuda, 1) == "batched_mm"
    monkeypatch.undo()
    monkeypatch.setitem(fusions.STATE, "experts", True)  # HF_QSA_FUSED=experts
    model.set_experts_implementation("eager")
    assert graph_experts(model, experts, cuda, 1) is None


def test_the_shared_expert_is_folded_only_where_it_may_be(monkeypatch):
    # The fusion on and hf_qsa_selected running: folded. A hook on any of the modules it would skip, autograd
    # recording, the fusion off, or another experts implementation: upstream's modules run.
    monkeypatch.setitem(fusions.STATE, "shared_expert", True)
    model = make_pair(seed=7)[1]
    model.set_experts_implementation(selected.SELECTED_EXPERTS)
    block = model.model.layers[0].mlp
    x = torch.randn(2, model.config.hidden_size)
    assert selected.shared_expert_to_fold(block, x) is None  # the weights require grad: autograd records
    with torch.no_grad():
        folded = selected.shared_expert_to_fold(block, x)
        assert folded is not None and folded.gate.shape[0] == 1  # views of the weights, not copies
        assert folded.gate.data_ptr() == block.shared_expert.gate_proj.weight.data_ptr()
        assert folded.gate_vector is block.shared_expert_gate.weight
        for module in (block.experts, block.shared_expert, block.shared_expert.down_proj, block.shared_expert_gate):
            handle = module.register_forward_hook(lambda *a: None)
            assert selected.shared_expert_to_fold(block, x) is None, type(module).__name__
            handle.remove()
        model.set_experts_implementation("grouped_mm")
        assert selected.shared_expert_to_fold(block, x) is None
        model.set_experts_implementation(selected.SELECTED_EXPERTS)
        monkeypatch.setitem(fusions.STATE, "shared_expert", False)
        assert selected.shared_expert_to_fold(block, x) is None


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
@pytest.mark.parametrize("route_fused", [False, True])
def test_a_block_with_its_shared_expert_folded_equals_upstreams_block(monkeypatch, family, route_fused):
    from hf_qsa_cache.ops import inkling_router, router

    model = make_pair(seed=7)[1] if family == "qwen4_exp" else inkling.make_pair(inkling.make_config(), seed=9)[1]
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        want = type(block).__mro__[1].forward(block, x)  # transformers' own block forward
        monkeypatch.setitem(fusions.STATE, "router", route_fused)
        monkeypatch.setitem(fusions.STATE, "inkling_router", route_fused)
        monkeypatch.setitem(fusions.STATE, "shared_expert", True)
        model.set_experts_implementation(selected.SELECTED_EXPERTS)
        calls = []
        shared_type = type(shared_module(model))
        real = shared_type.forward
        monkeypatch.setattr(shared_type, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
        have = block(x)
    assert not calls
    torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)


def test_inkling_shared_experts_are_folded_only_where_they_may_be(monkeypatch):
    monkeypatch.setitem(fusions.STATE, "shared_expert", True)
    model = inkling.make_pair(inkling.make_config(), seed=9)[1]
    model.set_experts_implementation(selected.SELECTED_EXPERTS)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(2, model.config.hidden_size)
    assert selected.inkling_shared_experts_to_fold(block, x) is None  # the weights require grad
    with torch.no_grad():
        folded = selected.inkling_shared_experts_to_fold(block, x)
        assert folded is not None and folded.gate is block.shared_experts.gate_proj and folded.token_weights is None
        for module in (block.experts, block.shared_experts):
            handle = module.register_forward_pre_hook(lambda *a: None)
            assert selected.inkling_shared_experts_to_fold(block, x) is None, type(module).__name__
            handle.remove()
        model.set_experts_implementation("grouped_mm")
        assert selected.inkling_shared_experts_to_fold(block, x) is None


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
