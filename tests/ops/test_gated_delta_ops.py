"""GatedDeltaNet's fused gates and gated output norm (`hf_qsa_cache.ops.gated_delta`): the written-out
norm against transformers' module, the model with the fused path on against the default, and the Triton
kernels against the torch functions (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, run_case_under_interpreter
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNormGated

from hf_qsa_cache.ops import gated_delta


def _norm(D, activation, dtype, seed=0):
    torch.manual_seed(seed)
    norm = Qwen4ExpTextRMSNormGated(D, eps=1e-6, activation=activation)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_out_norm_is_transformers_module(activation, dtype):
    norm = _norm(24, activation, dtype)
    g = torch.Generator().manual_seed(1)
    x, gate = (torch.randn(7, 24, generator=g).to(dtype) * 3 for _ in range(2))
    with torch.no_grad():
        assert torch.equal(gated_delta.gated_rms_norm_torch(x, gate, norm.weight, 1e-6, activation), norm(x, gate))


def test_generate_with_the_fused_path_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    _, model = make_pair(seed=5)
    ids, mask = left_pad(random_prompts([19, 7, 26], seed=6))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, gated_delta, "gdn",
                                         "gated_rms_norm_torch", atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_step_is_the_window_path(dtype):
    """`conv_decode_step` (what one-token steps run when fused) against the store's window path: the same
    output and the same kept inputs afterwards, over steps that shift every tap out."""
    import torch.nn.functional as F

    from hf_qsa_cache.stores.linear_state import LinearAttentionState

    B, C, K = 3, 10, 4
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(C, K, generator=g).to(dtype)
    stores = []
    for _ in range(2):
        store = LinearAttentionState(4, C, K, 2, 4, 4)
        store.allocate("cpu", dtype)
        store.conv[:B] = torch.randn(B, C, K - 1, generator=torch.Generator().manual_seed(3)).to(dtype)
        stores.append(store)
    windowed, fused = stores
    for step in range(K + 1):
        x = torch.randn(B, C, 1, generator=g).to(dtype)
        window = windowed.window("conv", x, None)
        windowed.write_window("conv", window, None)
        want = F.silu(F.conv1d(window.to(dtype), weight.unsqueeze(1), None, groups=C)).to(dtype).transpose(1, 2)
        got = fused.conv_step_in_place(x, weight, dtype)
        tol = 1e-6 if dtype == torch.float32 else 1.6e-2  # bf16: the conv sum's order, then one rounding
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(fused.conv[:B], windowed.conv[:B]), f"step {step}: kept inputs differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dilated_conv_decode_step_is_the_ple_window_path(dtype):
    """The PLE layer's dilated conv (taps 3 inputs apart) plus its residual, in place, against the window path
    the layer runs otherwise, over steps that shift every kept input out."""
    import torch.nn.functional as F

    from hf_qsa_cache.stores.linear_state import LinearAttentionState

    B, C, K, dilation = 2, 12, 4, 3
    g = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv1d(C, C, K, groups=C, dilation=dilation, bias=False).to(dtype)
    stores = []
    for _ in range(2):
        store = LinearAttentionState(4, 8, 4, 2, 4, 4, ple_channels=C, ple_window=(K - 1) * dilation)
        store.allocate("cpu", dtype)
        store.ple_conv[:B] = torch.randn(B, C, (K - 1) * dilation, generator=torch.Generator().manual_seed(6)).to(dtype)
        stores.append(store)
    windowed, fused = stores
    for step in range((K - 1) * dilation + 2):
        x = torch.randn(B, C, 1, generator=g).to(dtype)
        residual = torch.randn(B, 1, C, generator=g).to(dtype)
        window = windowed.window("ple_conv", x, None)
        windowed.write_window("ple_conv", window, None)
        with torch.no_grad():
            want = residual + F.silu(conv(window)).transpose(1, 2)
        got = fused.conv_step_in_place(x, conv.weight.detach()[:, 0], dtype, "ple_conv", dilation, residual)
        tol = 1e-6 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(fused.ple_conv[:B], windowed.ple_conv[:B]), f"step {step}: kept inputs differ"


@pytest.mark.parametrize("fresh", [False, True])
def test_keep_last_inputs_is_the_window_tail(fresh):
    """`keep_last_inputs` (what the fused prefill conv keeps, from the step's tail only) against the last
    columns of the whole window, for steps shorter and longer than the window, with and without pads
    (none, a few, more than the tail, every column)."""
    g = torch.Generator().manual_seed(4)
    for K in (2, 4):
        for L in range(1, 8):
            B, C = 5, 3
            state = torch.randn(B, C, K - 1, generator=g)
            x = torch.randn(B, C, L, generator=g)
            for pads in (None, torch.tensor([0, 1, L // 2, max(L - 1, 0), L])):
                want = gated_delta.causal_window(state, x, pads, fresh)[..., -(K - 1):]
                got = state.clone()
                gated_delta.keep_last_inputs(got, x, pads, fresh)
                assert torch.equal(got, want), (K, L, pads)


def _recurrent_inputs(B, Hk, Hv, Dk, Dv, dtype, seed, pads=(0,)):
    """One token per row as the model hands them over: query, key and value views into one conv output row
    (strided), the gates' inputs, a pad row or two, a recurrent state that has seen tokens."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, 2 * Hk * Dk + Hv * Dv + 3, generator=g).to(dtype)  # 3 spare columns: row stride != width
    query = mixed[:, : Hk * Dk].unflatten(-1, (Hk, Dk))
    key = mixed[:, Hk * Dk: 2 * Hk * Dk].unflatten(-1, (Hk, Dk))
    value = mixed[:, 2 * Hk * Dk: 2 * Hk * Dk + Hv * Dv].unflatten(-1, (Hv, Dv))
    b = (torch.randn(B, Hv, generator=g) * 3).to(dtype)
    a = (torch.rand(B, Hv, generator=g) * 50 - 25).to(dtype)  # both sides of softplus's threshold
    A_log, dt_bias = torch.randn(Hv, generator=g).to(dtype), torch.randn(Hv, generator=g).to(dtype)
    valid = torch.ones(B, dtype=torch.bool)
    valid[list(pads)] = False
    gate = (torch.randn(B, Hv, Dv, generator=g) * 2).to(dtype)
    state = torch.randn(B, Hv, Dk, Dv, generator=g) * 0.5
    return state, query, key, value, b, a, A_log, dt_bias, valid, gate


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_spec_is_upstreams_ops(activation, dtype):
    """`recurrent_step_torch` against what the model runs without it: the gates, transformers' recurrent delta
    rule (two value heads per key head) and the gated norm module, on rows with a pad."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import torch_recurrent_gated_delta_rule

    state, query, key, value, b, a, A_log, dt_bias, valid, gate = _recurrent_inputs(3, 2, 4, 6, 5, dtype, seed=1)
    norm = _norm(5, activation, dtype, seed=2)
    before = state.clone()
    with torch.no_grad():
        got = gated_delta.recurrent_step_torch(state, query, key, value, b, a, A_log, dt_bias, valid, gate,
                                               norm.weight, 1e-6, activation)
        beta, g = gated_delta.delta_gates_torch(b[:, None], a[:, None], A_log, dt_bias, valid[:, None])
        core, last = torch_recurrent_gated_delta_rule(query[:, None], key[:, None], value[:, None], g=g, beta=beta,
                                                      initial_state=before, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
        want = norm(core[:, 0].reshape(-1, 5), gate.reshape(-1, 5)).view(3, 4, 5)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(state, last, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(state[0], before[0])  # the pad row neither decays nor writes
    assert not torch.equal(state[1], before[1])


def test_generate_with_the_recurrent_step_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    _, model = make_pair(seed=5)
    ids, mask = left_pad(random_prompts([19, 7, 26], seed=6))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, gated_delta, "gdn_step",
                                         "recurrent_step_torch", atol=1e-5)


# bf16: two units in the last place (`_gated_norm_case`: three rounding points, up to three units).
DTYPES = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 1.6e-2)}
# The convs' (input dtype, state dtype, tolerance): bf16 inputs with a bf16 or an fp32 state.
CONV_DTYPES = {"fp32": (torch.float32, torch.float32, 1e-6), "bf16": (torch.bfloat16, torch.bfloat16, 1.6e-2),
               "bf16-fp32-state": (torch.bfloat16, torch.float32, 1.6e-2)}


def _delta_gates_case(dtype, tol, B: int, L: int, H: int) -> None:
    """`delta_gates_triton` against `delta_gates`, on both sides of softplus's threshold, with a pad or more."""
    from hf_qsa_cache.ops.gated_delta_triton import delta_gates_triton

    g = torch.Generator().manual_seed(B * 10 + H)
    b = (torch.randn(B, L, H, generator=g) * 4).to(dtype)
    a = (torch.rand(B, L, H, generator=g) * 60 - 30).to(dtype)  # both sides of softplus's threshold
    A_log = torch.randn(H, generator=g).to(dtype)
    dt_bias = torch.randn(H, generator=g).to(dtype)
    valid = torch.rand(B, L, generator=g) > 0.3
    valid[-1, 0] = False  # at least one pad
    got = delta_gates_triton(b, a, A_log, dt_bias, valid)
    want = gated_delta.delta_gates(b, a, A_log, dt_bias, valid)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x.float(), y.float(), atol=tol, rtol=tol)
    assert (got[1][~valid] == 0).all() and (got[0][~valid] == 0).all()


