"""Qwen4Exp's fused PLE ops (`hf_qsa_cache.ops.ple`): the gate's specification against transformers' PLE layer,
generate() with the fusion on against the default, and the two Triton kernels against the torch functions (as
a script under the Triton interpreter, `interpreter.py`): windows with end-of-sequence ids at every distance,
ids whose hashes overflow int64, several rows and step lengths, fp32 and bf16, pads; and generate() of the tiny
model with both kernels in its PLE layer.
"""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default, fused_generate_mismatch
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter
from transformers.models.qwen4_exp import modeling_qwen4_exp as upstream

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import ple


def _ple_layer(dtype=torch.float32, seed=0, **overrides):
    from helpers.qwen4 import tiny_config

    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    layer = upstream.Qwen4ExpTextPLELayer(config, layer_idx=1, ple_layer_index=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer.to(dtype)


def _gate_inputs(layer, tokens=(2, 3), seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hc, H = layer.hc_count, layer.hidden_size
    key = torch.randn(*tokens, hc * H, generator=g).to(dtype)
    value = torch.randn(*tokens, H, generator=g).to(dtype)
    streams = (torch.randn(*tokens, hc * H, generator=g) * 2).to(dtype)
    valid = torch.rand(*tokens, generator=g) > 0.3
    return key, value, streams, valid


def _upstream_gate(layer, key, value, streams, valid):
    """transformers' PLE forward from its projections to the conv's input (its own modules, in order)."""
    key_normed = layer.norm_key(key).unflatten(-1, (layer.hc_count, layer.hidden_size))
    query_normed = layer.norm_query(streams).unflatten(-1, (layer.hc_count, layer.hidden_size))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / layer.hidden_size ** 0.5
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)
    normed = layer.norm_conv(gated.flatten(-2))
    keep = valid[..., None]
    return torch.where(keep, gated.flatten(-2), 0), torch.where(keep, normed, 0)


def test_gate_spec_is_transformers_ple_layer_in_fp32():
    layer = _ple_layer()
    inputs = _gate_inputs(layer)
    with torch.no_grad():
        have = ple.ple_gate(*inputs, layer)
        want = _upstream_gate(layer, *inputs)
    for h, w in zip(have, want, strict=True):
        torch.testing.assert_close(h, w, atol=2e-6, rtol=2e-6)
    assert (have[0][~inputs[3]] == 0).all() and (have[1][~inputs[3]] == 0).all()


def test_gate_in_bf16_is_no_further_from_fp32_than_upstream():
    layer = _ple_layer()
    inputs = _gate_inputs(layer, tokens=(4, 5))
    with torch.no_grad():
        exact = _upstream_gate(layer, *inputs)
        half = _ple_layer(torch.bfloat16)
        inputs16 = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)
        ours = ple.ple_gate(*inputs16, half)
        theirs = _upstream_gate(half, *inputs16)
    for o, t, e in zip(ours, theirs, exact, strict=True):
        assert (o.float() - e).abs().mean() <= 1.05 * (t.float() - e).abs().mean()


def test_generate_with_the_fused_ple_equals_the_default(monkeypatch):
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    from hf_qsa_cache.stores.linear_state import LinearAttentionState

    _, model = make_pair(seed=3)
    ids, mask = left_pad(random_prompts([23, 9, 17], seed=4))
    steps = []  # the windows whose one-token steps ran in place: the PLE conv's only with the fusion on
    real = LinearAttentionState.conv_step_in_place
    monkeypatch.setattr(LinearAttentionState, "conv_step_in_place",
                        lambda self, x, w, dtype, name="conv", *a: steps.append((fusions.enabled("ple"), name)) or real(
                            self, x, w, dtype, name, *a))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, ple, "ple", "ple_gate_torch", atol=2e-5)
    assert (True, "ple_conv") in steps and (False, "ple_conv") not in steps


def test_hooks_and_autograd_keep_upstreams_ops(monkeypatch):
    monkeypatch.setitem(fusions.STATE, "ple", True)
    layer = _ple_layer()
    x = torch.randn(1, 2, layer.hc_count * layer.hidden_size)
    assert not ple.fuses_ple(layer, x)  # training: the weights record
    with torch.no_grad():
        assert ple.fuses_ple(layer, x)
        handle = layer.norm_query.register_forward_hook(lambda *a: None)
        assert not ple.fuses_ple(layer, x)
        handle.remove()
        monkeypatch.setitem(fusions.STATE, "ple", False)
        assert not ple.fuses_ple(layer, x)


