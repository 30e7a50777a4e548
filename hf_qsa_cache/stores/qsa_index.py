"""QSA indexer state: the raw-key ring of the open group, and the compressed-key store.

* Ring: per cache row ``capacity`` raw index keys (no norm, no RoPE) with their exact three-axis
  RoPE positions, at ``row * capacity + position % capacity``. It only ever holds keys of groups that
  are still open (plus speculative headroom); raw keys of closed groups are not kept. One extra ring
  (index ``max_rows``) absorbs pad writes.
* Compressed keys: one row per closed group (pooled, normed, rotated once), paged on the main
  block table: ``block_size / ratio`` rows per block, so they are freed with the main K/V. With
  ``index_dtype=torch.float8_e4m3fn`` they are fp8 with one fp32 scale per key beside them
  (``compressed_scales`` ``[num_blocks, rows_per_block]``): a write quantizes (`hf_qsa_cache.ops.fp8`), the
  index scores widen what they read. The ring stays in the model's dtype.
"""

from __future__ import annotations

import copy

import torch

from ..ops.fp8 import FP8, SCALE_DTYPE, fp8_zeros
from ..ops.qsa import paged_rows
from ..ops.row_writes import RowWrites
from .base import Store, grown_pool, tensor_bytes


class QSAIndexStore(Store):
    def __init__(self, table: str, num_blocks: int, block_size: int, ratio: int, max_rows: int, capacity: int,
                 index_head_dim: int, index_dtype: torch.dtype | None = None):
        self.table = table
        self.num_blocks = num_blocks
        self.rows_per_block = block_size // ratio
        self.ratio = ratio
        self.max_rows = max_rows
        self.capacity = capacity
        self.index_head_dim = index_head_dim
        self.ring_keys: torch.Tensor | None = None  # [(max_rows + 1) * capacity, Di]
        self.ring_positions: torch.Tensor | None = None  # [(max_rows + 1) * capacity, 3] int64
        self.compressed: torch.Tensor | None = None  # [num_blocks, rows_per_block, Di]
        self.index_dtype = index_dtype  # None: the model's dtype; torch.float8_e4m3fn: fp8 with scales
        self.compressed_scales: torch.Tensor | None = None  # fp8 only: [num_blocks, rows_per_block] fp32
        self._raw: torch.Tensor | None = None  # fp8 only: the compressed keys as bytes

    def _marker(self) -> torch.Tensor | None:
        return self.compressed

    @property
    def quantized(self) -> bool:
        return self.index_dtype == FP8

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the activations the store was allocated for (its compressed keys may be fp8)."""
        return None if self.compressed is None else self.ring_keys.dtype

    def allocate(self, device, dtype) -> None:
        ring_rows = (self.max_rows + 1) * self.capacity
        ring_keys = torch.zeros(ring_rows, self.index_head_dim, device=device, dtype=dtype)
        ring_positions = torch.zeros(ring_rows, 3, device=device, dtype=torch.int64)
        shape = (self.num_blocks, self.rows_per_block, self.index_head_dim)
        if self.quantized:
            self.compressed_scales = torch.zeros(shape[:2], device=device, dtype=SCALE_DTYPE)
            self._raw, compressed = fp8_zeros(shape, device)
        else:
            compressed = torch.zeros(shape, device=device, dtype=dtype)
        # Set together once all exist (``compressed`` marks the store allocated).
        self.ring_keys, self.ring_positions = ring_keys, ring_positions
        self.compressed = compressed

    def deallocate(self) -> None:
        self.ring_keys = self.ring_positions = self.compressed = None
        self.compressed_scales = self._raw = None

    def resize_blocks(self, num_blocks: int) -> None:
        """Grow the compressed-key pool to ``num_blocks`` blocks, keeping the held rows (the ring is per
        cache row and does not depend on the pool)."""
        if self.compressed is not None and num_blocks > self.num_blocks:
            if self.quantized:
                self.compressed_scales = grown_pool(self.compressed_scales, num_blocks)
                self._raw = grown_pool(self._raw, num_blocks)
                self.compressed = self._raw.view(FP8)
            else:
                self.compressed = grown_pool(self.compressed, num_blocks)
        self.num_blocks = max(num_blocks, self.num_blocks)

    def rows_from(self, first: int) -> "QSAIndexStore":
        """This store seen from cache row ``first`` on (a group of a grouped step): its ring viewed from that row's
        entries (the spare ring stays where it is); the compressed keys are paged, the same for every row."""
        if not first:
            return self
        view = copy.copy(self)
        view.max_rows = self.max_rows - first
        view.ring_keys = self.ring_keys[first * self.capacity:]
        view.ring_positions = self.ring_positions[first * self.capacity:]
        return view

    def ring_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Ring rows of a step's tokens from their ring slots (`StepMetadata.ring_slot`; -1: the trash row)."""
        trash = self.max_rows * self.capacity
        return torch.where(slots < 0, trash, slots)

    def write_ring(self, rows: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor,
                   writes: RowWrites) -> None:
        """raw_keys ``[tokens, Di]``, positions ``[tokens, 3]`` at ring ``rows`` (`ring_rows`, none negative),
        added to ``writes``."""
        writes.add(self.ring_keys, rows, raw_keys)
        writes.add(self.ring_positions, rows, positions)

    def group_rows(self, work: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Compressed-store row of group ``work[w] = (row, group)``: group ``g`` sits in the block of its tokens,
        at row ``g % rows_per_block``; unused items ``(-1, -1)`` get -1 (the null block)."""
        row, group = work[:, 0].long(), work[:, 1].long().clamp_min(0)
        rows = paged_rows(block_table, row.clamp_min(0), group, self.rows_per_block)
        return torch.where(row >= 0, rows, -1)

    def write_groups(self, rows: torch.Tensor, keys: torch.Tensor, writes: RowWrites) -> None:
        """Compressed key ``keys[w]`` at store row ``rows[w]`` (`group_rows`), added to ``writes``."""
        if self.quantized:
            writes.add_quantized(self.compressed.view(-1, self.index_head_dim), self.compressed_scales.view(-1),
                                 rows, keys)
            return
        writes.add(self.compressed.view(-1, self.index_head_dim), rows, keys)

    def inplace_rows(self) -> list[torch.Tensor]:
        """The ring, one row per cache row: overwritten in place by position modulo its capacity (compressed
        keys are paged by position, so a step never overwrites a read one)."""
        return self.row_tensors()

    def paged_tensors(self) -> list[torch.Tensor]:
        if self.quantized:  # as raw bytes, and the scales: what copying a row's blocks copies
            return [t for t in (self._raw, self.compressed_scales) if t is not None]
        return [self.compressed] if self.compressed is not None else []

    def row_tensors(self) -> list[torch.Tensor]:
        if self.ring_keys is None:
            return []
        return [
            self.ring_keys.view(self.max_rows + 1, self.capacity, -1),
            self.ring_positions.view(self.max_rows + 1, self.capacity, 3),
        ]

    # Nothing to reset: ring rows are rewritten before they are read; compressed rows follow the tables.

    def nbytes(self) -> dict[str, int]:
        return {
            "qsa_ring": tensor_bytes(self.ring_keys, self.ring_positions),
            "qsa_compressed": tensor_bytes(*self.paged_tensors()),
        }
