"""Qwen4Exp's fused hyper-connection mixing (`hf_qsa_cache.ops.hyper_connection`) against
transformers' ``Qwen4ExpTextGatedResidual``, and its Triton kernels against the torch functions.

The kernel comparison runs this file as a script under the Triton interpreter (`interpreter.py`).
"""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, run_case_under_interpreter
from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import hyper_connection as hc_ops


def _mixing(config, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    module = upstream.Qwen4ExpTextGatedResidual(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    return module.to(dtype)


def _streams(config, tokens=(2, 3), seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    H, hc = config.hidden_size, config.hc_count
    streams = torch.randn(*tokens, hc * H, generator=g) * 2
    out = torch.randn(*tokens, H, generator=g)
    inject = torch.rand(*tokens, hc, generator=g) * 2
    return streams.to(dtype), out.to(dtype), inject.to(dtype)


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setitem(fusions.STATE, "hc", True)


def test_fused_mixing_equals_upstream_in_fp32(fused):
    from helpers.qwen4 import tiny_config

    config = tiny_config()
    module = _mixing(config)
    streams, out, inject = _streams(config)
    with torch.no_grad():
        for got, want in [(hc_ops.gated_residual(module, streams), module(streams)),
                          (hc_ops.gated_residual(module, streams, (out, inject)),
                           module(streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)))]:
            assert len(got) == len(want) == 3
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("projections", [False, True])
def test_fused_mixing_in_bf16_is_no_further_from_fp32_than_upstream(fused, monkeypatch, projections):
    """Both round to bf16; the fused ops round once per output instead of after every op (with ``hc_proj``,
    the low-rank activations not at all)."""
    from helpers.qwen4 import tiny_config

    monkeypatch.setitem(fusions.STATE, "hc_proj", projections)
    config = tiny_config(hidden_size=64)
    exact = _mixing(config)
    low = _mixing(config, dtype=torch.bfloat16)
    streams, out, inject = _streams(config, tokens=(4, 8))
    with torch.no_grad():
        want = exact(streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2))
        args = [t.bfloat16() for t in (streams, out, inject)]
        ours = hc_ops.gated_residual(low, args[0], (args[1], args[2]))
        theirs = low(args[0] + (args[1].unsqueeze(-2) * args[2].unsqueeze(-1)).flatten(-2))
    for o, t, w in zip(ours, theirs, want):
        err_ours, err_theirs = (o.float() - w).abs().mean(), (t.float() - w).abs().mean()
        assert err_ours <= 1.1 * err_theirs + 1e-6, (err_ours, err_theirs)


def test_hooks_and_autograd_get_upstreams_forward(fused, monkeypatch):
    from helpers.qwen4 import tiny_config

    config = tiny_config()
    module = _mixing(config)
    streams, _, _ = _streams(config)
    calls = []
    monkeypatch.setattr(hc_ops, "hc_norm", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(AssertionError))
    seen = []
    handle = module.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        hc_ops.gated_residual(module, streams)
    handle.remove()
    hc_ops.gated_residual(module, streams.requires_grad_())  # training records the upstream ops
    assert seen == [1] and calls == []


def test_generate_with_fused_mixing_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    _, model = make_pair(seed=3)
    ids, mask = left_pad(random_prompts([23, 9, 17], seed=4))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, hc_ops, "hc", "mix_streams", atol=2e-5)


@pytest.mark.parametrize("tokens", [(2, 3), (1, hc_ops.HC_PROJ_MAX_TOKENS + 1)])
def test_fused_projections_equal_upstream_in_fp32(fused, monkeypatch, tokens):
    """``hc_proj`` on: steps of few tokens run `mix_projections` (the three projections fused), longer ones
    the GEMMs; both equal upstream's module."""
    from helpers.qwen4 import tiny_config

    monkeypatch.setitem(fusions.STATE, "hc_proj", True)
    calls = {"mix_projections": []}
    for name, seen in calls.items():
        real = getattr(hc_ops, name)
        monkeypatch.setattr(hc_ops, name, lambda *a, real=real, seen=seen: seen.append(1) or real(*a))
    config = tiny_config()
    module = _mixing(config)
    streams, out, inject = _streams(config, tokens=tokens)
    with torch.no_grad():
        got = hc_ops.gated_residual(module, streams, (out, inject))
        want = module(streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)
    few = tokens[0] * tokens[1] <= hc_ops.HC_PROJ_MAX_TOKENS
    assert len(calls["mix_projections"]) == int(few)


