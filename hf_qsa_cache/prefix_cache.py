"""Prefix caching: full blocks addressed by content, and snapshots of the per-row state at aligned points.

A prefix of a hybrid model is more than K/V blocks: GatedDeltaNet and PLE state, conv windows, the n-gram
context, the QSA raw-key ring, Inkling's conv taps and sliding windows. This module owns what the cache keeps
of earlier rows so that a new row can start where one of them was (`docs/prefix_caching.md`):

* **Entries.** The tokens of a row are cut into *units* of ``unit`` tokens (the main table's block size, a
  multiple of every non-windowed table's block size and of the QSA compress ratio). The entry of unit ``i``
  is keyed by its parent entry (unit ``i - 1``, or none) and its own tokens, so an entry stands for a whole
  prefix and a dictionary walk finds the longest cached one; keys hold the tokens themselves, so two prefixes
  never collide. An entry holds the unit's blocks of every non-windowed table (paged K/V of full-attention and
  QSA layers, the QSA compressed keys), shared by reference count with the rows that list them
  (`BlockTable.refs`, `BlockTable.cached`).
* **Snapshots.** An entry may also hold a `Snapshot`: every row-indexed state of every store at the end of the
  unit (recurrent and conv state, PLE window and n-gram context, the QSA ring) and a copy of the live blocks
  of each windowed table (Inkling's sliding-window K/V and conv taps). At a unit's end the QSA group is
  closed, so the ring holds nothing a later step reads, and the windows are copied whole, so a restored row
  continues exactly. A row can start from an entry only if it has a snapshot.
* **Budgets.** Snapshots are memory outside the pools: at most ``max_snapshots`` of them and
  ``max_snapshot_bytes`` bytes (least recently used evicted first; an entry left without a snapshot and
  without children goes too). Blocks live in the pools: a cached block that no row lists is *idle*, counts
  as available capacity, and is given back (its entry and the entries below it dropped, least recently used
  first) whenever a step, a row copy or a restore needs it (`make_room`): cached prefixes never make a
  request fail. ``max_blocks`` caps the blocks entries hold per table.

Entries change only outside a step (a restore, an insert after a forward landed, an eviction before a step
begins), never inside one, so a step's transaction has nothing of this module to take back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .blocks import NULL_BLOCK
from .stores.base import tensor_bytes


@dataclass(eq=False)
class Snapshot:
    """One row's non-paged state after ``length`` tokens (``length`` a multiple of the unit)."""

    length: int
    # every store's `snapshot_tensors` row, in the cache's store order, stacked by `prefix_rows.state_groups`
    state: list[torch.Tensor]
    # windowed table -> (the row's columns that held blocks, their pages of every store on the table, in store order)
    windows: dict[str, tuple[list[int], list[torch.Tensor]]] = field(default_factory=dict)
    size: int = 0  # its bytes, as counted when it was cached

    @property
    def nbytes(self) -> int:
        return tensor_bytes(*self.state) + sum(tensor_bytes(*pages) for _, pages in self.windows.values())




class Entry:
    """One unit of a cached prefix (see the module docstring)."""

    __slots__ = ("serial", "key", "parent", "depth", "blocks", "snapshot", "children", "used")

    def __init__(self, serial: int, key: tuple, parent: Entry | None, blocks: dict[str, list[int]]):
        self.serial = serial
        self.key = key
        self.parent = parent
        self.depth = 1 if parent is None else parent.depth + 1  # units covered
        self.blocks = blocks
        self.snapshot: Snapshot | None = None
        self.children: set[Entry] = set()
        self.used = 0


# A prompt's prefill stops at its snapshot point (the last unit boundary before its last token) to snapshot its
# state there, which splits the rest of the prompt into two steps. Where that rest (after the prefix its row starts
# from) is at most 256 tokens, one short step takes it whole (a recorded graph replays it in continuous batching:
# `cuda_graphs.SHORT_PREFILL_TOKENS`), and a later prompt that continues this one (a regenerated answer, a next turn
# after an answer that reached no unit boundary) would recompute at most that much again, and only if it comes: no
# stop there (a shared-prefix hit's 256-token question, a short chat turn). A longer rest stops as it always did
# (its two parts each replay where they are short: one step of the whole would run eagerly).
# `QSAPagedCache(prefix_snapshot_gap=...)`.
SNAPSHOT_GAP_TOKENS = 256


def snapshot_point(start: int, count: int, unit: int, gap: int) -> int:
    """Where the prefill of a row of ``count`` tokens, whose state is cached (or will be) at ``start``, ends a step
    to snapshot its state: its last unit boundary before its last token if more than ``gap`` of its tokens come
    after ``start``, else ``start`` (no stop)."""
    point = (count - 1) // unit * unit
    return point if count - start > gap else start


