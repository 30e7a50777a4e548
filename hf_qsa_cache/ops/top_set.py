"""The ``k`` best groups of each row of index scores (the QSA selection's ranking): the torch specification, and
`top_group_set`, the op the selection calls (one Triton launch with the ``qsa_topk`` fusion on CUDA,
`top_set_triton`).

Ties (relu makes exact-zero scores common): the torch path (the CPU) keeps the groups ``torch.topk`` keeps when
called as transformers' indexer calls it, over each token's visible groups alone (`top_group_set_as_topk`); the
Triton path (CUDA) keeps the lower group index among equal scores, as `top_groups` does, which is the set
``torch.topk`` keeps on CUDA (transformers' indexer there; checked by benchmarks/check_qsa_kernels.py's
`check_topk_tie_rule` from 2 to 1M groups, k from 1 to 2048, with torch 2.11 on an H100).
"""

from __future__ import annotations

import torch

from . import fusions, use_triton

# Below this many scores the packed top-k is cheap enough (and needs no host sync).
_FAST_TOPK_ELEMENTS = 1 << 22
# Groups per tile of the two-level top-k: with k picks it beats the packed top-k from 2 * k tiles and the float
# one from about 8 * k tiles (measured on the H200, benchmarks/check_qsa_kernels.py).
TOPK_TILE = 16


def top_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[N, k]`` of the ``k`` best groups per row of ``scores`` ``[N, G]``, best first.

    Among equal scores the lower group index wins (relu makes exact zero ties common; the CPU's selection
    then picks as ``torch.topk`` does, `top_group_set_as_topk`). Many groups per pick (long contexts) take `top_groups_two_level`; other
    large eager calls on CUDA take `top_groups_by_value`, which syncs with the host; the rest (decode
    steps, which CUDA graphs capture, and the CPU) take `top_groups_packed`. All give the same result.
    """
    groups = scores.shape[-1]
    if (scores.is_cuda and scores.numel() >= _FAST_TOPK_ELEMENTS and groups < 8 * k * TOPK_TILE
            and not torch.cuda.is_current_stream_capturing()):
        return top_groups_by_value(scores, k)
    if groups >= 2 * k * TOPK_TILE:
        return top_groups_two_level(scores, k)
    return top_groups_packed(scores, k)


def _pack(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (score, lower group) pairs: score bits high, reversed group index low. The
    scores are ``>= 0`` or ``-inf``, whose float32 bit patterns order as signed integers."""
    keys = (scores + 0.0).view(torch.int32).long()  # + 0.0 turns a -0.0 into 0.0
    return keys.mul_(1 << 32).add_((1 << 31) - 1 - groups)


def _unpack(keys: torch.Tensor) -> torch.Tensor:
    return (1 << 31) - 1 - (keys & 0xFFFFFFFF)


def top_groups_packed(scores: torch.Tensor, k: int, best_first: bool = True) -> torch.Tensor:
    """`top_groups` as one top-k over packed int64 keys: exact, no host sync. With ``best_first=False`` the
    same ``k`` groups in no particular order (a caller that only needs the set skips the top-k's sort)."""
    groups = scores.shape[-1]
    if groups >= 1 << 31:
        raise ValueError(f"top_groups packs group indices in 31 bits; got {groups} groups")
    keys = _pack(scores, torch.arange(groups, device=scores.device))
    return _unpack(keys.topk(k, dim=-1, sorted=best_first).values)


def top_group_set(scores: torch.Tensor, k: int, visible: torch.Tensor | None = None) -> torch.Tensor:
    """The groups of `top_groups` (the ``k`` best of each row of ``scores [N, G]``, the lower group first
    among equal scores) in ascending order: the set a selection needs, whose order only changes the order
    of the attention's sums. Where fused (``qsa_topk``) on CUDA, fewer than `top_groups_two_level`'s
    ``2 * k * TOPK_TILE`` groups take one launch that never sorts (`top_set_triton.top_set_triton`: a
    bisection for the ``k``-th best score, where torch's top-k sorts the whole row and gathers); otherwise
    `top_groups`, sorted by group.

    ``visible [N]``: the groups each row scores (the rest are ``-inf``), given by the torch path (the CPU): ties
    then resolve as transformers' indexer resolves them (`top_group_set_as_topk`, which syncs with the host)."""
    if visible is not None:
        return top_group_set_as_topk(scores, visible, k)
    if _fuses_top_set(scores, k):
        from .top_set_triton import top_set_triton

        return top_set_triton(scores, k)
    return top_groups(scores, k).sort(dim=-1).values


