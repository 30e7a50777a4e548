"""``qsa_gate``: a QSA layer's output gate, ``sigmoid(gate) * attention``, applied where the attention's splits are
merged (`qsa.gated_sparse_paged_attention`), against the torch ops it replaces; the kernels as a script under the
Triton interpreter (`interpreter.py`), one pytest item per case."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.interpreter import case_main, run_case_under_interpreter
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


DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 3e-2)}
# (num_splits, tokens): split widths merged with the gate (forced 3, and the one-token policy), one split (the gate
# in torch after the launch).
SPLITS = {"3-splits": (3, None), "one-token-policy": (None, 1), "1-split": (1, None)}
KERNEL_CASES = [f"{d}-{split}" for d in DTYPES for split in SPLITS] + ["generate"]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernels_under_interpreter(case):
    run_case_under_interpreter(__file__, case)


def test_nothing_selected_gives_zeros_without_a_launch():
    """A selection of width 0 (nothing selected anywhere): zeros in the gated output's shape, before any launch
    (so no interpreter needed)."""
    from hf_qsa_cache.ops import qsa_triton

    attn = split_attention_case(530, 2, 2, 16)
    empty = qsa_triton.sparse_paged_attention_triton(*attn[:5], attn[5][:, :0], *attn[6:], gate=_gate(attn[0], 0))
    assert empty.shape == (attn[0].shape[0], 2 * 2 * 16) and not empty.any()


def _kernel_case(case: str) -> str | None:
    """One case (a name of `KERNEL_CASES`) under the interpreter; raises where it differs."""
    from hf_qsa_cache.ops import qsa_triton

    merges = []
    kernel = qsa_triton._merge_splits_kernel

    class _Merges:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["GATE"]:  # counted: the merges that apply the gate
                    merges.append(grid)
                return kernel[grid](*args, **kwargs)

            return launch

    qsa_triton._merge_splits_kernel = _Merges()
    if case == "generate":
        return _generate_case(qsa_triton, merges)
    dtype_name, split_name = case.split("-", 1)
    (dtype, atol), (num_splits, tokens) = DTYPES[dtype_name], SPLITS[split_name]
    seed = list(DTYPES).index(dtype_name) * len(SPLITS) + list(SPLITS).index(split_name)
    return _gated_case(qsa_triton, merges, dtype, atol, num_splits, tokens, seed)


def _gated_case(qsa_triton, merges: list, dtype, atol: float, num_splits, tokens, seed: int) -> None:
    """The gated attention at one split setting against the torch ops: the gate merged where the width splits
    (one launch of the gated merge), in torch after one split's launch; a pad token (nothing selected) stays
    zero."""
    sigmoids = []
    real_sigmoid = torch.sigmoid
    case = split_attention_case(510 + seed, 2, 2, 16, dtype)
    if tokens is not None:
        case = (case[0][:tokens], *case[1:4], case[4][:tokens], case[5][:tokens], *case[6:])
    gate = _gate(case[0], seed)
    want = qsa.sparse_paged_attention(*case).reshape(case[0].shape[0], -1) * real_sigmoid(gate).reshape(
        case[0].shape[0], -1)
    torch.sigmoid = lambda x: sigmoids.append(1) or real_sigmoid(x)
    try:
        have = qsa_triton.sparse_paged_attention_triton(*case, num_splits=num_splits, gate=gate)
    finally:
        torch.sigmoid = real_sigmoid
    splits, _ = qsa_triton.attention_splits(case[0].shape[0], 2, case[5].shape[1], num_splits)
    assert have.shape == want.shape and have.dtype == want.dtype
    assert len(merges) == (splits > 1) and len(sigmoids) == (splits == 1), (merges, sigmoids)
    torch.testing.assert_close(have.float(), want.float(), atol=atol, rtol=0)
    if tokens is None:
        assert torch.equal(have[1], torch.zeros_like(have[1]))  # the pad
    return None


def _generate_case(qsa_triton, merges: list) -> str | None:
    """The tiny model with the gate in its decode steps' merges (decode tiles of 16, split one each). Budget 32
    (ratio 2): a selection 33 positions wide, three tiles of 16. The same tokens, logits within fp32 rounding (the
    sigmoid in another implementation)."""
    from helpers.fusions import fused_generate_mismatch
    from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config

    qsa.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    qsa_triton.ATTENTION_DECODE_BLOCK_W, qsa_triton.MIN_SPLIT_POSITIONS = 16, 1
    # One QSA layer (with a linear one before it): the merges of every other QSA layer are the same launches.
    config = tiny_config(indexer_budget=32, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"])
    error = fused_generate_mismatch(make_pair(config, seed=4)[1], *left_pad(random_prompts([14, 5, 9], seed=5)),
                                    "qsa_gate", merges, atol=1e-5)
    return f"generate: {error}" if error else None


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
