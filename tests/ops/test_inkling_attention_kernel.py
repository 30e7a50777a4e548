"""The Inkling paged attention kernel against the torch specification.

Inputs are built the way the cache builds them: a shuffled block pool (`BlockTable`, windowed for
sliding layers, so blocks below the window are the null block even for positions this forward
writes), a store holding the keys of earlier positions and garbage everywhere else, and slots and
positions from `build_step_metadata_torch`. Tile, key-tile and split sizes are forced small so every
loop runs several times.

The comparison runs each case as a script under the Triton interpreter (`interpreter.py`: TRITON_INTERPRET=1 only
counts if it is set before triton is first imported), one pytest item per case.
"""

from __future__ import annotations

import random
import sys
from functools import partial

import pytest
import torch

from hf_qsa_cache import fusions
from hf_qsa_cache.blocks import BlockTable
from hf_qsa_cache.metadata import build_step_metadata_torch
from hf_qsa_cache.ops.inkling_attention import paged_rel_attention_torch
from helpers.interpreter import case_main, run_case_under_interpreter


def make_case(seed: int, rows: list[tuple[int, int]], L: int, heads: int, kv_heads: int, head_dim: int,
              extent: int, window: int | None = None, block_size: int = 4, d_rel: int = 4,
              dtype=torch.float32, log_scaling=None) -> tuple[dict, list[int]]:
    """Rows given as (prev_len, count). Returns the op's keyword arguments and each row's count."""
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    num_blocks = sum(-(-(p + c) // block_size) for p, c in rows) + 4
    blocks = BlockTable("kv", num_blocks, block_size, B, max(p + c for p, c in rows), window=window)
    random.Random(seed).shuffle(blocks.free)
    # An earlier forward brought each row to prev_len; this one appends count tokens.
    for b, (p, c) in enumerate(rows):
        blocks.reserve(b, p)
    for b, (p, c) in enumerate(rows):
        blocks.release_out_of_window(b, p)
        blocks.reserve(b, p + c)
    table = blocks.device_table(B, "cpu")
    prev = torch.tensor([p for p, _ in rows], dtype=torch.int32)
    count = torch.tensor([c for _, c in rows], dtype=torch.int32)
    meta = build_step_metadata_torch(prev, count, L, {"kv": table}, {"kv": block_size}, None, prev.tolist(),
                                     count.tolist())

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    # Garbage everywhere (null block, free blocks), then the earlier keys at their slots.
    key_store = rand(num_blocks * block_size, kv_heads, head_dim, scale=3.0)
    value_store = rand(num_blocks * block_size, kv_heads, head_dim, scale=3.0)
    k = rand(B, L, kv_heads, head_dim, scale=3.0)
    v = rand(B, L, kv_heads, head_dim, scale=3.0)
    for b, (p, c) in enumerate(rows):
        hist_k, hist_v = rand(p + c, kv_heads, head_dim), rand(p + c, kv_heads, head_dim)
        for pos in range(p):
            block = int(table[b, pos // block_size])
            if block:  # positions below the window are gone
                key_store[block * block_size + pos % block_size] = hist_k[pos]
                value_store[block * block_size + pos % block_size] = hist_v[pos]
        k[b, L - c:] = hist_k[p:]
        v[b, L - c:] = hist_v[p:]
    args = dict(
        q=rand(B, L, heads, head_dim), k=k, v=v, r=rand(B, L, heads, d_rel), proj=rand(d_rel, extent),
        key_store=key_store, value_store=value_store, table=table, block_size=block_size,
        slots=meta.slots["kv"], position=meta.position, prev_len=meta.prev_len, host_prev_len=[p for p, _ in rows],
        scaling=0.5, window=window, log_scaling=log_scaling,
    )
    return args, [c for _, c in rows]


FULL_ROWS = [(0, 5), (7, 3), (37, 20), (3, 0), (18, 1)]  # a fresh row, ragged prefixes, a row of pads
SLIDING_ROWS = [(30, 20), (5, 12), (0, 20), (9, 0)]  # chunks much longer than the window over evicted keys
WIDE_ROWS = [(45, 40), (3, 25), (0, 40)]  # a window of several key tiles
DECODE_ROWS = [(37, 1), (5, 1), (20, 0), (0, 1), (70, 1)]
# One-token query tiles run a program per token, interpreted: shorter chunks with the same traits (a chunk past
# far keys in two splits, across blocks; chunks longer than the window writing positions below it).
ONE_TOKEN_FULL_ROWS = [(0, 5), (7, 3), (37, 8), (3, 0), (18, 1)]
ONE_TOKEN_SLIDING_ROWS = [(30, 12), (5, 12), (0, 12), (9, 0)]

# name, case arguments, kernel overrides
CASES = [
    ("full prefill fp32", dict(rows=FULL_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=12),
     dict(block_m=4, block_n=16, num_splits=1)),
    ("full prefill split fp32 hd24", dict(rows=FULL_ROWS, L=20, heads=6, kv_heads=2, head_dim=24, extent=12),
     dict(block_m=2, block_n=16, num_splits=3)),
    ("full prefill log-scaling fp32", dict(rows=FULL_ROWS, L=20, heads=4, kv_heads=1, head_dim=16, extent=12,
                                           log_scaling=(4.0, 0.4)), dict(block_m=4, block_n=16)),
    ("full prefill log-scaling bf16", dict(rows=FULL_ROWS, L=20, heads=4, kv_heads=1, head_dim=16, extent=12,
                                           log_scaling=(4.0, 0.4), dtype=torch.bfloat16), dict(block_m=4, block_n=16)),
    ("full prefill default tiles bf16", dict(rows=FULL_ROWS, L=20, heads=8, kv_heads=2, head_dim=32, extent=40,
                                             dtype=torch.bfloat16), {}),
    ("sliding prefill fp32", dict(rows=SLIDING_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=8, window=8),
     dict(block_m=4, block_n=16, num_splits=1)),
    ("sliding prefill bf16 mha", dict(rows=SLIDING_ROWS, L=20, heads=2, kv_heads=2, head_dim=16, extent=8, window=8,
                                      block_size=8, dtype=torch.bfloat16), dict(block_m=16, block_n=16)),
    ("sliding prefill split fp32", dict(rows=SLIDING_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=8,
                                        window=8), dict(block_m=8, block_n=16, num_splits=2)),
    ("sliding prefill wide window fp32", dict(rows=WIDE_ROWS, L=40, heads=6, kv_heads=2, head_dim=16, extent=20,
                                              window=36, block_size=8), dict(block_m=4, block_n=16, num_splits=1)),
    ("full decode fp32", dict(rows=DECODE_ROWS, L=1, heads=6, kv_heads=2, head_dim=16, extent=12),
     dict(block_n=16, num_splits=3)),
    ("full decode log-scaling bf16", dict(rows=DECODE_ROWS, L=1, heads=8, kv_heads=2, head_dim=16, extent=12,
                                          log_scaling=(8.0, 0.4), dtype=torch.bfloat16), dict(block_n=16, num_splits=4)),
    ("full decode default tiles fp32", dict(rows=DECODE_ROWS, L=1, heads=6, kv_heads=2, head_dim=16, extent=12), {}),
    ("sliding decode fp32", dict(rows=DECODE_ROWS, L=1, heads=6, kv_heads=2, head_dim=16, extent=20, window=20),
     dict(block_n=16, num_splits=2)),
    ("sliding decode bf16", dict(rows=DECODE_ROWS, L=1, heads=4, kv_heads=2, head_dim=16, extent=40, window=40,
                                 dtype=torch.bfloat16), dict(block_n=16, num_splits=2)),
    # The bias computed in the kernel (``rel_bias``): one-token query tiles, near and far keys, windows, splits.
    ("full decode bias in kernel fp32", dict(rows=DECODE_ROWS, L=1, heads=6, kv_heads=2, head_dim=16, extent=12),
     dict(block_n=16, num_splits=3, bias_in_kernel=True)),
    ("full decode bias in kernel log-scaling bf16 d_rel 16",
     dict(rows=DECODE_ROWS, L=1, heads=8, kv_heads=2, head_dim=16, extent=12, d_rel=16, log_scaling=(8.0, 0.4),
          dtype=torch.bfloat16), dict(block_n=16, num_splits=4, bias_in_kernel=True)),
    ("sliding decode bias in kernel bf16", dict(rows=DECODE_ROWS, L=1, heads=4, kv_heads=2, head_dim=16, extent=40,
                                                window=40, dtype=torch.bfloat16),
     dict(block_n=16, num_splits=2, bias_in_kernel=True)),
    ("full prefill one-token tiles bias in kernel fp32",
     dict(rows=ONE_TOKEN_FULL_ROWS, L=8, heads=6, kv_heads=2, head_dim=16, extent=12),
     dict(block_m=1, block_n=16, num_splits=2, bias_in_kernel=True)),
    ("sliding prefill one-token tiles bias in kernel fp32",
     dict(rows=ONE_TOKEN_SLIDING_ROWS, L=12, heads=6, kv_heads=2, head_dim=16, extent=8, window=8),
     dict(block_m=1, block_n=16, bias_in_kernel=True)),
    ("full prefill bias asked in kernel, tiles of 4 tokens (the matmul) fp32",
     dict(rows=FULL_ROWS, L=20, heads=6, kv_heads=2, head_dim=16, extent=12),
     dict(block_m=4, block_n=16, bias_in_kernel=True)),
]


def _check(name: str, case: dict, overrides: dict) -> str | None:
    from hf_qsa_cache.ops.inkling_attention_triton import paged_rel_attention_triton

    args, counts = make_case(7 + len(name), **case)
    ref = {**args, "key_store": args["key_store"].clone(), "value_store": args["value_store"].clone()}
    want = paged_rel_attention_torch(**ref)
    have = paged_rel_attention_triton(**args, **overrides)
    if have.shape != want.shape or have.dtype != want.dtype:
        return f"{name}: shape/dtype {have.shape} {have.dtype} vs {want.shape} {want.dtype}"
    valid = (args["position"] >= 0).view(have.shape[:2])
    if not torch.equal(have[~valid], torch.zeros_like(have[~valid])):  # the torch op's pad rows are junk
        return f"{name}: a pad query does not output zeros"
    err = (have.float() - want.float())[valid].abs().max() / want.float()[valid].abs().max()
    bound = 1e-4 if case.get("dtype", torch.float32) == torch.float32 else 1e-2
    if not err < bound:
        return f"{name}: relative error {err:.3g} >= {bound}"
    if overrides.get("bias_in_kernel"):  # and as the kernel's matmul path computes it (the rounding of r @ P)
        again = {**args, "key_store": ref["key_store"].clone(), "value_store": ref["value_store"].clone()}
        other = paged_rel_attention_triton(**again, **{**overrides, "bias_in_kernel": False})
        err = (have.float() - other.float())[valid].abs().max() / other.float()[valid].abs().max()
        bound = 1e-5 if case.get("dtype", torch.float32) == torch.float32 else 1e-3
        if not err < bound:
            return f"{name}: relative difference {err:.3g} >= {bound} from the bias computed by a matmul"
    # The store: every real slot as the torch op left it (block 0, the null block, takes pad writes).
    bs = args["block_size"]
    for mine, theirs in ((args["key_store"], ref["key_store"]), (args["value_store"], ref["value_store"])):
        if not torch.equal(mine[bs:], theirs[bs:]):
            return f"{name}: store differs"
    return None


def _check_out_of_shared_memory() -> str | None:
    """A launch whose tiles do not fit the device's shared memory retries with smaller tiles (same result), and
    later launches of that kind start at the tiles that fit. The interpreter has no shared-memory limit: here
    a launch with more than 16 keys or 2 tokens per tile is made to run out, as the GPU would."""
    from triton.runtime.errors import OutOfResources

    from hf_qsa_cache.ops import inkling_attention_triton as kernel

    launch, tried = kernel._launch, []

    def small_device(*args):
        block_m, block_n = args[16], args[17]
        tried.append((block_m, block_n))
        if block_n > 16 or block_m > 2:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return launch(*args)

    kernel._launch = small_device
    try:
        case = dict(rows=WIDE_ROWS, L=40, heads=6, kv_heads=2, head_dim=16, extent=10, window=12)
        for attempt in range(2):
            tried.clear()
            if err := _check("out of shared memory", case, {}):
                return err
            if attempt == 0 and not (len(tried) > 1 and tried[-1][1] == 16 and tried[-1][0] <= 2):
                return f"out of shared memory: tiles tried {tried}"
            if attempt == 1 and len(tried) != 1:
                return f"out of shared memory: the tiles that fit were not remembered, tried {tried}"
    finally:
        kernel._launch = launch
        kernel._TILES_THAT_FIT.clear()
    return None


def test_case_tables_evict_below_the_window():
    """The sliding cases really exercise eviction: early columns are the null block, and this forward
    writes some of its own positions there (so those keys exist only in the activations)."""
    args, _ = make_case(0, SLIDING_ROWS, L=20, heads=2, kv_heads=1, head_dim=16, extent=8, window=8)
    table, bs = args["table"], args["block_size"]
    assert (table[0, : (30 - 8 + 1) // bs] == 0).all()
    valid = args["position"] >= 0
    in_null = valid & (args["slots"] >= 0) & (args["slots"] < bs)
    assert in_null.sum() > 0


def test_the_rel_bias_fusion_picks_the_bias_path(monkeypatch):
    """The dispatch has the kernel compute the bias itself exactly when the ``rel_bias`` fusion is on and query tiles
    hold one token (decode); otherwise it gathers ``r @ P``; the kernel alone, unasked, gathers it (the launch
    itself is stubbed: no kernel runs here)."""
    from hf_qsa_cache.ops import inkling_attention
    from hf_qsa_cache.ops import inkling_attention_triton as kernel

    in_kernel = []
    monkeypatch.setattr(kernel, "_launch", lambda *args: in_kernel.append(args[4] is not None))
    monkeypatch.setattr(inkling_attention, "use_triton", lambda *t: True)  # the CUDA dispatch, on CPU tensors
    decode, _ = make_case(0, DECODE_ROWS, L=1, heads=4, kv_heads=2, head_dim=16, extent=12)
    prefill, _ = make_case(0, FULL_ROWS, L=20, heads=4, kv_heads=2, head_dim=16, extent=12)
    for flag in (False, True):
        monkeypatch.setitem(fusions.STATE, "rel_bias", flag)
        inkling_attention.paged_rel_attention(**decode)
        inkling_attention.paged_rel_attention(**prefill)
    kernel.paged_rel_attention_triton(**decode)  # unasked: r @ P gathered
    assert in_kernel == [False, False, True, False, False]


def _check_step_shapes_compile_once() -> str | None:
    """Steps of other lengths, earlier lengths and key split counts launch one compiled attention kernel (and one
    merge kernel per padded split count): the sizes a serving loop meets anew every few steps are plain arguments,
    and each specialisation would be a compilation on the GPU (~0.3 s each)."""
    from collections import Counter

    from helpers import kernel_compile
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops.inkling_attention_triton import paged_rel_attention_triton

    # (rows as (earlier length, new tokens), step length, key splits): spans of 57, 128, 160, 224 keys in tiles of
    # 16 split into exactly 2, 3, 5, 7 ranges
    steps = [(FULL_ROWS, 20, 2), ([(100, 28), (5, 9)], 28, 3), ([(140, 20)], 20, 5), ([(200, 24), (0, 24), (64, 2)], 24, 7)]
    seen: dict = {}
    for i, (rows, L, splits) in enumerate(steps):
        args, _ = make_case(i, rows=rows, L=L, heads=6, kv_heads=2, head_dim=16, extent=12)
        run = kernel_compile.record_into(seen, execute=i == 0)  # (the first step runs: compiled for the GPU too)
        try:
            paged_rel_attention_triton(**args, block_m=4, block_n=16, num_splits=splits)
        finally:
            InterpretedFunction.run = run
    kernels = Counter(entry["name"] for entry in seen.values())
    padded = {entry["constants"]["S_PAD"] for entry in seen.values() if entry["name"] == "_merge_splits_kernel"}
    if kernels["_rel_attention_kernel"] != 1 or kernels["_merge_splits_kernel"] != len(padded) or len(padded) != 3:
        return f"launches compiled apart: {dict(kernels)}, merge kernels padded to {sorted(padded)} splits"
    return None


def _case_id(name: str) -> str:
    """A case's name as a test id: words joined by hyphens, without punctuation."""
    return "-".join(name.replace(",", "").replace("(", "").replace(")", "").split())


# The cases by id (their names seed their inputs: `_check`), then the retry with smaller tiles.
KERNEL_CASES = {
    **{_case_id(name): partial(_check, name, case, overrides) for name, case, overrides in CASES},
    "out-of-shared-memory-retries-smaller-tiles": _check_out_of_shared_memory,
    "step-shapes-compile-once": _check_step_shapes_compile_once,
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch_under_interpreter(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> str | None:
    from triton.runtime.interpreter import InterpretedFunction

    from hf_qsa_cache.ops import inkling_attention_triton as kernel

    if not isinstance(kernel._rel_attention_kernel, InterpretedFunction):
        return "TRITON_INTERPRET was not honoured"
    return KERNEL_CASES[case]()


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
