"""generate() continues from the cache it returned (CPU, fp32, greedy, both families).

A cache generate() built is sized for that call only; a later call that continues it (the returned
sequences plus more tokens) grows it in place (`QSAPagedCache.grow`) and must then generate exactly
what one fresh call over the whole input generates, and what upstream generates on each row alone.
Long prompts cross a main block (64 tokens) when continued, so the main pool and block tables grow;
short Inkling prompts start on windowed pools smaller than their bound, so those grow. Qwen4Exp's QSA
selection is active (budget 8 of ~30 groups), Inkling's windows (6) evict.

A cache the caller built and sized is never grown: a call it cannot hold is refused before the
prefill, naming the size it needs, and the cache is left exactly as it was.
"""

from __future__ import annotations

import re

import pytest
import helpers.qwen4 as qh
import helpers.inkling as ih
import torch
from helpers.faults import host_state

from hf_qsa_cache import QSAPagedCache

NEW = 3
QWEN_LENS = [62, 37, 55]  # the longest row crosses 64 tokens in the second call
INKLING_LENS = [62, 21, 48]
INKLING_SHORT = [5, 2, 4]  # a first cache of 7 tokens: sliding and conv pools below their per-row bound
CASES = ["qwen4_exp", "inkling", "inkling_short"]


@pytest.fixture(scope="module")
def qwen():
    return qh.make_pair(seed=5)


@pytest.fixture(scope="module")
def ink():
    return ih.make_pair(ih.make_config(), seed=6)


def _batch(family):
    if family == "qwen4_exp":
        return qh.left_pad(qh.random_prompts(QWEN_LENS, seed=21))
    return ih.left_pad(ih.make_prompts(INKLING_SHORT if family == "inkling_short" else INKLING_LENS, seed=22))


def _models(family, qwen, ink):
    return qwen if family == "qwen4_exp" else ink


def _generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None, return_dict_in_generate=True, output_logits=True, **kwargs)


