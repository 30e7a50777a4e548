"""GPU check of the QSA Triton kernels against the torch reference, at real shapes, with timings.

    python benchmarks/check_qsa_kernels.py [--attention-sweep | --decode-sweep]

Sparse attention: H=16 query heads over 2 KV heads, head_dim 256, W=2051 selected positions; decode
(N=1, N=8) runs the default launch policy (split width), timed against one split per program too.
Index scores: 32 index heads x 128; tokens of 8 rows over up to 4096 compressed groups, a prefill
chunk of 4096 tokens of one row over 4096 and 32768 groups (token tiles; timed against one token per
program too), and one decode token over 262144 groups (a 1M-token context). Then the top-k paths, a
launch sweep of the prefill index scores, the whole selection of a prefill chunk (scores written then
ranked, against tile maxima with the best tiles rescored) from decode to a 1M-token context, and a launch
sweep of the prefill sparse attention (alone with ``--attention-sweep``). One line per case (max error,
torch and Triton times from triton.testing.do_bench), then PASS or FAIL. The same comparisons, untimed, are the
tests of tests/gpu/test_gpu_qsa_kernels.py (the case lists below). ``--decode-sweep``: the decode sparse
attention (1 and 8 tokens) at positions per tile x split counts x warps x pipelining stages, graph-timed as in a
decode step."""

from __future__ import annotations

import math
import sys

import torch
import triton.testing

from hf_qsa_cache.ops import qsa, qsa_triton, top_set

BLOCK_SIZE = 64
RATIO = 4
GROUPS = 4096
SEQ_LEN = GROUPS * RATIO
NUM_ROWS = 8

# Sparse attention: (tokens, dtype).
ATTENTION_CASES = [(1, torch.bfloat16), (8, torch.bfloat16), (4096, torch.bfloat16), (8, torch.float32)]
# Index scores: (tokens, dtype, groups, one row). Tokens of 8 rows; prefill chunks of one row (token tiles share key
# loads), decode in a 1M-token context, and the real long-context selection chunk: 512 tokens of one row over
# 262144 groups (1M tokens).
SCORES_CASES = [(1, torch.bfloat16, GROUPS, False), (8, torch.bfloat16, GROUPS, False),
                (4096, torch.bfloat16, GROUPS, False), (8, torch.float32, GROUPS, False),
                (4096, torch.bfloat16, 4096, True), (4096, torch.bfloat16, 32768, True),
                (1, torch.bfloat16, 262144, True), (512, torch.bfloat16, 262144, True)]
# The top-k paths: (tokens, groups).
TOP_GROUPS_CASES = [(4096, 32768), (512, 262144)]
# Scores written then ranked, against tile maxima and the best tiles' groups scored again: (tokens, groups) of
# decode and prefill chunks at 64k, 128k, 256k and 1M tokens of context.
SELECTION_CASES = [(1, 32768), (1, 262144), (4096, 16384), (4096, 32768), (2048, 65536), (2048, 262144)]
# Ties at the top-k cut. torch.topk on CUDA, called as transformers' indexer calls it (one query's visible scores,
# one 1-D tensor): (scores, k) over these widths and picks, on rows of relu zeros.
TOPK_TIE_WIDTHS = [2, 5, 17, 100, 1000, 4096, 32768, 99999, 100000, 262144, 1 << 20]
TOPK_TIE_PICKS = [1, 8, 64, 512, 2048]
# Whole selections of a step, Triton path against torch path (`check_selection_ties`): index heads (32: no exact
# ties; 1: about half the scores are exact relu zeros), and steps of (prior tokens per row, tokens per row, k).
SELECTION_TIE_HEADS = [32, 1]
SELECTION_TIE_STEPS = [([20, 37, 60, 5], [16, 16, 9, 16], 8), ([3000, 4100], [8, 8], 512)]


