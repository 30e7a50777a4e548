"""`Store`: what every kind of cached state offers the cache, which loops over its layers' stores.

A store holds one kind of state of one layer (paged K/V, the QSA index, GatedDeltaNet state, Inkling's
conv taps) or of the cache (the token log). Its tensors are made by `allocate` (at the first forward of
its layer, on that layer's device and in its dtype, or up front), and fall in three groups the cache
treats alike for every store:

* ``paged_tensors``: indexed by physical block of the store's block table (``table``); a row's data
  moves by changing which blocks it owns, never by copying;
* ``row_tensors``: indexed by cache row; copied when rows change place (`QSAPagedCache.select_rows`,
  `move_rows`);
* ``inplace_rows``: the per-row state a step overwrites in place (dim 0: cache row), which a step copies aside
  before it writes (`hf_qsa_cache.step.UndoCopies`, which owns the copies);
* ``snapshot_tensors``: the per-row state a prefix snapshot copies out and back (`hf_qsa_cache.prefix_cache`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def grown_pool(pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``pool`` (``[blocks, ...]``) with ``num_blocks`` blocks: the held ones copied, the new ones zero."""
    bigger = pool.new_zeros((num_blocks, *pool.shape[1:]))
    bigger[: pool.shape[0]] = pool
    return bigger


class Store(ABC):
    table: str | None = None  # the block table the store is paged on; None: dense per row

    @abstractmethod
    def _marker(self) -> torch.Tensor | None:
        """The tensor `allocate` sets last: the store is allocated once it exists."""

    @property
    def allocated(self) -> bool:
        return self._marker() is not None

    @property
    def dtype(self) -> torch.dtype | None:
        marker = self._marker()
        return None if marker is None else marker.dtype

    @abstractmethod
    def allocate(self, device, dtype: torch.dtype) -> None:
        """Make every tensor (zeros, or the state a fresh row starts from)."""

    @abstractmethod
    def deallocate(self) -> None:
        """Drop every tensor (the cache follows its model into another dtype)."""

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes held, by what they hold (`QSAPagedCache.memory_stats` sums them over layers)."""

    def resize_blocks(self, num_blocks: int) -> None:
        """Grow a paged store's pool to ``num_blocks`` blocks, keeping the held ones (`QSAPagedCache.grow`)."""

    def paged_tensors(self) -> list[torch.Tensor]:
        return []

    def row_tensors(self) -> list[torch.Tensor]:
        return []

    def inplace_rows(self) -> list[torch.Tensor]:
        return []

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """Row-indexed tensors (dim 0: cache row) a prefix snapshot copies: one row's state at a point, besides
        its paged blocks (`hf_qsa_cache.prefix_cache`). Default: `row_tensors`."""
        return self.row_tensors()

    def reset(self) -> None:
        """Every row back to the state a fresh row starts from (paged stores: nothing; the tables decide what
        is live)."""

    def reset_rows(self, rows: list[int]) -> None:
        """Rows ``rows`` start new sequences (continuous batching)."""
