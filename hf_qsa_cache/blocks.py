"""Block pool and per-row block tables.

A `BlockTable` owns one pool of fixed-size blocks (a free list of physical block ids) and, for
every cache row, the list of physical blocks that hold that row's logical positions:
logical position ``p`` of row ``r`` lives in physical block ``rows[r][p // block_size]`` at offset
``p % block_size``.

Physical block 0 is the *null block*: it is never handed out. Table entries that point at it are
unallocated (or released because they fell out of a sliding window), and pad tokens write into it,
so writes never need a mask.

Windowed tables (``window`` set) keep per row only the blocks a next query can read: ``base[r]`` is
the first logical block that may still hold a live block, so releasing old blocks walks from there
and no step ever scans a row's history.

The device copy is one persistent ``[max_rows, max_columns]`` int32 tensor (``max_columns`` covers
``max_len`` positions), so its address never changes (CUDA graphs replay against it). The host
records every entry it changes; `device_table` writes only those entries, so a step's host and copy
work is proportional to the blocks it touched, never to the rows' lengths. ``work`` counts table
entries visited by the host, for tests of that bound.

Shared blocks (prefix caching, `hf_qsa_cache.prefix_cache`): a block may be listed by several rows and
held by the prefix cache. ``refs[b]`` counts the rows that list ``b``; ``cached`` holds the blocks a
prefix entry keeps. A block is free only at zero references and not cached; a cached block at zero
references is *idle*: it keeps its content for a later request, and counts as available capacity
(`available`), because the prefix cache gives it back whenever the pool needs it (`PrefixCache.make_room`,
always outside a step). Rows copied from one another (beam search: `select_rows`) share their full blocks the
same way. Rows only write positions past their lengths, and a crop never brings a row's length into a shared block
(`shares_from`, which `rollback.crop_rows` asks), so a shared block is never written. The tables alone know which
blocks are shared: nothing else keeps a copy of it.
"""

from __future__ import annotations

import torch

from .ops import int_tensor

NULL_BLOCK = 0