def top_group_set_as_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The groups ``torch.topk`` keeps of each row of ``scores [N, G]`` called as transformers' indexer calls it:
    on a tensor of the row's ``visible [N]`` first scores alone, ``min(k, visible)`` of them. Ascending; a row
    with fewer than ``k`` visible groups is completed with groups at or past ``visible`` (a selection drops them).

    ``torch.topk`` leaves the order of equal values to its implementation (on the CPU a partial sort or an
    nth-element over the row, whose picks among ties depend on the row's length and every value in it), so a
    wider row (``-inf`` past ``visible``) can keep other tied groups. Any rule picks the same set unless the
    ``k``-th best score equals one left out: `top_groups` ranks every row, and only such rows are ranked again,
    one ``torch.topk`` per distinct width (rows of one width side by side, which picks as one row alone does).
    """
    groups = top_groups(scores, k)
    picked = scores.gather(1, groups)
    kth = picked.amin(dim=-1, keepdim=True)
    widths = visible.long()
    # Rows with more visible groups than picks whose k-th score ties a score left out (a finite k-th: the k picks
    # are visible groups there).
    redo = ((widths > k) & ((scores == kth).sum(dim=-1) > (picked == kth).sum(dim=-1))).nonzero().flatten()
    if redo.numel():
        redo_widths = widths[redo]
        for width in redo_widths.unique().tolist():
            rows = redo[redo_widths == width]
            groups[rows] = scores[rows, :width].topk(k, dim=-1).indices
    return groups.sort(dim=-1).values


def _fuses_top_set(scores: torch.Tensor, k: int) -> bool:
    return (fusions.enabled("qsa_topk") and use_triton(scores) and scores.dim() == 2 and scores.dtype == torch.float32
            and scores.shape[-1] < 2 * k * TOPK_TILE)


def top_groups_by_value(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_groups` from a float32 top-k (half the passes of the packed one over 64-bit keys).

    The float top-k is exact but for the order of ties: the selected set can differ only in a row
    whose ``k``-th score equals a score left out. Such rows (counted with one host sync) are redone
    packed; the ``k`` winners of every row are then ordered by (score, lower group).
    """
    values, index = scores.topk(k, dim=-1, sorted=False)
    kth = values.min(dim=-1, keepdim=True).values
    tie_left_out = (scores == kth).sum(dim=-1) > (values == kth).sum(dim=-1)
    redo = tie_left_out.nonzero().flatten()
    if redo.numel():
        index[redo] = top_groups_packed(scores[redo], k)
        values[redo] = scores[redo].gather(1, index[redo])
    return _unpack(_pack(values, index).sort(dim=-1, descending=True).values)


def top_groups_two_level(scores: torch.Tensor, k: int, tile: int = TOPK_TILE) -> torch.Tensor:
    """`top_groups` over ``k`` tiles of ``tile`` groups instead of all groups: exact, no host sync.

    Order tiles by their best (score, lower group), i.e. by (tile max, lower tile). If a group ``x``
    is among the ``k`` best groups, its tile is among the ``k`` best tiles: otherwise ``k`` tiles beat
    it, and the best group of each beats ``x``, ``k`` groups ahead of ``x``. So the ``k`` best groups
    of the ``k * tile`` groups of the best tiles are the ``k`` best of all. At long context that is a
    small share of the groups (``G / tile`` tile maxima, then ``k * tile`` candidates).
    """
    groups = scores.shape[1]

    def candidate_scores(candidates: torch.Tensor) -> torch.Tensor:
        # Groups past the end (in a partial tile) score -inf.
        picked = scores.gather(1, candidates.clamp_max(groups - 1))
        return picked.masked_fill(candidates >= groups, float("-inf"))

    return top_groups_of_best_tiles(tile_maxima(scores, tile), candidate_scores, k, tile)


def tile_maxima(scores: torch.Tensor, tile: int) -> torch.Tensor:
    """``[N, ceil(G / tile)]``: the best score of each tile of ``tile`` consecutive groups (a last tile
    may be partial)."""
    n, groups = scores.shape
    whole = groups // tile
    maxima = scores[:, :whole * tile].unflatten(1, (whole, tile)).amax(dim=-1)
    if groups % tile:  # a last, partial tile
        maxima = torch.cat([maxima, scores[:, whole * tile:].amax(dim=-1, keepdim=True)], dim=1)
    return maxima


def top_groups_of_best_tiles(maxima: torch.Tensor, candidate_scores, k: int, tile: int) -> torch.Tensor:
    """The second level of `top_groups_two_level`: from the tile maxima ``[N, T]``, the ``k`` best groups
    of the ``k`` best tiles, best first; ``candidate_scores(candidates [N, k * tile])`` gives those
    groups' scores, ``-inf`` for a group past the end (a partial last tile)."""
    # Only the set of best tiles matters (their candidates are ranked below): no sort here.
    tiles = top_groups_packed(maxima, min(k, maxima.shape[1]), best_first=False)
    candidates = (tiles[:, :, None] * tile + torch.arange(tile, device=maxima.device)).flatten(1)
    # A group past the end scores -inf under a higher index than every real group, so it loses to
    # all of them; at least k real candidates exist.
    return _unpack(_pack(candidate_scores(candidates), candidates).topk(k, dim=-1, sorted=True).values)
