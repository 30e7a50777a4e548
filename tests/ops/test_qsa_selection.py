"""QSA top-k ranking on the Triton path (CUDA): `top_groups` keeps the best groups with ties going to the lower
group (the CPU's selection keeps torch.topk's tied groups instead: `top_set.top_group_set_as_topk`)."""

from __future__ import annotations

import pytest
import torch

from hf_qsa_cache.ops import top_set
from hf_qsa_cache.ops.top_set import top_groups


@pytest.mark.parametrize("seed", range(40))
def test_top_groups_equals_a_stable_descending_sort(seed):
    g = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 300, (1,), generator=g))
    # Few distinct values: many exact ties, as relu zeros make them; -inf marks invisible groups.
    scores = torch.randint(0, 4, (5, groups), generator=g).float() * torch.rand(1, generator=g)
    scores[torch.rand(5, groups, generator=g) < 0.2] = float("-inf")
    scores[0, 0] = -0.0  # relu of a negative zero: must tie with 0.0
    k = int(torch.randint(1, groups + 1, (1,), generator=g))
    expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(top_groups(scores, k), expected)


def test_top_groups_orders_large_scores_and_many_groups():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 70_000, generator=g) * 1e30
    scores[:, 5000:6000] = 3.0e30  # a block of ties above everything else
    expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :1500]
    assert torch.equal(top_groups(scores, 1500), expected)


@pytest.mark.parametrize("seed", range(20))
def test_top_groups_by_value_equals_the_packed_top_k(seed):
    """The float top-k path (long CUDA prefills) redoes rows whose k-th score ties a left-out one."""
    g = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(2, 200, (1,), generator=g))
    scores = torch.rand(6, groups, generator=g)
    scores[:3] = torch.randint(0, 3, (3, groups), generator=g).float()  # rows full of ties
    scores[torch.rand(6, groups, generator=g) < 0.2] = float("-inf")
    k = int(torch.randint(1, groups + 1, (1,), generator=g))
    expected = top_set.top_groups_packed(scores, k)
    assert torch.equal(top_set.top_groups_by_value(scores, k), expected)
    assert torch.equal(expected, scores.sort(dim=-1, descending=True, stable=True).indices[:, :k])


@pytest.mark.parametrize("seed", range(30))
def test_top_groups_two_level_equals_the_packed_top_k(seed, monkeypatch):
    """Tiles of a few groups (forced small), group counts that leave a partial last tile, ties inside
    and across tiles, -inf tails (invisible groups) and rows with fewer visible groups than k. The best
    tiles are picked unsorted: the result must not depend on their order (shuffled here)."""
    g = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(2, 400, (1,), generator=g))
    scores = torch.rand(7, groups, generator=g)
    scores[:3] = torch.randint(0, 3, (3, groups), generator=g).float()  # rows full of ties
    visible = torch.randint(0, groups + 1, (7,), generator=g)
    visible[3] = groups
    scores[3, -1] = 5.0  # row 3: the best group alone in the last (maybe partial) tile
    scores[torch.arange(groups)[None, :] >= visible[:, None]] = float("-inf")
    k = int(torch.randint(1, groups + 1, (1,), generator=g))
    tile = int(torch.randint(1, 9, (1,), generator=g))
    expected = top_set.top_groups_packed(scores, k)
    assert torch.equal(top_set.top_groups_two_level(scores, k, tile), expected)
    assert torch.equal(expected, scores.sort(dim=-1, descending=True, stable=True).indices[:, :k])

    packed = top_set.top_groups_packed

    def shuffled_when_unordered(s, k, best_first=True):
        picked = packed(s, k, best_first)
        if best_first:
            return picked
        order = torch.rand(picked.shape, generator=g).argsort(dim=-1)
        return picked.gather(1, order)

    monkeypatch.setattr(top_set, "top_groups_packed", shuffled_when_unordered)
    assert torch.equal(top_set.top_groups_two_level(scores, k, tile), expected)


def test_top_groups_takes_the_two_level_path_for_many_groups(monkeypatch):
    calls = []
    two_level = top_set.top_groups_two_level
    monkeypatch.setattr(top_set, "top_groups_two_level", lambda s, k: calls.append(k) or two_level(s, k))
    scores = torch.rand(3, 2 * 4 * top_set.TOPK_TILE + 5)
    assert torch.equal(top_groups(scores, 4), top_set.top_groups_packed(scores, 4)) and calls == [4]
