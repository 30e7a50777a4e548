"""The paged short conv: hand-checked torch specification, and the Triton kernel against it.

The Triton comparison runs each case as a script under the Triton interpreter (`interpreter.py`: TRITON_INTERPRET=1
only counts if it is set before triton is first imported), one pytest item per layout and tiling.
"""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch

from hf_qsa_cache.ops.sconv import short_conv_torch
from helpers.interpreter import case_main, run_case_under_interpreter


def _dense_reference(seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + residual over one whole unpadded sequence [n, C], fp32."""
    K = weight.shape[1]
    padded = torch.cat([torch.zeros(K - 1, seq.shape[1]), seq])
    out = torch.stack([(padded[i: i + K].T * weight).sum(-1) for i in range(seq.shape[0])])
    return out + seq


def _case(seed: int, rows: list[tuple[int, int]], L: int, K: int = 4, H: int = 2, width: int = 3):
    """Rows given as (prev_len, count); the store holds each row's earlier inputs at their slots."""
    g = torch.Generator().manual_seed(seed)
    C = H * width
    B = len(rows)
    max_len = max(p + c for p, c in rows)
    cols = -(-max_len // K)
    # Distinct physical blocks per row (block 0 is the null block); some early ones left null.
    table = torch.zeros(B, cols, dtype=torch.int32)
    nxt = 1
    for b, (p, c) in enumerate(rows):
        for i in range(-(-(p + c) // K)):
            if (i + 1) * K > p - K:  # only blocks the window still needs
                table[b, i] = nxt
                nxt += 1
    store_full = torch.randn(nxt * K, H, width + 2, generator=g)
    store = store_full[:, :, 1: 1 + width]  # a strided stream view, as in the packed store
    history = [torch.randn(p + c, C, generator=g) for p, c in rows]
    for b, (p, c) in enumerate(rows):
        for pos in range(max(0, p - K + 1), p):
            slot = int(table[b, pos // K]) * K + pos % K
            store[slot] = history[b][pos].view(H, width)
    x = torch.randn(B, L, C, generator=g)
    position = torch.full((B, L), -1, dtype=torch.int64)
    slots = torch.full((B, L), -1, dtype=torch.int64)
    for b, (p, c) in enumerate(rows):
        x[b, L - c:] = history[b][p:]
        position[b, L - c:] = torch.arange(p, p + c)
        for j, pos in enumerate(range(p, p + c)):
            blk = int(table[b, pos // K])
            slots[b, L - c + j] = blk * K + pos % K if blk else -1
    weight = torch.randn(C, K, generator=g)
    prev = torch.tensor([p for p, _ in rows], dtype=torch.int32)
    return dict(x=x.view(B * L, C), weight=weight, store=store, table=table, block_size=K,
                slots=slots.view(-1), position=position.view(-1), prev_len=prev, query_len=L), history, store_full


def test_spec_matches_dense_conv_over_whole_sequence():
    rows = [(0, 5), (6, 3), (2, 1), (9, 4)]
    args, history, _ = _case(0, rows, L=6)
    y = short_conv_torch(**args).view(len(rows), 6, -1)
    for b, (p, c) in enumerate(rows):
        want = _dense_reference(history[b], args["weight"])[p:]
        torch.testing.assert_close(y[b, 6 - c:], want, atol=1e-5, rtol=0)
    # The inputs were written at their slots; pads were not.
    for b, (p, c) in enumerate(rows):
        for j, pos in enumerate(range(p, p + c)):
            slot = int(args["slots"][b * 6 + 6 - c + j])
            if slot >= 0:
                torch.testing.assert_close(args["store"][slot].reshape(-1), history[b][pos])


def test_pads_and_positions_before_zero_read_zero():
    args, _, _ = _case(1, [(0, 2)], L=5)
    args["weight"] = torch.ones_like(args["weight"])
    y = short_conv_torch(**args)
    x = args["x"]
    # Pad columns output their residual only; position 0 sees no history; position 1 sees position 0.
    torch.testing.assert_close(y[:3], x[:3])
    torch.testing.assert_close(y[3], 2 * x[3])
    torch.testing.assert_close(y[4], 2 * x[4] + x[3])


# (seed, rows as (prev_len, count), step length, taps).
LAYOUTS = {
    "4rows-L6-K4": (0, [(0, 5), (6, 3), (2, 1), (9, 4)], 6, 4),
    "1row-L17-K4": (1, [(0, 17)], 17, 4),
    "decode-3rows-K4": (2, [(13, 1), (3, 1), (0, 1)], 1, 4),
    "2rows-L7-K3": (3, [(5, 2), (0, 7)], 7, 3),
    "3rows-L6-K2": (4, [(20, 6), (1, 6), (0, 4)], 6, 2),
}
# Default tiles, and tiles forced small: token tiles that span rows and end past the last token, several channel
# tiles.
TILES = {"default-tiles": {}, "tiles-t4-c4": {"block_t": 4, "block_c": 4},
         "tiles-t2-c8": {"block_t": 2, "block_c": 8}}


def _sconv_case(seed: int, rows, L: int, K: int, tiles: dict) -> None:
    """The kernel against the torch specification at one layout and tiling: the output, and the store afterwards
    (the padding lanes beside the stream included)."""
    from hf_qsa_cache.ops.sconv_triton import short_conv_triton

    args, _, full = _case(seed, rows, L=L, K=K, H=3, width=5)
    ref_full = full.clone()
    ref_args = dict(args, store=ref_full[:, :, 1:6])
    want = short_conv_torch(**ref_args)
    got = short_conv_triton(**args, **tiles)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(full[1:], ref_full[1:], atol=0, rtol=0)


KERNEL_CASES = {f"{layout}-{name}": partial(_sconv_case, *LAYOUTS[layout], tiles)
                for layout in LAYOUTS for name, tiles in TILES.items()}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_torch_under_interpreter(case):
    run_case_under_interpreter(__file__, case)


def _kernel_case(case: str) -> None:
    return KERNEL_CASES[case]()


if __name__ == "__main__":
    sys.exit(case_main(_kernel_case))
