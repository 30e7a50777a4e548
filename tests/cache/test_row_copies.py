"""Rows copied from one another (beam search's `reorder_cache`, `batch_repeat_interleave`, `batch_select_indices`)
share their full blocks by reference and copy only the last, partial one (`BlockTable.select_rows`); a row whose
source is released takes its partial block over (a permutation copies nothing).

The copies then decode different tokens exactly as rows prefilled apart do (a shared block a row wrote into
would change the others' logits), the pools hold one row's full blocks and not one per copy, and a crop below
the shared blocks is refused before anything changes."""

from __future__ import annotations

import pytest
import helpers.inkling as inkling
import torch
from helpers.qwen4 import make_pair

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.blocks import NULL_BLOCK

PROMPT = 30  # not a multiple of the block size: each copy's last block is partial


@pytest.fixture(scope="module")
def models():
    return {"qwen4_exp": make_pair(seed=3)[1], "inkling": inkling.make_pair(inkling.make_config(), seed=4)[1]}


def _decode(model, cache, steps):
    with torch.no_grad():
        return [model(ids, past_key_values=cache).logits for ids in steps]


@pytest.mark.parametrize("copy", ["repeat", "reorder", "permute", "fork"])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_copies_share_full_blocks_and_decode_as_rows_prefilled_apart(models, family, copy):
    model = models[family]
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(2, vocab, (1, PROMPT), generator=gen)
    steps = [torch.randint(2, vocab, (3, 1), generator=gen) for _ in range(6)]  # each row its own tokens
    spec = 5 if family == "qwen4_exp" else 0  # (rollback history, so that a crop is refused by the floor alone)

    apart = QSAPagedCache(model.config, 3, 64, block_size=4, num_speculative_tokens=spec)
    with torch.no_grad():
        model(prompt.repeat(3, 1), past_key_values=apart)
    want = _decode(model, apart, steps)

    cache = QSAPagedCache(model.config, 3, 64, block_size=4, num_speculative_tokens=spec)
    with torch.no_grad():
        if copy == "repeat":
            model(prompt, past_key_values=cache)
            before = {name: (t.blocks_in_use(), list(t.rows[0])) for name, t in cache.tables.items()}
            cache.batch_repeat_interleave(3)
        elif copy == "reorder":  # beam search's reorder: row 1 is dropped for a second copy of row 0, row 2 stays
            model(prompt.repeat(3, 1), past_key_values=cache)
            before = {name: (t.blocks_in_use() - t.row_blocks_in_use(1), list(t.rows[0]))
                      for name, t in cache.tables.items()}
            cache.reorder_cache(torch.tensor([0, 0, 2]))
        elif copy == "fork":  # row 0 is dropped, rows 0 and 1 take row 2 (the first takes its partial block over)
            model(prompt.repeat(3, 1), past_key_values=cache)
            before = {name: (t.blocks_in_use() - t.row_blocks_in_use(0), list(t.rows[2]))
                      for name, t in cache.tables.items()}
            cache.reorder_cache(torch.tensor([2, 2, 1]))
        else:  # a permutation: every row's blocks change hands, none is copied or shared
            model(prompt.repeat(3, 1), past_key_values=cache)
            before = {name: (t.blocks_in_use(), list(t.rows[0])) for name, t in cache.tables.items()}
            cache.reorder_cache(torch.tensor([1, 2, 0]))
    for name, table in cache.tables.items():
        used, blocks = before[name]
        full = PROMPT // table.block_size
        partial = sum(b != NULL_BLOCK for b in blocks[full:])
        copies = {"repeat": 2, "reorder": 1, "permute": 0, "fork": 1}[copy]
        assert table.blocks_in_use() == used + copies * partial, name  # one row's full blocks, a partial a copy
        assert table.rows[1 if copy != "permute" else 2][:full] == blocks[:full], name
        table.check_accounting()
    for got, expected in zip(_decode(model, cache, steps), want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # (a 1-row prefill rounds apart from 3)
    if copy == "permute":  # nothing shared: crops go where they went before
        assert all(t.shared_columns(r) == 0 for t in cache.tables.values() for r in range(3))
        return
    floor = max(PROMPT // t.block_size * t.block_size for t in cache.tables.values())
    with pytest.raises(ValueError, match="rows copied from it"):
        cache.crop(-(PROMPT + len(steps) - floor + 1))
    assert cache.lengths[:3] == [PROMPT + len(steps)] * 3