def _table(g: torch.Generator, device, num_rows: int = NUM_ROWS, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, int]:
    """Shuffled distinct physical blocks per row (block 0 is the null block)."""
    columns = seq_len // BLOCK_SIZE
    num_blocks = num_rows * columns + 1
    ids = torch.randperm(num_blocks - 1, generator=g)[: num_rows * columns] + 1
    return ids.view(num_rows, columns).to(torch.int32).to(device), num_blocks


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3  # microseconds


def _attention_args(n: int, dtype, g: torch.Generator, device) -> tuple:
    """Sparse attention inputs: ``n`` tokens over 8 rows of ``SEQ_LEN`` positions, 2051 random positions each
    (5% holes; token 1 a pad)."""
    heads, num_kv, head_dim, width = 16, 2, 256, 2051
    table, num_blocks = _table(g, device)
    keys = torch.randn(num_blocks, BLOCK_SIZE, num_kv, head_dim, generator=g).to(device, dtype)
    values = torch.randn(num_blocks, BLOCK_SIZE, num_kv, head_dim, generator=g).to(device, dtype)
    query = torch.randn(n, heads, head_dim, generator=g).to(device, dtype)
    token_row = (torch.arange(n) % NUM_ROWS).to(torch.int32).to(device)
    positions = torch.randint(0, SEQ_LEN, (n, width), generator=g)
    positions[torch.rand(n, width, generator=g) < 0.05] = -1
    if n > 1:
        positions[1] = -1  # a pad
    positions = positions.to(device)
    return query, keys, values, table, token_row, positions, BLOCK_SIZE, 1.0 / math.sqrt(head_dim)


def check_attention(n: int, dtype, g: torch.Generator, device, timed: bool = True) -> bool:
    args = _attention_args(n, dtype, g, device)
    num_kv, width = args[1].shape[2], args[5].shape[1]
    want = qsa.sparse_paged_attention_torch(*args)
    have = qsa_triton.sparse_paged_attention_triton(*args)
    err = (have.float() - want.float()).abs().max().item()
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = err <= atol and have.dtype == want.dtype and (n == 1 or bool((have[1] == 0).all()))
    splits = qsa_triton.attention_splits(n, num_kv, width)[0]
    extra = ""
    if splits > 1:  # the default policy split the width: check and time one split per program too
        single = qsa_triton.sparse_paged_attention_triton(*args, num_splits=1)
        err = max(err, (single.float() - want.float()).abs().max().item())
        ok = ok and err <= atol
        if timed:
            t_one = _bench(lambda: qsa_triton.sparse_paged_attention_triton(*args, num_splits=1))
            extra = f" (1 split: {t_one:9.1f}us)"
    if timed:
        t_ref = _bench(lambda: qsa.sparse_paged_attention_torch(*args))
        t_tri = _bench(lambda: qsa_triton.sparse_paged_attention_triton(*args))
        extra = f" torch={t_ref:9.1f}us triton={t_tri:9.1f}us{extra} speedup={t_ref / t_tri:6.2f}x"
    print(f"attention N={n:5d} {dtype!s:14s} splits={splits:2d} max_err={err:.2e} (bound {atol:.0e}){extra} "
          f"{'ok' if ok else 'MISMATCH'}")
    return ok