def test_generate_with_fused_projections_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    monkeypatch.setitem(fusions.STATE, "hc", True)
    _, model = make_pair(seed=3)
    ids, mask = left_pad(random_prompts([23, 9, 17], seed=4))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, hc_ops, "hc_proj", "mix_projections",
                                         atol=2e-5)


# ----------------------------------------------------------------------------- triton vs torch
# (streams, features): padded streams (3) and features (24, 20).
MIXING_SHAPES = {"hc4xH24": (4, 24), "hc3xH20": (3, 20), "hc2xH16": (2, 16)}
TOKENS = {"T1": (1,), "T5": (5,), "T2x3": (2, 3)}
DTYPES = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 1.6e-2)}  # bf16: two units in the last place


def _mixing_inputs(hc: int, H: int, tokens: tuple, dtype):
    """The streams, a layer's output and injection, and the norm's weight; then the low-rank activation, the up
    projection's output and the mixing logits (one generator, in that order)."""
    g = torch.Generator().manual_seed(hc * 100 + H + len(tokens))
    streams = (torch.randn(*tokens, hc * H, generator=g) * 2).to(dtype)
    out = torch.randn(*tokens, H, generator=g).to(dtype)
    inject = (torch.rand(*tokens, hc, generator=g) * 2).to(dtype)
    weight = torch.randn(hc * H, generator=g).to(dtype)
    low = torch.randn(*tokens, 7, generator=g).to(dtype)
    up = torch.randn(*tokens, hc * H, generator=g).to(dtype)
    logits = torch.randn(*tokens, hc, generator=g).to(dtype)
    return streams, out, inject, weight, low, up, logits


def _hc_norm_case(hc: int, H: int, tokens: tuple, dtype, tol) -> None:
    """`hc_norm_triton` against `hc_norm`, without and with a pending residual (a layer's output and injection)."""
    from hf_qsa_cache.ops.hyper_connection_triton import hc_norm_triton

    streams, out, inject, weight, *_ = _mixing_inputs(hc, H, tokens, dtype)
    for residual in (None, (out, inject)):
        got = hc_norm_triton(streams, weight, hc, 1e-6, residual)
        want = hc_ops.hc_norm(streams, weight, hc, 1e-6, residual)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def _scaled_silu_case(hc: int, H: int, tokens: tuple, dtype, tol) -> None:
    from hf_qsa_cache.ops.hyper_connection_triton import scaled_silu_triton

    low = _mixing_inputs(hc, H, tokens, dtype)[4]
    torch.testing.assert_close(scaled_silu_triton(low, 1 / hc).float(), hc_ops.scaled_silu(low, 1 / hc).float(),
                               atol=tol, rtol=tol)


def _mix_streams_case(hc: int, H: int, tokens: tuple, dtype, tol) -> None:
    """`mix_streams_triton` against `mix_streams`, with the mixing logits and as the final mixer (no injection)."""
    from hf_qsa_cache.ops.hyper_connection_triton import mix_streams_triton

    streams, *_, up, logits = _mixing_inputs(hc, H, tokens, dtype)
    for a, b in zip(mix_streams_triton(up, streams, logits, hc), hc_ops.mix_streams(up, streams, logits, hc)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    mixed, none = mix_streams_triton(up, streams, None, hc)  # the final mixer: no injection
    assert none is None
    want_mixed = hc_ops.mix_streams(up, streams, None, hc)[0]
    torch.testing.assert_close(mixed.float(), want_mixed.float(), atol=tol, rtol=tol)


def _generate_case() -> str | None:
    """The tiny model with the mixing's kernels (prompts and decode steps): ``hc_proj`` gives the same tokens as
    ``hc`` alone, logits within fp32 rounding."""
    from helpers.fusions import fused_generate_mismatch
    from helpers.interpreter import count_launches
    from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config

    from hf_qsa_cache.ops import hyper_connection_triton as hct

    hc_ops.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    fusions.STATE["hc_proj"] = False
    launches: list = []
    count_launches(hct, "_hc_down_kernel", launches)
    # A layer of each kind: every layer more mixes its streams with the same launches again, interpreted.
    config = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"])
    return fused_generate_mismatch(make_pair(config, seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8)),
                                   "hc_proj", launches, atol=1e-4)