def _histories(emb, rows: int, width: int, seed: int) -> torch.Tensor:
    """Windows of ids with end-of-sequence ids at every distance (and at the window's start, as a fresh row's
    fill), and large ids whose hashes overflow int64."""
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(2, emb.unigram_vocab_size, (rows, width), generator=g)
    history[torch.rand(rows, width, generator=g) < 0.25] = emb.eos_token_id
    history[0, : emb.ngram_size - 1] = emb.eos_token_id
    return history


def _counted_launches() -> list:
    from hf_qsa_cache.ops import ple_triton as pt

    launches: list = []
    count_launches(pt, "_ngram_embeddings_kernel", launches)
    count_launches(pt, "_ple_gate_kernel", launches)
    return launches


def _ngram_case(overrides: dict, rows: int, length: int) -> str | None:
    """The n-gram lookup kernel against `ngram_ids_torch` and the embedding: one launch, the same rows."""
    from hf_qsa_cache.ops import ple_triton as pt

    launches = _counted_launches()
    emb = _ple_layer(**overrides).ple_embedding
    history = _histories(emb, rows, emb.ngram_size - 1 + length + 2, seed=rows * 10 + length)
    want = emb.ngram_embedding(ple.ngram_ids_torch(history, emb, length)).flatten(-2)
    have = pt.ngram_embeddings_triton(history, emb, length)
    if len(launches) != 1 or not torch.equal(have, want):
        return f"launches {len(launches)}, equal {torch.equal(have, want)}"
    return None


def _gate_case(dtype, tol) -> str | None:
    """The gate kernel against `ple_gate_torch` in one launch: fp32 within fp32 rounding, bf16 within a step of the
    fp32 math on the same inputs."""
    from hf_qsa_cache.ops import ple_triton as pt

    launches = _counted_launches()
    layer = _ple_layer(dtype)
    inputs = _gate_inputs(layer, tokens=(3, 2), dtype=dtype)
    want = ple.ple_gate_torch(*inputs, layer.norm_key.weight, layer.norm_query.weight, layer.norm_conv.weight,
                              layer.hc_count, layer.norm_key.eps)
    have = pt.ple_gate_triton(*inputs, layer.norm_key.weight, layer.norm_query.weight, layer.norm_conv.weight,
                              layer.hc_count, layer.norm_key.eps)
    for h, w in zip(have, want, strict=True):
        assert h.dtype == w.dtype and h.shape == w.shape
        torch.testing.assert_close(h.float(), w.float(), atol=tol, rtol=tol)
    return None if len(launches) == 1 else f"{len(launches)} launches"


def _generate_case() -> str | None:
    """The tiny model with both kernels in its PLE layer (prompts and decode steps): the same tokens as the
    default path, logits within fp32 rounding."""
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    launches = _counted_launches()
    ple.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    return fused_generate_mismatch(make_pair(seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8)), "ple",
                                   launches, atol=1e-4)


# n-gram lookup: 3-grams with rows of 4 features; 4-grams with rows of 3 features (padded to 4) and a vocabulary
# whose hashes overflow int64; rows x step length.
NGRAMS = {"3gram": {}, "4gram-2heads-vocab50k": {"ngram_size": 4, "heads_per_ngram": 2, "ple_embed_dim": 18,
                                                 "vocab_size": 50_000}}
KERNEL_CASES = {
    **{f"ngram-{name}-{rows}x{length}": partial(_ngram_case, overrides, rows, length)
       for name, overrides in NGRAMS.items() for rows, length in ((1, 1), (3, 1), (2, 4))},
    "gate-fp32": partial(_gate_case, torch.float32, 2e-6),
    "gate-bf16": partial(_gate_case, torch.bfloat16, 2e-2),
    "generate": _generate_case,
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_torch(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import ple_triton as pt

    if not isinstance(pt._ple_gate_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    return KERNEL_CASES[case]()


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