def _gated_norm_case(dtype, tol, D: int, activation: str) -> None:
    """`gated_rms_norm_triton` against transformers' gated norm module."""
    from hf_qsa_cache.ops.gated_delta_triton import gated_rms_norm_triton

    norm = _norm(D, activation, dtype, seed=D)
    g = torch.Generator().manual_seed(D)
    x, gate = (torch.randn(9, D, generator=g).to(dtype) * 3 for _ in range(2))
    got = gated_rms_norm_triton(x, gate, norm.weight.detach(), 1e-6, activation)
    with torch.no_grad():
        want = norm(x, gate)
    assert got.dtype == want.dtype
    # Three rounding points in bf16 (normed, times the weight, times the gate): up to three units.
    rounding = 1.5 * tol if dtype == torch.bfloat16 else tol
    torch.testing.assert_close(got.float(), want.float(), atol=rounding, rtol=rounding)


def _conv_decode_case(x_dtype, state_dtype, tol, B: int, C: int, K: int, dilation: int) -> None:
    """`conv_decode_step_triton` against `conv_decode_step`: the output and the kept inputs afterwards (dilated:
    with a residual, the PLE layer's conv)."""
    from hf_qsa_cache.ops.gated_delta_triton import conv_decode_step_triton

    g = torch.Generator().manual_seed(B * 100 + C + K)
    state = torch.randn(B, C, (K - 1) * dilation, generator=g).to(state_dtype)
    x = torch.randn(B, 1, C, generator=g).to(x_dtype).transpose(1, 2)  # [B, C, 1], strided as in the model
    weight = torch.randn(C, K, generator=g).to(x_dtype)
    residual = torch.randn(B, 1, C, generator=g).to(x_dtype) if dilation > 1 else None
    mine, theirs = state.clone(), state.clone()
    got = conv_decode_step_triton(mine, x, weight, x_dtype, dilation, residual)
    want = gated_delta.conv_decode_step(theirs, x, weight, x_dtype, dilation, residual)
    assert got.shape == want.shape == (B, 1, C) and got.dtype == want.dtype
    # With a residual, bf16 rounds twice (the silu, the sum): where the two cancel, the silu's unit in
    # the last place (up to 0.016 for terms below 4, truncated here, rounded on the CPU) stays absolute.
    out_tol = 5e-2 if residual is not None and x_dtype == torch.bfloat16 else tol
    torch.testing.assert_close(got.float(), want.float(), atol=out_tol, rtol=tol)
    # The interpreter truncates its fp32 -> bf16 casts where a GPU rounds: one unit apart at most.
    torch.testing.assert_close(mine.float(), theirs.float(), atol=tol, rtol=tol)