class PrefixCache:
    """The content-addressed entries of a cache, their LRU order, budgets and counters."""

    def __init__(self, tables: dict, unit: int, max_snapshots: int | None, max_snapshot_bytes: int | None,
                 max_blocks: int | None, snapshot_gap: int = SNAPSHOT_GAP_TOKENS):
        self.tables = tables  # the cache's block tables (grown in place)
        self.shared = [name for name, t in tables.items() if t.window is None]  # tables whose blocks are shared
        self.unit = unit
        # A prefill stops at a prompt's snapshot point only if more than this many of its tokens come after the prefix
        # its row was restored from (or, in continuous batching, stops at for others): `snapshot_point`.
        self.snapshot_gap = snapshot_gap
        self.max_snapshots = max_snapshots
        self.max_snapshot_bytes = max_snapshot_bytes
        self.max_blocks = max_blocks
        self.entries: dict[tuple, Entry] = {}
        self.snapshot_bytes = 0
        self.snapshots = 0
        self._serial = 0
        self._tick = 0
        self.version = 0  # changes whenever an entry or a snapshot is added (a lookup that missed may be retried)
        self.counters = {"lookup_tokens": 0, "hit_tokens": 0, "evictions": 0, "snapshot_evictions": 0}

    # ------------------------------------------------------------------ lookup
    def _key(self, parent: Entry | None, tokens, i: int) -> tuple:
        u = self.unit
        return (0 if parent is None else parent.serial, tuple(tokens[i * u: (i + 1) * u]))

    def match(self, tokens, limit: int) -> list[Entry]:
        """The cached entries of ``tokens``'s units, from the first, as far as they are cached (at most
        ``limit`` tokens)."""
        chain, parent = [], None
        for i in range(min(len(tokens), limit) // self.unit):
            entry = self.entries.get(self._key(parent, tokens, i))
            if entry is None:
                break
            chain.append(entry)
            parent = entry
        return chain

    def touch(self, chain: list[Entry]) -> None:
        self._tick += 1
        for entry in chain:
            entry.used = self._tick

    def chain_blocks(self, chain: list[Entry]) -> dict[str, list[int]]:
        return {name: [b for entry in chain for b in entry.blocks[name]] for name in self.shared}

    def has_snapshot(self, tokens, length: int) -> bool:
        chain = self.match(tokens, length)
        return len(chain) * self.unit == length and chain[-1].snapshot is not None

    # ------------------------------------------------------------------ insert
    def insert(self, row_blocks: dict[str, list[int]], tokens, length: int, snapshot: Snapshot | None) -> int:
        """Entries for the first ``length`` tokens of a row (``length`` a multiple of the unit) listing
        ``row_blocks`` (each shared table's block list of the row); ``snapshot`` (the row's state after
        ``length`` tokens) goes to the last one if it has none. Units already cached keep their blocks (the
        row's own copies stay the row's). Returns the tokens now covered."""
        if length % self.unit:
            raise ValueError(f"a prefix entry covers whole units of {self.unit} tokens, got {length}")
        size = snapshot.nbytes if snapshot is not None else 0  # (device work first: the rest is host bookkeeping)
        parent, chain = None, []
        for i in range(length // self.unit):
            key = self._key(parent, tokens, i)
            entry = self.entries.get(key)
            if entry is None:
                blocks = {}
                for name in self.shared:
                    table = self.tables[name]
                    per = self.unit // table.block_size
                    taken = row_blocks[name][i * per: (i + 1) * per]
                    if len(taken) < per or NULL_BLOCK in taken or any(b in table.cached for b in taken):
                        break
                    blocks[name] = taken
                else:
                    self._serial += 1
                    entry = Entry(self._serial, key, parent, blocks)
                    for name, taken in blocks.items():
                        for b in taken:
                            self.tables[name].mark_cached(b)
                    self.entries[key] = entry
                    self.version += 1
                    if parent is not None:
                        parent.children.add(entry)
                if entry is None:
                    break
            chain.append(entry)
            parent = entry
        self.touch(chain)
        covered = len(chain) * self.unit
        if snapshot is not None and chain and covered == snapshot.length and chain[-1].snapshot is None:
            self.version += 1
            snapshot.size = size
            chain[-1].snapshot = snapshot
            self.snapshots += 1
            self.snapshot_bytes += size
        self.trim()
        return covered

    # ------------------------------------------------------------------ eviction
    def _drop(self, entry: Entry, evicted: bool = True) -> None:
        """Drop ``entry`` and every entry below it (their prefixes are no longer reachable; no lookup that missed
        can hit now, so the version stays)."""
        stack = [entry]
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            self._drop_snapshot(e)
            for name, blocks in e.blocks.items():
                for b in blocks:
                    self.tables[name].uncache(b)
            del self.entries[e.key]
            self.counters["evictions"] += evicted
        if entry.parent is not None:
            entry.parent.children.discard(entry)

    def _drop_snapshot(self, entry: Entry) -> None:
        if entry.snapshot is not None:
            self.snapshots -= 1
            self.snapshot_bytes -= entry.snapshot.size
            entry.snapshot = None

    def _idle(self, entry: Entry, name: str) -> bool:
        refs = self.tables[name].refs
        return any(refs[b] == 0 for b in entry.blocks.get(name, ()))

    def make_room(self, name: str, need: int) -> None:
        """Give idle cached blocks of table ``name`` back (least recently used entries first, with the entries
        below them) until ``need`` blocks are free or none is idle.

        A pass looks at every entry (a sort by last use), so it frees a 64th of the pool more than asked: once
        the pool is full of cached blocks, as it is in a server that has run a while, the steps after it find
        free blocks without a pass of their own (`benchmarks/profile_prefix_eviction.py`)."""
        table = self.tables[name]
        if len(table.free) >= need or not table.idle:
            return
        need += table.num_blocks // 64
        for entry in sorted((e for e in self.entries.values() if self._idle(e, name)),
                            key=lambda e: (e.used, -e.depth)):
            if len(table.free) >= need or not table.idle:
                return
            if entry.key in self.entries:  # not dropped with an ancestor already
                self._drop(entry)

    def make_room_for(self, new_lengths: list[int]) -> None:
        """Before a step: free idle cached blocks wherever the step would take more than the free list holds."""
        for name in self.shared:
            table = self.tables[name]
            if table.idle:
                need = table.blocks_needed_rows(new_lengths)
                if need > len(table.free):
                    self.make_room(name, need)

    def trim(self) -> None:
        """Keep the budgets: snapshots (count, bytes) and blocks per table, least recently used first."""
        over_snapshots = (self.max_snapshots is not None and self.snapshots > self.max_snapshots) or \
                         (self.max_snapshot_bytes is not None and self.snapshot_bytes > self.max_snapshot_bytes)
        if over_snapshots:
            for entry in sorted((e for e in self.entries.values() if e.snapshot is not None),
                                key=lambda e: (e.used, -e.depth)):
                if (self.max_snapshots is None or self.snapshots <= self.max_snapshots) and \
                        (self.max_snapshot_bytes is None or self.snapshot_bytes <= self.max_snapshot_bytes):
                    break
                self._drop_snapshot(entry)
                self.counters["snapshot_evictions"] += 1
                # An entry with neither a snapshot nor entries below it serves no lookup: it goes, and so may
                # its parent.
                while entry is not None and entry.snapshot is None and not entry.children \
                        and entry.key in self.entries:
                    parent = entry.parent
                    self._drop(entry)
                    entry = parent
        if self.max_blocks is not None:
            for name in self.shared:
                table = self.tables[name]
                if len(table.cached) <= self.max_blocks:
                    continue
                for entry in sorted(self.entries.values(), key=lambda e: (e.used, -e.depth)):
                    if len(table.cached) <= self.max_blocks:
                        break
                    if entry.key in self.entries and all(
                            table.refs[b] == 0 for b in entry.blocks.get(name, ())):
                        self._drop(entry)

    def clear(self) -> None:
        """Drop every entry (their blocks go back to the pools unless rows list them); the counters start
        over."""
        for entry in [e for e in self.entries.values() if e.parent is None]:
            self._drop(entry, evicted=False)
        self.counters = dict.fromkeys(self.counters, 0)

    # ------------------------------------------------------------------ views
    def stats(self, block_bytes: dict[str, int]) -> dict:
        """``memory_stats()["prefix_cache"]``: ``block_bytes`` is one block's bytes per table."""
        blocks = {name: len(self.tables[name].cached) for name in self.shared}
        return {
            **{k: self.counters[k] for k in ("lookup_tokens", "hit_tokens")},
            "hit_rate": self.counters["hit_tokens"] / self.counters["lookup_tokens"]
            if self.counters["lookup_tokens"] else 0.0,
            "entries": len(self.entries),
            "blocks": sum(blocks.values()),
            "idle_blocks": sum(self.tables[name].idle for name in self.shared),
            "snapshots": self.snapshots,
            "bytes": self.snapshot_bytes,
            "block_bytes": sum(n * block_bytes.get(name, 0) for name, n in blocks.items()),
            "evictions": self.counters["evictions"],
            "snapshot_evictions": self.counters["snapshot_evictions"],
        }


def prefix_unit(tables: dict, qsa) -> int:
    """Tokens of one unit: a multiple of every non-windowed table's block size and of the QSA compress ratio."""
    unit = qsa.compress_ratio if qsa is not None else 1
    for table in tables.values():
        if table.window is None:
            unit = math.lcm(unit, table.block_size)
    return unit
