"""The set of a QSA selection's best groups (`top_set.top_group_set`) and its one-launch Triton kernel
(`top_set_triton`, the ``qsa_topk`` fusion).

The kernel runs this file as a script under the Triton interpreter (`interpreter.py`), one pytest item per case,
against the torch path: rows full of exact ties (relu zeros), -0.0 beside 0.0, -inf groups, negative scores, k
from 1 to the whole row, a strided row view, and blocks forced small so that rows are read in several chunks, with
ties that straddle a chunk boundary. Among equal scores it keeps the lower index (the Triton path's rule; the
CPU's selection keeps what torch.topk keeps, `top_group_set_as_topk`).
"""

from __future__ import annotations

import sys

import pytest
import torch

from hf_qsa_cache import fusions
from hf_qsa_cache.ops import top_set as top_set_ops
from helpers.fusions import fused_generate_mismatch
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter


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


def _rows(g: torch.Generator, n: int, groups: int) -> torch.Tensor:
    scores = torch.relu(torch.randn(n, groups, generator=g))  # relu zeros: exact ties
    scores[1 % n] = torch.randint(0, 3, (groups,), generator=g).float()  # a row of few values
    scores[torch.rand(n, groups, generator=g) < 0.15] = float("-inf")  # groups a token cannot see
    if n > 2:
        scores[2] = torch.randn(groups, generator=g)  # negative scores order below 0 (not QSA's, but floats)
    return scores


# (rows, groups) of the random-row cases; 33 groups are also read in chunks of 8 (blocks forced small).
ROW_SHAPES = [(1, 1), (3, 5), (4, 33), (3, 64), (5, 200)]
KERNEL_CASES = ([f"{n}x{groups}" for n, groups in ROW_SHAPES]
                + ["chunk-straddling-ties", "one-step-apart", "low-bits", "bad-k", "generate"])


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_the_specification_under_the_interpreter(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    """One kernel case (a name of `KERNEL_CASES`) under the interpreter: None, or what differs."""
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import top_set_triton as ts

    torch.set_num_threads(1)
    if not isinstance(ts._top_set_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    launches: list = []
    count_launches(ts, "_top_set_kernel", launches)
    if case == "generate":
        return _generate_case(launches)
    cases = {"chunk-straddling-ties": _chunk_straddling_ties, "one-step-apart": _one_step_apart,
             "low-bits": _low_bits, "bad-k": _bad_k}
    if case in cases:
        return cases[case](ts.top_set_triton)
    n, groups = ROW_SHAPES[[f"{n}x{gr}" for n, gr in ROW_SHAPES].index(case)]
    return _random_rows(ts.top_set_triton, launches, n, groups)


def _random_rows(top_set, launches: list, n: int, groups: int) -> str | None:
    """`_rows` of ``n`` x ``groups`` (after 3 dropped columns: contiguous, and a strided view), every k from 1 to the
    row, one launch each."""
    g = torch.Generator().manual_seed(n * 1000 + groups)
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
    return None


def _chunk_straddling_ties(top_set) -> str | None:
    """12 equal scores over chunks of 4, k cutting through them; a -0.0 that ties with the 0.0 after it and wins
    as the lower group."""
    scores = torch.zeros(1, 20)
    scores[0, :3] = 2.0
    scores[0, 15:] = float("-inf")
    scores[0, 3] = -0.0
    for k in (3, 5, 15):  # inside the first chunk, cutting the ties in a later one, all the ties
        have = top_set(scores, k, block=4)
        if not torch.equal(have, _stable_best(scores, k)):
            return f"chunk-straddling ties k={k}: {have.tolist()}"
    return None


def _one_step_apart(top_set) -> str | None:
    """Sixteen scores one float step apart (shuffled): the search must narrow to a single key value."""
    g = torch.Generator().manual_seed(16)
    close = torch.tensor(1.0) + torch.arange(16) * (torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)) - 1.0)
    close = close[torch.randperm(16, generator=g)][None]
    for k in (1, 5, 15):
        have = top_set(close, k)
        if not torch.equal(have, _stable_best(close, k)):
            return f"scores one step apart, k={k}: {have.tolist()}"
    return None


def _low_bits(top_set) -> str | None:
    """Keys that share their top 24 bits and differ in the last 8, keys 256 apart (their last 8 bits equal), and
    keys far apart."""
    g = torch.Generator().manual_seed(40)
    base = torch.tensor(3.0).view(torch.int32)
    for spread in (torch.arange(40) * 3, torch.arange(40) * 256 + 7):
        near = (base + spread).view(torch.float32)[torch.randperm(40, generator=g)][None]
        wide_apart = torch.cat([near, -near, near.neg().exp2()], dim=1)
        for rows in (near, wide_apart):
            for k in (1, 17, rows.shape[1]):
                have = top_set(rows, k, block=16)
                if not torch.equal(have, _stable_best(rows, k)):
                    return f"keys {spread[1].item()} apart, k={k}: {have.tolist()}"
    return None


def _bad_k(top_set) -> str | None:
    """k of 0 or past the row is refused, naming the value."""
    scores = torch.zeros(1, 20)
    top_set(scores, 20)  # the whole row is fine
    for bad in (0, 21):
        try:
            top_set(scores, bad)
            return f"k={bad} of 20 groups was not refused"
        except ValueError as err:
            if str(bad) not in str(err):
                return f"k={bad}: the error does not name the value: {err}"
    return None


def _generate_case(launches: list) -> str | None:
    """The tiny Qwen4Exp (4 of up to 7 groups kept: the selection is active) with the kernel in every QSA layer,
    against the ranking it replaces on CUDA (`top_groups`, the lower index among ties): the same selected sets, so
    the same logits bit for bit."""
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    from hf_qsa_cache.ops import qsa

    top_set_ops._fuses_top_set = lambda scores, k: fusions.enabled("qsa_topk")  # the CUDA dispatch, on CPU tensors
    qsa.top_group_set = lambda scores, k, visible=None: top_set_ops.top_group_set(scores, k)  # CUDA's ranking
    fusions.STATE["qsa_topk"] = False  # the torch path first
    error = fused_generate_mismatch(make_pair(seed=7)[1], *left_pad(random_prompts([9, 4, 7], seed=8)),
                                    "qsa_topk", launches, atol=None)
    return f"generate: {error}" if error else None


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))


def test_rows_of_every_length_up_to_max_block_share_four_compiled_variants(monkeypatch):
    """A kernel variant is compiled per block size: rows that grow through a serving run (a context of up to
    MAX_BLOCK groups) meet four of them, rows of up to SMALL_BLOCK groups one, not one per power of two."""
    from hf_qsa_cache.ops import top_set_triton as ts

    blocks = set()

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, BLOCK, ONE_CHUNK, **options: blocks.add((BLOCK, ONE_CHUNK))

    monkeypatch.setattr(ts, "_top_set_kernel", Recorder())
    for groups in (1, 5, 100, 1000, 1024):
        ts.top_set_triton(torch.zeros(2, groups), 1)
    assert blocks == {(ts.SMALL_BLOCK, True)}
    for groups in (1025, 2200, 4400, 8192):
        ts.top_set_triton(torch.zeros(2, groups), 1)
    assert blocks == {(block, True) for block in (1024, 2048, 4096, 8192)}
