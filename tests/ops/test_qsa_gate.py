"""``qsa_gate``: a QSA layer's output gate, ``sigmoid(gate) * attention``, applied where the attention's splits are
merged (`qsa.gated_sparse_paged_attention`), against the torch ops it replaces; the kernels as a script under the
Triton interpreter (`interpreter.py`)."""

from __future__ import annotations

import sys

import torch
from helpers.interpreter import run_under_interpreter
from test_qsa_kernels import split_attention_case

from hf_qsa_cache.ops import qsa


def _gate(query: torch.Tensor, seed: int) -> torch.Tensor:
    """Gate logits ``[N, H, D]`` as the model has them: the second half of each head's projection (strided)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(query.shape[0], query.shape[1], 2 * query.shape[2], generator=g).to(query.dtype) * 3
    return torch.chunk(packed, 2, dim=-1)[1]


def test_the_torch_path_is_the_gated_attention():
    case = split_attention_case(500, 2, 2, 16)
    gate = _gate(case[0], 1)
    have = qsa.gated_sparse_paged_attention(*case, gate)
    want = qsa.sparse_paged_attention(*case).reshape(case[0].shape[0], -1) * torch.sigmoid(gate).reshape(
        case[0].shape[0], -1)
    assert torch.equal(have, want)


def test_kernels_under_interpreter():
    run_under_interpreter(__file__, "all qsa gate cases ok")


def main() -> int:
    from helpers.fusions import fused_generate_mismatch
    from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config

    from hf_qsa_cache.ops import qsa_triton

    merges, sigmoids = [], []
    kernel = qsa_triton._merge_splits_kernel

    class _Merges:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["GATE"]:  # counted: the merges that apply the gate
                    merges.append(grid)
                return kernel[grid](*args, **kwargs)

            return launch

    qsa_triton._merge_splits_kernel = _Merges()
    real_sigmoid = torch.sigmoid
    torch.sigmoid = lambda x: sigmoids.append(1) or real_sigmoid(x)
    cases = 0
    # Split widths merged with the gate (forced 3, and the one-token policy), one split (the gate in torch after
    # the launch); fp32 and bf16; a pad token (nothing selected) stays zero.
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for num_splits, tokens in ((3, None), (None, 1), (1, None)):
            case = split_attention_case(510 + cases, 2, 2, 16, dtype)
            if tokens is not None:
                case = (case[0][:tokens], *case[1:4], case[4][:tokens], case[5][:tokens], *case[6:])
            gate = _gate(case[0], cases)
            want = qsa.sparse_paged_attention(*case).reshape(case[0].shape[0], -1) * real_sigmoid(gate).reshape(
                case[0].shape[0], -1)
            merges.clear()
            sigmoids.clear()
            have = qsa_triton.sparse_paged_attention_triton(*case, num_splits=num_splits, gate=gate)
            splits, _ = qsa_triton.attention_splits(case[0].shape[0], 2, case[5].shape[1], num_splits)
            assert have.shape == want.shape and have.dtype == want.dtype
            assert len(merges) == (splits > 1) and len(sigmoids) == (splits == 1), (merges, sigmoids)
            torch.testing.assert_close(have.float(), want.float(), atol=atol, rtol=0)
            if tokens is None:
                assert torch.equal(have[1], torch.zeros_like(have[1]))  # the pad
            cases += 1
    # Nothing selected anywhere (a selection of width 0): zeros, in the gated output's shape.
    case = split_attention_case(530, 2, 2, 16)
    empty = qsa_triton.sparse_paged_attention_triton(*case[:5], case[5][:, :0], *case[6:], gate=_gate(case[0], 0))
    assert empty.shape == (case[0].shape[0], 2 * 2 * 16) and not empty.any()
    torch.sigmoid = real_sigmoid
    # The tiny model with the gate in its decode steps' merges (decode tiles of 16, split one each).
    qsa.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    qsa_triton.ATTENTION_DECODE_BLOCK_W, qsa_triton.MIN_SPLIT_POSITIONS = 16, 1
    # Budget 32 (ratio 2): a selection 33 positions wide, three tiles of 16. The same tokens, logits within fp32
    # rounding (the sigmoid in another implementation).
    error = fused_generate_mismatch(make_pair(tiny_config(indexer_budget=32), seed=4)[1],
                                    *left_pad(random_prompts([14, 5, 9], seed=5)), "qsa_gate", merges, atol=1e-5)
    if error:
        print(f"generate: {error}")
        return 1
    print(f"all qsa gate cases ok ({cases})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