def check_scores(n: int, dtype, g: torch.Generator, device, groups: int = GROUPS, one_row: bool = False,
                 timed: bool = True) -> bool:
    """Tokens of ``NUM_ROWS`` rows with random visible counts, or (``one_row``) the last ``n`` tokens
    of one row of ``groups * RATIO`` positions (a prefill chunk, or decode when n is 1)."""
    heads, head_dim, topk = 32, 128, 512
    rows_per_block = BLOCK_SIZE // RATIO
    table, num_blocks = _table(g, device, 1 if one_row else NUM_ROWS, groups * RATIO)
    q_index = torch.randn(n, heads, head_dim, generator=g).to(device, dtype)
    compressed = torch.randn(num_blocks, rows_per_block, head_dim, generator=g).to(device, dtype)
    if one_row:
        token_row = torch.zeros(n, dtype=torch.int32)
        position = groups * RATIO - n + torch.arange(n)
        visible = ((position + 1) // RATIO).to(torch.int32)  # the closed groups before each token
    else:
        token_row = (torch.arange(n) % NUM_ROWS).to(torch.int32)
        visible = torch.randint(0, groups + 1, (n,), generator=g, dtype=torch.int32)
        visible[0] = groups
    token_row, visible = token_row.to(device), visible.to(device)
    args = (q_index, compressed, table, token_row, visible, rows_per_block, groups)
    want = qsa.index_scores_torch(*args)
    have = qsa_triton.index_scores_triton(*args)
    finite = torch.isfinite(want)
    same_inf = torch.equal(finite, torch.isfinite(have))
    err = (have[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    # Selection: the top-k sets may only differ where the k-th and (k+1)-th scores nearly tie.
    k = min(topk, groups)
    top_want = want.sort(dim=-1, descending=True, stable=True)
    top_have = have.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    differs = (top_want.indices[:, :k].sort(-1).values != top_have.sort(-1).values).any(-1)
    boundary = (top_want.values[:, k - 1] - top_want.values[:, k]).abs() if groups > k else None
    near_tie = boundary < 1e-4 * scale if boundary is not None else torch.zeros_like(differs)
    bad_selection = int((differs & ~near_tie).sum())
    del top_want, top_have
    ok = same_inf and err <= 1e-5 * scale + 1e-4 and bad_selection == 0
    block_m = qsa_triton.scores_block_m(n)
    extra = ""
    if block_m > 1:  # token tiles: check and time one token per program too
        single = qsa_triton.index_scores_triton(*args, block_m=1)
        ok = ok and torch.equal(finite, torch.isfinite(single))
        ok = ok and (single[finite] - want[finite]).abs().max().item() <= 1e-5 * scale + 1e-4
        del single
        if timed:
            t_one = _bench(lambda: qsa_triton.index_scores_triton(*args, block_m=1))
            extra = f" (block_m=1: {t_one:9.1f}us)"
    del want, have
    if n == 1 and timed:  # decode: time the other orientation too
        t_other = _bench(lambda: qsa_triton.index_scores_triton(
            *args, groups_major=not qsa_triton.SCORES_GROUPS_MAJOR))
        extra = f" (groups_major={not qsa_triton.SCORES_GROUPS_MAJOR}: {t_other:9.1f}us)"
    if timed:
        t_ref = _bench(lambda: qsa.index_scores_torch(*args))
        t_tri = _bench(lambda: qsa_triton.index_scores_triton(*args))
        extra = f" torch={t_ref:9.1f}us triton={t_tri:9.1f}us{extra} speedup={t_ref / t_tri:6.2f}x"
    print(f"scores    N={n:5d} G={groups:6d} {'1 row ' if one_row else f'{NUM_ROWS} rows'} {dtype!s:14s} "
          f"block_m={block_m} max_err={err:.2e} (|s|<={scale:.1f}) "
          f"selections differ={int(differs.sum())} (near-ties {int((differs & near_tie).sum())}){extra} "
          f"{'ok' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    if "--attention-sweep" in sys.argv[1:]:  # only the prefill attention's launch sweep
        ok = sweep_attention(4096, g, device)
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    if "--decode-sweep" in sys.argv[1:]:  # only the decode attention's launch sweep
        ok = all([sweep_decode_attention(n, g, device) for n in (1, 8)])
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    ok = True
    for n, dtype in ATTENTION_CASES:
        ok &= check_attention(n, dtype, g, device)
    for n, dtype, groups, one_row in SCORES_CASES:
        ok &= check_scores(n, dtype, g, device, groups=groups, one_row=one_row)
    for n, groups in TOP_GROUPS_CASES:
        ok &= check_top_groups(n, groups, g, device)
    for n, groups in TOP_GROUPS_CASES:
        ok &= sweep_scores(n, groups, g, device)
    for n, groups in SELECTION_CASES:
        ok &= check_selection(n, groups, g, device)
    ok &= check_topk_tie_rule(g, device)[1] == 0
    for heads in SELECTION_TIE_HEADS:
        ok &= check_selection_ties(heads, g, device)["ok"]
    ok &= sweep_attention(4096, g, device)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def check_top_groups(n: int, groups: int, g: torch.Generator, device, k: int = 512, timed: bool = True) -> bool:
    """The three top-k paths of the selection on prefill-like scores (relu-zero ties, a causal -inf
    tail per token): same groups, and their times."""
    scores = torch.randn(n, groups, generator=g).relu_().to(device)
    visible = groups - n // 4 + torch.arange(n, device=device) // 4
    scores.masked_fill_(torch.arange(groups, device=device)[None, :] >= visible[:, None], float("-inf"))
    want = top_set.top_groups_packed(scores, k)
    ok = True
    times = []
    for name in ("top_groups_packed", "top_groups_by_value", "top_groups_two_level"):
        fn = getattr(top_set, name)
        same = torch.equal(fn(scores, k), want)
        ok &= same
        t = f"={_bench(lambda: fn(scores, k)):8.1f}us" if timed else ""
        times.append(f"{name.removeprefix('top_groups_')}{t}{'' if same else ' MISMATCH'}")
    print(f"top-k     N={n:5d} G={groups:6d} k={k} " + " ".join(times) + f" {'ok' if ok else 'MISMATCH'}")
    return ok


def sweep_scores(n: int, groups: int, g: torch.Generator, device) -> bool:
    """Prefill index scores of one row under other launch settings (dot orientation, tokens per program,
    groups per key tile, warps, pipeline stages): time, TFLOP/s and agreement with the default settings."""
    heads, head_dim = 32, 128
    rows_per_block = BLOCK_SIZE // RATIO
    table, num_blocks = _table(g, device, 1, groups * RATIO)
    q_index = torch.randn(n, heads, head_dim, generator=g).to(device, torch.bfloat16)
    compressed = torch.randn(num_blocks, rows_per_block, head_dim, generator=g).to(device, torch.bfloat16)
    position = groups * RATIO - n + torch.arange(n)
    visible = ((position + 1) // RATIO).to(torch.int32).to(device)
    token_row = torch.zeros(n, dtype=torch.int32, device=device)
    args = (q_index, compressed, table, token_row, visible, rows_per_block, groups)
    want = qsa_triton.index_scores_triton(*args)
    finite = torch.isfinite(want)
    flops = 2.0 * heads * head_dim * float(visible.long().sum())
    defaults = (qsa_triton.SCORES_BLOCK_G, qsa_triton.SCORES_NUM_WARPS, qsa_triton.SCORES_NUM_STAGES)
    # The other orientation's best setting, then groups-major (up to 256 dot columns: 8 tokens x 32 heads).
    settings = [(False, 8, 64, 4, 3), (False, 8, 64, 8, 3)]
    settings += [(True, block_m, block_g, warps, stages) for block_m in (4, 8) for block_g in (64, 128)
                 for warps in (4, 8) for stages in (2, 3)]
    ok = True
    results = []
    for groups_major, block_m, block_g, warps, stages in settings:
        qsa_triton.SCORES_BLOCK_G, qsa_triton.SCORES_NUM_WARPS, qsa_triton.SCORES_NUM_STAGES = block_g, warps, stages
        launch = dict(block_m=block_m, groups_major=groups_major)
        try:
            have = qsa_triton.index_scores_triton(*args, **launch)
            same = torch.equal(finite, torch.isfinite(have)) and bool(
                torch.allclose(have[finite], want[finite], rtol=1e-5, atol=1e-4))
            del have
            t = _bench(lambda: qsa_triton.index_scores_triton(*args, **launch))
            results.append((t, groups_major, block_m, block_g, warps, stages, same))
            ok &= same
        except Exception as error:  # out of resources for a setting: report and go on
            print(f"  sweep groups_major={groups_major} block_m={block_m} block_g={block_g} warps={warps} "
                  f"stages={stages}: {type(error).__name__}")
    qsa_triton.SCORES_BLOCK_G, qsa_triton.SCORES_NUM_WARPS, qsa_triton.SCORES_NUM_STAGES = defaults
    print(f"scores sweep N={n} G={groups} (1 row, bf16; default groups_major={qsa_triton.SCORES_GROUPS_MAJOR} "
          f"block_m={qsa_triton.scores_block_m(n)} block_g={defaults[0]} warps={defaults[1]} stages={defaults[2]}):")
    for t, groups_major, block_m, block_g, warps, stages, same in sorted(results)[:10]:
        print(f"  {t:9.1f}us {flops / t / 1e6:6.1f} TFLOP/s groups_major={groups_major} block_m={block_m} "
              f"block_g={block_g} warps={warps} stages={stages} {'ok' if same else 'MISMATCH'}")
    return ok


def sweep_attention(n: int, g: torch.Generator, device) -> bool:
    """Prefill sparse attention (bf16, one split) under other launch settings (positions per tile, warps,
    pipeline stages): time, the bytes of K/V it gathers per second, and agreement with the defaults."""
    args = _attention_args(n, torch.bfloat16, g, device)
    query, keys, positions = args[0], args[1], args[5]
    want = qsa_triton.sparse_paged_attention_triton(*args)
    gathered = float((positions >= 0).sum()) * keys.shape[2] * keys.shape[3] * keys.element_size() * 2
    defaults = qsa_triton.ATTENTION_BLOCK_W, qsa_triton.ATTENTION_NUM_WARPS, qsa_triton.ATTENTION_NUM_STAGES
    results = []
    ok = True
    for block_w in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3, 4):
                qsa_triton.ATTENTION_BLOCK_W, qsa_triton.ATTENTION_NUM_WARPS, qsa_triton.ATTENTION_NUM_STAGES = (
                    block_w, warps, stages)
                try:
                    have = qsa_triton.sparse_paged_attention_triton(*args)
                    same = bool((have.float() - want.float()).abs().max() <= 2e-2)
                    t = _bench(lambda: qsa_triton.sparse_paged_attention_triton(*args))
                    results.append((t, block_w, warps, stages, same))
                    ok &= same
                except Exception as error:  # out of resources for a setting: report and go on
                    print(f"  sweep block_w={block_w} warps={warps} stages={stages}: {type(error).__name__}")
    qsa_triton.ATTENTION_BLOCK_W, qsa_triton.ATTENTION_NUM_WARPS, qsa_triton.ATTENTION_NUM_STAGES = defaults
    print(f"attention sweep N={n} (bf16, {query.shape[1]} heads over {keys.shape[2]} x {keys.shape[3]}, width "
          f"{positions.shape[1]}; default block_w={defaults[0]} warps={defaults[1]} stages={defaults[2]}):")
    for t, block_w, warps, stages, same in sorted(results)[:10]:
        print(f"  {t:9.1f}us {gathered / t / 1e6:6.2f} TB/s gathered block_w={block_w} warps={warps} "
              f"stages={stages} {'ok' if same else 'MISMATCH'}")
    return ok


def sweep_decode_attention(n: int, g: torch.Generator, device, calls: int = 16) -> bool:
    """Decode sparse attention (bf16, ``n`` tokens) at positions per tile x split counts x warps x pipelining
    stages: microseconds a call in a CUDA graph of ``calls`` calls, each over its own K/V stores (so that, as in a
    decode step, the gathered rows come from memory, not L2), beside the launch policy; every setting must agree
    with the policy's output. A one-token QSA layer's attention took 22.5 us in the graphed step (b769a18) for
    about 4 MB of K/V."""
    from sweep_experts_tiles import graph_us

    base = _attention_args(n, torch.bfloat16, g, device)
    sets = [(base[0], torch.randn_like(base[1]), torch.randn_like(base[2]), *base[3:]) for _ in range(calls)]
    num_kv, width = base[1].shape[2], base[5].shape[1]
    names = ("ATTENTION_DECODE_BLOCK_W", "ATTENTION_DECODE_NUM_WARPS", "ATTENTION_DECODE_NUM_STAGES")
    defaults = {name: getattr(qsa_triton, name) for name in names}
    policy = qsa_triton.attention_splits(n, num_kv, width)[0]
    want = qsa_triton.sparse_paged_attention_triton(*sets[0])

    def timed(splits):
        return graph_us([lambda a=a: qsa_triton.sparse_paged_attention_triton(*a, num_splits=splits) for a in sets])

    results = [(timed(None), f"policy: {policy} splits, tile {defaults['ATTENTION_DECODE_BLOCK_W']}, warps "
                             f"{defaults['ATTENTION_DECODE_NUM_WARPS']}, "
                             f"stages {defaults['ATTENTION_DECODE_NUM_STAGES']}", True)]
    ok = True
    try:
        for block_w in (16, 32, 64):
            qsa_triton.ATTENTION_DECODE_BLOCK_W = block_w
            tiles = -(-width // block_w)
            for splits in sorted({1, 8, 32, tiles}):
                for warps in (4, 8):
                    for stages in (1, 3):
                        qsa_triton.ATTENTION_DECODE_NUM_WARPS = warps
                        qsa_triton.ATTENTION_DECODE_NUM_STAGES = stages
                        label = f"tile {block_w}, {splits} splits, warps {warps}, stages {stages}"
                        try:
                            have = qsa_triton.sparse_paged_attention_triton(*sets[0], num_splits=splits)
                            same = bool((have.float() - want.float()).abs().max() <= 2e-2)
                            results.append((timed(splits), label, same))
                            ok &= same
                        except Exception as error:  # out of resources for a setting: report and go on
                            print(f"  decode sweep {label}: {type(error).__name__}")
    finally:
        for name, value in defaults.items():
            setattr(qsa_triton, name, value)
    print(f"decode attention sweep N={n} (bf16, width {width}, {calls} calls a graph on their own K/V):")
    for t, label, same in [results[0]] + sorted(results[1:])[:12]:
        print(f"  {t:8.2f}us {label} {'ok' if same else 'MISMATCH'}")
    return ok


def check_selection(n: int, groups: int, g: torch.Generator, device, k: int = 512, timed: bool = True) -> bool:
    """The whole selection of a prefill chunk (`score_and_select`: the last ``n`` tokens of one row of
    ``groups * RATIO`` positions), scores written then ranked, against tile maxima with the best tiles'
    groups scored again (tiles of 8, 16, 32 groups), each with both dot orientations. Selections must
    agree but for near-ties (groups whose scores are within 1e-5 of the row's k-th best)."""
    from hf_qsa_cache.metadata import QSAGeometry, build_step_metadata_torch

    heads, head_dim = 32, 128
    rows_per_block = BLOCK_SIZE // RATIO
    table, num_blocks = _table(g, device, 1, groups * RATIO)
    q_index = torch.randn(n, heads, head_dim, generator=g).to(device, torch.bfloat16)
    compressed = torch.randn(num_blocks, rows_per_block, head_dim, generator=g).to(device, torch.bfloat16)
    prev = torch.tensor([groups * RATIO - n], dtype=torch.int32, device=device)
    count = torch.tensor([n], dtype=torch.int32, device=device)
    meta = build_step_metadata_torch(prev, count, n, {"main": table}, {"main": BLOCK_SIZE},
                                     QSAGeometry(RATIO, RATIO), prev.tolist(), count.tolist())
    args = (q_index, compressed, meta, "main", BLOCK_SIZE, RATIO, k)
    saved = qsa.SELECT_BY_TILES_MIN_GROUPS, top_set.TOPK_TILE, qsa_triton.SCORES_GROUPS_MAJOR
    try:
        def run(by_tiles: bool, tile: int, groups_major: bool) -> torch.Tensor:
            qsa.SELECT_BY_TILES_MIN_GROUPS = 0 if by_tiles else 1 << 40
            top_set.TOPK_TILE, qsa_triton.SCORES_GROUPS_MAJOR = tile, groups_major
            return qsa.score_and_select(*args)

        want = run(False, 16, False)
        scores = qsa_triton.index_scores_triton(q_index, compressed, table, meta.token_row, meta.visible_blocks,
                                                rows_per_block, groups)
        kth = scores.topk(k, dim=-1).values[:, -1:]
        want_groups = (want[:, :k * RATIO:RATIO] // RATIO).sort(-1).values
        ok = True
        line = []
        for by_tiles, tile in ((False, 16), (True, 8), (True, 16), (True, 32)):
            if by_tiles and groups < 2 * k * tile:  # the tile path needs two tiles per pick
                continue
            for groups_major in (False, True):
                have = run(by_tiles, tile, groups_major)
                have_groups = (have[:, :k * RATIO:RATIO] // RATIO).sort(-1).values
                rows = (have_groups != want_groups).any(-1).nonzero().flatten().tolist()
                bad = 0
                for r in rows:  # a differing row is fine where every differing group nearly ties the k-th
                    a, b = set(have_groups[r].tolist()), set(want_groups[r].tolist())
                    diff = torch.tensor(sorted(a ^ b), device=device)
                    s = scores[r, diff]
                    bad += int(((s - kth[r]).abs() > 1e-5 * kth[r].abs() + 1e-6).any())
                ok &= bad == 0
                t = f"={_bench(lambda: run(by_tiles, tile, groups_major)):8.1f}us" if timed else ""
                name = f"tiles of {tile}" if by_tiles else "scores"
                line.append(f"{name}{' gm' if groups_major else ''}{t}"
                            f"{f' ({len(rows)} near-ties)' if rows else ''}{' MISMATCH' if bad else ''}")
        print(f"selection N={n:5d} G={groups:6d} k={k} " + " ".join(line) + f" {'ok' if ok else 'MISMATCH'}")
    finally:
        qsa.SELECT_BY_TILES_MIN_GROUPS, top_set.TOPK_TILE, qsa_triton.SCORES_GROUPS_MAJOR = saved
    return ok


def check_topk_tie_rule(g: torch.Generator, device) -> tuple[int, int]:
    """Which groups torch.topk on CUDA keeps among exact ties at the k-th value, called as transformers' indexer
    calls it (one 1-D tensor of a query's visible scores): (calls, calls whose set is not the lower index's) over
    `TOPK_TIE_WIDTHS` x `TOPK_TIE_PICKS`, on rows of relu zeros (half, 90% and all of the scores)."""
    calls = differing = 0
    for width in TOPK_TIE_WIDTHS:
        for k in (k for k in TOPK_TIE_PICKS if k < width):
            for zeros in (0.5, 0.9, 1.0):
                x = torch.randn(width, generator=g).relu_()
                x[torch.rand(width, generator=g) < zeros] = 0.0
                kept = x.to(device).topk(k).indices.sort().values.cpu()
                lower = x.sort(descending=True, stable=True).indices[:k].sort().values
                calls += 1
                if not torch.equal(kept, lower):
                    differing += 1
                    print(f"topk ties W={width} k={k} zeros={zeros}: CUDA keeps another set than the lower index")
    print(f"topk ties on CUDA: {calls} calls, {differing} keep another set than the lower index "
          f"{'ok' if differing == 0 else 'DIFFERS'}")
    return calls, differing


def _selection_step(g: torch.Generator, device, heads: int, prev: list[int], count: list[int], k: int) -> tuple:
    """`score_and_select`'s arguments for one step of ``len(prev)`` rows (fp32, index head_dim 128): row ``b``
    holds ``prev[b]`` tokens and adds ``count[b]`` (left-padded to the longest)."""
    from hf_qsa_cache.metadata import QSAGeometry, build_step_metadata_torch

    head_dim, query_len = 128, max(count)
    seq_len = -(-max(p + c for p, c in zip(prev, count)) // BLOCK_SIZE) * BLOCK_SIZE
    table, num_blocks = _table(g, device, len(prev), seq_len)
    prev_t = torch.tensor(prev, dtype=torch.int32, device=device)
    count_t = torch.tensor(count, dtype=torch.int32, device=device)
    meta = build_step_metadata_torch(prev_t, count_t, query_len, {"main": table}, {"main": BLOCK_SIZE},
                                     QSAGeometry(RATIO, RATIO), prev, count)
    q_index = torch.randn(len(prev) * query_len, heads, head_dim, generator=g).to(device)
    compressed = torch.randn(num_blocks, BLOCK_SIZE // RATIO, head_dim, generator=g).to(device)
    return q_index, compressed, meta, "main", BLOCK_SIZE, RATIO, k


def _torch_path_select(args: tuple) -> torch.Tensor:
    """`score_and_select` on the torch path on CUDA tensors: torch's scores, and torch.topk over each token's
    visible scores where the k-th score ties (what transformers' indexer runs on CUDA)."""
    saved = qsa.use_triton
    qsa.use_triton = lambda *tensors: False
    try:
        return qsa.score_and_select(*args)
    finally:
        qsa.use_triton = saved


def _selected_group_sets(selected: torch.Tensor, k: int) -> list[set[int]]:
    return [{g for g in row if g >= 0} for row in (selected[:, :k * RATIO:RATIO] // RATIO).tolist()]


def check_selection_ties(heads: int, g: torch.Generator, device, timed: bool = True) -> dict:
    """Whole selections of `SELECTION_TIE_STEPS` (fp32, ``heads`` index heads) on CUDA: the Triton path (its
    kernels' scores, the lower group index among equal scores) against the torch path (torch's scores, torch.topk
    over each token's visible scores: what transformers' indexer keeps on CUDA). Per token with more visible
    groups than ``k``: the torch path keeps torch.topk's set; the Triton path keeps the lower index's set of the
    torch scores unless the cut nearly ties (non-zero scores within 1e-5, whose order the two sums may swap);
    without an exact or near tie both keep the same set. Returns the counts and ``ok``."""
    stats = dict(tokens=0, exact_ties=0, topk_not_lower=0, triton_not_topk=0, near_ties=0, bad=0)
    times = []
    for prev, count, k in SELECTION_TIE_STEPS:
        args = _selection_step(g, device, heads, prev, count, k)
        q_index, compressed, meta = args[:3]
        scores = qsa.index_scores_torch(q_index, compressed, meta.block_tables["main"], meta.token_row,
                                        meta.visible_blocks, BLOCK_SIZE // RATIO, meta.max_seq_len // RATIO)
        triton_sets = _selected_group_sets(qsa.score_and_select(*args), k)
        torch_sets = _selected_group_sets(_torch_path_select(args), k)
        for token, width in enumerate(meta.visible_blocks.tolist()):
            if width <= k:  # every visible group kept, by both
                stats["bad"] += not (triton_sets[token] == torch_sets[token] == set(range(width)))
                continue
            row = scores[token, :width]
            values = row.sort(descending=True).values
            kth, after = float(values[k - 1]), float(values[k])
            exact = kth == after
            near = not exact and kth - after <= 1e-5 * abs(kth) + 1e-6
            by_topk = set(row.topk(k).indices.tolist())
            lower = set(row.sort(descending=True, stable=True).indices[:k].tolist())
            stats["tokens"] += 1
            stats["exact_ties"] += exact
            stats["near_ties"] += near
            stats["topk_not_lower"] += by_topk != lower
            stats["triton_not_topk"] += exact and triton_sets[token] != by_topk
            stats["bad"] += torch_sets[token] != by_topk
            stats["bad"] += not near and triton_sets[token] != lower
            stats["bad"] += not (exact or near) and triton_sets[token] != torch_sets[token]
        if timed:
            times.append(f"k={k}: triton={_bench(lambda: qsa.score_and_select(*args)):8.1f}us "
                         f"torch={_bench(lambda: _torch_path_select(args)):8.1f}us")
    stats["ok"] = stats["bad"] == 0 and stats["tokens"] > 0
    print(f"selection ties, {heads} index heads: " + " ".join(f"{k}={v}" for k, v in stats.items() if k != "ok")
          + (" " + " ".join(times) if times else "") + f" {'ok' if stats['ok'] else 'MISMATCH'}")
    return stats


if __name__ == "__main__":
    sys.exit(main())
