"""Per-row GatedDeltaNet state, plus the PLE short-conv window and n-gram context on PLE layers.

Everything here is dense per cache row (``[max_rows, ...]``): the state does not grow with the
sequence. Conv windows keep the last ``kernel - 1`` inputs (the only ones a causal conv reads).
"""

from __future__ import annotations

import torch


class LinearAttentionState:
    table = None  # dense per row, not paged

    def __init__(self, max_rows: int, conv_dim: int, conv_kernel: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, ple_channels: int = 0, ple_window: int = 0, ngram_context: int = 0,
                 eos_token_id: int = 0):
        self.max_rows = max_rows
        self.conv_shape = (max_rows, conv_dim, conv_kernel - 1)
        self.recurrent_shape = (max_rows, num_v_heads, head_k_dim, head_v_dim)
        self.ple_shape = (max_rows, ple_channels, ple_window) if ple_channels else None
        self.ngram_shape = (max_rows, ngram_context) if ngram_context else None
        self.eos_token_id = eos_token_id
        self.conv: torch.Tensor | None = None  # model dtype
        self.recurrent: torch.Tensor | None = None  # fp32, as upstream
        self.ple_conv: torch.Tensor | None = None  # model dtype
        self.ngram_ids: torch.Tensor | None = None  # int64 token ids, EOS when fresh

    # overwritten in place every step
    rollback_safe = False

    @property
    def allocated(self) -> bool:
        return self.conv is not None

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.conv is None else self.conv.dtype

    def allocate(self, device, dtype) -> None:
        self.conv = torch.zeros(self.conv_shape, device=device, dtype=dtype)
        self.recurrent = torch.zeros(self.recurrent_shape, device=device, dtype=torch.float32)
        if self.ple_shape is not None:
            self.ple_conv = torch.zeros(self.ple_shape, device=device, dtype=dtype)
        if self.ngram_shape is not None:
            self.ngram_ids = torch.full(self.ngram_shape, self.eos_token_id, device=device, dtype=torch.int64)

    def paged_tensors(self) -> list[torch.Tensor]:
        return []

    def row_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.conv, self.recurrent, self.ple_conv, self.ngram_ids) if t is not None]

    def reset(self) -> None:
        for t in (self.conv, self.recurrent, self.ple_conv):
            if t is not None:
                t.zero_()
        if self.ngram_ids is not None:
            self.ngram_ids.fill_(self.eos_token_id)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Fresh state for rows that start a new sequence."""
        for t in (self.conv, self.recurrent, self.ple_conv):
            if t is not None:
                t.index_fill_(0, rows, 0)
        if self.ngram_ids is not None:
            self.ngram_ids.index_fill_(0, rows, self.eos_token_id)

    def nbytes(self) -> dict[str, int]:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "linear_conv": size(self.conv),
            "linear_recurrent": size(self.recurrent),
            "ple_conv": size(self.ple_conv),
            "ple_ngram": size(self.ngram_ids),
        }
