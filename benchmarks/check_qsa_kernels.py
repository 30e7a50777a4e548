"""GPU check of the QSA Triton kernels against the torch reference, at real shapes, with timings.

    python benchmarks/check_qsa_kernels.py

Sparse attention: H=16 query heads over 2 KV heads, head_dim 256, W=2051 selected positions.
Index scores: 32 index heads x 128, up to 4096 compressed groups per row. One line per case
(max error, torch and Triton times from triton.testing.do_bench), then PASS or FAIL.
"""

from __future__ import annotations

import math
import sys

import torch
import triton.testing

from hf_qsa_cache.ops import qsa, qsa_triton

qsa.USE_TRITON = False  # the module functions below must run the torch reference

BLOCK_SIZE = 64
RATIO = 4
GROUPS = 4096
SEQ_LEN = GROUPS * RATIO
NUM_ROWS = 8


def _table(g: torch.Generator, device) -> tuple[torch.Tensor, int]:
    """Shuffled distinct physical blocks per row (block 0 is the null block)."""
    columns = SEQ_LEN // BLOCK_SIZE
    num_blocks = NUM_ROWS * columns + 1
    ids = torch.randperm(num_blocks - 1, generator=g)[: NUM_ROWS * columns] + 1
    return ids.view(NUM_ROWS, columns).to(torch.int32).to(device), num_blocks


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3  # microseconds


def check_attention(n: int, dtype, g: torch.Generator, device) -> bool:
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
    args = (query, keys, values, table, token_row, positions, BLOCK_SIZE, 1.0 / math.sqrt(head_dim))
    want = qsa.sparse_paged_attention(*args)
    have = qsa_triton.sparse_paged_attention_triton(*args)
    err = (have.float() - want.float()).abs().max().item()
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = err <= atol and have.dtype == want.dtype and (n == 1 or bool((have[1] == 0).all()))
    t_ref = _bench(lambda: qsa.sparse_paged_attention(*args))
    t_tri = _bench(lambda: qsa_triton.sparse_paged_attention_triton(*args))
    print(f"attention N={n:5d} {str(dtype):14s} max_err={err:.2e} torch={t_ref:9.1f}us "
          f"triton={t_tri:9.1f}us speedup={t_ref / t_tri:6.2f}x {'ok' if ok else 'MISMATCH'}")
    return ok


def check_scores(n: int, dtype, g: torch.Generator, device) -> bool:
    heads, head_dim, topk = 32, 128, 512
    rows_per_block = BLOCK_SIZE // RATIO
    table, num_blocks = _table(g, device)
    q_index = torch.randn(n, heads, head_dim, generator=g).to(device, dtype)
    compressed = torch.randn(num_blocks, rows_per_block, head_dim, generator=g).to(device, dtype)
    token_row = (torch.arange(n) % NUM_ROWS).to(torch.int32).to(device)
    visible = torch.randint(0, GROUPS + 1, (n,), generator=g, dtype=torch.int32)
    visible[0] = GROUPS
    visible = visible.to(device)
    args = (q_index, compressed, table, token_row, visible, rows_per_block, GROUPS)
    want = qsa.index_scores_torch(*args)
    have = qsa_triton.index_scores_triton(*args)
    finite = torch.isfinite(want)
    same_inf = torch.equal(finite, torch.isfinite(have))
    err = (have[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    # Selection: the top-k sets may only differ where the k-th and (k+1)-th scores nearly tie.
    k = min(topk, GROUPS)
    top_want = want.sort(dim=-1, descending=True, stable=True)
    top_have = have.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    differs = (top_want.indices[:, :k].sort(-1).values != top_have.sort(-1).values).any(-1)
    boundary = (top_want.values[:, k - 1] - top_want.values[:, k]).abs() if GROUPS > k else None
    near_tie = boundary < 1e-4 * scale if boundary is not None else torch.zeros_like(differs)
    bad_selection = int((differs & ~near_tie).sum())
    ok = same_inf and err <= 1e-5 * scale + 1e-4 and bad_selection == 0
    t_ref = _bench(lambda: qsa.index_scores_torch(*args))
    t_tri = _bench(lambda: qsa_triton.index_scores_triton(*args))
    print(f"scores    N={n:5d} {str(dtype):14s} max_err={err:.2e} (|s|<={scale:.1f}) "
          f"selections differ={int(differs.sum())} (near-ties {int((differs & near_tie).sum())}) "
          f"torch={t_ref:9.1f}us triton={t_tri:9.1f}us speedup={t_ref / t_tri:6.2f}x {'ok' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    ok = True
    for n in (1, 8, 4096):
        ok &= check_attention(n, torch.bfloat16, g, device)
    ok &= check_attention(8, torch.float32, g, device)
    for n in (1, 8, 4096):
        ok &= check_scores(n, torch.bfloat16, g, device)
    ok &= check_scores(8, torch.float32, g, device)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
