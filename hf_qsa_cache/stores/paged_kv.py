"""Paged attention K/V: ``[num_blocks, block_size, kv_heads, head_dim]`` per layer.

Slot ``s`` is row ``s`` of the flattened ``[num_blocks * block_size, kv_heads, head_dim]`` view. Pad
tokens carry slot -1 and are redirected into the null block (block 0), which is never read.
"""

from __future__ import annotations

import torch

from ..ops.row_writes import RowWrites
from .base import Store, grown_pool, tensor_bytes


class PagedKV(Store):
    def __init__(self, table: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        self.table = table
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def _marker(self) -> torch.Tensor | None:
        return self.keys

    def allocate(self, device, dtype) -> None:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        values = torch.zeros(shape, device=device, dtype=dtype)
        keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values, self.keys = values, keys  # keys mark the store allocated: set only once all exist

    def deallocate(self) -> None:
        self.keys = self.values = None

    def resize_blocks(self, num_blocks: int) -> None:
        """Grow the pool to ``num_blocks`` blocks, keeping what the held ones hold."""
        if self.allocated and num_blocks > self.num_blocks:
            self.values, self.keys = grown_pool(self.values, num_blocks), grown_pool(self.keys, num_blocks)
        self.num_blocks = max(num_blocks, self.num_blocks)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.keys.view(shape), self.values.view(shape)

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, writes: RowWrites) -> None:
        """keys/values ``[tokens, kv_heads, head_dim]`` at ``slots``, added to ``writes`` (the caller flushes them)."""
        if not self.allocated:
            self.allocate(keys.device, keys.dtype)
        k, v = self.flat()
        writes.add(k, slots, keys)
        writes.add(v, slots, values)

    def with_step_written(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """``(keys, values)`` pages as `write` leaves them, built out of place so that they carry this step's
        autograd history (for a layer that reads its own step's keys back from the pages while training)."""
        k, v = self.flat()
        at = slots.clamp_min(0)
        return (k.index_copy(0, at, keys.to(k.dtype)).view_as(self.keys),
                v.index_copy(0, at, values.to(v.dtype)).view_as(self.values))

    def paged_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    # Paged by position: a step writes only past its rows' lengths (no in-place rows), and stale blocks are
    # unreachable once the tables are reset (nothing to reset).

    def nbytes(self) -> dict[str, int]:
        return {"attention_kv": tensor_bytes(self.keys, self.values)}


class SlidingKV(PagedKV):
    """Paged K/V of sliding-window layers (reported apart from the full layers' K/V)."""

    def nbytes(self) -> dict[str, int]:
        return {"sliding_kv": tensor_bytes(self.keys, self.values)}
