"""A cache row's side of prefix caching: start a row from a cached prefix, keep a row's prefix, and move a row's
state in and out of a `Snapshot`.

`hf_qsa_cache.prefix_cache.PrefixCache` owns what is cached (entries, their blocks' references, snapshots,
budgets); this module owns what a row does with it, for `QSAPagedCache`'s methods of the same names
(`restore_prefix`, `prefix_lookup`, `snapshot_row`, `cache_prefix`, `keep_tails`). All of it runs between
steps, never inside one; a restore that raises leaves the row empty, as it was.
"""

from __future__ import annotations

import torch

from .blocks import NULL_BLOCK
from .prefix_cache import Snapshot


class _NoRoom(Exception):
    """A restore found no room in a windowed pool (the row then starts empty)."""


def token_list(tokens) -> list[int]:
    """Token ids as a list of ints (a list of ints as is: the serving loop looks prefixes up often)."""
    if type(tokens) is list and all(type(t) is int for t in tokens[:1]):
        return tokens
    return [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]


def check_prefix_row(cache, row: int) -> None:
    """``row`` may be cached from or restored into now (a cache with prefix caching, between steps, a row that
    no failed step left without its state)."""
    if cache.prefix is None:
        raise ValueError("this cache was built without prefix_caching=True")
    if cache.open_step is not None or (cache._scope is not None and cache._scope.pending is not None):
        raise RuntimeError("cached prefixes change only between steps, never inside one")
    cache.check_usable()
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < cache.max_batch_size:
        raise ValueError(f"row must be an integer in [0, max_batch_size={cache.max_batch_size}), got {row!r}")
    if cache.rows.lost[row]:
        raise ValueError(f"row {row} lost its state when a step that fed it failed (step_undo=False): nothing of "
                         "it is cached or restored into it until it is released (move_rows) or cache.reset()")


def restore_prefix(cache, row: int, tokens, limit: int | None, counted: int | None) -> int:
    """`QSAPagedCache.restore_prefix`: start empty ``row`` from the longest restorable cached prefix of ``tokens``;
    the length restored (0: none)."""
    check_prefix_row(cache, row)
    tokens = token_list(tokens)
    limit = len(tokens) if limit is None else min(int(limit), len(tokens))
    if cache.rows.lengths[row] or any(t.rows[row] for t in cache.tables.values()):
        raise ValueError(f"row {row} holds tokens: a cached prefix starts an empty row")
    prefix = cache.prefix
    if counted is None:
        prefix.counters["lookup_tokens"] += len(tokens)
    chain, cache.prefix_matched = restorable_chain(cache, tokens, limit)
    if not chain:
        return 0
    snapshot = chain[-1].snapshot
    length = snapshot.length
    prefix.touch(chain)
    try:
        for name, blocks in prefix.chain_blocks(chain).items():
            cache.tables[name].attach(row, blocks)
        for name, table in cache.tables.items():  # windowed tables: fresh blocks at the snapshot's columns
            if table.window is not None:
                if table.blocks_needed(row, length) > len(table.free):
                    raise _NoRoom
                table.reserve(row, length)
        restore(cache, row, snapshot)
        log = cache.token_log
        if log.ids is None and snapshot.state:
            log.allocate(snapshot.state[0].device)
        if log.ids is not None:
            log.ids[row, :length] = torch.tensor(tokens[:length], dtype=torch.int32, device=log.ids.device)
    except BaseException as error:
        for table in cache.tables.values():
            table.release_row(row)
        cache.rows.clear_row(row)
        for store in cache.layer_stores():
            if store.allocated:
                store.reset_rows([row])
        if isinstance(error, _NoRoom):
            return 0
        raise
    # Qwen4Exp's rollback ring holds nothing of the restored row: no crop to its length or below.
    floor = length + 1 if cache.keeps_rollback_history else 0
    cache.rows.start_at(row, length, floor)
    prefix.counters["hit_tokens"] += max(0, length - (counted or 0))
    return length


def prefix_lookup(cache, tokens, limit: int | None) -> tuple[int, int]:
    """`QSAPagedCache.prefix_lookup`: ``(restorable, matched)``, changing nothing."""
    if cache.prefix is None:
        return 0, 0
    tokens = token_list(tokens)
    chain, matched = restorable_chain(cache, tokens, len(tokens) if limit is None else min(int(limit), len(tokens)))
    return len(chain) * cache.prefix.unit, matched


def restorable_chain(cache, tokens: list[int], limit: int) -> tuple[list, int]:
    """The cached entries of the longest prefix of ``tokens`` (at most ``limit``) whose last entry has a snapshot
    this cache can take, and how many tokens cached blocks match (with or without a snapshot)."""
    chain = cache.prefix.match(tokens, limit)
    matched = len(chain) * cache.prefix.unit
    while chain and (chain[-1].snapshot is None or not fits(cache, chain[-1].snapshot)):
        chain.pop()
    return chain, matched


