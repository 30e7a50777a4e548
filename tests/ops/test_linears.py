"""Several projections in one launch (`hf_qsa_cache.ops.linears`): the Triton kernel against its torch
specification, when the layers take it (`fuses_projections`), and greedy generate() of both tiny models
with it in every attention and GatedDeltaNet layer.

The kernel comparison runs this file as a script under the Triton interpreter (`interpreter.py`): one to four
weights whose row counts and reduction size the forced tiles do not divide, 1, 3 and 17 tokens, a strided
input, fp32 and bf16, the one-token GEMV form (its weights read before the early-launch wait or after: the same
bits); then both models, also with the projections alone (o_proj,
out_proj) through the kernel.
"""

from __future__ import annotations

import sys
from functools import partial

import pytest
import helpers.inkling as inkling
import torch
from helpers.fusions import fused_generate_mismatch
from helpers.qwen4 import left_pad, make_pair, random_prompts
from torch import nn

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import linears
from hf_qsa_cache.ops import linears_triton as lt
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter

TILES = [(16, 16, 1), (32, 32, 2), None]
GEMV_TILES = [(16, 16, 1, True), (4, 32, 2, True), lt.ONE_TOKEN_WIDE_TILES]  # one token, no tl.dot (None: the policy's)
DOT_TILES = [lt.ONE_TOKEN_DOT_TILES]


def _tiles(tokens: int) -> list:
    return TILES + (GEMV_TILES + DOT_TILES if tokens == 1 else [])


def _weights(rows, K, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, K, generator=gen) * 0.2).to(dtype) for n in rows]


K = 40  # not a multiple of the 16- and 32-wide chunks


def _counted_launches() -> list:
    launches: list = []
    count_launches(lt, "_linears_kernel", launches)
    return launches


def _inputs(tokens: int) -> torch.Tensor:
    """``[tokens, 2K]``: its first K columns (contiguous, or a copy) or every other one (strided) are the input."""
    return torch.randn(tokens, 2 * K, generator=torch.Generator().manual_seed(tokens))


def _tiled_case(rows: list[int], tokens: int) -> str | None:
    """The kernel against `linears_torch` on a contiguous and a strided input with every tiling (`_tiles`): one
    launch of one program per tile of rows, outputs contiguous."""
    launches = _counted_launches()
    wide = _inputs(tokens)
    for label, x in (("contiguous", wide[:, :K].contiguous()), ("strided", wide[:, ::2])):
        weights = _weights(rows, K, seed=len(rows))
        want = linears.linears_torch(x, weights)
        for tiles in _tiles(tokens):
            where = f"{label} tiles={tiles}"
            launches.clear()
            have = lt.linears_triton(x, weights, tiles=tiles)
            block_n = (tiles or lt.default_tiles(tokens, K))[0]
            if len(launches) != 1 or launches[0][0] != sum(-(-n // block_n) for n in rows):
                return f"{where}: launches {launches}"
            try:
                for h, w in zip(have, want, strict=True):
                    assert h.shape == w.shape and h.dtype == w.dtype and h.is_contiguous()
                    torch.testing.assert_close(h, w, atol=1e-5, rtol=1e-5)
            except AssertionError as err:
                return f"{where}: {err}"
    return None


def _keep_case(rows: list[int], tokens: int) -> str | None:
    """Tokens marked not kept read as zeros (GatedDeltaNet's pads): every other token, so that kept and dropped
    rows share tiles; one token kept or not in the GEMV form."""
    x = _inputs(tokens)[:, :K]
    weights = _weights(rows, K, seed=5)
    for keep, tiles in [(torch.arange(tokens) % 2 == 0, (16, 16, 1))] + (
            [(torch.tensor([True]), t) for t in GEMV_TILES[:2]] + [(torch.tensor([False]), GEMV_TILES[0])]
            if tokens == 1 else []):
        have = lt.linears_triton(x, weights, keep, tiles=tiles)
        try:
            for h, w in zip(have, linears.linears_torch(x, weights, keep), strict=True):
                torch.testing.assert_close(h, w, atol=1e-5, rtol=1e-5)
                assert tokens > 1 or keep[0] or h.abs().max() == 0
                assert tokens == 1 or h[1].abs().max() == 0
        except AssertionError as err:
            return f"keep={keep.tolist()} tiles={tiles}: {err}"
    return None


def _preload_case(rows: list[int]) -> str | None:
    """One token: the GEMV form with its weight rows read before the wait (one or two chunks) gives the bits of the
    form that reads them after, in fp32 and bf16 (the same products summed in the same order)."""
    x = _inputs(1)[:, :K]
    for dtype in (torch.float32, torch.bfloat16):
        xd, weights = x.to(dtype), _weights(rows, K, seed=9, dtype=dtype)
        for tiles in [(4, 32, 2, True), (8, 64, 1, True)]:
            if not lt.preloads_weights(K, tiles[1]):
                return f"tiles={tiles}: K={K} should be read before the wait"
            have = lt.linears_triton(xd, weights, tiles=tiles)
            lt.PRELOAD_WEIGHTS = False
            want = lt.linears_triton(xd, weights, tiles=tiles)
            lt.PRELOAD_WEIGHTS = True
            if any(not torch.equal(h, w) for h, w in zip(have, want, strict=True)):
                return f"{dtype} tiles={tiles}: preloaded weights give other bits"
    return None


def _bf16_case(rows: list[int], tokens: int) -> str | None:
    """bf16: each output within one bf16 step of the fp32 math on the same values (the interpreter rounds casts
    towards zero: a whole step, not half of one)."""
    xh = _inputs(tokens)[:, :K].to(torch.bfloat16)
    weights = _weights(rows, K, seed=7, dtype=torch.bfloat16)
    for tiles in [(16, 16, 1)] + (GEMV_TILES[:1] if tokens == 1 else []):
        have = lt.linears_triton(xh, weights, tiles=tiles)
        for h, w in zip(have, weights):
            exact = xh.float() @ w.float().T
            step = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))
            excess = ((h.float() - exact).abs() - step - 1e-6 * exact.abs().max()).max()
            if h.dtype != torch.bfloat16 or excess > 0:
                return f"tiles={tiles}: an output further than one bf16 step (by {excess})"
    return None


