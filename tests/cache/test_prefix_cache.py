"""Prefix caching at the cache level (`hf_qsa_cache.prefix_cache`): rows started from cached prefixes
(`QSAPagedCache.restore_prefix`), then fed the rest of their prompts, give the logits of transformers' own model
run on each prompt alone (fp32), on both families; shared blocks are reference counted, never written, and every
block is free, listed by rows or held by the prefix cache exactly as counted.

The prompts diverge inside a unit (inside a QSA group; with a cached prefix ending inside Inkling's sliding window
and conv span of the next tokens), two rows share the same cached blocks, and a row restores a shorter prefix
than it could reach (no snapshot further on)."""

from __future__ import annotations

import pytest
import torch

import helpers.inkling as inkling
from helpers.qwen4 import left_pad, make_pair, random_prompts, tiny_config

from hf_qsa_cache import QSAPagedCache


def family(name: str):
    """(transformers' model, ours, prompt maker, block size): Qwen4Exp with compress ratio 2 (a unit of 4
    tokens spans two QSA groups) or 4 (selection active), Inkling with window 6 and conv kernel 4."""
    if name == "qwen4_exp":
        ref, ours = make_pair()
        return ref, ours, lambda n, seed: random_prompts([n], seed=seed)[0], 4
    if name == "qwen4_exp_ratio4":
        ref, ours = make_pair(tiny_config(indexer_compress_ratio=4, indexer_budget=8))
        return ref, ours, lambda n, seed: random_prompts([n], seed=seed)[0], 8
    ref, ours = inkling.make_pair(inkling.make_config())
    return ref, ours, lambda n, seed: inkling.make_prompts([n], seed=seed)[0].tolist(), 4


def feed(model, cache, chunks: list[list[int]], keep: int = 0) -> torch.Tensor:
    """Rows ``0 .. len(chunks) - 1`` take their chunk (left-padded, one step); each row's last logits. With
    ``keep=1`` (only the last logits) a forward on an empty cache is a prefill from cached prefixes, which
    caches the prompts too; by default the test places every prefix itself."""
    ids, mask = left_pad(chunks)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=keep).logits[:, -1]


def alone(ref, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0, -1]


def check_accounting(cache) -> None:
    for table in cache.tables.values():
        table.check_accounting()


def cached_pages(cache) -> list[torch.Tensor]:
    """Copies of every cached block's pages, per paged store (to check no step writes them)."""
    out = []
    for name, table in cache.tables.items():
        blocks = torch.tensor(sorted(table.cached), dtype=torch.long)
        for store in cache.layer_stores():
            if store.table == name and store.allocated:
                out += [t[blocks].clone() for t in store.paged_tensors()]
    return out


@pytest.mark.parametrize("name", ["qwen4_exp", "qwen4_exp_ratio4", "inkling"])
def test_restored_prefix_then_rest_equals_the_whole_prompt(name):
    ref, ours, prompt, block = family(name)
    unit = block
    a = prompt(5 * unit - 1, 1)
    b = a[: 3 * unit + 1] + prompt(2 * unit, 2)  # diverges one token into unit 3 (inside a QSA group)
    c = a[: 2 * unit - 3] + prompt(3 * unit, 3)  # diverges inside unit 1: only a shorter snapshot serves it
    cache = QSAPagedCache(ours.config, 3, 8 * unit, block_size=block, prefix_caching=True)
    assert cache.prefix_unit == block
    # First pass: rows stop at aligned points (3 units of a, 1 unit of c), are cached there, then go on.
    feed(ours, cache, [a[: 3 * unit], c[:unit]])
    assert cache.cache_prefix(0, a) == 3 * unit and cache.cache_prefix(1, c) == unit
    got = feed(ours, cache, [a[3 * unit:], c[unit:]])
    torch.testing.assert_close(got[0], alone(ref, a), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], alone(ref, c), atol=1e-4, rtol=0)
    check_accounting(cache)

    cache.reset()  # rows go, cached prefixes stay
    stats = cache.memory_stats()["prefix_cache"]
    # a's three units (c's first unit is a's: one entry, which holds c's snapshot), two snapshots
    assert (stats["entries"], stats["blocks"], stats["snapshots"]) == (3, 3, 2)
    assert stats["idle_blocks"] == 3 and stats["bytes"] > 0
    check_accounting(cache)
    pages = cached_pages(cache)

    # Second pass: b and a share a's cached blocks (two rows list them), c + more restores c's shorter prefix.
    c2 = c + prompt(3, 4)
    assert cache.restore_prefix(0, b, limit=len(b) - 1) == 3 * unit
    assert cache.restore_prefix(1, a, limit=len(a) - 1) == 3 * unit
    assert cache.restore_prefix(2, c2, limit=len(c2) - 1) == unit
    main = cache.tables["main"]
    assert main.rows[0][: 3 * unit // main.block_size] == main.rows[1][: 3 * unit // main.block_size]
    first, second = main.rows[0][0], main.rows[0][1]
    assert main.refs[first] == 3 and main.refs[second] == 2 and {first, second} <= main.cached
    check_accounting(cache)
    got = feed(ours, cache, [b[3 * unit:], a[3 * unit:], c2[unit:]])
    for i, p in enumerate([b, a, c2]):
        torch.testing.assert_close(got[i], alone(ref, p), atol=1e-4, rtol=0, msg=lambda m: f"row {i}: {m}")
    # The next step reads state only the restored rows' snapshots gave them (rings, windows, recurrent state).
    nxt = [p[-1] for p in (a, b, c)]
    got = feed(ours, cache, [[t] for t in nxt])
    for i, (p, t) in enumerate(zip([b, a, c2], nxt)):
        torch.testing.assert_close(got[i], alone(ref, p + [t]), atol=1e-4, rtol=0, msg=lambda m: f"row {i}: {m}")
    for before, after in zip(pages, cached_pages(cache)):
        assert torch.equal(before, after), "a step wrote a shared block"
    check_accounting(cache)
    stats = cache.memory_stats()["prefix_cache"]
    assert stats["hit_tokens"] == 7 * unit and stats["lookup_tokens"] == len(a) + len(b) + len(c2)

    cache.reset(prefixes=True)
    assert cache.memory_stats()["prefix_cache"]["entries"] == 0
    assert all(len(t.free) == t.num_blocks - 1 for t in cache.tables.values())
    check_accounting(cache)