def keep_tails(cache, plan) -> None:
    """`QSAPagedCache.keep_tails`: rows of a landed one-token step that reached a unit boundary keep a snapshot
    there. A snapshot that cannot be taken is only a later miss."""
    unit = cache.prefix.unit
    for b, (n, c) in enumerate(zip(plan.new_lengths, plan.counts)):
        if c and n % unit == 0:
            try:
                cache.prefix_tails[b] = capture(cache, b)
            except Exception:  # noqa: BLE001 (the step landed; the tail is an optimisation)
                cache.prefix_tails.pop(b, None)


def cache_prefix(cache, row: int, tokens, snapshot: Snapshot | None) -> int:
    """`QSAPagedCache.cache_prefix`: keep ``row``'s whole units up to its length (or ``snapshot.length``) as a
    cached prefix; the length cached (0: not aligned)."""
    check_prefix_row(cache, row)
    length = snapshot.length if snapshot is not None else cache.rows.lengths[row]
    if length == 0 or length % cache.prefix.unit or length > cache.rows.lengths[row]:
        return 0
    tokens = token_list(tokens[:length])
    if len(tokens) < length:
        raise ValueError(f"row {row} caches {length} tokens, {len(tokens)} given")
    if snapshot is None and not cache.prefix.has_snapshot(tokens, length):
        snapshot = capture(cache, row)
    blocks = {name: cache.tables[name].rows[row] for name in cache.prefix.shared}
    return cache.prefix.insert(blocks, tokens, length, snapshot)


# ---------------------------------------------------------------------- a row's state in and out of a snapshot
def snapshot_targets(cache) -> list[torch.Tensor]:
    """Every row-indexed tensor a snapshot copies, in one order (allocated stores only)."""
    return [t for store in cache.layer_stores() if store.allocated for t in store.snapshot_tensors()]


def window_targets(cache, name: str) -> list[torch.Tensor]:
    return [t for store in cache.layer_stores() if store.table == name and store.allocated
            for t in store.paged_tensors()]


def state_groups(targets: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``targets`` grouped by row shape, dtype and device, in first-seen order: a snapshot keeps each
    group's rows stacked, copied out with one launch and back with one (a 40-layer Qwen4Exp has 82 such tensors in
    5 groups: a launch each otherwise, every time a row is snapshotted)."""
    groups: dict = {}
    for i, t in enumerate(targets):
        groups.setdefault((t.shape[1:], t.dtype, t.device), []).append(i)
    return list(groups.values())


def capture(cache, row: int) -> Snapshot:
    """A copy of ``row``'s non-paged state and its live windowed blocks, at its current length."""
    length = cache.rows.lengths[row]
    with torch.no_grad():
        targets = snapshot_targets(cache)
        state = [torch.stack([targets[i][row] for i in group]) for group in state_groups(targets)]
        windows = {}
        for name, table in cache.tables.items():
            if table.window is None:
                continue
            # The blocks the row holds from the first one its window may keep (after a crop, the oldest of those
            # may already be gone: nothing reads it).
            first, end = table._first_live_block(length), -(-length // table.block_size)
            held = table.rows[row]
            columns = [c for c in range(first, min(end, len(held))) if held[c] != NULL_BLOCK]
            index = _on_devices([held[c] for c in columns])
            windows[name] = (columns, [t.index_select(0, index(t.device)) for t in window_targets(cache, name)])
    return Snapshot(length, state, windows)


def fits(cache, snapshot: Snapshot) -> bool:
    """Whether ``snapshot`` was taken with the stores the cache has allocated now."""
    targets = snapshot_targets(cache)
    groups = state_groups(targets)
    if len(groups) != len(snapshot.state):
        return False
    if any(s.shape != (len(g), *targets[g[0]].shape[1:]) or s.dtype != targets[g[0]].dtype
           for g, s in zip(groups, snapshot.state)):
        return False
    return all(len(window_targets(cache, name)) == len(pages) for name, (_, pages) in snapshot.windows.items())


def restore(cache, row: int, snapshot: Snapshot) -> None:
    """Copy ``snapshot`` into ``row``, whose windowed tables already hold fresh blocks at the snapshot's
    columns (`BlockTable.reserve` to its length)."""
    with torch.no_grad():
        targets = snapshot_targets(cache)
        for group, data in zip(state_groups(targets), snapshot.state):
            torch._foreach_copy_([targets[i][row] for i in group], list(data.unbind(0)))
        for name, (columns, pages) in snapshot.windows.items():
            held = cache.tables[name].rows[row]
            index = _on_devices([held[c] for c in columns])
            for t, data in zip(window_targets(cache, name), pages):
                t.index_copy_(0, index(t.device), data)


def _on_devices(values: list[int]):
    """``index(device)``: ``values`` as a long tensor on ``device``, made once per device (one copy each)."""
    made: dict = {}

    def index(device):
        if device not in made:
            made[device] = torch.tensor(values, dtype=torch.long, device=device)
        return made[device]

    return index