def _generate_case(family: str) -> str | None:
    """The tiny model: decode steps (3 rows: 3 tokens) run the kernel in every attention and GatedDeltaNet layer;
    prompts (more than MAX_FUSED_TOKENS tokens) keep the modules. Same tokens, logits within fp32 rounding of the
    default. Then a projection alone (o_proj, out_proj) through the kernel too, in decode steps (3 tokens): one
    launch more in every layer of each step, the same tokens."""
    launches = _counted_launches()
    linears.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    if family == "qwen4_exp":
        model, ids, mask = make_pair(seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8))
    else:
        model = inkling.make_pair(inkling.make_config(), seed=3)[1]
        ids, mask = inkling.left_pad(inkling.make_prompts([9, 4, 7], seed=4))
    error = fused_generate_mismatch(model, ids, mask, "projections", launches, atol=1e-4)
    if error:
        return error
    grouped = len(launches)
    shipped, linears.ALONE_MAX_TOKENS = linears.ALONE_MAX_TOKENS, 3
    error = fused_generate_mismatch(model, ids, mask, "projections", launches, atol=1e-4)
    linears.ALONE_MAX_TOKENS = shipped
    layers, steps = model.config.num_hidden_layers, 4  # 5 new tokens: the prompt's forward, then 4 steps
    if error or len(launches) != grouped + layers * steps:
        return f"alone: {error or f'{len(launches)} launches, {grouped} + {layers} x {steps} expected'}"
    return None


# One to four weights, every one with some rows past a tile (row counts and K = 40 the forced tiles do not
# divide), 1, 3 and 17 tokens.
WEIGHT_ROWS = {"70": [70], "70+5": [70, 5], "33+50+1": [33, 50, 1], "70+40+5+33": [70, 40, 5, 33]}
KERNEL_CASES = {
    **{f"rows{name}-T{tokens}-{part}": partial(run, rows, tokens) for name, rows in WEIGHT_ROWS.items()
       for tokens in (1, 3, 17)
       for part, run in (("fp32-all-tiles", _tiled_case), ("keep-some-tokens", _keep_case), ("bf16", _bf16_case))},
    **{f"rows{name}-T1-gemv-weights-before-the-wait": partial(_preload_case, rows)
       for name, rows in WEIGHT_ROWS.items()},
    **{f"generate-{family}": partial(_generate_case, family) for family in ("qwen4_exp", "inkling")},
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_the_specification_under_the_interpreter(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(lt._linears_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    return KERNEL_CASES[case]()


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))


# ----------------------------------------------------------------------------- when it applies (no kernel)
@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setitem(fusions.STATE, "projections", True)
    monkeypatch.setattr(linears, "use_triton", lambda x: True)


def test_fuses_only_plain_bias_free_linears_of_few_tokens(on_cuda, monkeypatch):
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 6, bias=False)
    x = torch.randn(1, linears.MAX_FUSED_TOKENS, 8)
    with torch.no_grad():
        assert linears.fuses_projections(x, (a, b))
        assert not linears.fuses_projections(torch.randn(1, linears.MAX_FUSED_TOKENS + 1, 8), (a, b))  # a prompt
        assert not linears.fuses_projections(x, (a, nn.Linear(8, 4)))  # a bias
        assert not linears.fuses_projections(x, (a,) * (lt.MAX_WEIGHTS + 1))
        assert not linears.fuses_projections(x.double(), (a, b))  # another dtype
        handle = b.register_forward_hook(lambda *args: None)  # a user's hook must see its module run
        assert not linears.fuses_projections(x, (a, b))
        handle.remove()
        b.weight.data = torch.randn(8, 6).t()  # not contiguous
        assert not linears.fuses_projections(x, (a, b))
    assert not linears.fuses_projections(x, (a,))  # autograd records: the kernel has no backward
    monkeypatch.setitem(fusions.STATE, "projections", False)
    with torch.no_grad():
        assert not linears.fuses_projections(x, (a,))