def _projection_case(hc: int, H: int, R: int, tokens: tuple, dtype, tol) -> None:
    """`mix_projections_triton` against the torch spec with its tiles forced small (and as measured): several
    input splits (and a last, shorter one), feature blocks past H, token blocks past 16 (the down projection's),
    low-rank widths below, at and above the up projection's chunk of 16 (the last chunk partial), streams
    padded (3 to 4)."""
    from helpers.interpreter import count_launches

    from hf_qsa_cache.ops import hyper_connection_triton as hct

    launches: list = []
    count_launches(hct, "_hc_down_kernel", launches)
    count_launches(hct, "_hc_up_mix_kernel", launches)
    # One token also in the down projection's GEMV form: small (several splits, a last block of rows past R + hc, a
    # partial chunk of 8) and the default.
    gemv = [hct.MixTiles(splits=8, block_n=4, block_k=8, down_warps=2, block_h=16, r_chunk=16, up_warps=4, gemv=True),
            hct.ONE_TOKEN_MIX_TILES]
    g = torch.Generator().manual_seed(hc * 100 + H + R + len(tokens))
    normed = torch.randn(*tokens, hc * H, generator=g).to(dtype)
    down = (torch.randn(R, hc * H, generator=g) / 4).to(dtype)
    up = torch.randn(hc * H, R, generator=g).to(dtype)
    inject_weight = (torch.randn(hc, hc * H, generator=g) / 4).to(dtype)
    # Small tiles (several splits, a partial chunk), one split, and the measured defaults.
    for tiles in [hct.MixTiles(splits=8, block_n=16, block_k=16, down_warps=4, block_h=16, r_chunk=16, up_warps=4),
                  hct.MixTiles(splits=1, block_n=16, block_k=128, down_warps=2, block_h=16, r_chunk=16, up_warps=1),
                  None] + (gemv if tokens == (1,) else []):
        # None: the final mixer, no injection (with the small tiles only: the interpreter is slow)
        small = tiles is not None and tiles.splits == 8 and tiles.block_k <= 16
        for weight in (inject_weight, None) if small else (inject_weight,):
            launches.clear()
            got = hct.mix_projections_triton(normed, down, up, weight, hc, tiles)
            want = hc_ops.mix_projections(normed, down, up, weight, hc)
            assert len(launches) == 2, (tiles, launches)
            assert (got[1] is None) == (weight is None) == (want[1] is None)
            _assert_outputs_close(got, want, tol)


def _assert_outputs_close(got: tuple, want: tuple, tol: float) -> None:
    """Each output the spec gives (None: no injection) matches the kernel's in dtype, shape and value."""
    for a, b in zip(got, want):
        if b is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


