"""Triton version of `hf_qsa_cache.ops.qsa.top_group_set`: the ``k`` best of each row of float32 scores, as a
set (ascending index), the lower index first among equal scores. One program per row, no sort.

torch's ``topk`` of a few hundred out of a few thousand groups sorts the whole row (a radix sort and a
gather: 27.5 + 13.1 us a QSA layer of a 1 x 4096 decode step on an H200). What the selection needs is only
the set:

1. Each score becomes an int32 key whose signed order is the float order (a -0.0 made 0.0 first).
2. A bisection over the 2**32 key values finds the ``k``-th largest key ``T``: the largest value with at
   least ``k`` keys at or above it (32 rounds of counting).
3. Every key above ``T`` is kept, and of the keys equal to ``T`` the ``k - count(> T)`` of lowest index (a
   running count along the row); each kept index is written at its rank along the row.

A row that fits one block (up to `MAX_BLOCK` scores) is loaded once and held in registers; a longer one is
read in chunks of ``BLOCK`` at every round (tests force small blocks). On the H200 the bisection takes 11.2 us
a call at 1 x 4096 (1100 groups) and 30.0 us at 1 x 16384 (4400 groups, 47 us when 4096-score blocks made
that row two chunks; timed when a round compared int64 keys and masked each lane, untimed since it compares
int32 keys). A 16-way search (8 rounds, each counting 16 values in one pass) measured slower, 21.6 us at
1 x 4096 (`benchmarks/RESULTS.md`).

``search="radix"`` finds ``T`` in 4 rounds instead of 32: each round takes a 256-bin histogram of the next 8 bits
of the keys that still match the bits found so far (`tl.histogram`, one shared-memory count per key), and the
bin where the ``k``-th largest falls gives those 8 bits. Each round is one pass and a scan of 256 counts where a
bisection round is one pass and a block-wide sum: the 32 rounds' serial reductions are what a one-token call
waits on. Slower on the H200 with the defaults (a Qwen4Exp 8-layer step at 1 x 16384 1.31 against 1.20 ms): on
only with the ``qsa_topk_radix`` setting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fusions import fusion_enabled
from .triton_common import on_device_of_first_tensor, pdl, pdl_begin

MAX_BLOCK = 8192  # scores a program holds at once (32 registers a thread at 8 warps); longer rows: chunks
SEARCHES = ("bisect", "radix")
# How the k-th largest key is found by default: the bisection (measured), or with the ``qsa_topk_radix`` setting
# (off by default: slower on the H200, `hf_qsa_cache.fusions`) the radix search.
FUSED_RADIX_SEARCH = fusion_enabled("qsa_topk_radix")


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


@triton.jit
def _digit_counts(base, num_groups, prefix, shift, BLOCK: tl.constexpr):
    """256 counts: of the row's keys whose bits above ``shift + 8`` are ``prefix``'s (as unsigned values, the
    keys plus 2**31), how many have each value of bits ``shift .. shift + 7`` (one pass over the row per round:
    four rounds, so a row of one block is read again rather than held, unlike the bisection's 32)."""
    counts = tl.zeros([256], tl.int32)
    for start in range(0, num_groups, BLOCK):
        key, valid = _keys(base, start, num_groups, BLOCK)
        u = key.to(tl.int64) + 2147483648
        match = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
        counts += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
    return counts


@triton.jit
def _kth_key_radix(base, num_groups, k, BLOCK: tl.constexpr):
    """The ``k``-th largest key of the row, 8 bits a round from the top (4 rounds of a 256-bin histogram)."""
    prefix = tl.zeros([], tl.int64)  # the bits found so far, of the key plus 2**31
    rank = k  # the wanted key's rank among the keys that match ``prefix`` (1 = the largest)
    bins = tl.arange(0, 256)
    for shift in tl.static_range(24, -1, -8):
        counts = _digit_counts(base, num_groups, prefix, shift, BLOCK)
        at_or_above = tl.cumsum(counts, axis=0, reverse=True)  # matching keys with these bits >= each bin
        digit = tl.sum((at_or_above >= rank).to(tl.int32), axis=0) - 1  # the highest bin holding the rank-th
        rank -= tl.sum(tl.where(bins > digit, counts, 0), axis=0)
        prefix += digit.to(tl.int64) << shift
    return (prefix - 2147483648).to(tl.int32)


@triton.jit(do_not_specialize=["num_groups", "k", "stride_row"])
def _top_set_kernel(scores_ptr, out_ptr, num_groups, k, stride_row, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
                    RADIX: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_row
    if RADIX:
        kth = _kth_key_radix(base, num_groups, k, BLOCK)
    else:
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
def top_set_triton(scores: torch.Tensor, k: int, block: int | None = None, search: str | None = None) -> torch.Tensor:
    """`qsa.top_group_set` of ``scores [N, G]`` (float32, ``1 <= k <= G``) in one launch; ``block``: scores a
    program holds at once (default: the row, up to `MAX_BLOCK`; tests force it small); ``search``: how the
    k-th largest is found, one of `SEARCHES` (default: "radix" with ``qsa_topk_radix`` on, else "bisect")."""
    n, groups = scores.shape
    if not 0 < k <= groups:
        raise ValueError(f"top_set_triton needs 1 <= k <= {groups} groups; got k={k}")
    search = search or ("radix" if FUSED_RADIX_SEARCH else "bisect")
    if search not in SEARCHES:
        raise ValueError(f"top_set_triton's search must be one of {SEARCHES}; got {search!r}")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n:
        block = block or min(MAX_BLOCK, triton.next_power_of_2(groups))
        _top_set_kernel[(n,)](scores, out, groups, k, scores.stride(0), BLOCK=block, ONE_CHUNK=groups <= block,
                              RADIX=search == "radix", num_warps=8 if block >= 2048 else 4, **pdl(scores))
    return out
