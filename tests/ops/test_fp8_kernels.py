"""fp8 cache stores at the ops: the torch specification reads an fp8 store as its widened values, and every Triton
kernel that writes or reads one (the quantizing write, the QSA sparse attention, the index and candidate scores,
Inkling's attention with its in-kernel store write) computes what the torch functions compute: the same fp8 bytes
and scales written, the same outputs up to the order of fp32 sums. The Triton comparisons run this file as a script
under TRITON_INTERPRET=1 (`helpers.interpreter`)."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_qsa_cache.ops import fp8, qsa
from hf_qsa_cache.ops.inkling_attention import paged_rel_attention_torch
from helpers.interpreter import case_main, run_case_under_interpreter
from test_inkling_attention_kernel import DECODE_ROWS, FULL_ROWS, SLIDING_ROWS, make_case
from test_qsa_kernels import attention_case, scores_case, split_attention_case

FP8 = torch.float8_e4m3fn


def _quantized(store: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 store (its bytes in a tensor of their own, as the cache keeps them) and its scales."""
    q8, scale = fp8.quantize_fp8(store)
    return q8.view(torch.uint8).clone().view(FP8), scale


# ----------------------------------------------------------------------------- torch (CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_on_an_fp8_store_equal_the_ops_on_its_widened_values(dtype):
    """The torch specification reads an fp8 store exactly as its dequantized values (what the kernels widen)."""
    query, keys, values, table, token_row, positions, bs, scaling = attention_case(1, 2, 2, 16, dtype)
    (kq, ks), (vq, vs) = _quantized(keys), _quantized(values)
    wide_k, wide_v = fp8.dequantize_fp8(kq, ks, dtype), fp8.dequantize_fp8(vq, vs, dtype)
    want = qsa.sparse_paged_attention_torch(query, wide_k, wide_v, table, token_row, positions, bs, scaling)
    have = qsa.sparse_paged_attention_torch(query, kq, vq, table, token_row, positions, bs, scaling, ks, vs)
    assert torch.equal(have, want)
    want = qsa.sparse_paged_attention_probs(query, wide_k, table, token_row, positions, bs, scaling, 130)
    assert torch.equal(qsa.sparse_paged_attention_probs(query, kq, table, token_row, positions, bs, scaling, 130, ks),
                       want)
    q_index, compressed, table, token_row, visible, rpb, groups = scores_case(2, 4, 16, 2, dtype)
    cq, cs = _quantized(compressed)
    wide = fp8.dequantize_fp8(cq, cs, dtype)
    want = qsa.index_scores_torch(q_index, wide, table, token_row, visible, rpb, groups)
    assert torch.equal(qsa.index_scores_torch(q_index, cq, table, token_row, visible, rpb, groups, cs), want)
    candidates = torch.randint(-1, groups + 2, (q_index.shape[0], 20), generator=torch.Generator().manual_seed(1))
    want = qsa.candidate_scores_torch(q_index, wide, table, token_row, visible, rpb, candidates)
    assert torch.equal(qsa.candidate_scores_torch(q_index, cq, table, token_row, visible, rpb, candidates, cs), want)


def test_inkling_attention_writes_this_step_quantized_and_reads_earlier_steps_widened():
    args, _ = make_case(3, FULL_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=12)
    (kq, ks), (vq, vs) = _quantized(args["key_store"]), _quantized(args["value_store"])
    widened = {**args, "key_store": fp8.dequantize_fp8(kq, ks, torch.float32),
               "value_store": fp8.dequantize_fp8(vq, vs, torch.float32)}
    want = paged_rel_attention_torch(**widened)
    have = paged_rel_attention_torch(**{**args, "key_store": kq, "value_store": vq}, key_scales=ks, value_scales=vs)
    assert torch.equal(have, want)
    # This step's keys and values were written quantized: the widened store holds them as given.
    at = args["slots"][args["slots"] >= 0]
    for store, scales, wide in ((kq, ks, widened["key_store"]), (vq, vs, widened["value_store"])):
        again = fp8.quantize_fp8(wide[at])
        assert torch.equal(store[at].view(torch.uint8), again[0].view(torch.uint8)) and torch.equal(scales[at],
                                                                                                     again[1])