def _conv_prefill_case(x_dtype, state_dtype, tol, B: int, C: int, L: int, K: int, pads) -> None:
    """`conv_prefill_triton` (blocks of 4 columns x 16 channels) against `conv_prefill_torch`, for rows that
    continue and fresh rows: the output, and the kept inputs afterwards."""
    from hf_qsa_cache.ops.gated_delta_triton import conv_prefill_triton

    for fresh in (False, True):
        g = torch.Generator().manual_seed(B * 100 + C + L + K)
        state = torch.randn(B, C, K - 1, generator=g).to(state_dtype)
        x = torch.randn(B, L, C, generator=g).to(x_dtype).transpose(1, 2)  # [B, C, L], strided as in the model
        weight = torch.randn(C, K, generator=g).to(x_dtype)
        leading = None if pads is None else torch.tensor(pads)
        mine, theirs = state.clone(), state.clone()
        got = conv_prefill_triton(mine, x, weight, leading, fresh, x_dtype, block_t=4, block_c=16)
        gated_delta.keep_last_inputs(mine, x, leading, fresh)
        want = gated_delta.conv_prefill_torch(theirs, x, weight, leading, fresh, x_dtype)
        assert got.shape == want.shape == (B, L, C) and got.dtype == want.dtype, fresh
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"fresh={fresh}: {m}")
        assert torch.equal(mine, theirs), f"fresh={fresh}: the kept inputs differ"


