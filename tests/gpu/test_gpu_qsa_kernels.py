"""The QSA Triton kernels against their torch specification at real shapes (benchmarks/check_qsa_kernels.py's
cases and bounds; that script also times them and sweeps their launch settings).

Sparse attention: 16 query heads over 2 KV heads of 256, 2051 selected positions (5% holes, a pad), bf16 within
2e-2 and fp32 within 1e-4. Index scores: 32 index heads of 128 over up to 262144 compressed groups, within
1e-5 of the largest score, top-k sets equal but for near-ties. The three top-k paths equal; the whole selection
of a chunk (scores written then ranked, or tile maxima with the best tiles rescored) equal but for near-ties.
Ties at the top-k cut: torch.topk on CUDA (as transformers' indexer calls it) keeps the lower index among exact
ties, as the Triton path does; whole selections of the Triton path and the torch path agree without exact ties,
and on exact relu-zero ties each keeps what it says it keeps.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_qsa_kernels.py
"""

from __future__ import annotations

import pytest
import torch

import check_qsa_kernels as script

pytestmark = pytest.mark.gpu


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("n, dtype", script.ATTENTION_CASES,
                         ids=[f"{n}-tokens-{_name(d)}" for n, d in script.ATTENTION_CASES])
def test_sparse_attention(n, dtype):
    assert script.check_attention(n, dtype, _generator(), torch.device("cuda"), timed=False)


@pytest.mark.parametrize("n, dtype, groups, one_row", script.SCORES_CASES,
                         ids=[f"{n}-tokens-{groups}-groups-{'1-row' if one else f'{script.NUM_ROWS}-rows'}-{_name(d)}"
                              for n, d, groups, one in script.SCORES_CASES])
def test_index_scores(n, dtype, groups, one_row):
    assert script.check_scores(n, dtype, _generator(), torch.device("cuda"), groups=groups, one_row=one_row,
                               timed=False)


@pytest.mark.parametrize("n, groups", script.TOP_GROUPS_CASES,
                         ids=[f"{n}-tokens-{groups}-groups" for n, groups in script.TOP_GROUPS_CASES])
def test_top_groups_paths_agree(n, groups):
    assert script.check_top_groups(n, groups, _generator(), torch.device("cuda"), timed=False)


@pytest.mark.parametrize("n, groups", script.SELECTION_CASES,
                         ids=[f"{n}-tokens-{groups}-groups" for n, groups in script.SELECTION_CASES])
def test_selection_by_tiles_equals_scores_ranked(n, groups):
    assert script.check_selection(n, groups, _generator(), torch.device("cuda"), timed=False)


def test_cuda_topk_keeps_the_lower_index_among_exact_ties():
    """The rule the Triton path follows is torch's own on CUDA: torch.topk of one 1-D tensor of scores (as
    transformers' indexer calls it per query), over widths from 2 to 1M and k from 1 to 2048, keeps the lowest
    indices among the scores equal to the k-th."""
    calls, differing = script.check_topk_tie_rule(_generator(), torch.device("cuda"))
    assert calls > 100 and differing == 0


@pytest.mark.parametrize("heads", script.SELECTION_TIE_HEADS,
                         ids=[f"{h}-index-heads" for h in script.SELECTION_TIE_HEADS])
def test_selection_ties_triton_path_and_torch_path(heads):
    """The Triton path against the torch path on CUDA (`check_selection_ties`): the same groups where the cut has
    no exact or near tie; on exact ties (1 index head: relu zeros) the Triton path keeps the lower index and the
    torch path torch.topk's set over the token's visible scores, which are the same groups."""
    stats = script.check_selection_ties(heads, _generator(), torch.device("cuda"), timed=False)
    assert stats["ok"], stats
    if heads >= 16:
        assert stats["exact_ties"] == 0, stats
    else:
        assert stats["exact_ties"] > 0, stats
    assert stats["triton_not_topk"] == 0, stats
