"""Inkling's short convs fused with their norms (`hf_qsa_cache.ops.conv_norm`): the specifications against
transformers' norm and a dense conv, the model with the fusion on against the default, and the Triton kernels
against the specifications (as a script under the Triton interpreter, `interpreter.py`)."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.fusions import assert_fused_generate_equals_default, fused_generate_mismatch
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter
from test_inkling_sconv import _case as sconv_case, _dense_reference
from transformers.models.inkling.modeling_inkling import InklingRMSNorm

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import conv_norm
from hf_qsa_cache.ops.sconv import ConvTaps

HEAD_DIM = 5


def _norm(D, dtype, seed):
    torch.manual_seed(seed)
    norm = InklingRMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    return norm.to(dtype)


def _taps_case(seed, rows, L, heads, dtype=torch.float32):
    """A conv case (`test_inkling_sconv._case`) as ``(x, ConvTaps, histories, the store's backing tensor)``."""
    args, history, full = sconv_case(seed, rows, L=L, H=heads, width=HEAD_DIM)
    full = full.to(dtype)
    store = full[:, :, 1: 1 + HEAD_DIM]
    taps = ConvTaps(args["weight"], store, args["table"], args["block_size"], args["slots"], args["position"],
                    args["prev_len"], L)
    return args["x"].to(dtype), taps, history, full


def _shared(taps: ConvTaps, other: ConvTaps) -> ConvTaps:
    """``other``'s conv (weight, store) on ``taps``' table and step metadata (the same objects, as in a layer)."""
    return taps._replace(weight=other.weight, store=other.store)


def test_attention_inputs_spec_is_norm_and_dense_conv():
    """Per row, unpadded: the query is transformers' norm per head, the key its norm of the dense causal conv over
    the row's whole history, the value that conv; the store then holds the step's inputs."""
    rows = [(0, 5), (6, 3), (2, 1), (9, 4)]
    L = 6
    q_norm, k_norm = _norm(HEAD_DIM, torch.float32, 1), _norm(HEAD_DIM, torch.float32, 2)
    k, k_taps, k_hist, _ = _taps_case(0, rows, L, heads=2)
    v, v_taps, v_hist, _ = _taps_case(1, rows, L, heads=2)
    v_taps = _shared(k_taps, v_taps)
    # The value case's own table differs: its store rows were written for k's slots by the same layout
    # (same rows, same block allocation order), so one table serves both.
    assert torch.equal(_taps_case(1, rows, L, heads=2)[1].table, k_taps.table)
    q = torch.randn(len(rows) * L, 3 * HEAD_DIM)
    with torch.no_grad():
        query, key, value = conv_norm.attention_inputs_torch(
            q, k, v, k_taps, v_taps, q_norm.weight, 1e-6, k_norm.weight, 1e-6, HEAD_DIM)
        torch.testing.assert_close(query, q_norm(q.view(-1, 3, HEAD_DIM)))
        for b, (p, c) in enumerate(rows):
            at = slice(b * L + L - c, b * L + L)
            dense_k = _dense_reference(k_hist[b], k_taps.weight)[p:]
            dense_v = _dense_reference(v_hist[b], v_taps.weight)[p:]
            torch.testing.assert_close(key[at], k_norm(dense_k.view(c, 2, HEAD_DIM)), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(value[at], dense_v.view(c, 2, HEAD_DIM), atol=1e-5, rtol=1e-5)
            for j, pos in enumerate(range(p, p + c)):
                slot = int(k_taps.slots[b * L + L - c + j])
                if slot >= 0:
                    torch.testing.assert_close(k_taps.store[slot].reshape(-1), k_hist[b][pos])
                    torch.testing.assert_close(v_taps.store[slot].reshape(-1), v_hist[b][pos])


def test_conv_add_rms_norm_spec_is_dense_conv_residual_and_norm():
    rows = [(3, 2), (0, 4)]
    L = 4
    norm = _norm(2 * HEAD_DIM, torch.float32, 3)
    x, taps, hist, _ = _taps_case(2, rows, L, heads=2)
    residual = torch.randn_like(x)
    with torch.no_grad():
        h, normed = conv_norm.conv_add_rms_norm_torch(x, taps, residual, norm.weight, 1e-6)
        torch.testing.assert_close(normed, norm(h))
        for b, (p, c) in enumerate(rows):
            at = slice(b * L + L - c, b * L + L)
            torch.testing.assert_close(h[at], residual[at] + _dense_reference(hist[b], taps.weight)[p:], atol=1e-5,
                                       rtol=1e-5)


def test_generate_with_the_fusion_equals_the_default(monkeypatch):
    """The tiny Inkling model with the fusion on runs both fused specifications (on the CPU) in its steps: same
    tokens, same logits as the default path."""
    import helpers.inkling as inkling

    _, model = inkling.make_pair(inkling.make_config(), seed=4)
    ids, mask = inkling.left_pad(inkling.make_prompts([15, 6, 11], seed=5))
    for function in ("attention_inputs_torch", "conv_add_rms_norm_torch"):
        assert_fused_generate_equals_default(monkeypatch, model, ids, mask, conv_norm, "conv_norm", function,
                                             atol=1e-5)


def test_fuses_only_steps_of_few_tokens_without_hooks_or_autograd(monkeypatch):
    monkeypatch.setitem(fusions.STATE, "conv_norm", True)
    norm = _norm(8, torch.float32, 0)
    x = torch.randn(1, conv_norm.MAX_FUSED_TOKENS, 8)
    with torch.no_grad():
        assert conv_norm.fuses_conv_norm(x, norm)
        assert not conv_norm.fuses_conv_norm(torch.randn(1, conv_norm.MAX_FUSED_TOKENS + 1, 8), norm)  # a prompt
        handle = norm.register_forward_hook(lambda *a: None)
        assert not conv_norm.fuses_conv_norm(x, norm)
        handle.remove()
    assert not conv_norm.fuses_conv_norm(x, norm)  # autograd records the norm's weight
    monkeypatch.setitem(fusions.STATE, "conv_norm", False)
    with torch.no_grad():
        assert not conv_norm.fuses_conv_norm(x, norm)


# Rows as (length before the step, tokens in it): prompts in the step, decode tokens, pads, taps that
# reach back across blocks into the store; each layout's seed is its place in this table.
LAYOUTS = {
    "prompts-4rows-L6": ([(0, 5), (6, 3), (2, 1), (9, 4)], 6),
    "decode-3rows-L1": ([(13, 1), (3, 1), (0, 1)], 1),
    "deep-2rows-L2": ([(20, 2), (1, 2)], 2),
}
# bf16: the conv rounds once, the normed value once, its product once (and the residual sum once).
DTYPES = {"fp32": (torch.float32, 2e-6), "bf16": (torch.bfloat16, 3e-2)}


def _attention_inputs_case(dtype, tol, seed: int, rows, L: int) -> str | None:
    """`attention_inputs_triton` against the specification: the query, key and value, and both stores afterwards."""
    from hf_qsa_cache.ops.conv_norm_triton import attention_inputs_triton

    q_norm, k_norm = _norm(HEAD_DIM, dtype, 1), _norm(HEAD_DIM, dtype, 2)
    k, k_taps, _, k_full = _taps_case(seed, rows, L, heads=2, dtype=dtype)
    v, v_taps, _, v_full = _taps_case(seed + 10, rows, L, heads=2, dtype=dtype)
    v_taps = _shared(k_taps, v_taps)
    q = torch.randn(k.shape[0], 3 * HEAD_DIM).to(dtype)
    stores = {}
    for name in ("want", "got"):
        k_copy, v_copy = k_full.clone(), v_full.clone()
        args = (q, k, v, k_taps._replace(store=k_copy[:, :, 1: 1 + HEAD_DIM]),
                v_taps._replace(store=v_copy[:, :, 1: 1 + HEAD_DIM]), q_norm.weight.detach(), 1e-6,
                k_norm.weight.detach(), 1e-5, HEAD_DIM)
        run = conv_norm.attention_inputs_torch if name == "want" else attention_inputs_triton
        stores[name] = (run(*args), k_copy, v_copy)
    for a, b in zip(stores["got"][0], stores["want"][0]):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    for a, b in zip(stores["got"][1:], stores["want"][1:]):
        if not torch.equal(a, b):
            return "the stores differ afterwards"
    return None


def _conv_add_norm_case(dtype, tol, seed: int, rows, L: int) -> str | None:
    """`conv_add_rms_norm_triton` against the specification, without and with a residual: the sum, the normed
    value and the store afterwards."""
    from hf_qsa_cache.ops.conv_norm_triton import conv_add_rms_norm_triton

    wide_norm = _norm(3 * HEAD_DIM, dtype, 3)
    x, taps, _, full = _taps_case(seed + 20, rows, L, heads=3, dtype=dtype)
    residual = torch.randn_like(x)
    for res in (None, residual):
        outs = {}
        for name in ("want", "got"):
            copy = full.clone()
            args = (x, taps._replace(store=copy[:, :, 1: 1 + HEAD_DIM]), res, wide_norm.weight.detach(), 1e-6)
            run = conv_norm.conv_add_rms_norm_torch if name == "want" else conv_add_rms_norm_triton
            outs[name] = (*run(*args), copy)
        for a, b in zip(outs["got"][:2], outs["want"][:2]):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
        if not torch.equal(outs["got"][2], outs["want"][2]):
            return f"residual={res is not None}: the stores differ afterwards"
    return None


def _generate_case() -> str | None:
    """The tiny Inkling with both kernels in its steps (the CUDA dispatch, on CPU tensors): the same tokens as the
    default path, logits within fp32 rounding."""
    import helpers.inkling as inkling

    from hf_qsa_cache.ops import conv_norm_triton

    launches: list = []
    count_launches(conv_norm_triton, "_attention_inputs_kernel", launches)
    count_launches(conv_norm_triton, "_conv_add_rms_norm_kernel", launches)
    conv_norm.use_triton = lambda *x: True
    # Two layers, one of each attention kind (its head shapes): each layer makes the same two launches, so every
    # layer more is only the same launches interpreted again.
    config = inkling.make_config(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], dense_mlp_idx=1)
    model = inkling.make_pair(config, seed=3)[1]
    return fused_generate_mismatch(model, *inkling.left_pad(inkling.make_prompts([5, 2], seed=4)), "conv_norm",
                                   launches, atol=1e-4)


# Each kernel at each dtype and layout (seeded by its place in `LAYOUTS`), then generate() with both.
KERNEL_CASES = {
    **{f"{op}-{d}-{layout}": partial(run, *DTYPES[d], seed, *LAYOUTS[layout])
       for op, run in (("attention-inputs", _attention_inputs_case), ("conv-add-norm", _conv_add_norm_case))
       for d in DTYPES for seed, layout in enumerate(LAYOUTS)},
    "generate": _generate_case,
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_torch(case):
    run_case_under_interpreter(__file__, case)


if __name__ == "__main__":
    sys.exit(case_main(KERNEL_CASES))
