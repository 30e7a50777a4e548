"""Paged attention K/V: ``[num_blocks, block_size, kv_heads, head_dim]`` per layer.

Slot ``s`` is row ``s`` of the flattened ``[num_blocks * block_size, kv_heads, head_dim]`` view. Pad
tokens carry slot -1 and are redirected into the null block (block 0), which is never read.

With ``kv_dtype=torch.float8_e4m3fn`` the keys and values are fp8 and each (slot, head) has an fp32 scale beside
them (``key_scales`` / ``value_scales`` ``[num_blocks, block_size, kv_heads]``, paged with the values): a write
quantizes (`hf_qsa_cache.ops.fp8`), the attention ops widen what they read.
"""

from __future__ import annotations

import torch

from ..ops.fp8 import FP8, SCALE_DTYPE, dequantize_fp8, fp8_zeros
from ..ops.row_writes import RowWrites
from .base import Store, grown_pool, tensor_bytes


class PagedKV(Store):
    def __init__(self, table: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: torch.dtype | None = None):
        self.table = table
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype  # None: the model's dtype; torch.float8_e4m3fn: fp8 with scales
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None  # fp8 only: [num_blocks, block_size, kv_heads] fp32
        self.value_scales: torch.Tensor | None = None
        self._raw: tuple[torch.Tensor, torch.Tensor] | None = None  # fp8 only: (keys, values) as bytes
        self._model_dtype: torch.dtype | None = None

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == FP8

    def _marker(self) -> torch.Tensor | None:
        return self.keys

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the activations the store was allocated for (its values may be fp8)."""
        return self._model_dtype if self.keys is not None else None

    def allocate(self, device, dtype) -> None:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.quantized:
            (raw_v, values), (raw_k, keys) = fp8_zeros(shape, device), fp8_zeros(shape, device)
            self.key_scales = torch.zeros(shape[:3], device=device, dtype=SCALE_DTYPE)
            self.value_scales = torch.zeros(shape[:3], device=device, dtype=SCALE_DTYPE)
            self._raw = raw_k, raw_v
        else:
            values = torch.zeros(shape, device=device, dtype=dtype)
            keys = torch.zeros(shape, device=device, dtype=dtype)
        self._model_dtype = dtype
        self.values, self.keys = values, keys  # keys mark the store allocated: set only once all exist

    def deallocate(self) -> None:
        self.keys = self.values = self.key_scales = self.value_scales = self._raw = None

    def resize_blocks(self, num_blocks: int) -> None:
        """Grow the pool to ``num_blocks`` blocks, keeping what the held ones hold."""
        if self.allocated and num_blocks > self.num_blocks:
            if self.quantized:
                self.key_scales = grown_pool(self.key_scales, num_blocks)
                self.value_scales = grown_pool(self.value_scales, num_blocks)
                self._raw = tuple(grown_pool(t, num_blocks) for t in self._raw)
                self.values, self.keys = self._raw[1].view(FP8), self._raw[0].view(FP8)
            else:
                self.values, self.keys = grown_pool(self.values, num_blocks), grown_pool(self.keys, num_blocks)
        self.num_blocks = max(num_blocks, self.num_blocks)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.keys.view(shape), self.values.view(shape)

    def flat_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(key_scales, value_scales)`` ``[slots, kv_heads]`` of an fp8 store; ``(None, None)`` otherwise."""
        if not self.quantized:
            return None, None
        shape = (-1, self.num_kv_heads)
        return self.key_scales.view(shape), self.value_scales.view(shape)

    def scales(self) -> dict:
        """The attention ops' scale arguments: ``{}`` for a store in the model's dtype."""
        if not self.quantized:
            return {}
        return {"key_scales": self.key_scales, "value_scales": self.value_scales}

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, writes: RowWrites) -> None:
        """keys/values ``[tokens, kv_heads, head_dim]`` at ``slots``, added to ``writes`` (the caller flushes them)."""
        if not self.allocated:
            self.allocate(keys.device, keys.dtype)
        k, v = self.flat()
        if self.quantized:
            ks, vs = self.flat_scales()
            writes.add_quantized(k, ks, slots, keys)
            writes.add_quantized(v, vs, slots, values)
            return
        writes.add(k, slots, keys)
        writes.add(v, slots, values)

    def with_step_written(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """``(keys, values)`` pages as `write` leaves them, built out of place so that they carry this step's
        autograd history (for a layer that reads its own step's keys back from the pages while training). An fp8
        store's pages come back widened to the activations' dtype, this step's keys and values unquantized."""
        k, v = self.flat()
        if self.quantized:
            ks, vs = self.flat_scales()
            k, v = dequantize_fp8(k, ks, keys.dtype), dequantize_fp8(v, vs, values.dtype)
        at = slots.clamp_min(0)
        return (k.index_copy(0, at, keys.to(k.dtype)).view(self.keys.shape),
                v.index_copy(0, at, values.to(v.dtype)).view(self.values.shape))

    def paged_tensors(self) -> list[torch.Tensor]:
        """The pages (an fp8 store's as raw bytes, and its scales): what copying a row's blocks copies."""
        if self.quantized and self.keys is not None:
            return [*self._raw, self.key_scales, self.value_scales]
        return [t for t in (self.keys, self.values) if t is not None]

    # Paged by position: a step writes only past its rows' lengths (no in-place rows), and stale blocks are
    # unreachable once the tables are reset (nothing to reset).

    def nbytes(self) -> dict[str, int]:
        return {"attention_kv": tensor_bytes(*self.paged_tensors())}


class SlidingKV(PagedKV):
    """Paged K/V of sliding-window layers (reported apart from the full layers' K/V)."""

    def nbytes(self) -> dict[str, int]:
        return {"sliding_kv": tensor_bytes(*self.paged_tensors())}
