"""Inkling's fused residual add and RMS norm (`hf_qsa_cache.ops.rms_norm`): the written-out norm
against transformers' module, the model with the fused path on against the default, and the Triton kernel
against the torch function (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default
from helpers.interpreter import case_main, run_case_under_interpreter
from transformers.models.inkling.modeling_inkling import InklingRMSNorm

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import rms_norm


def _norm(D, dtype, seed=0):
    torch.manual_seed(seed)
    norm = InklingRMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_out_norm_is_transformers_module(dtype):
    norm = _norm(24, dtype)
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(2, 7, 24, generator=g).to(dtype) * 3 for _ in range(2))
    with torch.no_grad():
        h, normed = rms_norm.add_rms_norm_torch(x, residual, norm.weight, 1e-6)
        assert torch.equal(h, residual + x) and torch.equal(normed, norm(residual + x))
        h, normed = rms_norm.add_rms_norm_torch(x, None, norm.weight, 1e-6)
        assert h is x and torch.equal(normed, norm(x))


def test_generate_with_the_fused_path_equals_the_default(monkeypatch):
    import helpers.inkling as inkling

    _, model = inkling.make_pair(inkling.make_config(), seed=4)
    ids, mask = inkling.left_pad(inkling.make_prompts([15, 6, 11], seed=5))
    assert_fused_generate_equals_default(monkeypatch, model, ids, mask, rms_norm, "norm", "add_rms_norm_torch",
                                         atol=1e-5)


# bf16: the sum, the normed value and its product with the weight each round once: up to three units.
DTYPES = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 2.4e-2)}
SHAPES = {"1x24": (1, 24), "3x2x16": (3, 2, 16), "5x20": (5, 20)}
KERNEL_CASES = [f"{d}-{shape}" for d in DTYPES for shape in SHAPES]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> None:
    """The kernel against the torch function at one dtype and shape, with and without a residual."""
    from hf_qsa_cache.ops.rms_norm_triton import add_rms_norm_triton

    dtype_name, shape_name = case.split("-")
    (dtype, tol), shape = DTYPES[dtype_name], SHAPES[shape_name]
    norm = _norm(shape[-1], dtype, seed=shape[-1])
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x, residual = (torch.randn(*shape, generator=g).to(dtype) * 3 for _ in range(2))
    for res in (None, residual):
        got = add_rms_norm_triton(x, res, norm.weight.detach(), 1e-6)
        want = rms_norm.add_rms_norm_torch(x, res, norm.weight.detach(), 1e-6)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))


def test_the_layer_loop_leaves_each_mlp_residual_to_the_next_norm(monkeypatch):
    """With the fusion on, every layer hands its MLP output and residual on unsummed (the next layer's input norm,
    or the final norm, adds them in its pass), with the same logits as the default path; a layer a hook watches,
    and every layer while hidden states are collected, hands on the sum."""
    import helpers.inkling as inkling

    from modeling import modeling_inkling as ours

    _, model = inkling.make_pair(inkling.make_config(), seed=4)
    ids, mask = inkling.left_pad(inkling.make_prompts([15, 6, 11], seed=5))
    deferred = []
    real = ours.InklingPagedDecoderLayer._forward
    monkeypatch.setattr(ours.InklingPagedDecoderLayer, "_forward",
                        lambda self, *a: deferred.append(a[-1]) or real(self, *a))
    layers = len(model.model.layers)
    logits = {}
    for on in (False, True):
        monkeypatch.setitem(fusions.STATE, "norm", on)
        deferred.clear()
        with torch.no_grad():
            logits[on] = model(ids, attention_mask=mask).logits
        assert deferred == [on] * layers
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=0)
    with torch.no_grad():
        deferred.clear()
        hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert deferred == [False] * layers and len(hidden) == layers + 1
        handle = model.model.layers[1].register_forward_hook(lambda *a: None)
        deferred.clear()
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, logits[False], atol=1e-5, rtol=0)
        handle.remove()
    assert deferred == [True, False] + [True] * (layers - 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedding_norm_runs_fused_and_equals_the_module(monkeypatch, dtype):
    """`InklingTextModel.embed`: the normed embedding with its norm through `rms_norm` (one launch where fused), equal
    to transformers' module; a hook on the embedding sees its call."""
    import helpers.inkling as inkling

    text = inkling.make_pair(inkling.make_config(), seed=4)[1].model.to(dtype)
    ids = torch.randint(0, text.config.vocab_size, (2, 5))
    calls = []
    real = rms_norm.add_rms_norm_torch
    monkeypatch.setattr(rms_norm, "add_rms_norm_torch", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        assert torch.equal(text.embed(ids), text.embed_tokens(ids)) and calls
        seen = []
        handle = text.embed_tokens.register_forward_hook(lambda *a: seen.append(1))
        text.embed(ids)
        handle.remove()
    assert seen == [1]