def _recurrent_step_case(dtype, tol, state_tol, B, Hk, Hv, Dk, Dv, pads, activation: str) -> None:
    """`recurrent_step_triton` against the torch specification: the output, and the state updated in place alike
    (pad rows untouched)."""
    from hf_qsa_cache.ops.gated_delta_triton import recurrent_step_triton

    inputs = _recurrent_inputs(B, Hk, Hv, Dk, Dv, dtype, seed=B + Hv + Dk, pads=pads)
    norm_w = _norm(Dv, activation, dtype, seed=Dv).weight.detach()
    mine, theirs = inputs[0].clone(), inputs[0].clone()
    got = recurrent_step_triton(mine, *inputs[1:], norm_w, 1e-6, activation)
    want = gated_delta.recurrent_step_torch(theirs, *inputs[1:], norm_w, 1e-6, activation)
    assert got.shape == want.shape == (B, Hv, Dv) and got.dtype == want.dtype
    torch.testing.assert_close(mine, theirs, atol=state_tol, rtol=state_tol)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for row in pads:
        assert torch.equal(mine[row], inputs[0][row])


def _generate_case() -> str | None:
    """The tiny model with the recurrent step's kernel in its decode steps: the same tokens as without it, logits
    within fp32 rounding (the kernel's sums in another order)."""
    from helpers.fusions import fused_generate_mismatch
    from helpers.interpreter import count_launches
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    from hf_qsa_cache.ops import gated_delta_triton

    gated_delta.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    launches: list = []
    count_launches(gated_delta_triton, "_recurrent_step_kernel", launches)
    return fused_generate_mismatch(make_pair(seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8)), "gdn_step",
                                   launches, atol=1e-4)


# 300 channels: two blocks, the second partial; dilation 3 with a residual: the PLE layer's conv.
CONV_DECODE_SHAPES = {"1x300-K4": (1, 300, 4, 1), "3x24-K2": (3, 24, 2, 1), "2x40-K3": (2, 40, 3, 1),
                      "2x40-K4-dilation3-residual": (2, 40, 4, 3), "1x300-K2-dilation2-residual": (1, 300, 2, 2)}
# The prefill conv, (rows, channels, tokens, taps, leading pads), its blocks forced small (4 columns x 16 channels)
# so rows, column blocks and channel blocks all split, the last of each partial; pads before, inside and past the
# kept window.
CONV_PREFILL_SHAPES = {"3x40x7-K4-pads": (3, 40, 7, 4, [0, 2, 5]), "2x24x2-K4-pads": (2, 24, 2, 4, [1, 0]),
                       "1x16x9-K2": (1, 16, 9, 2, None), "2x20x5-K3": (2, 20, 5, 3, None),
                       "3x33x6-K4-pads": (3, 33, 6, 4, [6, 0, 3])}
# (rows, key heads, value heads, key dim, value dim, pad rows): head dims below and past a power of two (masked
# lanes), one and two value heads per key head, pad rows, strided inputs.
RECURRENT_SHAPES = {"3x2k4v-Dk12-Dv20-pad": (3, 2, 4, 12, 20, (1,)), "1x3k3v-Dk16-Dv8": (1, 3, 3, 16, 8, ()),
                    "2x1k2v-Dk8-Dv16-2pads": (2, 1, 2, 8, 16, (0, 1))}