def test_project_runs_the_modules_where_it_does_not_fuse():
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 6)
    x = torch.randn(2, 3, 8)
    have = linears.project(x, a, b)
    assert [h.shape for h in have] == [(2, 3, 4), (2, 3, 6)]
    torch.testing.assert_close(have[1], b(x))


def test_project_zeroes_tokens_not_kept_on_its_unfused_path():
    a = nn.Linear(8, 4, bias=False)
    x = torch.randn(2, 3, 8)
    keep = torch.tensor([[True, False, True], [False, True, True]])
    (have,) = linears.project(x, a, keep=keep)
    torch.testing.assert_close(have, a(torch.where(keep[..., None], x, 0)))
    assert have[0, 1].abs().max() == 0


@pytest.mark.parametrize("case", ["weights", "tokens", "shape", "tile", "keep", "gemv"])
def test_bad_input_is_refused_with_the_limit(case):
    x = torch.randn(lt.MAX_TOKENS + 1 if case == "tokens" else 2, 8)
    weights = [torch.randn(4, 8)] * (lt.MAX_WEIGHTS + 1 if case == "weights" else 1)
    if case == "shape":
        weights = [torch.randn(4, 9)]
    message = {"weights": "1 to 4 weights, got 5", "tokens": "at most 64 tokens, got 65",
               "shape": r"contiguous \[N, 8\]", "tile": "powers of two >= 16",
               "keep": r"one flag per token \(2\), got shape \(3,\)", "gemv": "GEMV tiles take one token, got 2"}[case]
    keep = torch.ones(3, dtype=torch.bool) if case == "keep" else None
    with pytest.raises(ValueError, match=message):
        lt.linears_triton(x, weights, keep, tiles={"tile": (8, 16, 1), "gemv": (16, 16, 1, True)}.get(case))


def test_a_projection_alone_keeps_its_module_unless_asked(on_cuda, monkeypatch):
    module = nn.Linear(8, 4, bias=False)
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    one_token = torch.randn(1, 1, 8)
    monkeypatch.setattr(linears, "ALONE_MAX_TOKENS", 0)
    with torch.no_grad():
        linears.project_alone(one_token, module)
    assert calls == [1]  # ALONE_MAX_TOKENS 0: cuBLAS through the module, whatever the step
    monkeypatch.setattr(linears, "ALONE_MAX_TOKENS", 1)
    monkeypatch.setattr(linears, "project", lambda x, *modules, keep=None: ["through project"])
    assert linears.project_alone(one_token, module) == "through project"
    with torch.no_grad():
        assert linears.project_alone(torch.randn(1, 2, 8), module).shape == (1, 2, 4)  # more tokens: the module
    assert calls == [1, 1]


def test_the_launch_policy_takes_the_gemv_form_for_one_token_and_wider_programs_past_wide_k():
    assert lt.default_tiles(1, lt.WIDE_K) == lt.ONE_TOKEN_TILES
    assert lt.default_tiles(1, lt.WIDE_K + 1) == lt.ONE_TOKEN_WIDE_TILES
    assert lt.ONE_TOKEN_TILES[3] and lt.ONE_TOKEN_WIDE_TILES[3]  # the GEMV form, no tl.dot
    assert lt.default_tiles(2, 64) == lt.default_tiles(16, 4096) == lt.TILES


def test_the_one_token_form_reads_its_weights_before_the_wait_up_to_two_chunks(monkeypatch):
    # At the released widths: Inkling's and QSA's 2048-wide reductions in two chunks of 1024, GatedDeltaNet's
    # 4096-wide out_proj (four chunks) asking for its rows in L2 instead.
    assert lt.preloads_weights(2048, lt.ONE_TOKEN_TILES[1])
    assert lt.preloads_weights(1024, 1024) and not lt.preloads_weights(2049, 1024)
    assert not lt.preloads_weights(4096, lt.ONE_TOKEN_WIDE_TILES[1])
    monkeypatch.setattr(lt, "PRELOAD_WEIGHTS", False)
    assert not lt.preloads_weights(2048, 1024)
