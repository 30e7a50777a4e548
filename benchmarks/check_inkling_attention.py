"""GPU check of the Inkling paged attention kernel against the torch op, at real shapes, with timings.

    python benchmarks/check_inkling_attention.py          # on a CUDA GPU
    python benchmarks/check_inkling_attention.py --tiny   # tiny shapes on CPU, Triton interpreter
    python benchmarks/check_inkling_attention.py --split-sweep   # decode key splits, graph-timed
    python benchmarks/check_inkling_attention.py --tile-sweep    # decode keys per tile x warps x stages, graph-timed

Shapes (hidden 2048): 16 query heads over 4 KV heads of 128, d_rel 16; full layers with rel_extent
1024 and log scaling (n_floor 128000, alpha 0.1), sliding layers with window 512. Cases: decode at
1 x 131072 and 8 x 4096 cached tokens, and a 4096-token prefill chunk over 8192 cached tokens, each
on a full and a sliding layer. Inputs follow the cache: block size 64, shuffled physical blocks, a
windowed table (blocks below the window are the null block) on sliding layers.

One line per case: max error relative to the largest output, whether the stores agree, and the times
of the torch op and the kernel (CUDA events). Decode cases run the kernel both ways of computing the relative
bias (the ``rel_bias`` fusion off and on): the error is the worse of the two, and the other way's time is
shown. Exits non-zero when a bound is exceeded. The same comparisons at the real shapes, untimed, are the tests of
tests/gpu/test_gpu_inkling_attention.py (`REAL_CASES`). ``--split-sweep`` graph-times the decode steps at each split
count and, at the policy's count, with the bias computed in the kernel.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one
TINY = "--tiny" in sys.argv[1:]
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

from hf_qsa_cache.blocks import BlockTable  # noqa: E402
from hf_qsa_cache.metadata import build_step_metadata_torch  # noqa: E402
from hf_qsa_cache.ops.inkling_attention import paged_rel_attention_torch  # noqa: E402
from hf_qsa_cache import fusions  # noqa: E402
from hf_qsa_cache.ops import inkling_attention, inkling_attention_triton  # noqa: E402
from hf_qsa_cache.ops.inkling_attention_triton import paged_rel_attention_triton  # noqa: E402

# name, layer, rows as (prev_len, count), dtype
REAL_CASES = [
    ("decode 1 x 131072", "full", [(131072, 1)], torch.bfloat16),
    ("decode 1 x 131072", "sliding", [(131072, 1)], torch.bfloat16),
    ("decode 8 x 4096", "full", [(4096, 1)] * 8, torch.bfloat16),
    ("decode 8 x 4096", "sliding", [(4096, 1)] * 8, torch.bfloat16),
    ("decode 8 x 4096", "full", [(4096, 1)] * 8, torch.float32),
    ("prefill 4096 over 8192", "full", [(8192, 4096)], torch.bfloat16),
    ("prefill 4096 over 8192", "sliding", [(8192, 4096)], torch.bfloat16),
]
if TINY:
    # Small key tiles and splits, so the tiny decode cases take the split path like the real ones.
    inkling_attention_triton.DECODE_BLOCK_N = 16
    inkling_attention_triton.MIN_SPLIT_KEYS = 16
    HEADS, KV_HEADS, HEAD_DIM, D_REL, REL_EXTENT, WINDOW, BLOCK_SIZE = 4, 2, 16, 4, 24, 8, 4
    LOG_SCALING = (16.0, 0.1)
    # name, layer, rows as (prev_len, count), dtype
    CASES = [
        ("decode 1 x 100", "full", [(100, 1)], torch.bfloat16),
        ("decode 1 x 100", "sliding", [(100, 1)], torch.bfloat16),
        ("decode 3 x 20", "full", [(20, 1)] * 3, torch.float32),
        ("decode 3 x 20", "sliding", [(20, 1)] * 3, torch.bfloat16),
        ("prefill 20 over 30", "full", [(30, 20)], torch.bfloat16),
        ("prefill 20 over 30", "sliding", [(30, 20)], torch.bfloat16),
    ]
else:
    HEADS, KV_HEADS, HEAD_DIM, D_REL, REL_EXTENT, WINDOW, BLOCK_SIZE = 16, 4, 128, 16, 1024, 512, 64
    LOG_SCALING = (128000.0, 0.1)
    CASES = REAL_CASES
BOUND = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def make_inputs(layer: str, rows: list[tuple[int, int]], dtype, device, seed: int = 0) -> dict:
    """The op's arguments for one layer: the store holds random keys at every slot (earlier positions
    included), the table comes from a shuffled, windowed-or-not `BlockTable`."""
    window = WINDOW if layer == "sliding" else None
    B = len(rows)
    L = max(c for _, c in rows)
    blocks_per_row = [-(-(p + c) // BLOCK_SIZE) for p, c in rows]
    if window is not None:
        blocks_per_row = [min(n, 2 * (-(-window // BLOCK_SIZE) + 1)) for n in blocks_per_row]
    num_blocks = sum(blocks_per_row) + 1
    table = BlockTable(layer, num_blocks, BLOCK_SIZE, B, max(p + c for p, c in rows), window=window)
    random.Random(seed).shuffle(table.free)
    for b, (p, c) in enumerate(rows):
        table.reserve(b, p)  # the forwards before this one
    for b, (p, c) in enumerate(rows):
        table.release_out_of_window(b, p)
        table.reserve(b, p + c)
    block_table = table.device_table(B, device)
    prev = torch.tensor([p for p, _ in rows], dtype=torch.int32, device=device)
    count = torch.tensor([c for _, c in rows], dtype=torch.int32, device=device)
    meta = build_step_metadata_torch(prev, count, L, {layer: block_table}, {layer: BLOCK_SIZE}, None,
                                     prev.tolist(), count.tolist())

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    slots = num_blocks * BLOCK_SIZE
    extent = WINDOW if window is not None else REL_EXTENT
    return dict(
        q=rand(B, L, HEADS, HEAD_DIM), k=rand(B, L, KV_HEADS, HEAD_DIM), v=rand(B, L, KV_HEADS, HEAD_DIM),
        r=rand(B, L, HEADS, D_REL), proj=rand(D_REL, extent, scale=D_REL ** -0.5),
        key_store=rand(slots, KV_HEADS, HEAD_DIM), value_store=rand(slots, KV_HEADS, HEAD_DIM),
        table=block_table, block_size=BLOCK_SIZE, slots=meta.slots[layer], position=meta.position,
        prev_len=meta.prev_len, host_prev_len=[p for p, _ in rows],
        # 1/sqrt(hd) rather than the model's 1/hd, so that q.k weighs as much as the bias in the check.
        scaling=HEAD_DIM ** -0.5, window=window, log_scaling=None if window is not None else LOG_SCALING,
    )


def time_ms(fn, iters: int) -> float:
    fn()  # warm-up (and compilation)
    if TINY:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check(name: str, layer: str, rows, dtype, device, timed: bool = True) -> bool:
    args = make_inputs(layer, rows, dtype, device)
    L = args["q"].shape[1]
    iters = 1 if TINY else (3 if L > 1 else 20)
    label = f"{name:24s} {layer:7s} {str(dtype).removeprefix('torch.'):8s}"
    have_args = {**args, "key_store": args["key_store"].clone(), "value_store": args["value_store"].clone()}
    have = paged_rel_attention_triton(**have_args, bias_in_kernel=fusions.enabled("rel_bias"))
    t_kernel = time_ms(lambda: paged_rel_attention_triton(**have_args, bias_in_kernel=fusions.enabled("rel_bias")),
                       iters if TINY else 50) if timed else float("nan")
    extra = ""
    if L == 1 and not TINY and timed:
        t_one = time_ms(lambda: paged_rel_attention_triton(**have_args, num_splits=1), 20)
        extra = f"  (one split {t_one:.3f} ms)"
    if L == 1:  # the other way of computing the bias (the rel_bias fusion on or off), checked below too
        other_args = {**args, "key_store": args["key_store"].clone(), "value_store": args["value_store"].clone()}
        in_kernel = not fusions.enabled("rel_bias")
        other = paged_rel_attention_triton(**other_args, bias_in_kernel=in_kernel)
        if not TINY and timed:
            t_other = time_ms(lambda: paged_rel_attention_triton(**other_args, bias_in_kernel=in_kernel), 50)
            extra += f"  (bias {'in kernel' if in_kernel else 'by matmul'} {t_other:.3f} ms)"
    try:
        want_args = {**args, "key_store": args["key_store"].clone(), "value_store": args["value_store"].clone()}
        want = paged_rel_attention_torch(**want_args)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        print(f"{label} torch op out of memory; kernel {t_kernel:.3f} ms{extra}  (no comparison)")
        return bool(torch.isfinite(have).all())
    valid = (args["position"] >= 0).view(have.shape[:2])
    err = ((have.float() - want.float())[valid].abs().max() / want.float()[valid].abs().max()).item()
    if L == 1:
        err = max(err, ((other.float() - want.float())[valid].abs().max() / want.float()[valid].abs().max()).item())
    bs = BLOCK_SIZE  # block 0 is the null block: pads and positions below the window write there
    store_ok = all(torch.equal(a[bs:], b[bs:]) for a, b in ((have_args["key_store"], want_args["key_store"]),
                                                           (have_args["value_store"], want_args["value_store"])))
    del want
    try:
        torch_time = f"{time_ms(lambda: paged_rel_attention_torch(**want_args), iters):9.3f} ms" if timed else "-"
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        torch_time = "      OOM"
    ok = err < BOUND[dtype] and store_ok and bool(torch.isfinite(have).all())
    print(f"{label} rel err {err:.2e} (bound {BOUND[dtype]:.0e})  store {'same' if store_ok else 'DIFFERS'}  "
          f"torch {torch_time}  kernel {t_kernel:8.3f} ms{extra}  {'ok' if ok else 'FAIL'}")
    return ok


SWEEP_CASES = [  # the decode steps of `bench_generate.py`'s Inkling cases
    ("decode 1 x 16384", "full", [(16384, 1)]),
    ("decode 1 x 16384", "sliding", [(16384, 1)]),
    ("decode 32 x 2048", "full", [(2048, 1)] * 32),
    ("decode 32 x 2048", "sliding", [(2048, 1)] * 32),
]


SWEEP_SETS = 8  # input sets a sweep's graph cycles through: their K/V stores exceed L2, as in a decode step


def sweep_time_us(sets: list[dict], **kwargs) -> float:
    """Microseconds a call of the attention with ``kwargs``, in a CUDA graph of one call on each of ``sets``
    (their stores together larger than L2: the keys come from memory, as in a step where the other layers'
    weights have passed through L2 since)."""
    from sweep_experts_tiles import graph_us

    return graph_us([lambda a=a: paged_rel_attention_triton(**a, **kwargs) for a in sets])


def split_sweep(device) -> None:
    """Each decode case at key split counts from 1 up, beside the launch policy's choice (``num_splits=None``):
    graph-timed microseconds a call on `SWEEP_SETS` input sets, bf16."""
    for name, layer, rows in SWEEP_CASES:
        sets = [make_inputs(layer, rows, torch.bfloat16, device, seed=i) for i in range(SWEEP_SETS)]
        times = {"policy": sweep_time_us(sets, bias_in_kernel=False)}
        # The rel_bias fusion (the bias computed per key tile, no r @ P matmul before the launch): that matmul
        # is part of both figures, so this compares whole steps' attention.
        times["policy, bias in kernel"] = sweep_time_us(sets, bias_in_kernel=True)
        span = max(p for p, _ in rows) + 1 if layer == "full" else WINDOW
        most = max(1, min(inkling_attention_triton.MAX_SPLITS, span // inkling_attention_triton.DECODE_BLOCK_N))
        splits = 1
        while splits <= most:
            times[splits] = sweep_time_us(sets, num_splits=splits, bias_in_kernel=False)
            splits *= 2
        best = min((k for k in times if isinstance(k, int)), key=times.get)
        print(f"{name:18s} {layer:7s} " + "  ".join(f"{k}: {v:.1f}" for k, v in times.items())
              + f"  (us; best {best} splits)", flush=True)


def tile_sweep(device) -> None:
    """Each decode case at keys per tile x warps x pipelining stages (the policy's split count for that tile),
    beside the policy: graph-timed microseconds a call on `SWEEP_SETS` input sets, bf16 (a one-token tile is
    load-latency bound: wider key tiles keep more bytes in flight per program, and take more registers)."""
    fits = inkling_attention_triton._TILES_THAT_FIT  # a tile that does not fit would shrink the policy's: kept out
    for name, layer, rows in SWEEP_CASES:
        sets = [make_inputs(layer, rows, torch.bfloat16, device, seed=i) for i in range(SWEEP_SETS)]
        fits.clear()
        times = {"policy": sweep_time_us(sets, bias_in_kernel=False)}
        for block_n in (16, 32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    times[f"{block_n}x{warps}x{stages}"] = sweep_time_us(
                        sets, block_n=block_n, num_warps=warps, num_stages=stages, bias_in_kernel=False)
                    fits.clear()
        best = min((k for k in times if k != "policy"), key=times.get)
        print(f"{name:18s} {layer:7s} " + "  ".join(f"{k}: {v:.1f}" for k, v in times.items())
              + f"  (us; best keys x warps x stages {best})", flush=True)


def main() -> int:
    if "--split-sweep" in sys.argv[1:]:
        split_sweep(torch.device("cuda"))
        return 0
    if "--tile-sweep" in sys.argv[1:]:
        tile_sweep(torch.device("cuda"))
        return 0
    if TINY:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device (use --tiny for a CPU run under the Triton interpreter)")
        return 2
    else:
        device = torch.device("cuda")
        print(torch.cuda.get_device_name(device))
    print(f"heads {HEADS}/{KV_HEADS} x {HEAD_DIM}, d_rel {D_REL}, rel_extent {REL_EXTENT}, window {WINDOW}, "
          f"block size {BLOCK_SIZE}")
    results = []
    for name, layer, rows, dtype in CASES:
        results.append(check(name, layer, rows, dtype, device))
        if not TINY:
            torch.cuda.empty_cache()
    print("PASS" if all(results) else "FAIL")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