def default_num_blocks(rows: int, block_size: int, max_len: int, window: int | None = None) -> int:
    """Blocks (the null block included) that let every one of ``rows`` rows reach ``max_len`` positions.

    A windowed row holds at most ``ceil(window / block_size) + 1`` live blocks after a step and twice
    that while a step is in flight, never more than a whole row would."""
    per_row = -(-max_len // block_size)
    if window is not None:
        per_row = min(2 * (-(-window // block_size) + 1), per_row + 1)
    return rows * per_row + 1


class BlockTable:
    def __init__(self, name: str, num_blocks: int, block_size: int, max_rows: int, max_len: int,
                 window: int | None = None):
        if block_size <= 0:
            raise ValueError(f"{name}: block_size must be positive, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"{name}: num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_columns = max(1, -(-max_len // block_size))
        # A window of w means position p only needs positions >= p - w + 1 afterwards; older blocks are freed.
        self.window = window
        self.work = 0
        self._device: torch.Tensor | None = None
        self._view: tuple | None = None  # (device table, rows, its first rows): `device_table`'s last answer
        self.reset()

    def reset(self, keep_cached: bool = True) -> None:
        """Every row released. Blocks the prefix cache holds stay cached (idle) unless ``keep_cached`` is
        False (the prefix cache drops its entries first)."""
        cached = getattr(self, "cached", set()) if keep_cached else set()
        self.cached: set[int] = cached  # blocks prefix entries hold (`mark_cached`)
        self.refs = [0] * self.num_blocks  # rows listing each block
        self.idle = len(cached)  # cached blocks no row lists: evictable, counted as available
        # Hand out low ids first (pop from the end of a descending list).
        self.free = [b for b in range(self.num_blocks - 1, NULL_BLOCK, -1) if b not in cached]
        self.rows: list[list[int]] = [[] for _ in range(self.max_rows)]
        self.base = [0] * self.max_rows  # windowed: entries below base are all the null block
        self._changed: dict[tuple[int, int], int] = {}  # (row, column) -> block, not yet on the device
        if self._device is not None:
            self._device.zero_()
        # Undo record of the step in flight: the table length before it of each row it changed (None: no
        # step in flight), and the blocks it took.
        self._step_marks: dict[int, int] | None = None
        self._step_taken: list[int] = []

    def grow(self, num_blocks: int, max_len: int) -> None:
        """Enlarge the pool to ``num_blocks`` and let rows reach ``max_len`` positions, keeping every held
        entry: the new blocks join the free list behind the free ones, and the device table is widened
        (held columns copied over, a new address). Never shrinks."""
        if self._step_marks is not None:
            raise RuntimeError(f"{self.name}: cannot grow while a step is in flight")
        num_blocks = max(num_blocks, self.num_blocks)
        columns = max(self.max_columns, -(-max_len // self.block_size))
        if self._device is not None and columns > self.max_columns:
            wider = torch.zeros(self.max_rows, columns, dtype=self._device.dtype, device=self._device.device)
            wider[:, : self.max_columns] = self._device
            self._device = wider
        self.free[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)  # popped from the end: handed out last
        self.refs.extend([0] * (num_blocks - self.num_blocks))
        self.num_blocks = num_blocks
        self.max_columns = columns

    def _set(self, row: int, column: int, block: int) -> None:
        self._changed[(row, column)] = block
        self.work += 1

    # ------------------------------------------------------------------ references (shared blocks)
    def _take(self) -> int:
        """A free block, now listed by one row."""
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _unref(self, block: int) -> None:
        """A row no longer lists ``block``: free at zero references, idle if the prefix cache holds it."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.cached:
                self.idle += 1
            else:
                self.free.append(block)

    def available(self) -> int:
        """Blocks a step may take: the free ones and the idle cached ones (the prefix cache gives those back)."""
        return len(self.free) + self.idle

    def mark_cached(self, block: int) -> None:
        """A prefix entry holds ``block`` (listed by a row now): it outlives the row."""
        if block in self.cached or block == NULL_BLOCK:
            raise ValueError(f"{self.name}: block {block} cannot be cached twice or be the null block")
        self.cached.add(block)
        if self.refs[block] == 0:
            self.idle += 1

    def uncache(self, block: int) -> None:
        """The prefix entry holding ``block`` is gone: free if no row lists it."""
        self.cached.remove(block)
        if self.refs[block] == 0:
            self.idle -= 1
            self.free.append(block)

    def attach(self, row: int, blocks: list[int]) -> None:
        """An empty ``row`` lists ``blocks`` (shared, full blocks of a cached prefix) as its first columns.
        Outside a step only."""
        if self._step_marks is not None:
            raise RuntimeError(f"{self.name}: cannot share blocks while a step is in flight")
        table = self.rows[row]
        if table:
            raise ValueError(f"{self.name}: row {row} holds blocks; shared blocks start an empty row")
        for column, block in enumerate(blocks):
            if self.refs[block] == 0 and block in self.cached:
                self.idle -= 1
            self.refs[block] += 1
            table.append(block)
            self._set(row, column, block)

    def check_accounting(self) -> None:
        """Raise unless every block but the null block is exactly one of: free, listed by rows (``refs``
        times), idle cached (for tests)."""
        listed = [0] * self.num_blocks
        for blocks in self.rows:
            for b in blocks:
                if b != NULL_BLOCK:
                    listed[b] += 1
        free = set(self.free)
        if len(free) != len(self.free):
            raise AssertionError(f"{self.name}: a block is free twice")
        idle = 0
        for b in range(1, self.num_blocks):
            if listed[b] != self.refs[b]:
                raise AssertionError(f"{self.name}: block {b} listed {listed[b]} times, refs {self.refs[b]}")
            if b in free and (listed[b] or b in self.cached):
                raise AssertionError(f"{self.name}: block {b} is free and listed or cached")
            if b not in free and not listed[b] and b not in self.cached:
                raise AssertionError(f"{self.name}: block {b} is lost (not free, listed or cached)")
            idle += b in self.cached and not listed[b]
        if idle != self.idle:
            raise AssertionError(f"{self.name}: {idle} idle cached blocks, counted {self.idle}")

    # ------------------------------------------------------------------ one step: reserve, then commit or roll back
    def begin_step(self, num_rows: int) -> None:
        """Start recording what `reserve` takes, so that `rollback_step` can return it exactly (a row's
        length is recorded when the step first changes it)."""
        self._step_marks = {}
        self._step_taken = []

    def commit_step(self, new_lengths: list[int]) -> None:
        """The step landed: free what fell out of the window at the rows' new lengths (only rows whose
        window passed a block boundary do any work)."""
        if self.window is not None:
            base, block_size, reach = self.base, self.block_size, self.window - 1
            for row, length in enumerate(new_lengths):
                if (length - reach) // block_size > base[row]:  # the first live block moved past base
                    self.release_out_of_window(row, length)
        self._step_marks = None
        self._step_taken = []

    def rollback_step(self) -> None:
        """Return the table and the free list to exactly what they were at `begin_step`."""
        if self._step_marks is None:
            return
        for row, mark in self._step_marks.items():
            self._drop_columns(row, mark, return_blocks=False)
        for block in self._step_taken:  # fresh blocks of this step: listed by one row, which gave them back
            self.refs[block] = 0
        self.free.extend(reversed(self._step_taken))
        self._step_marks = None
        self._step_taken = []

    # ------------------------------------------------------------------ planning (no mutation)
    def longest_row(self) -> int | None:
        """The most positions one row can hold with the whole pool to itself, growing to it one position a step,
        or None where the pool never limits a row (a window's live blocks always fit)."""
        usable, size = self.num_blocks - 1, self.block_size  # (the null block is nobody's)
        if self.window is None:
            return usable * size
        # A step to length m holds ceil(m / size) blocks less those wholly below the window at the length before
        # it (they go when the step lands, `commit_step`); past the window that count repeats with period `size`,
        # its peak this one.
        if (self.window + 2 * size - 2) // size <= usable:
            return None
        m = 1
        while -(-(m + 1) // size) - self._first_live_block(m) <= usable:  # (within the window's first period)
            m += 1
        return m

    def blocks_needed(self, row: int, new_len: int) -> int:
        """Free blocks `reserve(row, new_len)` would take from the pool."""
        want = -(-new_len // self.block_size)
        start = max(len(self.rows[row]), self._first_live_block(new_len))  # blocks below the window cost nothing
        return max(0, want - start)

    def blocks_needed_rows(self, new_lengths: list[int]) -> int:
        """Free blocks reserving rows ``0, 1, ...`` to ``new_lengths`` would take (`reserve_rows`). A row that
        stays within the blocks it has costs a comparison."""
        block_size, window, need = self.block_size, self.window, 0
        for n, table in zip(new_lengths, self.rows):
            if n > len(table) * block_size:  # (`blocks_needed`, inline: a decode step asks this of every row)
                start = len(table) if window is None else max(len(table), max(0, n - window + 1) // block_size)
                need += max(0, -(-n // block_size) - start)
        return need

    def _first_live_block(self, length: int) -> int:
        if self.window is None:
            return 0
        # The next query (position `length`) still reads positions >= length - window + 1.
        oldest = max(0, length - self.window + 1)
        return oldest // self.block_size

    # ------------------------------------------------------------------ mutation
    def reserve(self, row: int, new_len: int) -> None:
        """Make positions ``[0, new_len)`` of ``row`` addressable.

        With a window, blocks wholly below it are never allocated, not even for positions a long
        prefill writes in this step: ops read same-step keys and taps from the activations, so those
        writes go to the null block and a row never holds more than the window's blocks. Blocks that
        fall out of the window are freed only when the step commits (`commit_step`), so a step that
        fails can be undone without losing keys the previous length still reads.
        """
        table = self.rows[row]
        want = -(-new_len // self.block_size)
        if want > self.max_columns:
            raise ValueError(f"{self.name}: row {row} needs {want} blocks, the table holds {self.max_columns}")
        if len(table) >= want:  # (the window's first live block is never past `want`: nothing to fill below it)
            return
        marks = self._step_marks
        if marks is not None and row not in marks:
            marks[row] = len(table)
        keep_from = self._first_live_block(new_len)
        if len(table) < keep_from:  # wholly below the window: null entries (already zero on the device)
            table.extend([NULL_BLOCK] * (keep_from - len(table)))
        for column in range(len(table), want):
            if not self.free:
                raise ValueError(f"{self.name}: block pool exhausted ({self.num_blocks - 1} blocks)")
            block = self._take()
            table.append(block)
            self._set(row, column, block)
            if marks is not None:
                self._step_taken.append(block)

    def reserve_rows(self, new_lengths: list[int]) -> None:
        """`reserve` rows ``0, 1, ...`` to ``new_lengths``; rows within the blocks they hold are not visited
        further (nothing to reserve: the null entries below a window come only with new blocks)."""
        rows, block_size = self.rows, self.block_size
        for row, n in enumerate(new_lengths):
            if n > len(rows[row]) * block_size:
                self.reserve(row, n)

    def release_out_of_window(self, row: int, length: int) -> None:
        if self.window is None:
            return
        table = self.rows[row]
        first_live = min(self._first_live_block(length), len(table))
        for i in range(self.base[row], first_live):
            self.work += 1
            if table[i] != NULL_BLOCK:
                self._unref(table[i])
                table[i] = NULL_BLOCK
                self._set(row, i, NULL_BLOCK)
        self.base[row] = max(self.base[row], first_live)

    def _drop_columns(self, row: int, keep: int, return_blocks: bool) -> None:
        """Shorten ``row`` to ``keep`` columns, last column first; only columns from ``base`` on can hold a
        block (those below are null), so a windowed row's long null prefix is dropped without a visit."""
        table = self.rows[row]
        if len(table) <= keep:
            return
        for column in range(len(table) - 1, max(keep, self.base[row]) - 1, -1):
            b = table[column]
            if b != NULL_BLOCK:
                self._set(row, column, NULL_BLOCK)
                if return_blocks:
                    self._unref(b)
        del table[keep:]
        self.base[row] = min(self.base[row], keep)

    def truncate(self, row: int, new_len: int) -> None:
        """Return the blocks past ``new_len`` to the pool (crop)."""
        self._drop_columns(row, -(-new_len // self.block_size), return_blocks=True)

    def release_row(self, row: int) -> None:
        self.truncate(row, 0)
        self.base[row] = 0

    def move_rows(self, src: list[int], num_rows: int) -> None:
        """Row ``i`` takes over row ``src[i]``'s blocks (``-1``: a new, empty row); rows ``[0, num_rows)``
        that no entry names give theirs back. Blocks change owner, not content: no data moves.

        Only rows that change are visited, each from its ``base`` on (a windowed row's null prefix is
        not), and a row's block list changes hands without a copy."""
        changed = [i for i, s in enumerate(src) if s != i] + list(range(len(src), num_rows))
        if not changed:
            return
        for row in sorted(set(range(num_rows)).difference(src)):  # rows no entry names
            self.release_row(row)
        rows, bases = self.rows, self.base
        # Every changed row's new list and base before any is replaced (a row's list may go to an earlier row).
        taken = [(rows[src[i]], bases[src[i]]) if i < len(src) and src[i] >= 0 else ([], 0) for i in changed]
        for i, (blocks, base) in zip(changed, taken):
            old, old_base = rows[i], bases[i]
            # Entries below a list's base are null, and the device holds null past a list's end: only the
            # columns from a list's base to its end (each list's live span) can differ.
            old_end, end = len(old), len(blocks)
            for column in range(base, end):
                block = blocks[column]
                if block != (old[column] if old_base <= column < old_end else NULL_BLOCK):
                    self._set(i, column, block)
            for column in range(old_base, old_end):
                if old[column] != NULL_BLOCK and not base <= column < end:
                    self._set(i, column, NULL_BLOCK)
            rows[i], bases[i] = blocks, base

    def _select_plan(self, src: list[int], num_rows: int, lengths: list[int]):
        """What `select_rows` does: ``(moved, released, plan)``, ``plan`` one ``(row, blocks, base, keep)`` per
        moved row, where the row lists ``blocks[:keep]`` by reference and copies the rest. It keeps its source's
        full blocks (wholly below the source's length: never written again); the last, partial block too when
        the source row is released and this is the first row to take it (a permutation of rows copies nothing)."""
        moved = [i for i in range(len(src)) if src[i] != i]
        released = [*moved, *range(len(src), num_rows)]
        gone = set(released) - {i for i in range(len(src)) if src[i] == i}  # source rows whose own row is released
        plan = []
        for i in moved:
            s, blocks = src[i], self.rows[src[i]]
            keep = len(blocks) if s in gone else lengths[s] // self.block_size
            gone.discard(s)  # a second copy of the same row copies its partial block
            plan.append((i, list(blocks), self.base[s], keep))
        return moved, released, plan

    def blocks_for_select(self, src: list[int], num_rows: int, lengths: list[int]) -> int:
        """Free blocks `select_rows(src, num_rows, lengths)` takes beyond those it gives back."""
        _, released, plan = self._select_plan(src, num_rows, lengths)
        change: dict[int, int] = {}  # block -> its change of references
        taken = 0
        for _, blocks, _, keep in plan:
            for column, b in enumerate(blocks):
                if b != NULL_BLOCK:
                    if column < keep:
                        change[b] = change.get(b, 0) + 1
                    else:
                        taken += 1
        for i in released:
            for b in self.rows[i]:
                if b != NULL_BLOCK:
                    change[b] = change.get(b, 0) - 1
        # Only blocks no row lists afterwards and no prefix entry holds come back.
        returned = sum(1 for b, d in change.items() if d < 0 and self.refs[b] + d == 0 and b not in self.cached)
        return max(0, taken - returned)

    def select_rows(self, src: list[int], num_rows: int, lengths: list[int]) -> tuple[list[int], list[int]]:
        """Row ``i`` takes row ``src[i]``'s blocks (beam search, repeat, select; ``lengths``: the rows' lengths
        before); rows ``len(src) .. num_rows - 1`` give theirs back.

        A block wholly below its source row's length is never written again (a step writes past a row's length,
        and a crop never reaches into a block rows share, `shares_from`): the row lists it, one reference
        more. The last, partial block is copied into a fresh one, unless the source row is released and this is
        its first taker (`_select_plan`). Only rows that change are touched: their sources' blocks are read and
        referenced first (a source may itself be replaced), their own are released, then each gets its list.
        Returns ``(old, new)`` physical blocks: the stores copy block ``old[j]`` into ``new[j]``.
        """
        _, released, plan = self._select_plan(src, num_rows, lengths)
        for _, blocks, _, keep in plan:  # referenced before any row lets go of them
            for b in blocks[:keep]:
                if b != NULL_BLOCK:
                    self.refs[b] += 1
        for i in released:
            self.release_row(i)
        old, new = [], []
        for i, blocks, base, keep in plan:
            for column, b in enumerate(blocks):
                block = b
                if b != NULL_BLOCK and column >= keep:
                    block = self._take()
                    old.append(b)
                    new.append(block)
                self.rows[i].append(block)
                if block != NULL_BLOCK:
                    self._set(i, column, block)
            self.base[i] = base
        return old, new

    def _shared(self, block: int) -> bool:
        """Whether ``block`` is listed by more than one row or kept by a prefix entry (it is never written)."""
        return block != NULL_BLOCK and (self.refs[block] > 1 or block in self.cached)

    def shares_from(self, row: int, length: int) -> bool:
        """Whether a block of ``row`` holding a position ``>= length`` is shared (`_shared`): ``row`` cropped to
        ``length`` would write it. Looks only at those blocks, so a crop's check costs what it drops."""
        blocks, first = self.rows[row], max(length // self.block_size, self.base[row])
        return any(self._shared(blocks[column]) for column in range(first, len(blocks)))

    def shared_columns(self, row: int) -> int:
        """Columns of ``row`` up to its last shared block (`_shared`; 0: none)."""
        blocks = self.rows[row]
        for column in range(len(blocks) - 1, self.base[row] - 1, -1):
            if self._shared(blocks[column]):
                return column + 1
        return 0

    # ------------------------------------------------------------------ views
    def blocks_in_use(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def row_blocks_in_use(self, row: int) -> int:
        return sum(1 for b in self.rows[row] if b != NULL_BLOCK)

    def device_table(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """``[num_rows, max_columns]`` int32 view of the persistent device table (null block = 0).

        Entries changed since the last call are written first (one small copy); a new device gets
        a whole copy.
        """
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if self._device is None or self._device.device != device:
            host = torch.zeros(self.max_rows, self.max_columns, dtype=torch.int32)
            for r, blocks in enumerate(self.rows):
                if blocks:
                    host[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
                    self.work += len(blocks)
            self._device = host.to(device)
            self._changed.clear()
        elif self._changed:
            _land_changes([self], device)
        view = self._view
        if view is None or view[0] is not self._device or view[1] != num_rows:
            view = self._view = (self._device, num_rows, self._device[:num_rows])  # kept while both hold
        return view[2]


def _land_changes(tables: list[BlockTable], device: torch.device) -> None:
    """Write the entries each of ``tables`` changed since it last landed them into its device table (every one
    already on ``device``): one host-to-device copy for all of them, one ``index_copy_`` each."""
    offsets, values, ends = [], [], []
    for table in tables:
        width = table.max_columns
        offsets.extend(r * width + c for r, c in table._changed)
        values.extend(table._changed.values())
        ends.append(len(offsets))
    changes = int_tensor([offsets, values]).to(device, non_blocking=True)
    entries = changes[1].to(torch.int32)
    start = 0
    for table, end in zip(tables, ends):
        table._device.view(-1).index_copy_(0, changes[0, start:end], entries[start:end])
        table._changed.clear()
        start = end


def device_tables(tables: dict[str, BlockTable], num_rows: int, device) -> dict[str, torch.Tensor]:
    """`BlockTable.device_table` of each of ``tables`` (by name), the entries they changed since the last step
    landed with one host-to-device copy for all of them instead of one a table (a decode step of Inkling changes
    its conv table's entries at almost every step, and often the others')."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    changed = [t for t in tables.values() if t._changed and t._device is not None and t._device.device == device]
    if len(changed) > 1:
        _land_changes(changed, device)
    return {name: table.device_table(num_rows, device) for name, table in tables.items()}
