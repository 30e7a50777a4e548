"""`hf_qsa_cache.ops.row_writes`: a layer's cache writes gathered, flushed one by one (torch) or in one launch
(``qsa_writes``), against `write_slots` (the specification); the kernel as a script under the Triton interpreter
(`interpreter.py`)."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch
from helpers.interpreter import case_main, run_case_under_interpreter

from hf_qsa_cache import QSAPagedCache, fusions
from hf_qsa_cache.ops import fp8, row_writes
from hf_qsa_cache.ops.fp8 import FP8
from hf_qsa_cache.ops.row_writes import RowWrites, fuses_row_writes, write_slots


def _targets(seed: int, n: int = 5):
    """A QSA layer's five writes at small shapes, each in its own layout: keys and values ``[n, 2, 8]`` (the values
    a strided view into a wider projection output), fp32 group keys whose rows hold pads (-1), ring keys split from
    a wider tensor, int32 positions read transposed into an int64 ring. Returns ``[(store, rows, values)]``."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(24, generator=g)[:n]
    slots[n // 2] = -1  # a pad: the null block's first row
    keys = torch.randn(n, 2, 8, generator=g).to(torch.bfloat16)
    projected = torch.randn(n, 40, generator=g).to(torch.bfloat16)
    values = projected[:, 8:24].view(n, 2, 8)
    group_rows = torch.tensor([5, -1, 2][: max(1, n - 2)], dtype=torch.int64)
    group_keys = torch.randn(group_rows.numel(), 12, generator=g)
    ring_rows = torch.randperm(30, generator=g)[:n]
    index_qk = torch.randn(n, 44, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 1000, (3, n), generator=g, dtype=torch.int32).t()
    return [
        (torch.randn(24, 2, 8, generator=g).to(torch.bfloat16), slots, keys),
        (torch.randn(24, 2, 8, generator=g).to(torch.bfloat16), slots, values),
        (torch.randn(8, 12, generator=g), group_rows, group_keys),
        (torch.randn(30, 12, generator=g).to(torch.bfloat16), ring_rows, index_qk[:, 32:]),
        (torch.randint(0, 9, (30, 3), generator=g), ring_rows, positions),
    ]


def _spec(targets):
    stores = [store.clone() for store, _, _ in targets]
    for store, (_, rows, values) in zip(stores, targets):
        write_slots(store, rows, values)
    return stores


def _fp8_targets(seed: int, n: int = 5):
    """A QSA layer's writes on an fp8 cache: keys and values ``[n, 3, 24]`` (values a strided view into a wider
    projection output; a head of zeros, tiny and negative-zero entries, a wide range of magnitudes) and compressed
    keys ``[., 40]`` (pad rows -1) into fp8 stores with their scales, then the ring's keys and positions as plain
    writes. Returns ``[(store, scales or None, rows, values)]``."""
    g = torch.Generator().manual_seed(seed)
    plain = _targets(seed, n)

    def spread(*shape):
        return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 5)

    def fp8_store(*shape):
        return torch.zeros(*shape, dtype=torch.uint8).view(FP8), torch.zeros(*shape[:-1])

    keys = spread(n, 3, 24)
    keys[0, 1] = 0.0
    keys[-1].view(-1)[:4] = torch.tensor([-0.0, 1e-38, -3e-39, 2e-45])
    values = spread(n, 100).to(torch.bfloat16)[:, 10:82].view(n, 3, 24)
    group_rows = plain[2][1]
    slots = plain[0][1]
    return [
        (*fp8_store(24, 3, 24), slots, keys.to(torch.bfloat16)),
        (*fp8_store(24, 3, 24), slots, values),
        (*fp8_store(8, 40), group_rows, spread(group_rows.numel(), 40)),
        (plain[3][0], None, *plain[3][1:]),
        (plain[4][0], None, *plain[4][1:]),
    ]


def _as_written(targets):
    """Clones of the ``(store, scales)`` of each target."""
    return [(store.view(torch.uint8).clone().view(store.dtype), None if scales is None else scales.clone())
            for store, scales, _, _ in targets]


def _fp8_spec(targets):
    """Each ``(store, scales)`` as `write_slots` / `fp8.write_fp8_rows` leave them."""
    out = _as_written(targets)
    for (store, scales), (_, _, rows, values) in zip(out, targets):
        if scales is None:
            write_slots(store, rows, values)
        else:
            fp8.write_fp8_rows(store, scales, rows.clamp_min(0), values)
    return out


def _same_stores(have, want) -> bool:
    return all(torch.equal(h.view(torch.uint8) if h.dtype == FP8 else h, w.view(torch.uint8) if w.dtype == FP8 else w)
               and (hs is None or torch.equal(hs, ws)) for (h, hs), (w, ws) in zip(have, want))


def test_the_torch_flush_writes_each_store_as_the_specification():
    targets = _targets(seed=0)
    want = _spec(targets)
    writes = RowWrites()
    stores = [store.clone() for store, _, _ in targets]
    for store, (_, rows, values) in zip(stores, targets):
        writes.add(store, rows, values)
    assert all(torch.equal(s, t) for s, (t, _, _) in zip(stores, targets))  # nothing written before the flush
    writes.flush()
    assert all(torch.equal(s, w) for s, w in zip(stores, want)) and not writes.pending
    assert stores[4].dtype == torch.int64 and torch.equal(stores[4][targets[4][1]], targets[4][2].long())