def _extend(out, mask, seed):
    """The returned sequences plus one more column of tokens, and the mask extended with ones."""
    rows = out.sequences.shape[0]
    column = torch.randint(3, 90, (rows, 1), generator=torch.Generator().manual_seed(seed))
    seq = torch.cat([out.sequences, column], dim=1)
    return seq, torch.cat([mask, torch.ones(rows, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)


def _upstream(family, ref, tokens):
    if family == "qwen4_exp":
        return qh.upstream_generate(ref, tokens.tolist(), NEW)
    return ih.upstream_row(ref, tokens, NEW)


@pytest.mark.parametrize("family", CASES)
def test_generate_continues_from_the_cache_it_returned(qwen, ink, family):
    ref, model = _models(family, qwen, ink)
    ids, mask = _batch(family)
    first = _generate(model, ids, mask)
    cache = first.past_key_values
    built_len = cache.max_cache_len
    built = {name: (t.num_blocks, t.max_columns) for name, t in cache.tables.items()}
    seq, mask2 = _extend(first, mask, seed=7)

    out = _generate(model, seq, mask2, past_key_values=cache)
    assert out.past_key_values is cache
    assert cache.max_cache_len > built_len
    grown = {name: (t.num_blocks, t.max_columns) for name, t in cache.tables.items()}
    if family == "inkling_short":  # the windowed pools grew
        assert all(grown[n][0] > built[n][0] for n in ("sliding", "conv"))
    else:  # the main pool and table grew
        assert grown["main"][0] > built["main"][0] and grown["main"][1] > built["main"][1]

    # One fresh call over the whole input generates the same.
    fresh = _generate(model, seq, mask2)
    assert torch.equal(out.sequences, fresh.sequences)
    # Upstream, each row alone and unpadded, generates the same (both calls' tokens, the second's logits).
    width = ids.shape[1]
    for i in range(seq.shape[0]):
        real = seq[i][mask2[i].bool()]
        tokens, logits = _upstream(family, ref, real)
        assert torch.equal(out.sequences[i, seq.shape[1]:], tokens), f"row {i}"
        torch.testing.assert_close(torch.stack([s[i] for s in out.logits]), logits, atol=1e-4, rtol=0)
        first_tokens, _ = _upstream(family, ref, ids[i][mask[i].bool()])
        assert torch.equal(first.sequences[i, width:], first_tokens), f"row {i} (first call)"


def _snapshot(cache):
    stores = [s for layer in cache.layers for s in layer.stores.values()]
    return {
        "host": host_state(cache),
        "paged": [[t.clone() for t in s.paged_tensors()] for s in stores],
        "rows": [[t.clone() for t in s.row_tensors()] for s in stores],
        "log": cache.token_log.ids.clone(),
        "pools": {n: t.num_blocks for n, t in cache.tables.items()},
    }


@pytest.mark.parametrize("family", CASES)
def test_grow_keeps_everything_the_cache_holds(qwen, ink, family):
    _, model = _models(family, qwen, ink)
    ids, mask = _batch(family)
    cache = _generate(model, ids, mask).past_key_values
    cache.graph_runners[model] = object()  # stands in for a captured runner: it holds the old buffers
    before = _snapshot(cache)
    old_len = cache.max_cache_len
    cache.grow(old_len + 200)

    assert cache.max_cache_len == cache.token_log.max_len == old_len + 200
    assert len(cache.graph_runners) == 0
    lengths, rows, columns, floors, tables = before["host"]
    now_lengths, now_rows, now_columns, now_floors, now_tables = host_state(cache)
    assert (now_lengths, now_rows, now_columns, now_floors) == (lengths, rows, columns, floors)
    for name, table in cache.tables.items():
        held, base, free = tables[name]
        old_pool = before["pools"][name]
        assert table.num_blocks >= old_pool and table.max_columns * table.block_size >= old_len + 200
        # Held entries and bases unchanged; the free list gains exactly the new blocks.
        assert now_tables[name][:2] == (held, base)
        assert now_tables[name][2] == sorted(free + list(range(old_pool, table.num_blocks)))
        assert torch.equal(table.device_table(rows, "cpu")[:, : max(len(r) for r in held)],
                           torch.tensor([r + [0] * (max(len(r) for r in held) - len(r)) for r in held][:rows],
                                        dtype=torch.int32))
    assert all(cache.tables[n].num_blocks > before["pools"][n]
               for n in (("sliding", "conv") if family == "inkling_short" else ("main",)))
    stores = [s for layer in cache.layers for s in layer.stores.values()]
    for store, paged, per_row in zip(stores, before["paged"], before["rows"]):
        for t, old in zip(store.paged_tensors(), paged, strict=True):
            assert t.shape[0] == cache.tables[store.table].num_blocks
            assert torch.equal(t[: old.shape[0]], old) and not t[old.shape[0]:].any()
        for t, old in zip(store.row_tensors(), per_row, strict=True):
            assert torch.equal(t, old)
    assert torch.equal(cache.token_log.ids[:, :old_len], before["log"])
    cache.grow(old_len)  # smaller: nothing changes
    assert cache.max_cache_len == old_len + 200


def _state(cache):
    snap = _snapshot(cache)
    return snap["host"], snap["pools"], cache.max_cache_len, cache.steps_started, snap["paged"], snap["rows"], \
        snap["log"]


def _assert_same(a, b):
    assert a[:4] == b[:4]
    for x, y in zip(a[4:], b[4:]):
        flat_x = [t for group in x for t in group] if isinstance(x, list) else [x]
        flat_y = [t for group in y for t in group] if isinstance(y, list) else [y]
        assert len(flat_x) == len(flat_y) and all(torch.equal(p, q) for p, q in zip(flat_x, flat_y))


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_cache_the_caller_built_too_small_is_refused_before_the_prefill(qwen, ink, family):
    _, model = _models(family, qwen, ink)
    ids, mask = _batch(family)
    longest = int(mask.sum(dim=1).max())
    need = longest + NEW - 1  # generate() never feeds the last token it generates

    # Empty: refused before anything is allocated.
    cache = QSAPagedCache(model.config, max_batch_size=3, max_cache_len=need - 1)
    with pytest.raises(ValueError, match=rf"needs {need} slots .*max_cache_len={need - 1}"):
        _generate(model, ids, mask, past_key_values=cache)
    assert not cache.is_initialized and cache.columns_seen == 0 and cache.steps_started == 0

    # Holding rows of an earlier call, sized exactly for it: the continuation is refused, nothing changes.
    cache = QSAPagedCache(model.config, max_batch_size=3, max_cache_len=need)
    first = _generate(model, ids, mask, past_key_values=cache)
    seq, mask2 = _extend(first, mask, seed=8)
    counts = mask2.sum(dim=1).tolist()
    row = next(b for b, n in enumerate(counts) if n + NEW - 1 > need)
    before = _state(cache)
    with pytest.raises(ValueError, match=re.escape(f"row {row} needs {counts[row] + NEW - 1} slots")):
        _generate(model, seq, mask2, past_key_values=cache)
    _assert_same(_state(cache), before)
    assert cache.max_cache_len == need
