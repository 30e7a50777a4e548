"""Triton version of `hf_qsa_cache.ops.top_set.top_group_set`: the ``k`` best of each row of float32 scores, as a
set (ascending index), the lower index first among equal scores. One program per row, no sort.

torch's ``topk`` of a few hundred out of a few thousand groups sorts the whole row (a radix sort and a
gather). What the selection needs is only the set:

1. Each score becomes an int32 key whose signed order is the float order (a -0.0 made 0.0 first).
2. A bisection over the 2**32 key values finds the ``k``-th largest key ``T``: the largest value with at
   least ``k`` keys at or above it (32 rounds of counting).
3. Every key above ``T`` is kept, and of the keys equal to ``T`` the ``k - count(> T)`` of lowest index (a
   running count along the row); each kept index is written at its rank along the row.

A row that fits one block (up to `MAX_BLOCK` scores) is loaded once and held in registers; a longer one is
read in chunks of ``BLOCK`` at every round (tests force small blocks). A 16-way search (8 rounds, each counting 16
values in one pass) was slower than this bisection (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, pdl, pdl_begin

MAX_BLOCK = 8192  # scores a program holds at once (32 registers a thread at 8 warps); longer rows: chunks
# A row takes the power of two at or above its length, at least SMALL_BLOCK: every context of up to 4096 tokens
# (1024 groups of 4) shares one compiled variant, four cover every row up to MAX_BLOCK (ten without the floor, each
# compiled while the loop served the first time a context crossed it). On an H100 (64 rows, k = 64) the floor costs
# ~2 us at 64 groups (10.6 against 8.6); one 8192 block for all rows past 1024 cost 24.6 us against 13.9 at 1100.
SMALL_BLOCK = 1024


@triton.jit
def _keys(base, start, num_groups, BLOCK: tl.constexpr):
    """(int32 keys ordered as the float scores, in-row mask) of the chunk at ``start``."""
    g = start + tl.arange(0, BLOCK)
    valid = g < num_groups
    s = tl.load(base + g, mask=valid, other=0.0) + 0.0  # -0.0 + 0.0 = 0.0: ties with 0.0
    bits = s.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their 31 low bits.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF), valid


@triton.jit
def _narrow(lo, hi, mid, count, k):
    """One bisection round: keep ``count(key >= lo) >= k > count(key >= hi)``."""
    enough = count >= k
    return tl.where(enough, mid, lo), tl.where(enough, hi, mid)


@triton.jit
def _counted_keys(base, start, num_groups, BLOCK: tl.constexpr):
    """The chunk's keys with lanes past the row set to -2**31, which no bisection midpoint reaches (every midpoint
    is above ``lo``'s start), so a round counts with one 32-bit compare a lane."""
    key, valid = _keys(base, start, num_groups, BLOCK)
    return tl.where(valid, key, -2147483648)


@triton.jit
def _kth_key_bisect(base, num_groups, k, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """The ``k``-th largest key of the row by bisection over the 2**32 key values (32 rounds of counting). The
    bounds are int64 (``hi`` starts at 2**31); a midpoint lies in [lo, hi), so it fits in int32."""
    lo = tl.zeros([], tl.int64) - 2147483648  # every key is >= lo: count = num_groups >= k
    hi = tl.zeros([], tl.int64) + 2147483648  # no key is >= hi
    if ONE_CHUNK:
        key = _counted_keys(base, 0, num_groups, BLOCK)
        for _ in range(32):
            mid = (lo + hi) >> 1
            count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            lo, hi = _narrow(lo, hi, mid, count, k)
    else:
        for _ in range(32):
            mid = (lo + hi) >> 1
            count = tl.zeros([], tl.int32)
            for start in range(0, num_groups, BLOCK):
                key = _counted_keys(base, start, num_groups, BLOCK)
                count += tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            lo, hi = _narrow(lo, hi, mid, count, k)
    return lo.to(tl.int32)


@triton.jit(do_not_specialize=["num_groups", "k", "stride_row"])
def _top_set_kernel(scores_ptr, out_ptr, num_groups, k, stride_row, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_row
    kth = _kth_key_bisect(base, num_groups, k, BLOCK, ONE_CHUNK)
    # How many of the keys equal to kth to keep: k less those above it.
    above = tl.zeros([], tl.int32)
    for start in range(0, num_groups, BLOCK):
        key, valid = _keys(base, start, num_groups, BLOCK)
        above += tl.sum((valid & (key > kth)).to(tl.int32), axis=0)
    ties_wanted = k - above
    ties_seen = tl.zeros([], tl.int32)
    written = tl.zeros([], tl.int32)
    for start in range(0, num_groups, BLOCK):
        key, valid = _keys(base, start, num_groups, BLOCK)
        tie = (valid & (key == kth)).to(tl.int32)
        keep = (valid & (key > kth)) | ((tie != 0) & (ties_seen + tl.cumsum(tie, axis=0) <= ties_wanted))
        rank = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        g = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * k + rank, g.to(tl.int64), mask=keep & (rank < k))  # (never past the row)
        ties_seen += tl.sum(tie, axis=0)
        written += tl.sum(keep.to(tl.int32), axis=0)


@on_device_of_first_tensor
def top_set_triton(scores: torch.Tensor, k: int, block: int | None = None) -> torch.Tensor:
    """`top_set.top_group_set` of ``scores [N, G]`` (float32, ``1 <= k <= G``) in one launch; ``block``: scores a
    program holds at once (default: the row's power of two, from `SMALL_BLOCK` to `MAX_BLOCK`; tests force it
    small)."""
    n, groups = scores.shape
    if not 0 < k <= groups:
        raise ValueError(f"top_set_triton needs 1 <= k <= {groups} groups; got k={k}")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n:
        block = block or min(MAX_BLOCK, max(SMALL_BLOCK, triton.next_power_of_2(groups)))
        _top_set_kernel[(n,)](scores, out, groups, k, scores.stride(0), BLOCK=block, ONE_CHUNK=groups <= block,
                              num_warps=8 if block >= 2048 else 4, **pdl(scores))
    return out