# (streams, features, low rank) of the projections: features past H, ranks below, at and above a chunk of 16.
PROJECTION_SHAPES = {"hc4xH24-R10": (4, 24, 10), "hc3xH20-R40": (3, 20, 40), "hc2xH16-R16": (2, 16, 16)}
PROJECTION_TOKENS = {"T1": (1,), "T5": (5,), "T3x6": (3, 6)}
PROJECTION_DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 1.6e-2)}
KERNEL_CASES = {
    **{f"{op}-{shape}-{t}-{d}": partial(run, *MIXING_SHAPES[shape], TOKENS[t], *DTYPES[d])
       for op, run in (("hc-norm", _hc_norm_case), ("scaled-silu", _scaled_silu_case),
                       ("mix-streams", _mix_streams_case))
       for shape in MIXING_SHAPES for t in TOKENS for d in DTYPES},
    **{f"projections-{shape}-{t}-{d}": partial(_projection_case, *PROJECTION_SHAPES[shape], PROJECTION_TOKENS[t],
                                               *PROJECTION_DTYPES[d])
       for shape in PROJECTION_SHAPES for t in PROJECTION_TOKENS for d in PROJECTION_DTYPES},
    "generate": _generate_case,
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_torch(case):
    run_case_under_interpreter(__file__, case)


if __name__ == "__main__":
    sys.exit(case_main(KERNEL_CASES))


@pytest.mark.parametrize("fused", [False, True])
def test_the_residual_is_upstreams_unfused_and_rounded_once_fused(fused, monkeypatch):
    """`add_injection`: with ``hc`` off, upstream's ops (product rounded, then the sum); on, one pass rounded
    once (bf16, where the two differ)."""
    monkeypatch.setitem(fusions.STATE, "hc", fused)
    g = torch.Generator().manual_seed(0)
    streams, out = torch.randn(5, 3 * 8, generator=g).bfloat16(), torch.randn(5, 8, generator=g).bfloat16()
    inject = torch.rand(5, 3, generator=g).bfloat16() * 2
    got = hc_ops.add_injection(streams, out, inject)
    upstream = streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
    once = (streams.float().unflatten(-1, (3, 8)) + out.float().unsqueeze(-2) * inject.float().unsqueeze(-1))
    assert torch.equal(got, once.flatten(-2).bfloat16() if fused else upstream)
    assert not torch.equal(upstream, once.flatten(-2).bfloat16())  # the case tells them apart


def test_the_layer_loop_leaves_each_moe_residual_to_the_next_layers_norm(monkeypatch):
    """With the fusion on, a forward adds a layer's MoE residual on its own only before a PLE layer: every other
    one goes into the fused `hc_norm` of the next layer or of the final mixer. With ``output_hidden_states``
    (a recorder hooked on every layer) each layer hands on its whole streams, equal to the default path's."""
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    from modeling import modeling_qwen4_exp as ours

    _, model = make_pair(seed=3)
    ids, mask = left_pad(random_prompts([11, 6], seed=4))
    layers = model.model.layers
    calls = []
    real = ours.add_injection
    monkeypatch.setattr(ours, "add_injection", lambda *a: calls.append(1) or real(*a))
    runs = {}
    for on in (False, True):
        monkeypatch.setitem(fusions.STATE, "hc", on)
        calls.clear()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        runs[on] = (logits, hidden, len(calls))
    ple_after_first = sum(layer.ple is not None for layer in layers[1:])
    # Off: every layer adds its own; on: each PLE layer's (the last layer's goes into the final mixer's norm), and
    # every layer's own while hidden states are recorded.
    assert runs[False][2] == 2 * len(layers)
    assert runs[True][2] == ple_after_first + len(layers)
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=2e-5, rtol=0)
    for have, want in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(have, want, atol=2e-5, rtol=0)
    # A hook of the user's on a layer sees whole streams: that layer adds its own residual.
    seen = []
    handle = layers[1].register_forward_hook(lambda m, a, out: seen.append(isinstance(out, torch.Tensor)))
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, runs[False][0], atol=2e-5, rtol=0)
    handle.remove()
    assert seen == [True] and len(calls) == 1 + ple_after_first


def test_the_final_mixer_fused_equals_upstreams_in_fp32(fused):
    """The mixer after the last layer (no injection weight) through `gated_residual`, with and without a pending
    residual, against transformers' module on the streams with the residual added."""
    from helpers.qwen4 import tiny_config

    config = tiny_config()
    torch.manual_seed(0)
    mixer = upstream.Qwen4ExpTextGatedResidual(config, use_combine=False).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.5)
        streams, out, inject = _streams(config)
        for residual in (None, (out, inject)):
            whole = streams if residual is None else hc_ops.add_injection(streams, *residual)
            mixed, _, none = hc_ops.gated_residual(mixer, streams, residual)
            assert none is None
            torch.testing.assert_close(mixed, mixer(whole), atol=2e-6, rtol=2e-6)


def test_the_gemv_form_takes_one_token_of_normed_streams():
    from hf_qsa_cache.ops import hyper_connection_triton as hct

    tiles = hct.ONE_TOKEN_MIX_TILES
    down, up = torch.zeros(4, 32), torch.zeros(32, 4)
    with pytest.raises(ValueError, match="one token of normed streams, got 2 tokens"):
        hct.mix_projections_triton(torch.zeros(2, 32), down, up, None, 2, tiles)


def test_down_projection_tiles_below_tl_dot_size_are_refused():
    """A chunk of 8 passes the interpreter (its dots widen to fp32) but does not compile for the GPU in bf16."""
    from hf_qsa_cache.ops import hyper_connection_triton as hct

    tiles = hct.MixTiles(splits=2, block_n=16, block_k=8, down_warps=1, block_h=16, r_chunk=16, up_warps=1)
    normed, down, up = torch.zeros(1, 32), torch.zeros(4, 32), torch.zeros(32, 4)
    with pytest.raises(ValueError, match="block_k 8"):
        hct.mix_projections_triton(normed, down, up, None, 2, tiles)
