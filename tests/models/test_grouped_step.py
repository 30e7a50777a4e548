"""Grouped steps (`hf_qsa_cache.grouped`): rows of one step in consecutive rectangles of their own lengths, decoding
rows one token each beside prefill chunks of others. Every token's logits equal transformers' own model on that
row's sequence alone (fp32, CPU), under random schedules: chunks that end inside QSA groups, Inkling windows and
conv spans, rows fed one token beside rows fed eight, groups of several rows with left pads."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.serving import FAMILIES, family_pair

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.grouped import grouped_logits
from hf_qsa_cache.rollback import crop_rows


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *family_pair(request.param))


def _reference_logits(ref, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([sequence])).logits[0]


def _schedule(rng: random.Random, fed: list[int], total: list[int]):
    """One grouped step: rows fed one token or none (a run of them makes one group: a row fed none is all pads, as a
    prefilling row beside decoding ones), rows fed a chunk (alone, or with the next row in one group of the longer
    chunk, the shorter left-padded)."""
    chunks = [min(total[b] - fed[b], 1 if rng.random() < 0.4 else rng.randint(2, 8)) for b in range(len(fed))]
    chunks = [0 if c == 1 and rng.random() < 0.3 else c for c in chunks]
    if not any(chunks):
        chunks[0] = 1
    shape, counts, b = [], [], 0
    while b < len(fed):
        if chunks[b] <= 1:
            run = 1
            while b + run < len(fed) and chunks[b + run] <= 1:
                run += 1
            shape.append((run, 1))
            counts += chunks[b:b + run]
        elif b + 1 < len(fed) and rng.random() < 0.5:  # (a one-token neighbour: pads in its last columns)
            run = 2
            shape.append((2, max(chunks[b], chunks[b + 1])))
            counts += chunks[b:b + 2]
        else:
            run = 1
            shape.append((1, chunks[b]))
            counts.append(chunks[b])
        b += run
    return shape, counts


@pytest.mark.parametrize("seed, spec", [(0, 0), (1, 0), (2, 0), (3, 2), (4, 2)])
def test_every_token_of_random_grouped_steps_equals_transformers_alone(family, seed, spec):
    """``spec``: the cache keeps rollback history for that many tokens, and after each step some rows drop up to
    that many of the tokens they just took (`crop_rows`, as a verify step's rejected drafts), fed again later:
    the state comes back from the rollback rings the groups wrote."""
    name, ref, ours = family
    rng = random.Random(seed)
    rows = 4
    steps = 7 if not spec else 9
    total = [rng.randint(steps, 40) for _ in range(rows)]
    sequences = [[rng.randrange(1, 90) for _ in range(n)] for n in total]
    expected = [_reference_logits(ref, s) for s in sequences]
    cache = QSAPagedCache(ours.config, max_batch_size=rows, max_cache_len=48, block_size=4,
                          num_speculative_tokens=spec)
    cache.move_rows([-1] * rows)
    fed = [0] * rows
    cropped = 0
    for _ in range(steps):
        if min(t - f for t, f in zip(total, fed)) == 0:
            break
        shape, counts = _schedule(rng, fed, total)
        ids, keep, where = [], [], []
        start = b = 0
        for group_rows, length in shape:
            for r in range(b, b + group_rows):
                pads = length - counts[r]
                tokens = sequences[r][fed[r]:fed[r] + counts[r]]
                ids += [0] * pads + tokens
                keep += range(start + pads, start + length)
                where += [(r, fed[r] + j) for j in range(counts[r])]
                start += length
            b += group_rows
        logits = grouped_logits(ours, cache, shape, counts, torch.tensor([ids]), torch.tensor(keep))
        got = {rw: logits[i] for i, rw in enumerate(where)}
        for (r, position), value in got.items():
            torch.testing.assert_close(value, expected[r][position], atol=2e-4, rtol=2e-4,
                                       msg=lambda m, r=r, p=position, s=shape: f"row {r} position {p}, step {s}: {m}")
        fed = [f + c for f, c in zip(fed, counts)]
        if spec:
            drops = [rng.randint(0, min(spec, max(c - 1, 0))) for c in counts]
            crop_rows(cache, drops)
            fed = [f - d for f, d in zip(fed, drops)]
            cropped += sum(drops)
    assert cache.lengths[:rows] == fed and sum(fed) > 4 * rows
    assert not spec or cropped > 0


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
