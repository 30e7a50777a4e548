"""QSA index scores and sparse paged attention: the torch functions against plain loops, and the
Triton kernels against the torch functions.

The Triton comparison runs this file as a script in a subprocess with TRITON_INTERPRET=1 (the
variable only counts if it is set before triton is first imported).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from hf_qsa_cache.ops import qsa, top_set
from helpers.interpreter import case_main, count_launches, run_case_under_interpreter


# ----------------------------------------------------------------------------- random inputs


def _paged_table(g: torch.Generator, num_rows: int, columns: int) -> tuple[torch.Tensor, int]:
    """Distinct shuffled physical blocks (0 is the null block, never used); returns (table, num_blocks)."""
    num_blocks = num_rows * columns + 3
    ids = torch.randperm(num_blocks - 1, generator=g)[: num_rows * columns] + 1
    return ids.view(num_rows, columns).to(torch.int32), num_blocks


def attention_case(seed: int, group: int, num_kv: int, head_dim: int, dtype=torch.float32,
                   num_tokens: int = 7, num_rows: int = 3, width: int = 70, block_size: int = 4):
    """Inputs of `sparse_paged_attention`: holes in every selection, one token with nothing selected."""
    g = torch.Generator().manual_seed(seed)
    columns = 30
    table, num_blocks = _paged_table(g, num_rows, columns)
    # The store is a strided view (one stream of a packed [.., 2, H_kv, D] buffer).
    packed = torch.randn(num_blocks, block_size, 2, num_kv, head_dim, generator=g).to(dtype)
    keys, values = packed[:, :, 0], packed[:, :, 1]
    query = torch.randn(num_tokens, num_kv * group, head_dim, generator=g).to(dtype)
    token_row = torch.randint(0, num_rows, (num_tokens,), generator=g, dtype=torch.int32)
    seq_len = (columns + 1) * block_size  # a few positions past the table: its last column is used
    positions = torch.randint(0, seq_len, (num_tokens, width), generator=g)
    positions[torch.rand(num_tokens, width, generator=g) < 0.3] = -1
    positions[1] = -1  # a pad: nothing to attend
    positions[2, 1:] = -1  # a single position
    return query, keys, values, table, token_row, positions, block_size, 1.0 / math.sqrt(head_dim)


def scores_case(seed: int, num_heads: int, head_dim: int, ratio: int, dtype=torch.float32,
                num_tokens: int = 9, num_rows: int = 3, max_groups: int = 70, block_size: int = 8):
    """Inputs of `index_scores_torch`: ragged visible counts, some tokens seeing nothing."""
    g = torch.Generator().manual_seed(seed)
    rows_per_block = block_size // ratio
    # One column short of max_groups: the last groups clamp to the table's last column, like paged_rows.
    table, num_blocks = _paged_table(g, num_rows, -(-max_groups // rows_per_block) - 1)
    q_index = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    compressed = torch.randn(num_blocks, rows_per_block, head_dim, generator=g).to(dtype)
    token_row = torch.randint(0, num_rows, (num_tokens,), generator=g, dtype=torch.int32)
    visible = torch.randint(0, max_groups + 1, (num_tokens,), generator=g, dtype=torch.int32)
    visible[0] = max_groups
    visible[1] = 0
    return q_index, compressed, table, token_row, visible, rows_per_block, max_groups


def split_attention_case(seed: int, group: int, num_kv: int, head_dim: int, dtype=torch.float32):
    """`attention_case` over a width of several tiles (64 positions each), with holes covering whole
    splits: the first ones (token 4), the last ones (token 3), the middle ones (token 5)."""
    case = attention_case(seed, group, num_kv, head_dim, dtype, width=300)
    positions = case[5]
    positions[3, 128:] = -1
    positions[4, :192] = -1
    positions[5, 64:256] = -1
    return case


def tiled_scores_case(seed: int, num_heads: int, head_dim: int, ratio: int, dtype=torch.float32,
                      mixed_rows: bool = False):
    """`scores_case` for 15 tokens in tiles of 4: three tiles of one row each (ragged visible counts,
    tokens that see nothing, a tile whose tokens all see fewer than 64 groups), then a last tile of 3
    tokens across two rows; ``mixed_rows``: random rows instead."""
    case = scores_case(seed, num_heads, head_dim, ratio, dtype, num_tokens=15)
    q_index, compressed, table, token_row, visible, rows_per_block, max_groups = case
    if not mixed_rows:
        token_row = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 1, 2, 2], dtype=torch.int32)
        visible = torch.tensor([70, 0, 13, 64, 65, 1, 64, 40, 10, 20, 0, 63, 30, 70, 5], dtype=torch.int32)
    return q_index, compressed, table, token_row, visible, rows_per_block, max_groups


ATTENTION_SHAPES = [  # (group, num_kv, head_dim, dtype, atol)
    (1, 2, 16, torch.float32, 1e-5),
    (2, 1, 32, torch.float32, 1e-5),
    (3, 2, 24, torch.float32, 1e-5),  # non-power-of-two group and head_dim
    (8, 2, 64, torch.float32, 1e-5),
    (8, 1, 32, torch.bfloat16, 2e-2),
]
SCORE_SHAPES = [  # (num_heads, head_dim, ratio, dtype)
    (1, 16, 2, torch.float32),  # one head: about half the scores are exact relu zeros (ties)
    (4, 32, 4, torch.float32),
    (20, 64, 2, torch.float32),  # more heads than one tile
    (4, 24, 4, torch.float32),
    (8, 32, 4, torch.bfloat16),
]


# ----------------------------------------------------------------------------- torch vs loops


def _loop_scores(q_index, compressed, table, token_row, visible, rows_per_block, max_groups):
    out = torch.full((q_index.shape[0], max_groups), float("-inf"))
    flat = compressed.reshape(-1, q_index.shape[2]).float()
    for n in range(q_index.shape[0]):
        row = int(token_row[n])
        for grp in range(int(visible[n])):
            column = min(grp // rows_per_block, table.shape[1] - 1)
            key = flat[int(table[row, column]) * rows_per_block + grp % rows_per_block]
            out[n, grp] = (q_index[n].float() @ key).relu().sum() / math.sqrt(q_index.shape[2])
    return out


def _loop_attention(query, keys, values, table, token_row, positions, block_size, scaling):
    n, num_heads, head_dim = query.shape
    group = num_heads // keys.shape[2]
    out = torch.zeros(n, num_heads, head_dim)
    for t in range(n):
        pos = [int(p) for p in positions[t] if p >= 0]
        if not pos:
            continue
        row = int(token_row[t])
        blocks = [int(table[row, min(p // block_size, table.shape[1] - 1)]) for p in pos]
        for h in range(num_heads):
            k = torch.stack([keys[b, p % block_size, h // group] for b, p in zip(blocks, pos)]).float()
            v = torch.stack([values[b, p % block_size, h // group] for b, p in zip(blocks, pos)]).float()
            out[t, h] = torch.softmax(k @ query[t, h].float() * scaling, dim=0) @ v
    return out


@pytest.mark.parametrize("shape", SCORE_SHAPES[:4])
@pytest.mark.parametrize("rows", [1, 3])
def test_index_scores_torch_matches_loops(shape, rows):
    case = scores_case(5, *shape, num_rows=rows)
    torch.testing.assert_close(qsa.index_scores_torch(*case), _loop_scores(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SCORE_SHAPES[:4])
def test_candidate_scores_and_tile_maxima_torch_match_loops(shape):
    """Candidates at and past the visible count, negative ones; tiles whose last one is partial."""
    case = scores_case(6, *shape)
    q_index, compressed, table, token_row, visible, rows_per_block, max_groups = case
    full = torch.cat([_loop_scores(*case), torch.full((q_index.shape[0], 1), float("-inf"))], dim=1)
    candidates = torch.randint(-1, max_groups + 1, (q_index.shape[0], 40), generator=torch.Generator().manual_seed(1))
    want = full[torch.arange(q_index.shape[0])[:, None], candidates]  # -1 and max_groups read the -inf column
    have = qsa.candidate_scores_torch(q_index, compressed, table, token_row, visible, rows_per_block, candidates)
    torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
    maxima = qsa.index_tile_maxima_torch(*case, 16)  # 70 groups: four whole tiles and one of 6
    assert maxima.shape == (q_index.shape[0], 5)
    torch.testing.assert_close(maxima, torch.stack([t.amax(-1) for t in full[:, :-1].split(16, dim=1)], dim=1))


@pytest.mark.parametrize("shape", SCORE_SHAPES[:4])
@pytest.mark.parametrize("tile", [2, 4, 16])
def test_selection_by_tile_maxima_equals_the_top_k_of_the_scores(shape, tile):
    """The torch path of `select_by_tile_maxima` (never holding all scores) picks the groups `top_groups` picks
    from all scores, relu-zero ties included (one head: about half the scores are exact zeros)."""
    case = scores_case(8, *shape, num_tokens=12)
    k = 70 // (2 * tile)  # at least two tiles per pick
    want = top_set.top_groups(qsa.index_scores_torch(*case), k)
    assert torch.equal(qsa.select_by_tile_maxima(*case, k, tile), want)


@pytest.mark.parametrize("shape", ATTENTION_SHAPES[:4])
def test_sparse_attention_torch_matches_loops(shape):
    case = attention_case(3, *shape[:4])
    torch.testing.assert_close(qsa.sparse_paged_attention(*case), _loop_attention(*case), atol=1e-5, rtol=1e-5)


def _tied_selection_case():
    """A step of two rows whose index scores tie: groups 0, 1, 4 and 6 of row 0 share one key (equal positive
    scores), group 7 scores highest; 3 groups kept. Returns (`score_and_select`'s arguments, the visible groups'
    scores of each token, ``[4, G]``)."""
    from hf_qsa_cache.metadata import QSAGeometry, build_step_metadata_torch

    ratio, block_size, topk = 2, 4, 3
    prev, count = torch.tensor([20, 13], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    table = torch.tensor([[5, 2, 7, 1, 9, 3], [4, 8, 6, 10, 0, 0]], dtype=torch.int32)
    meta = build_step_metadata_torch(prev, count, 2, {"main": table}, {"main": block_size},
                                     QSAGeometry(ratio, ratio), prev.tolist(), count.tolist())
    g = torch.Generator().manual_seed(0)
    compressed = torch.randn(11, block_size // ratio, 8, generator=g)
    flat = compressed.view(-1, 8)
    slot = lambda grp: int(table[0, grp // 2]) * 2 + grp % 2  # noqa: E731
    tied = flat[slot(0)].abs()
    for grp in (0, 1, 4, 6):
        flat[slot(grp)] = tied
    flat[slot(7)] = tied * 3
    q_index = torch.ones(4, 2, 8)  # every head scores a key by its sum
    scores = qsa.index_scores_torch(q_index, compressed, meta.block_tables["main"], meta.token_row,
                                    meta.visible_blocks, block_size // ratio, meta.max_seq_len // ratio)
    return (q_index, compressed, meta, "main", block_size, ratio, topk), scores


def _selected_groups(selected: torch.Tensor, ratio: int, topk: int) -> list[list[int]]:
    return [sorted({int(p) // ratio for p in row[: topk * ratio] if p >= 0}) for row in selected]


def test_cpu_selection_keeps_the_tied_groups_torch_topk_keeps():
    """Equal scores at the cut (relu makes exact zeros common): the torch path keeps the groups transformers'
    indexer keeps, ``torch.topk`` over each token's visible scores alone, whatever the chunking. Here that is
    not the lower group index (the Triton path's rule, the ``selection-ties`` kernel case)."""
    args, scores = _tied_selection_case()
    meta, ratio, topk = args[2], args[5], args[6]
    want = []
    for token, width in enumerate(meta.visible_blocks.tolist()):
        want.append(sorted(scores[token, :width].clone().topk(min(topk, width)).indices.tolist()) if width else [])
    # Row 0, position 20 (10 visible groups): 7 first, then two of the tied 0/1/4/6.
    assert want[0][-1] == 7 and want[0] != [0, 1, 7], want
    for budget in (1 << 26, 3):  # one chunk, and one token per chunk
        with pytest.MonkeyPatch.context() as m:
            m.setattr(qsa, "_CHUNK_ELEMENTS", budget)
            selected = qsa.score_and_select(*args)
        assert _selected_groups(selected, ratio, topk) == want, budget


# ----------------------------------------------------------------------------- triton vs torch


def test_candidate_launch_fills_the_gpu_at_decode_and_caps_prefill_programs():
    from hf_qsa_cache.ops import qsa_triton as kt

    decode = kt.candidates_per_program(1, 512 * 16)  # one token, k = 512 tiles of 16
    assert decode % kt.CANDIDATES_BLOCK == 0 and 512 * 16 // decode >= kt.CANDIDATES_TARGET_PROGRAMS // 8
    assert kt.candidates_per_program(4096, 512 * 16) == kt.CANDIDATES_PER_PROGRAM
    assert kt.candidates_per_program(3, 5) == kt.CANDIDATES_BLOCK


def test_score_kernels_refuse_a_tile_or_split_they_cannot_run():
    from hf_qsa_cache.ops import qsa_triton as kt

    case = scores_case(1, *SCORE_SHAPES[1])
    for tile in (0, 3, 2 * kt.SCORES_BLOCK_G):
        with pytest.raises(ValueError, match=f"tile must be a power of two dividing the key tile .* got {tile}"):
            kt.index_scores_triton(*case, tile=tile)
    candidates = torch.zeros(case[0].shape[0], 4, dtype=torch.long)
    with pytest.raises(ValueError, match="per_program must be at least 1 candidate, got 0"):
        kt.candidate_scores_triton(*case[:6], candidates, per_program=0)


# The kernels against their torch specification under the Triton interpreter (`interpreter.py`), one pytest item
# per case: each runs this file as a script with ``--case NAME`` in a forked child of the interpreter server.
def _dtype_name(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


SCORE_NAMES = [f"{h}h-{d}d-r{r}-{_dtype_name(dt)}" for h, d, r, dt in SCORE_SHAPES]
ATTENTION_NAMES = [f"g{g}-{kv}kv-{d}d-{_dtype_name(dt)}" for g, kv, d, dt, _ in ATTENTION_SHAPES]
KERNEL_CASES = ([f"{kind}-{name}" for kind in ("scores", "tiled-scores", "tile-maxima", "candidates",
                                                 "selection-by-tiles") for name in SCORE_NAMES]
                + [f"attention-{name}" for name in ATTENTION_NAMES]
                + ["split-attention", "decode-tiles", "selected-positions", "pool-groups", "selection-ties"])


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernels_match_torch(case):
    run_case_under_interpreter(__file__, case)


def _min_gap(scores: torch.Tensor) -> float:
    """Smallest relative gap between distinct non-zero finite scores of one token (near-tie guard)."""
    gap = float("inf")
    for row in scores:
        vals = row[torch.isfinite(row) & (row != 0)].double().sort().values
        if vals.numel() > 1:
            gap = min(gap, float(((vals[1:] - vals[:-1]) / vals[1:].abs()).min()))
    return gap


def _check_selection(seed: int, num_heads: int, head_dim: int, ratio: int, dtype, topk: int = 6) -> str | None:
    """`score_and_select` through the Triton kernels selects exactly what the kernels' rule picks from the torch
    scores: the best ``topk`` groups, the lower group index among exact (relu-zero) ties."""
    from hf_qsa_cache.metadata import QSAGeometry, build_step_metadata_torch

    g = torch.Generator().manual_seed(seed)
    block_size, num_rows, query_len = 4 * ratio, 3, 5
    prev = torch.tensor([37, 0, 61], dtype=torch.int32)
    count = torch.tensor([5, 3, 1], dtype=torch.int32)  # ragged: left pads in rows 1 and 2
    columns = -(-int((prev + count).max()) // block_size)
    table, num_blocks = _paged_table(g, num_rows, columns)
    meta = build_step_metadata_torch(prev, count, query_len, {"main": table}, {"main": block_size},
                                     QSAGeometry(compress_ratio=ratio, ring_capacity=ratio), prev.tolist(),
                                     count.tolist())
    q_index = torch.randn(num_rows * query_len, num_heads, head_dim, generator=g).to(dtype)
    compressed = torch.randn(num_blocks, block_size // ratio, head_dim, generator=g).to(dtype)
    max_groups = meta.max_seq_len // ratio
    torch_scores = qsa.index_scores_torch(q_index, compressed, table, meta.token_row, meta.visible_blocks,
                                          block_size // ratio, max_groups)
    if _min_gap(torch_scores) < 1e-5:
        return "near-tie"
    args = (q_index, compressed, meta, "main", block_size, ratio, topk)
    groups = top_set.top_groups(torch_scores, min(topk, max_groups)).sort(dim=-1).values
    want = qsa.selected_positions(groups, meta.visible_blocks, meta.position, ratio, topk)
    original = qsa.use_triton
    qsa.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    try:
        have = qsa.score_and_select(*args)
    finally:
        qsa.use_triton = original
    if not torch.equal(want, have):
        return f"selection case {seed}: torch {want.tolist()}\n triton {have.tolist()}"
    return None


def _kernel_case(case: str) -> str | None:
    """One kernel case (a name of `KERNEL_CASES`) under the interpreter: None, or what differs."""
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import qsa_triton

    if not isinstance(qsa_triton._index_scores_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    for kind, run in (("scores", _scores_case), ("tiled-scores", _tiled_scores_case),
                      ("tile-maxima", _tile_maxima_case), ("candidates", _candidate_case),
                      ("selection-by-tiles", _selection_by_tiles_case)):
        if case.startswith(kind + "-") and case[len(kind) + 1:] in SCORE_NAMES:
            return run(qsa_triton, SCORE_NAMES.index(case[len(kind) + 1:]))
    if case.startswith("attention-"):
        return _attention_case(qsa_triton, ATTENTION_NAMES.index(case.removeprefix("attention-")))
    return {"split-attention": _split_attention_case, "decode-tiles": _decode_tiles_case,
            "selected-positions": _selected_positions_case, "pool-groups": _pool_groups_case,
            "selection-ties": _selection_ties_case}[case](qsa_triton)


def _launches(qsa_triton, *kernels: str) -> list:
    """The grids of every launch of ``kernels`` from here on (`count_launches`)."""
    launches: list = []
    for name in kernels:
        count_launches(qsa_triton, name, launches)
    return launches


def _scores_case(qsa_triton, i: int) -> str | None:
    """The index scores in one launch at the default policy, then the whole selection through the kernels (the
    first seed whose inputs have no near-ties; exact relu-zero ties are kept: they test the kernels' rule)."""
    num_heads, head_dim, ratio, dtype = SCORE_SHAPES[i]
    launches = _launches(qsa_triton, "_index_scores_kernel")
    case = scores_case(100 + i, num_heads, head_dim, ratio, dtype)
    want = qsa.index_scores_torch(*case)
    have = qsa_triton.index_scores_triton(*case)
    if len(launches) != 1:
        return f"scores case {i}: {len(launches)} launches"
    if have.dtype != torch.float32:
        return f"scores case {i}: dtype {have.dtype}"
    if error := _compare_scores(f"scores case {i} {SCORE_SHAPES[i]}", have, want, dtype):
        return error
    seed = 200 + 50 * i
    while (error := _check_selection(seed, num_heads, head_dim, ratio, dtype)) == "near-tie" and seed < 220 + 50 * i:
        seed += 1
    return error


def _tiled_scores_case(qsa_triton, i: int) -> str | None:
    """Token tiles and group ranges, forced: tiles of 1, 4 and 8 tokens (a tile across rows runs one pass per row;
    15 tokens end in a partial tile), key tiles of 64 or 16 groups, one program along the groups or several (so a
    program loops over several key tiles and over -inf tiles past every token's visible count); and the default
    policy in prefill."""
    num_heads, head_dim, ratio, dtype = SCORE_SHAPES[i]
    launches = _launches(qsa_triton, "_index_scores_kernel")
    forced = [(4, False, None, 64), (8, False, 1, 16), (4, True, 2, 16), (1, True, 3, 16)]
    for block_m, mixed_rows, splits, block_g in forced + [(None, False, None, 16)] * (i >= 3):
        case = tiled_scores_case(150 + i, num_heads, head_dim, ratio, dtype, mixed_rows)
        if block_m is None:  # 71 tokens of one row, visible counts growing like a prefill chunk's
            q_index, compressed, table, _, _, rows_per_block, max_groups = case
            q_index = q_index.repeat(5, 1, 1)[:71]
            token_row = torch.full((71,), 1, dtype=torch.int32)
            visible = (torch.arange(71, dtype=torch.int32) + 3) // 3 * 3 - 2
            case = (q_index, compressed, table, token_row, visible, rows_per_block, max_groups)
            if qsa_triton.scores_block_m(71) == 1:
                return "the default policy does not tile prefill tokens"
        want = qsa.index_scores_torch(*case)
        launches.clear()
        default_block_g, qsa_triton.SCORES_BLOCK_G = qsa_triton.SCORES_BLOCK_G, block_g
        try:
            have = qsa_triton.index_scores_triton(*case, block_m=block_m, group_splits=splits)
        finally:
            qsa_triton.SCORES_BLOCK_G = default_block_g
        label = (f"tiled scores case {i} {SCORE_SHAPES[i]} block_m={block_m} mixed={mixed_rows} splits={splits} "
                 f"block_g={block_g}")
        if len(launches) != 1 or (splits is not None and launches[0][1] != splits):
            return f"{label}: launches {launches}"
        if error := _compare_scores(label, have, want, dtype):
            return error
    return None


def _attention_case(qsa_triton, i: int) -> str | None:
    """Sparse attention at the default split policy: holes, a pad token (zeros), a single position."""
    group, num_kv, head_dim, dtype, atol = ATTENTION_SHAPES[i]
    launches = _launches(qsa_triton, "_sparse_paged_attention_kernel", "_merge_splits_kernel")
    case = attention_case(300 + i, group, num_kv, head_dim, dtype)
    want = qsa.sparse_paged_attention(*case)
    have = qsa_triton.sparse_paged_attention_triton(*case)
    splits, _ = qsa_triton.attention_splits(case[0].shape[0], num_kv, case[5].shape[1])
    if len(launches) != (1 if splits == 1 else 2):
        return f"attention case {i}: {splits} splits, {len(launches)} launches"
    try:
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have[1], torch.zeros_like(have[1])), "pad token is not zero"
        torch.testing.assert_close(have.float(), want.float(), atol=atol, rtol=0)
    except AssertionError as err:
        return f"attention case {i} {ATTENTION_SHAPES[i][:4]}: {err}"
    return None


def _split_attention_case(qsa_triton) -> str | None:
    """Split widths (5 tiles): forced split counts (3 leaves a middle split of holes only, 100 is clamped to one
    tile per split), the single-launch path when forced to one split, and the default policy at decode (one token:
    the policy splits)."""
    launches = _launches(qsa_triton, "_sparse_paged_attention_kernel", "_merge_splits_kernel")
    # (ATTENTION_SHAPES index, num_splits, expected splits)
    split_cases = [(0, 2, 2), (1, 3, 3), (2, 3, 3), (3, 3, 3), (4, 3, 3), (2, 100, 5), (4, 100, 5), (2, 1, 1),
                   (3, 2, 2), (4, None, 5)]
    for i, num_splits, expect in split_cases:
        group, num_kv, head_dim, dtype, atol = ATTENTION_SHAPES[i]
        case = split_attention_case(400 + i, group, num_kv, head_dim, dtype)
        if num_splits is None:
            query, keys, values, table, token_row, positions, block_size, scaling = case
            case = (query[:1], keys, values, table, token_row[:1], positions[:1], block_size, scaling)
        want = qsa.sparse_paged_attention(*case)
        launches.clear()
        have = qsa_triton.sparse_paged_attention_triton(*case, num_splits=num_splits)
        splits, _ = qsa_triton.attention_splits(case[0].shape[0], num_kv, case[5].shape[1], num_splits)
        label = f"split attention case {i} {(group, num_kv, head_dim, dtype)} num_splits={num_splits}"
        if splits != expect or len(launches) != (1 if splits == 1 else 2):
            return f"{label}: {splits} splits, {len(launches)} launches"
        try:
            assert have.dtype == want.dtype and have.shape == want.shape
            if num_splits is not None:
                assert torch.equal(have[1], torch.zeros_like(have[1])), "pad token is not zero"
            torch.testing.assert_close(have.float(), want.float(), atol=atol, rtol=0)
        except AssertionError as err:
            return f"{label}: {err}"
    return None


def _decode_tiles_case(qsa_triton) -> str | None:
    """One-token launches tiled finer than prompts (ATTENTION_DECODE_BLOCK_W forced to 16): the policy's splits and
    forced ones against the spec, the kernel's tile 16 (a prompt's 64), a forced split of three 16-wide tiles."""
    kernel, tiles_seen = qsa_triton._sparse_paged_attention_kernel, []

    class _Tiles:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: tiles_seen.append(kwargs["BLOCK_W"]) or kernel[grid](*args, **kwargs)

    qsa_triton.ATTENTION_DECODE_BLOCK_W = 16
    qsa_triton._sparse_paged_attention_kernel = _Tiles()
    for i, num_splits, want_len in ((2, None, None), (4, None, None), (3, 7, 48), (0, 1, 304)):
        group, num_kv, head_dim, dtype, atol = ATTENTION_SHAPES[i]
        query, keys, values, table, token_row, positions, block_size, scaling = split_attention_case(
            450 + i, group, num_kv, head_dim, dtype)
        case = (query[:1], keys, values, table, token_row[:1], positions[:1], block_size, scaling)
        splits, split_len = qsa_triton.attention_splits(1, num_kv, positions.shape[1], num_splits)
        want = qsa.sparse_paged_attention(*case)
        tiles_seen.clear()
        have = qsa_triton.sparse_paged_attention_triton(*case, num_splits=num_splits)
        label = f"decode tiles of 16, case {i}, num_splits={num_splits}: {splits} x {split_len}"
        if tiles_seen != [16] or split_len % 16 or (want_len is not None and split_len != want_len):
            return f"{label}: tiles {tiles_seen}"
        try:
            torch.testing.assert_close(have.float(), want.float(), atol=atol, rtol=0)
        except AssertionError as err:
            return f"{label}: {err}"
    tiles_seen.clear()
    prompt = attention_case(460, *ATTENTION_SHAPES[0][:4], num_tokens=20, width=300)
    qsa_triton.sparse_paged_attention_triton(*prompt)
    if prompt[0].shape[0] <= qsa_triton.ATTENTION_DECODE_MAX_TOKENS or tiles_seen != [64]:
        return f"a prompt of {prompt[0].shape[0]} tokens launched tiles {tiles_seen}"
    return None


def _selected_positions_case(qsa_triton) -> str | None:
    """The selection's index arithmetic: groups at and past the visible count, fewer groups than block_topk, none
    at all, pads (position -1), positions at and around group boundaries, and ratios 1, 2 and 4."""
    from hf_qsa_cache.ops import selected_positions_triton

    for i, (ratio, block_topk, k) in enumerate([(4, 5, 5), (2, 6, 3), (4, 3, 0), (1, 4, 4), (2, 2, 1)]):
        g = torch.Generator().manual_seed(500 + i)
        n = 9
        groups = torch.stack([torch.randperm(12, generator=g)[:k] for _ in range(n)])
        visible = torch.randint(0, 13, (n,), generator=g)
        position = torch.randint(-1, 50, (n,), generator=g)
        position[:3] = torch.tensor([-1, 4 * ratio - 1, 4 * ratio])
        want = qsa.selected_positions(groups, visible, position, ratio, block_topk)
        have = selected_positions_triton.selected_positions_triton(groups, visible, position, ratio, block_topk)
        if not torch.equal(have, want):
            return f"selected positions case {i} (ratio {ratio}, block_topk {block_topk}, k {k}):\n{have}\n{want}"
    return None


def _pool_groups_case(qsa_triton) -> str | None:
    """Group pooling: groups closed wholly inside the step, across the ring and the step, and unused items."""
    from types import SimpleNamespace

    for ratio, dtype in ((4, torch.float32), (2, torch.bfloat16), (4, torch.bfloat16)):
        g = torch.Generator().manual_seed(600 + ratio)
        rows, L, cap, head_dim = 3, 6, 8, 20
        prev, count = [3, 9, 0], [5, 2, 6]
        work = [(b, grp) for b in range(rows) for grp in range(prev[b] // ratio, (prev[b] + count[b]) // ratio)]
        work += [(-1, -1)] * 2
        meta = SimpleNamespace(prev_len=torch.tensor(prev, dtype=torch.int32),
                               count=torch.tensor(count, dtype=torch.int32), query_len=L,
                               derived=lambda key, make: make())
        args = (torch.tensor(work, dtype=torch.int32), ratio, torch.randn((rows + 1) * cap, head_dim, generator=g),
                torch.randint(0, 99, ((rows + 1) * cap, 3), generator=g), cap,
                torch.randn(rows * L, head_dim, generator=g).to(dtype),
                torch.randint(0, 99, (rows * L, 3), generator=g))
        want = qsa.pool_groups(meta, *args)
        have = qsa_triton.pool_groups_triton(args[0], meta.prev_len, meta.count, L, *args[1:])
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        try:
            assert have[0].dtype == want[0].dtype and torch.equal(have[1][:-2], want[1][:-2])
            torch.testing.assert_close(have[0][:-2].float(), want[0][:-2].float(), atol=tol, rtol=tol)
        except AssertionError as err:
            return f"pool groups (ratio {ratio}, {dtype}): {err}"
    return None


def _selection_ties_case(qsa_triton) -> str | None:
    """The Triton path's tie rule: among equal scores at the cut the lower group index is kept (where the torch
    path keeps torch.topk's), with the scores from the kernel and ranked by torch's packed top-k or by the
    ``qsa_topk`` kernel, in one chunk or one token per chunk."""
    from hf_qsa_cache.ops import top_set_triton

    launches = _launches(qsa_triton, "_index_scores_kernel")
    count_launches(top_set_triton, "_top_set_kernel", launches)
    args, scores = _tied_selection_case()
    ratio, topk = args[5], args[6]
    torch_path = _selected_groups(qsa.score_and_select(*args), ratio, topk)
    qsa.use_triton = lambda *x: True  # the CUDA dispatch, on CPU tensors
    for fused in (False, True):
        top_set._fuses_top_set = lambda s, k, fused=fused: fused
        for budget in (1 << 26, 3):
            qsa._CHUNK_ELEMENTS = budget
            launches.clear()
            groups = _selected_groups(qsa.score_and_select(*args), ratio, topk)
            label = f"qsa_topk={fused}, chunk budget {budget}"
            if len(launches) < 1 + fused:
                return f"{label}: launches {launches}"
            # Row 0, position 20 (10 visible groups): 7 first, then the tied 0/1/4/6 keep the lowest (0, 1).
            if groups[0] != [0, 1, 7] or groups[1] != [0, 1, 7]:
                return f"{label}: {groups}"
            if groups[2:] != torch_path[2:] or torch_path[0] == groups[0]:
                return f"{label}: Triton {groups}, torch {torch_path}: only the tie may differ"
    return None


def _tile_maxima_case(qsa_triton, i: int) -> str | None:
    """`index_scores_triton` writing tile maxima (and the scores with groups as the dot's rows) against the
    torch reference: partial last tiles, tiles past every token's visible count, token tiles across rows,
    several programs along the groups, key tiles of 16 and 64 groups."""
    forced = [  # (block_m, mixed_rows, group_splits, block_g, tile, groups_major)
        (4, False, None, 64, 16, False), (8, False, 1, 16, 4, True), (4, True, 2, 16, 2, False),
        (1, True, 3, 16, 8, True), (4, False, 2, 16, 1, True), (1, True, None, 64, 1, True)]
    num_heads, head_dim, ratio, dtype = SCORE_SHAPES[i]
    for block_m, mixed_rows, splits, block_g, tile, groups_major in forced:
        case = tiled_scores_case(700 + i, num_heads, head_dim, ratio, dtype, mixed_rows)
        want = qsa.index_tile_maxima_torch(*case, tile)
        default_block_g, qsa_triton.SCORES_BLOCK_G = qsa_triton.SCORES_BLOCK_G, block_g
        try:
            have = qsa_triton.index_scores_triton(*case, tile=tile, block_m=block_m, group_splits=splits,
                                                  groups_major=groups_major)
        finally:
            qsa_triton.SCORES_BLOCK_G = default_block_g
        label = (f"tile maxima case {i} {(num_heads, head_dim, ratio, dtype)} block_m={block_m} "
                 f"mixed={mixed_rows} splits={splits} block_g={block_g} tile={tile} groups_major={groups_major}")
        if error := _compare_scores(label, have, want, dtype):
            return error
    return None


def _compare_scores(label: str, have: torch.Tensor, want: torch.Tensor, dtype) -> str | None:
    """Kernel scores against the torch ones: same shape, -inf where they have it, close elsewhere."""
    if have.shape != want.shape or not torch.equal(torch.isinf(want), torch.isinf(have)):
        return f"{label}: shape {tuple(have.shape)} or the -inf pattern differs"
    tol = 1e-5 if dtype == torch.float32 else 1e-4
    try:
        torch.testing.assert_close(have, want, atol=tol, rtol=tol)
    except AssertionError as err:
        return f"{label}: {err}"
    return None


def _candidate_case(qsa_triton, i: int) -> str | None:
    """`candidate_scores_triton` against `candidate_scores_torch`: candidates at and past a token's visible
    count, past the table (its last column is used), negative ones; one program per token or several."""
    num_heads, head_dim, ratio, dtype = SCORE_SHAPES[i]
    case = scores_case(800 + i, num_heads, head_dim, ratio, dtype)
    q_index, compressed, table, token_row, visible, rows_per_block, max_groups = case
    g = torch.Generator().manual_seed(850 + i)
    candidates = torch.randint(-1, max_groups + 4, (q_index.shape[0], 150), generator=g)
    args = (q_index, compressed, table, token_row, visible, rows_per_block, candidates)
    want = qsa.candidate_scores_torch(*args)
    for per_program in (None, 64, 100):
        have = qsa_triton.candidate_scores_triton(*args, per_program=per_program)
        label = f"candidate case {i} {(num_heads, head_dim, ratio, dtype)} per_program={per_program}"
        if error := _compare_scores(label, have, want, dtype):
            return error
    return None


def _selection_by_tiles_case(qsa_triton, i: int) -> str | None:
    """`score_and_select` forced onto the tile-maxima selection (tiles of 2 groups, from any group count,
    chunks of a few tokens) gives exactly the kernels' selection of all scores: it must launch the candidate
    kernel."""
    launches: list = []
    count_launches(qsa_triton, "_candidate_scores_kernel", launches)
    qsa.SELECT_BY_TILES_MIN_GROUPS, top_set.TOPK_TILE, qsa._CHUNK_ELEMENTS = 0, 2, 40  # this child only
    num_heads, head_dim, ratio, dtype = SCORE_SHAPES[i]
    seed = 900 + 50 * i
    while (error := _check_selection(seed, num_heads, head_dim, ratio, dtype, topk=3)) == "near-tie" \
            and seed < 920 + 50 * i:
        seed += 1
    if error:
        return f"by tiles: {error}"
    if len(launches) < 2:  # one per chunk of a few tokens
        return f"by tiles case {i}: {len(launches)} candidate launches, the tile path was not taken"
    return None


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