# ----------------------------------------------------------------------------- Triton (interpreter)
def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _write_case() -> str | None:
    """The quantizing store write (`row_writes_triton.write_rows_triton` of one fp8 target) writes the bytes and
    scales `fp8.write_fp8_rows` writes: K/V rows of several heads (one head's values zero, tiny, negative zeros, a
    wide range), compressed keys of one, a pad row (-1)."""
    from hf_qsa_cache.ops.row_writes_triton import write_rows_triton

    g = torch.Generator().manual_seed(0)
    for shape in ((12, 3, 24), (9, 40)):
        values = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 5)
        values[0] = 0.0
        values[1].view(-1)[:4] = torch.tensor([-0.0, 1e-38, -3e-39, 2e-45])
        for dtype in (torch.float32, torch.bfloat16):
            rows = torch.randperm(40, generator=g)[: shape[0]]
            rows[2] = -1
            stores = [(torch.zeros(40, *shape[1:], dtype=torch.uint8).view(FP8), torch.zeros(40, *shape[1:-1]))
                      for _ in range(2)]
            x = values.to(dtype)
            fp8.write_fp8_rows(*stores[0], rows.clamp_min(0), x)
            write_rows_triton([(stores[1][0], rows, x, stores[1][1])])
            if not (_same_bytes(stores[0][0], stores[1][0]) and torch.equal(stores[0][1], stores[1][1])):
                return f"write {shape} {dtype}: bytes or scales differ"
    return None


