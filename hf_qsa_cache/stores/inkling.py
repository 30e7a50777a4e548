"""Inkling's short-conv taps: the inputs of a layer's four short convolutions, paged by logical position on
the ``"conv"`` table (`hf_qsa_cache.layout`: block size = conv kernel size, only the last ``K - 1`` positions
of a row stay live).

Conv layout, per layer: ``[num_blocks, K, H, D]`` with ``H`` the layer's KV heads and the four
streams packed per head along ``D = 2 * head_dim + 2 * hidden / H`` (K, V, attention-output chunk,
MLP-output chunk). Flat channel ``c`` of a stream of width ``w`` per head lives at head ``c // w``.
"""

from __future__ import annotations

import torch

from .base import Store, grown_pool, tensor_bytes

STREAM_K, STREAM_V, STREAM_ATTN, STREAM_MLP = 0, 1, 2, 3


class InklingConvStore(Store):
    """Inputs of one layer's four short convolutions, paged by logical position."""

    def __init__(self, table: str, num_blocks: int, kernel_size: int, num_heads: int, head_dim: int,
                 hidden_size: int):
        self.table = table
        self.num_blocks = num_blocks
        self.kernel_size = kernel_size
        self.num_heads = num_heads
        chunk = hidden_size // num_heads
        self.widths = (head_dim, head_dim, chunk, chunk)  # per head: K, V, attention out, MLP out
        self.offsets = tuple(sum(self.widths[:i]) for i in range(4))
        self.head_width = sum(self.widths)
        self.state: torch.Tensor | None = None  # [num_blocks, K, H, D], model dtype

    def _marker(self) -> torch.Tensor | None:
        return self.state

    def allocate(self, device, dtype) -> None:
        shape = (self.num_blocks, self.kernel_size, self.num_heads, self.head_width)
        self.state = torch.zeros(shape, device=device, dtype=dtype)

    def deallocate(self) -> None:
        self.state = None

    def resize_blocks(self, num_blocks: int) -> None:
        """Grow the pool to ``num_blocks`` blocks, keeping what the held ones hold."""
        if self.state is not None and num_blocks > self.num_blocks:
            self.state = grown_pool(self.state, num_blocks)
        self.num_blocks = max(num_blocks, self.num_blocks)

    def stream(self, idx: int) -> torch.Tensor:
        """``[num_blocks * K, H, width]`` view of one stream; row ``s`` is slot ``s``."""
        flat = self.state.view(-1, self.num_heads, self.head_width)
        off = self.offsets[idx]
        return flat[:, :, off: off + self.widths[idx]]

    def paged_tensors(self) -> list[torch.Tensor]:
        return [self.state] if self.state is not None else []

    # Paged by position: a step writes only past its rows' lengths (no in-place rows), and taps are read only
    # for positions a row wrote (nothing to reset).

    def nbytes(self) -> dict[str, int]:
        return {"inkling_conv": tensor_bytes(self.state)}


__all__ = ["InklingConvStore", "STREAM_K", "STREAM_V", "STREAM_ATTN", "STREAM_MLP"]