# bf16: beta is rounded to bf16 (the interpreter truncates that cast where a GPU rounds, one unit apart in the
# state's write), then the output rounds and the norm's three rounding points follow (`gated_rms_norm`'s bound).
RECURRENT_TOLERANCES = {"fp32": (2e-6, 2e-6), "bf16": (2.4e-2, 1e-2)}
ACTIVATIONS = ("sigmoid", "silu")
KERNEL_CASES = {
    **{f"delta-gates-{d}-{B}x{L}x{H}": partial(_delta_gates_case, *DTYPES[d], B, L, H)
       for d in DTYPES for B, L, H in ((1, 1, 5), (3, 4, 8))},
    **{f"gated-norm-{d}-D{D}-{act}": partial(_gated_norm_case, *DTYPES[d], D, act)
       for d in DTYPES for D in (24, 16) for act in ACTIVATIONS},
    **{f"conv-decode-{d}-{shape}": partial(_conv_decode_case, *CONV_DTYPES[d], *CONV_DECODE_SHAPES[shape])
       for d in CONV_DTYPES for shape in CONV_DECODE_SHAPES},
    **{f"conv-prefill-{d}-{shape}-blocks4x16": partial(_conv_prefill_case, *CONV_DTYPES[d], *CONV_PREFILL_SHAPES[shape])
       for d in CONV_DTYPES for shape in CONV_PREFILL_SHAPES},
    **{f"recurrent-step-{d}-{shape}-{act}": partial(_recurrent_step_case, DTYPES[d][0], *RECURRENT_TOLERANCES[d],
                                                    *RECURRENT_SHAPES[shape], act)
       for d in DTYPES for shape in RECURRENT_SHAPES for act in ACTIVATIONS},
    "generate": _generate_case,
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_torch(case):
    run_case_under_interpreter(__file__, case)


if __name__ == "__main__":
    sys.exit(case_main(KERNEL_CASES))


def _packed_kernel_rule(calls: list):
    """A chunked rule bound by transformers' own decorator to a stand-in for flash-linear-attention's kernel (a
    package of its own): it takes packed sequences (``cu_seqlens``, ``chunk_indices``) and runs transformers'
    torch reference on each sequence alone. ``calls`` records what it was given."""
    import types

    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
    from transformers.models.qwen4_exp.modeling_qwen4_exp import torch_chunk_gated_delta_rule

    reference = torch_chunk_gated_delta_rule.__wrapped__

    def kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_indices=None, **kwargs):
        calls.append({"batch": q.shape[0], "cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices,
                      "l2norm": use_qk_l2norm_in_kernel})
        bounds = cu_seqlens.tolist()
        outs, states = [], []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            start = None if initial_state is None else initial_state[i:i + 1]  # (a first step starts from none)
            o, s = reference(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
                             initial_state=start, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, 1), torch.cat(states)

    package = types.ModuleType("packed_kernel_stand_in")
    package.chunk_gated_delta_rule = kernel
    sys.modules[package.__name__] = package
    try:
        return use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", package.__name__)(reference)
    finally:
        del sys.modules[package.__name__]


def test_packed_rows_are_made_once_a_step_and_never_kept_past_it(monkeypatch):
    """Every GatedDeltaNet layer of a step gets the same packed bounds, made for that step; the next step gets new
    ones. Nothing is kept across steps: a CUDA graph records the launches that make them, so it reads only what it
    owns (tests/gpu/test_gpu_gated_delta.py shows what a pair kept per shape did to a replay)."""
    import transformers.models.qwen4_exp.modeling_qwen4_exp as upstream
    from helpers.qwen4 import make_pair

    from hf_qsa_cache import QSAPagedCache

    calls = []
    monkeypatch.setattr(upstream, "torch_chunk_gated_delta_rule", _packed_kernel_rule(calls))
    _, model = make_pair(seed=3)
    cache = QSAPagedCache(model.config, 2, 64, block_size=4)
    layers = sum(t == "linear_attention" for t in model.config.layer_types)
    made = []
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(2, 90, (2, 12)), past_key_values=cache)
            made.append({id(c["cu_seqlens"]) for c in calls[-layers:]})
    assert len(calls) == 2 * layers > 2 and all(len(ids) == 1 for ids in made) and made[0] != made[1]
    assert calls[-1]["cu_seqlens"].tolist() == [0, 12, 24]


@pytest.mark.parametrize("rows, length", [(1, 5), (3, 70), (2, 128)], ids=["one-row", "chunk-boundary", "two-chunks"])
def test_chunked_rule_packs_rows_for_a_kernel_that_takes_packed_sequences(rows, length):
    """Rows packed into one batch of sequences (the kernel's autotuning then sees one shape) give what the rule
    gives on the rectangle with its own L2 norms: outputs and final states. Transformers' own torch reference
    (the CPU here) takes the rectangle as before."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import torch_chunk_gated_delta_rule

    calls = []
    rule = _packed_kernel_rule(calls)
    assert gated_delta.takes_packed_sequences(rule)
    assert not gated_delta.takes_packed_sequences(torch_chunk_gated_delta_rule)  # (no such kernel on the CPU)
    g = torch.Generator().manual_seed(rows * length)
    H, K, V = 2, 8, 6
    q, k = (torch.randn(rows, length, H, K, generator=g) * 2 for _ in range(2))
    v = torch.randn(rows, length, H, V, generator=g)
    decay = -torch.rand(rows, length, H, generator=g)
    beta = torch.rand(rows, length, H, generator=g)
    state = torch.randn(rows, H, K, V, generator=g)
    want, want_state = torch_chunk_gated_delta_rule.__wrapped__(
        q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    have, have_state = gated_delta.chunked_rule(rule, q, k, v, decay, beta, state)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(have_state, want_state, rtol=1e-5, atol=1e-5)
    (call,) = calls
    assert call["batch"] == 1 and not call["l2norm"]
    assert call["cu_seqlens"].tolist() == [i * length for i in range(rows + 1)]
    chunks = -(-length // 64)
    assert call["chunk_indices"].tolist() == [[r, c] for r in range(rows) for c in range(chunks)]
