"""Block pool and per-row block tables.

A `BlockTable` owns one pool of fixed-size blocks (a free list of physical block ids) and, for
every cache row, the list of physical blocks that hold that row's logical positions:
logical position ``p`` of row ``r`` lives in physical block ``table[r][p // block_size]`` at offset
``p % block_size``.

Physical block 0 is the *null block*: it is never handed out. Table entries that point at it are
unallocated (or released because they fell out of a sliding window), and pad tokens write into it,
so writes never need a mask.

All bookkeeping here is host-side Python; the device copy of the table is refreshed only when it
changed (`device_table`).
"""

from __future__ import annotations

import torch

NULL_BLOCK = 0


class BlockTable:
    def __init__(self, name: str, num_blocks: int, block_size: int, max_rows: int, window: int | None = None):
        if block_size <= 0:
            raise ValueError(f"{name}: block_size must be positive, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"{name}: num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_rows = max_rows
        # A window of w means position p only needs positions >= p - w + 1 afterwards; older blocks are freed.
        self.window = window
        self.reset()

    def reset(self) -> None:
        # Hand out low ids first (pop from the end of a descending list).
        self.free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))
        self.rows: list[list[int]] = [[] for _ in range(self.max_rows)]
        self._device_tables: dict[torch.device, torch.Tensor] = {}
        self._version = 0
        self._device_versions: dict[torch.device, int] = {}
        # Undo record of the step in flight: each row's table length before it, and the blocks it took.
        self._step_marks: list[int] | None = None
        self._step_taken: list[int] = []

    # ------------------------------------------------------------------ one step: reserve, then commit or roll back
    def begin_step(self, num_rows: int) -> None:
        """Start recording what `reserve` takes, so that `rollback_step` can return it exactly."""
        self._step_marks = [len(t) for t in self.rows[:num_rows]]
        self._step_taken = []

    def commit_step(self, new_lengths: list[int]) -> None:
        """The step landed: free what fell out of the window at the rows' new lengths."""
        for row, length in enumerate(new_lengths):
            self.release_out_of_window(row, length)
        self._step_marks = None
        self._step_taken = []

    def rollback_step(self) -> None:
        """Return the table and the free list to exactly what they were at `begin_step`."""
        if self._step_marks is None:
            return
        for row, mark in enumerate(self._step_marks):
            del self.rows[row][mark:]
        self.free.extend(reversed(self._step_taken))
        self._version += 1
        self._step_marks = None
        self._step_taken = []

    # ------------------------------------------------------------------ planning (no mutation)
    def blocks_needed(self, row: int, new_len: int) -> int:
        """Free blocks `reserve(row, new_len)` would take from the pool."""
        want = -(-new_len // self.block_size)
        have = len(self.rows[row])
        first_live = self._first_live_block(new_len)
        # Blocks below the window are never allocated, so they cost nothing.
        return sum(1 for i in range(have, want) if i >= first_live)

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
        keep_from = self._first_live_block(new_len)
        if len(table) < want:
            self._version += 1  # the device copy is refreshed only when a table changed
        while len(table) < want:
            if len(table) < keep_from:
                table.append(NULL_BLOCK)
            else:
                if not self.free:
                    raise ValueError(f"{self.name}: block pool exhausted ({self.num_blocks - 1} blocks)")
                table.append(self.free.pop())
                if self._step_marks is not None:
                    self._step_taken.append(table[-1])

    def release_out_of_window(self, row: int, length: int) -> None:
        if self.window is None:
            return
        table = self.rows[row]
        first_live = self._first_live_block(length)
        changed = False
        for i in range(min(first_live, len(table))):
            if table[i] != NULL_BLOCK:
                self.free.append(table[i])
                table[i] = NULL_BLOCK
                changed = True
        if changed:
            self._version += 1

    def truncate(self, row: int, new_len: int) -> None:
        """Return the blocks past ``new_len`` to the pool (crop)."""
        table = self.rows[row]
        want = -(-new_len // self.block_size)
        if len(table) > want:
            self._version += 1
        while len(table) > want:
            b = table.pop()
            if b != NULL_BLOCK:
                self.free.append(b)

    def release_row(self, row: int) -> None:
        self.truncate(row, 0)

    # ------------------------------------------------------------------ views
    def blocks_in_use(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def row_blocks_in_use(self, row: int) -> int:
        return sum(1 for b in self.rows[row] if b != NULL_BLOCK)

    def device_table(self, num_rows: int, device: torch.device, min_columns: int = 1) -> torch.Tensor:
        """``[num_rows, columns]`` int32 table on ``device``; missing entries are the null block."""
        device = torch.device(device)
        columns = max(min_columns, max((len(t) for t in self.rows[:num_rows]), default=0), 1)
        cached = self._device_tables.get(device)
        if (
            cached is not None
            and self._device_versions.get(device) == self._version
            and cached.shape[0] == num_rows
            and cached.shape[1] >= columns
        ):
            return cached
        host = torch.zeros(num_rows, columns, dtype=torch.int32)
        for r in range(num_rows):
            if self.rows[r]:
                host[r, : len(self.rows[r])] = torch.tensor(self.rows[r], dtype=torch.int32)
        table = host.to(device, non_blocking=True) if device.type == "cuda" else host
        self._device_tables[device] = table
        self._device_versions[device] = self._version
        return table