def _attention(split: bool, dtype) -> str | None:
    from hf_qsa_cache.ops import qsa_triton

    case = split_attention_case(5, 2, 2, 16, dtype) if split else attention_case(6, 4, 2, 32, dtype)
    query, keys, values, table, token_row, positions, bs, scaling = case
    (kq, ks), (vq, vs) = _quantized(keys), _quantized(values)
    args = (query, kq, vq, table, token_row, positions, bs, scaling)
    want = qsa.sparse_paged_attention_torch(*args, ks, vs)
    gate = torch.randn(query.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_splits in ((1, 3) if split else (None,)):
        have = qsa_triton.sparse_paged_attention_triton(*args, num_splits=num_splits, key_scales=ks, value_scales=vs)
        gated = qsa_triton.sparse_paged_attention_triton(*args, num_splits=num_splits, gate=gate, key_scales=ks,
                                                         value_scales=vs)
        want_gated = qsa.gated_sparse_paged_attention(*args, gate, ks, vs)
        try:
            torch.testing.assert_close(have.float(), want.float(), atol=atol, rtol=0)
            torch.testing.assert_close(gated.float(), want_gated.float(), atol=atol, rtol=0)
        except AssertionError as err:
            return f"attention split={split} {dtype} num_splits={num_splits}: {err}"
    return None


def _scores(dtype) -> str | None:
    from hf_qsa_cache.ops import qsa_triton

    q_index, compressed, table, token_row, visible, rpb, groups = scores_case(7, 4, 16, 2, dtype, num_tokens=70)
    cq, cs = _quantized(compressed)
    args = (q_index, cq, table, token_row, visible, rpb)
    tol = 1e-5 if dtype == torch.float32 else 1e-4
    checks = [
        ("scores", qsa_triton.index_scores_triton(*args, groups, scales=cs),
         qsa.index_scores_torch(*args, groups, cs)),
        ("decode scores", qsa_triton.index_scores_triton(*[a[:1] if i in (0, 3, 4) else a for i, a in enumerate(args)],
                                                         groups, scales=cs),
         qsa.index_scores_torch(*[a[:1] if i in (0, 3, 4) else a for i, a in enumerate(args)], groups, cs)),
        ("tile maxima", qsa_triton.index_scores_triton(*args, groups, tile=4, scales=cs),
         qsa.index_tile_maxima_torch(*args, groups, 4, cs)),
    ]
    candidates = torch.randint(-1, groups + 3, (q_index.shape[0], 100), generator=torch.Generator().manual_seed(3))
    checks.append(("candidates", qsa_triton.candidate_scores_triton(*args, candidates, scales=cs),
                   qsa.candidate_scores_torch(*args, candidates, cs)))
    for name, have, want in checks:
        if not torch.equal(torch.isinf(have), torch.isinf(want)):
            return f"{name} {dtype}: the -inf pattern differs"
        try:
            torch.testing.assert_close(have, want, atol=tol, rtol=tol)
        except AssertionError as err:
            return f"{name} {dtype}: {err}"
    return None


INKLING = {
    "full-prefill-fp32": (dict(rows=FULL_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=12),
                          dict(block_m=4, block_n=16, num_splits=1)),
    "full-prefill-split-bf16": (dict(rows=FULL_ROWS, L=20, heads=8, kv_heads=2, head_dim=32, extent=40,
                                     log_scaling=(4.0, 0.4), dtype=torch.bfloat16), dict(num_splits=3)),
    "sliding-prefill-fp32": (dict(rows=SLIDING_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=8, window=8),
                             dict(block_m=4, block_n=16)),
    "full-decode-bias-in-kernel-bf16": (dict(rows=DECODE_ROWS, L=1, heads=8, kv_heads=2, head_dim=16, extent=12,
                                             dtype=torch.bfloat16), dict(block_n=16, num_splits=4,
                                                                         bias_in_kernel=True)),
    "sliding-decode-bf16": (dict(rows=DECODE_ROWS, L=1, heads=4, kv_heads=2, head_dim=16, extent=40, window=40,
                                 dtype=torch.bfloat16), dict(block_n=16, num_splits=2)),
}


def _inkling(name: str) -> str | None:
    """Inkling's kernel on fp8 stores: the output of the torch op, and the same fp8 bytes and scales in every real
    slot (the kernel quantizes this step's keys and values as it writes them)."""
    from hf_qsa_cache.ops.inkling_attention_triton import paged_rel_attention_triton

    case, overrides = INKLING[name]
    args, _ = make_case(11 + len(name), **case)
    (kq, ks), (vq, vs) = _quantized(args["key_store"]), _quantized(args["value_store"])
    ref = {**args, "key_store": kq.clone(), "value_store": vq.clone()}
    ref_scales = ks.clone(), vs.clone()
    want = paged_rel_attention_torch(**ref, key_scales=ref_scales[0], value_scales=ref_scales[1])
    have = paged_rel_attention_triton(**{**args, "key_store": kq, "value_store": vq}, key_scales=ks,
                                      value_scales=vs, **overrides)
    valid = (args["position"] >= 0).view(have.shape[:2])
    err = (have.float() - want.float())[valid].abs().max() / want.float()[valid].abs().max()
    bound = 1e-4 if case.get("dtype", torch.float32) == torch.float32 else 1e-2
    if not err < bound:
        return f"inkling {name}: relative error {err:.3g} >= {bound}"
    bs = args["block_size"]  # block 0, the null block, takes pad writes
    for mine, theirs in ((kq, ref["key_store"]), (vq, ref["value_store"]), (ks, ref_scales[0]), (vs, ref_scales[1])):
        if not _same_bytes(mine[bs:], theirs[bs:]):
            return f"inkling {name}: the store differs"
    return None


KERNEL_CASES = {
    "write": _write_case,
    "attention-fp32": lambda: _attention(False, torch.float32),
    "attention-bf16": lambda: _attention(False, torch.bfloat16),
    "attention-split-bf16": lambda: _attention(True, torch.bfloat16),
    "scores-fp32": lambda: _scores(torch.float32),
    "scores-bf16": lambda: _scores(torch.bfloat16),
    **{f"inkling-{name}": (lambda name=name: _inkling(name)) for name in INKLING},
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_on_fp8_stores_match_torch(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import row_writes_triton

    if not isinstance(row_writes_triton._write_rows_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    return KERNEL_CASES[case]()


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
