"""The set of a QSA selection's best groups (`top_set.top_group_set`) and its one-launch Triton kernel
(`top_set_triton`, the ``qsa_topk`` fusion).

The kernel runs this file as a script under the Triton interpreter (`interpreter.py`) against the torch
path: rows full of exact ties (relu zeros), -0.0 beside 0.0, -inf groups, negative scores, k from 1 to
the whole row, a strided row view, and blocks forced small so that rows are read in several chunks, with
ties that straddle a chunk boundary.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import top_set as top_set_ops
from helpers.fusions import fused_generate_mismatch
from helpers.interpreter import count_launches, run_under_interpreter


def _stable_best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best of each row by a stable descending sort (the lower index first among equals), ascending."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values


@pytest.mark.parametrize("seed", range(20))
def test_top_group_set_is_the_stable_best_k_in_ascending_order(seed):
    g = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 300, (1,), generator=g))
    scores = torch.randint(0, 4, (5, groups), generator=g).float()
    scores[torch.rand(5, groups, generator=g) < 0.2] = float("-inf")
    k = int(torch.randint(1, groups + 1, (1,), generator=g))
    assert torch.equal(top_set_ops.top_group_set(scores, k), _stable_best(scores, k))


@pytest.mark.parametrize("seed", range(12))
def test_cpu_selection_keeps_what_torch_topk_keeps_over_the_visible_groups(seed):
    """Rows full of exact ties (relu zeros, few distinct values) and ``-inf`` past each row's visible groups: the
    CPU's set is what ``torch.topk`` keeps on each row's visible scores alone, as transformers' indexer calls it
    (``min(k, visible)`` of them; a row with fewer visible groups than ``k`` keeps them all). The cases must hold
    rows where that differs from the lower index among ties, and rows where the wider row would pick otherwise."""
    g = torch.Generator().manual_seed(100 + seed)
    n, groups = 24, int(torch.randint(6, 120, (1,), generator=g))
    k = int(torch.randint(1, groups // 2 + 1, (1,), generator=g))
    scores = torch.relu(torch.randn(n, groups, generator=g))
    scores[: n // 2] = torch.randint(0, 3, (n // 2, groups), generator=g).float()  # few values: ties everywhere
    visible = torch.randint(0, groups + 1, (n,), generator=g)
    scores[torch.arange(groups)[None, :] >= visible[:, None]] = float("-inf")
    have = top_set_ops.top_group_set(scores, k, visible)
    assert have.shape == (n, k) and torch.equal(have, have.sort(dim=-1).values)
    differs_from_lower = differs_from_wide = 0
    for row in range(n):
        width = int(visible[row])
        kept = set(have[row].tolist()) & set(range(width))
        want = set(scores[row, :width].clone().topk(min(k, width)).indices.tolist())
        assert kept == want, (row, width, k)
        if width > k:
            differs_from_lower += want != set(_stable_best(scores[row:row + 1, :width], k)[0].tolist())
            differs_from_wide += want != set(scores[row].topk(k).indices.tolist())
    assert differs_from_lower > 0 and differs_from_wide > 0, (differs_from_lower, differs_from_wide)


def test_kernel_matches_the_specification_under_the_interpreter():
    run_under_interpreter(__file__, "all top set cases ok")


def _rows(g: torch.Generator, n: int, groups: int) -> torch.Tensor:
    scores = torch.relu(torch.randn(n, groups, generator=g))  # relu zeros: exact ties
    scores[1 % n] = torch.randint(0, 3, (groups,), generator=g).float()  # a row of few values
    scores[torch.rand(n, groups, generator=g) < 0.15] = float("-inf")  # groups a token cannot see
    if n > 2:
        scores[2] = torch.randn(groups, generator=g)  # negative scores order below 0 (not QSA's, but floats)
    return scores


def _cases(launches: list) -> str | None:
    """Every case of the kernel against the specification."""
    from hf_qsa_cache.ops import top_set_triton as ts

    top_set = ts.top_set_triton
    g = torch.Generator().manual_seed(0)
    for n, groups in ((1, 1), (3, 5), (4, 33), (3, 64), (5, 200)):
        wide = _rows(g, n, groups + 3)
        # Rows read in several chunks (blocks forced small) in one case: the interpreter's rounds are slow.
        blocks = (None, 8) if groups == 33 else (None,)
        for label, scores in (("contiguous", wide[:, 3:].contiguous()), ("strided", wide[:, 3:])):
            for k in sorted({1, groups // 3 or 1, 2 * groups // 3 or 1, groups}):  # 2/3: cuts among negatives
                want = _stable_best(scores, k)
                for block in blocks:
                    launches.clear()
                    have = top_set(scores, k, block=block)
                    where = f"n={n} G={groups} k={k} {label} block={block}"
                    if len(launches) != 1 or have.dtype != torch.int64 or not torch.equal(have, want):
                        return f"{where}: launches {len(launches)}, {have.tolist()} != {want.tolist()}"
    # Ties across a chunk boundary: 12 equal scores over chunks of 4, k cutting through them.
    scores = torch.zeros(1, 20)
    scores[0, :3] = 2.0
    scores[0, 15:] = float("-inf")
    scores[0, 3] = -0.0  # must tie with the 0.0 after it, and win as the lower group
    for k in (3, 5, 15):  # inside the first chunk, cutting the ties in a later one, all the ties
        have = top_set(scores, k, block=4)
        if not torch.equal(have, _stable_best(scores, k)):
            return f"chunk-straddling ties k={k}: {have.tolist()}"
    # Sixteen scores one float step apart (shuffled): the search must narrow to a single key value.
    close = torch.tensor(1.0) + torch.arange(16) * (torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)) - 1.0)
    close = close[torch.randperm(16, generator=g)][None]
    for k in (1, 5, 15):
        have = top_set(close, k)
        if not torch.equal(have, _stable_best(close, k)):
            return f"scores one step apart, k={k}: {have.tolist()}"
    # Keys that share their top 24 bits and differ in the last 8, keys 256 apart (their last 8 bits equal), and keys
    # far apart.
    base = torch.tensor(3.0).view(torch.int32)
    for spread in (torch.arange(40) * 3, torch.arange(40) * 256 + 7):
        near = (base + spread).view(torch.float32)[torch.randperm(40, generator=g)][None]
        wide_apart = torch.cat([near, -near, near.neg().exp2()], dim=1)
        for rows in (near, wide_apart):
            for k in (1, 17, rows.shape[1]):
                have = top_set(rows, k, block=16)
                if not torch.equal(have, _stable_best(rows, k)):
                    return f"keys {spread[1].item()} apart, k={k}: {have.tolist()}"
    for bad in (0, 21):
        try:
            top_set(scores, bad)
            return f"k={bad} of 20 groups was not refused"
        except ValueError as err:
            if str(bad) not in str(err):
                return f"k={bad}: the error does not name the value: {err}"
    return None


def _main() -> int:
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import top_set_triton as ts

    torch.set_num_threads(1)
    if not isinstance(ts._top_set_kernel, InterpretedFunction):
        print("TRITON_INTERPRET was not honoured")
        return 1
    launches: list = []
    count_launches(ts, "_top_set_kernel", launches)
    error = _cases(launches)
    if error:
        print(error)
        return 1
    # The tiny Qwen4Exp (4 of up to 7 groups kept: the selection is active) with the kernel in every QSA
    # layer: the same selected sets as the torch path, so the same logits bit for bit.
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    top_set_ops._fuses_top_set = lambda scores, k: fusions.enabled("qsa_topk")  # the CUDA dispatch, on CPU tensors
    fusions.STATE["qsa_topk"] = False  # the torch path first
    error = fused_generate_mismatch(make_pair(seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8)),
                                    "qsa_topk", launches, atol=None)
    if error:
        print(f"generate: {error}")
        return 1
    print("all top set cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
