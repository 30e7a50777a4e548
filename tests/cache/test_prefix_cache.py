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


def test_bad_arguments_are_refused_by_name():
    _, ours = make_pair()
    for kwargs, named in [(dict(prefix_caching="yes"), "'yes'"), (dict(prefix_caching=True, prefix_snapshots=-1), "-1"),
                          (dict(prefix_caching=True, prefix_snapshot_bytes=1.5), "1.5"),
                          (dict(prefix_caching=True, prefix_blocks=True), "True"),
                          (dict(prefix_caching=True, prefix_snapshot_gap=-1), "prefix_snapshot_gap must be .* -1"),
                          (dict(prefix_snapshot_gap="8"), "prefix_snapshot_gap must be .* '8'")]:
        with pytest.raises(ValueError, match=named):
            QSAPagedCache(ours.config, 2, 32, block_size=4, **kwargs)
    with pytest.raises(ValueError, match="prefix_caching=True"):
        QSAPagedCache(ours.config, 2, 32, block_size=4).restore_prefix(0, [5, 6, 7, 8, 9])
    cache = QSAPagedCache(ours.config, 2, 32, block_size=4, prefix_caching=True)
    with pytest.raises(ValueError, match="row must be"):
        cache.restore_prefix(2, [5, 6, 7, 8, 9])


def test_a_row_never_crops_into_shared_blocks():
    ref, ours, prompt, block = family("inkling")  # Inkling crops without rollback headroom
    cache = QSAPagedCache(ours.config, 1, 32, block_size=block, prefix_caching=True, num_speculative_tokens=4)
    a = prompt(3 * block + 2, 7)
    feed(ours, cache, [a[: 2 * block]])
    assert cache.cache_prefix(0, a) == 2 * block
    feed(ours, cache, [a[2 * block:]])
    cache.crop(-2)  # back to 3 blocks: above the shared part
    with pytest.raises(ValueError, match="shares its first 8"):
        cache.crop(-(block + 1))
    assert cache.lengths[0] == 3 * block


def test_a_snapshot_stacks_like_state_and_restores_only_onto_stores_of_its_shapes():
    """A snapshot keeps the row's per-layer state stacked by shape, dtype and device (`prefix_rows.state_groups`: one
    launch a group each way, not one a tensor); restoring it gives the other row every tensor back exactly, and a
    snapshot whose groups do not match the cache's stores is not restorable (its prefix is then a miss)."""
    from hf_qsa_cache import prefix_rows

    ref, ours, prompt, block = family("qwen4_exp")
    cache = QSAPagedCache(ours.config, 2, 32, block_size=block, prefix_caching=True)
    a = prompt(3 * block, 9)
    feed(ours, cache, [a[: 2 * block], a[:block]])
    targets = prefix_rows.snapshot_targets(cache)
    groups = prefix_rows.state_groups(targets)
    snapshot = cache.snapshot_row(0)
    assert len(groups) < len(targets) and sorted(i for g in groups for i in g) == list(range(len(targets)))
    assert [s.shape[0] for s in snapshot.state] == [len(g) for g in groups]
    prefix_rows.restore(cache, 1, snapshot)
    for t in targets:
        assert torch.equal(t[1], t[0])
    assert prefix_rows.fits(cache, snapshot)
    for broken in ([s.double() for s in snapshot.state], [s[1:] for s in snapshot.state], snapshot.state[1:]):
        assert not prefix_rows.fits(cache, type(snapshot)(snapshot.length, broken, snapshot.windows))
    assert cache.cache_prefix(0, a) == 2 * block
    assert cache.prefix_lookup(a, limit=2 * block) == (2 * block, 2 * block)
    cache.prefix.match(a, 2 * block)[-1].snapshot.state[0] = snapshot.state[0][1:]  # (as if taken on other stores)
    assert cache.prefix_lookup(a, limit=2 * block) == (0, 2 * block)  # the blocks match; nothing is restorable


