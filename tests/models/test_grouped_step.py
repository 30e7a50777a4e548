"""Grouped steps (`hf_qsa_cache.grouped`): rows of one step in consecutive rectangles of their own lengths, decoding
rows one token each beside prefill chunks of others. Every token's logits equal transformers' own model on that
row's sequence alone (fp32, CPU), under random schedules: chunks that end inside QSA groups, Inkling windows and
conv spans, rows fed one token beside rows fed eight, groups of several rows with left pads."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.grouped import run_schedule
from helpers.serving import FAMILIES, family_pair

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.grouped import grouped_logits
from hf_qsa_cache.rollback import crop_rows


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *family_pair(request.param))


_references: dict = {}


def _reference_logits(ref, sequence: list[int]) -> torch.Tensor:
    key = (ref, tuple(sequence))
    if key not in _references:
        with torch.no_grad():
            _references[key] = ref(input_ids=torch.tensor([sequence])).logits[0]
    return _references[key]


@pytest.mark.parametrize("seed, spec", [(0, 0), (1, 0), (2, 0), (3, 2), (4, 2)])
def test_every_token_of_random_grouped_steps_equals_transformers_alone(family, seed, spec):
    """``spec``: the cache keeps rollback history for that many tokens, and after each step some rows drop up to
    that many of the tokens they just took (`crop_rows`, as a verify step's rejected drafts), fed again later:
    the state comes back from the rollback rings the groups wrote."""
    name, ref, ours = family
    rng = random.Random(seed)
    steps = 7 if not spec else 9
    sequences = [[rng.randrange(1, 90) for _ in range(rng.randint(20, 40))] for _ in range(4)]
    got, cache, dropped = run_schedule(ours, sequences, steps, seed, spec)
    for (r, position), value in got.items():
        torch.testing.assert_close(value, _reference_logits(ref, sequences[r])[position], atol=2e-4, rtol=2e-4,
                                   msg=lambda m, r=r, p=position: f"row {r} position {p}: {m}")
    assert len(got) > 24 and (dropped > 0) == bool(spec)
    for r, sequence in enumerate(sequences):  # each group's ids logged in its own rows (`check_continues` reads them)
        held = cache.lengths[r]
        assert cache.token_log.ids[r, :held].tolist() == sequence[:held], r


@pytest.mark.parametrize("shape, counts, message", [
    ([(1, 3), (2, 1)], [3, 1], "the groups cover 3 rows, 2 counts given"),
    ([(1, 3), (2, 1)], [4, 1, 1], "row 0 takes 4 tokens in a group of 3 columns"),
    ([(1, 3), (2, 1)], [3, -1, 1], "row 1 takes -1 tokens in a group of 1 columns"),
    ([(1, 3), (2, 1)], [0, 0, 0], "feeds at least one token"),
    ([(0, 3), (3, 1)], [1, 1, 1], "each with at least one row and one column"),
    ([(1, 3), (3, 1)], [3, 1, 1, 1], "a step over 4 rows, the cache holds 3"),
], ids=["counts-short", "count-past-group", "negative-count", "no-token", "empty-group", "more-rows-than-placed"])
def test_a_bad_grouped_step_is_refused_before_anything_changes(shape, counts, message):
    _, ours = family_pair("qwen4_exp")
    cache = QSAPagedCache(ours.config, max_batch_size=4, max_cache_len=48, block_size=4)
    cache.move_rows([-1] * 3)
    before = (list(cache.lengths), {n: list(t.free) for n, t in cache.tables.items()})
    ids = torch.ones(1, sum(r * n for r, n in shape), dtype=torch.long)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        grouped_logits(ours, cache, shape, counts, ids, torch.tensor([0]))
    assert (list(cache.lengths), {n: list(t.free) for n, t in cache.tables.items()}) == before


def test_a_grouped_step_needs_rows_placed_by_move_rows():
    _, ours = family_pair("qwen4_exp")
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=48, block_size=4)
    with pytest.raises(ValueError, match="rows placed with move_rows"), torch.no_grad():
        grouped_logits(ours, cache, [(2, 1)], [1, 1], torch.ones(1, 2, dtype=torch.long), torch.tensor([0, 1]))


def test_a_row_crop_leaves_a_row_that_took_nothing_as_it_is(family):
    """A grouped step where one row verifies drafts and another row, just started from a cached prefix, takes
    nothing (a waiting row beside it); the first drops its rejected drafts (`crop_rows` with a count per row).
    The waiting row's rollback ring holds nothing of its restored state, so the crop must leave it alone: both
    rows then go on equal to transformers alone (the engine's grouped steps with prompt lookup and prefix caching
    gave wrong tokens when every row was restored from its ring)."""
    name, ref, ours = family
    rng = random.Random(7)
    prefix = [rng.randrange(1, 90) for _ in range(8)]
    first = prefix + [rng.randrange(1, 90) for _ in range(12)]
    second = prefix + [rng.randrange(1, 90) for _ in range(6)]
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=48, block_size=4, num_speculative_tokens=2,
                          prefix_caching=True)

    def step(shape, counts, ids):
        with torch.no_grad():
            return grouped_logits(ours, cache, shape, counts, torch.tensor([ids]), torch.arange(len(ids)))

    cache.move_rows([-1])
    step([(1, 8)], [8], first[:8])
    assert cache.cache_prefix(0, first[:8]) == 8
    step([(1, 2)], [2], first[8:10])
    cache.move_rows([0, -1])
    assert cache.restore_prefix(1, second) == 8
    step([(2, 3)], [3, 0], first[10:13] + [0, 0, 0])  # row 0: its token and two drafts; row 1 all pads
    crop_rows(cache, [2, 0])  # both drafts rejected
    assert cache.lengths[:2] == [11, 8]
    got = step([(1, 2), (1, 3)], [2, 3], first[11:13] + second[8:11])
    for i, (sequence, position) in enumerate([(first, 11), (first, 12), (second, 8), (second, 9), (second, 10)]):
        torch.testing.assert_close(got[i], _reference_logits(ref, sequence)[position], atol=2e-4, rtol=2e-4,
                                   msg=lambda m, i=i: f"token {i}: {m}")