def test_the_torch_flush_quantizes_fp8_writes_as_the_specification():
    targets = _fp8_targets(seed=0)
    want = _fp8_spec(targets)
    stores = _as_written(targets)
    writes = RowWrites()
    for (store, scales), (_, _, rows, values) in zip(stores, targets):
        if scales is None:
            writes.add(store, rows, values)
        else:
            writes.add_quantized(store, scales, rows, values)
    writes.flush()
    assert _same_stores(stores, want) and not writes.pending
    assert not torch.equal(want[0][1], targets[0][1])  # the scales were written


def test_writes_run_in_the_order_added():
    store = torch.zeros(4, 2)
    writes = RowWrites()
    writes.add(store, torch.tensor([1]), torch.ones(1, 2))
    writes.add(store, torch.tensor([1]), torch.full((1, 2), 2.0))
    writes.flush()
    assert store[1].tolist() == [2.0, 2.0]


def test_one_launch_only_for_writes_it_copies_as_torch(monkeypatch):
    monkeypatch.setitem(fusions.STATE, "qsa_writes", True)
    monkeypatch.setattr(row_writes, "use_triton", lambda *t: True)
    targets = _targets(seed=1)
    assert fuses_row_writes(targets)
    assert not fuses_row_writes([])
    assert not fuses_row_writes(targets + targets[:1])  # more than MAX_TARGETS
    store, rows, values = targets[0]
    assert not fuses_row_writes([(store, rows, values.float())])  # a float cast the kernel would round otherwise
    assert not fuses_row_writes([(store.transpose(1, 2), rows, values)])  # a store's rows not contiguous
    assert not fuses_row_writes([(store, rows, values.transpose(1, 2))])  # a value row not one strided run
    assert not fuses_row_writes([(store, rows[:, None], values)])
    assert not fuses_row_writes([(store, rows, values.requires_grad_())])
    quantized = [(store, rows, values, scales) if scales is not None else (store, rows, values)
                 for store, scales, rows, values in _fp8_targets(seed=1)]
    assert fuses_row_writes(quantized)
    store, rows, values, scales = quantized[0]
    assert not fuses_row_writes([(store, rows, values)])  # an fp8 store written without its scales
    assert not fuses_row_writes([(store, rows, values, scales[:, :1])])  # not one scale per head
    assert not fuses_row_writes([(store, rows, values, scales.t().contiguous().t())])  # scales not contiguous
    assert not fuses_row_writes([(store, rows, values.long(), scales)])  # fp8 takes float values only
    monkeypatch.setitem(fusions.STATE, "qsa_writes", False)
    assert not fuses_row_writes(targets)


def _write_case(seed: int, n: int, count: int) -> None:
    """The first ``count`` of a layer's writes of ``n`` rows (`_targets`; with three, the third of no rows) in one
    launch, chunks of 8 elements (rows of 12 and 16 elements in two chunks, 3 in a masked one): each store as the
    specification leaves it."""
    from hf_qsa_cache.ops import row_writes_triton

    row_writes_triton.BLOCK = 8
    targets = _targets(seed, n)
    chosen = targets[:count]
    if count == 3:  # a write of no rows beside the others
        chosen = [*targets[:2], (targets[2][0], targets[2][1][:0], targets[2][2][:0])]
    want = _spec(chosen)
    stores = [store.clone() for store, _, _ in chosen]
    row_writes_triton.write_rows_triton([(s, r, v) for s, (_, r, v) in zip(stores, chosen)])
    for i, (have, expected) in enumerate(zip(stores, want)):
        assert torch.equal(have, expected), f"store {i}"


def _fp8_write_case(seed: int, n: int, count: int) -> None:
    """The first ``count`` of an fp8 cache layer's writes (`_fp8_targets`: three quantized, two plain) in one
    launch: each store's bytes and scales as the specification leaves them."""
    from hf_qsa_cache.ops import row_writes_triton

    targets = _fp8_targets(seed, n)[:count]
    want = _fp8_spec(targets)
    stores = _as_written(targets)
    row_writes_triton.write_rows_triton([(s, r, v) if q is None else (s, r, v, q)
                                         for (s, q), (_, _, r, v) in zip(stores, targets)])
    assert _same_stores(stores, want)


def _generate_case(kv: str = "bf16") -> str | None:
    """The tiny model with its QSA layers' writes in one launch each: the same bits as the torch writes."""
    from helpers.fusions import fused_generate_mismatch
    from helpers.interpreter import count_launches
    from helpers.qwen4 import left_pad, make_pair, random_prompts

    from hf_qsa_cache.ops import row_writes_triton

    row_writes.use_triton = lambda *t: True  # the CUDA dispatch, on CPU tensors
    launches: list = []
    count_launches(row_writes_triton, "_write_rows_kernel", launches)
    model = make_pair(seed=7)[1]
    cache = None  # fp8: the keys, values and compressed keys quantized in the same one launch
    if kv == "fp8":
        cache = partial(QSAPagedCache, model.config, 3, 32, block_size=4, kv_cache_dtype=FP8, index_cache_dtype=FP8)

    return fused_generate_mismatch(model, *left_pad(random_prompts([9, 4, 7], seed=8)), "qsa_writes", launches,
                                   atol=None, cache=cache)


KERNEL_CASES = {
    **{f"block8-{n}rows-{count}targets{'-one-empty' * (count == 3)}": partial(_write_case, seed, n, count)
       for seed, n in ((0, 5), (1, 3), (2, 1)) for count in range(1, 6)},
    **{f"fp8-{n}rows-{count}targets": partial(_fp8_write_case, seed, n, count)
       for seed, n in ((3, 5), (4, 1)) for count in (1, 3, 5)},
    "generate": _generate_case,
    "generate-fp8": partial(_generate_case, "fp8"),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_under_interpreter(case):
    run_case_under_interpreter(__file__, case)


if __name__ == "__main__":
    sys.exit(case_main(KERNEL_CASES))