def test_budgets_evict_least_recently_used_and_idle_blocks_are_available():
    ref, ours, prompt, block = family("qwen4_exp")
    # Two rows of 6 blocks each fill the pool: cached blocks must be given back for new prompts.
    cache = QSAPagedCache(ours.config, 2, 6 * block, block_size=block, num_blocks=13, prefix_caching=True,
                          prefix_snapshots=2, prefix_snapshot_gap=0)
    prompts = [prompt(5 * block + 1, 10 + i) for i in range(3)]
    for p in prompts[:2]:  # each prefill caches its prompt at 5 blocks, then the next call retires it
        cache.reset()
        feed(ours, cache, [p], keep=1)
    stats = cache.memory_stats()
    assert stats["prefix_cache"]["snapshots"] == 2 and stats["prefix_cache"]["blocks"] == 10
    cache.reset()
    main = cache.tables["main"]
    assert main.available() == 12 and len(main.free) == 2 and main.idle == 10
    assert cache.why_not_fits([6 * block, 6 * block]) is None  # idle cached blocks count as room
    # A third prompt, and a fourth that continues the first: one snapshot over budget, blocks taken back.
    got = feed(ours, cache, [prompts[2], prompts[0] + prompt(3, 20)], keep=1)
    for i, p in enumerate([prompts[2], prompts[0] + prompt(3, 20)]):
        torch.testing.assert_close(got[i], alone(ref, p), atol=1e-4, rtol=0)
    stats = cache.memory_stats()["prefix_cache"]
    assert stats["hit_tokens"] == 5 * block  # the first prompt's prefix was used, and is most recent
    assert stats["evictions"] > 0 and stats["snapshots"] <= 2
    cache.reset()
    assert cache.restore_prefix(0, prompts[1]) == 0  # the least recently used prefix went first
    cache.reset()
    assert cache.restore_prefix(0, prompts[0] + [3]) == 5 * block
    check_accounting(cache)


def test_snapshot_budget_keeps_the_recently_used():
    ref, ours, prompt, block = family("qwen4_exp")
    cache = QSAPagedCache(ours.config, 1, 6 * block, block_size=block, num_blocks=20, prefix_caching=True,
                          prefix_snapshots=2, prefix_snapshot_gap=0)
    prompts = [prompt(3 * block + 1, 30 + i) for i in range(3)]
    for p in prompts[:2]:
        cache.reset()
        feed(ours, cache, [p], keep=1)  # cached at 3 blocks
    cache.reset()
    assert cache.restore_prefix(0, prompts[0]) == 3 * block  # the first is now the more recently used
    cache.reset()
    feed(ours, cache, [prompts[2]], keep=1)  # a third snapshot: one over budget
    cache.reset()
    stats = cache.memory_stats()["prefix_cache"]
    assert stats["snapshots"] == 2 and stats["snapshot_evictions"] == 1
    assert cache.restore_prefix(0, prompts[1]) == 0
    # An entry left without a snapshot or entries below it serves no lookup: its blocks went back too.
    assert stats["entries"] == 6 and stats["blocks"] == 6
    for p in (prompts[0], prompts[2]):
        cache.reset()
        assert cache.restore_prefix(0, p) == 3 * block


def test_a_full_pool_of_idle_cached_blocks_is_not_sorted_at_every_step():
    """Once the pool is full of idle cached blocks (a server that has run a while), each eviction pass looks at
    every entry: a pass frees a 64th of the pool beyond what the step asked, so the steps after it find free
    blocks without one (a pass per step cost 14 ms at 20,000 entries), still least recently used first."""
    from hf_qsa_cache.blocks import BlockTable
    from hf_qsa_cache.prefix_cache import PrefixCache

    table = BlockTable("main", 641, 4, max_rows=2, max_len=4 * 640)
    cache = PrefixCache({"main": table}, 4, None, None, None)
    for i in range(640):  # 640 one-unit prefixes, each cached and idle, the first the least recently used
        table.reserve(0, 4)
        cache.insert({"main": table.rows[0]}, [i] * 4, 4, None)
        table.release_row(0)
    assert not table.free and table.idle == 640
    looks = []
    idle = cache._idle
    cache._idle = lambda entry, name: looks.append(entry) or idle(entry, name)
    for k in range(50):  # a row that takes one more block each step
        cache.make_room_for([0, 4 * (k + 1)])
        table.reserve(1, 4 * (k + 1))
    passes = len(looks) / 640  # (a pass looks at every entry once)
    assert passes <= 50 / (1 + 640 // 64) + 1, passes
    left = sorted(key[1][0] for key in cache.entries)
    assert left == list(range(640 - len(left), 640))  # the oldest went
