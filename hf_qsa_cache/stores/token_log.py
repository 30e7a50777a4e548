"""Each row's token ids by logical position: what lets a new `generate()` call be checked against what
the cache holds (`QSAPagedCache.check_continues`).

``ids`` is ``[max_rows + 1, max_len]`` int32 on the device of the embeddings (4 bytes per cached token);
the extra row absorbs pads. Steps write it past their rows' old lengths, so an aborted step leaves
nothing that is read, and crop only shortens the rows. A step that ran from ``inputs_embeds`` has no
ids to log: the log is then incomplete until `reset()` and the check is skipped.
"""

from __future__ import annotations

import torch

from ..ops.token_log import log_tokens
from .base import Store, tensor_bytes


class TokenLog(Store):
    def __init__(self, max_rows: int, max_len: int):
        self.max_rows = max_rows
        self.max_len = max_len
        self.ids: torch.Tensor | None = None
        self.complete = True

    def write(self, position: torch.Tensor, token_row: torch.Tensor, input_ids: torch.Tensor | None) -> None:
        """Log this step's ids ``[B, L]`` at their positions ``[B*L]`` (-1 = pad)."""
        if input_ids is None:
            self.complete = False
            return
        if self.ids is None:
            self.allocate(input_ids.device)
        device = self.ids.device
        log_tokens(self.ids, position.to(device), token_row.to(device), input_ids.to(device))

    def _marker(self) -> torch.Tensor | None:
        return self.ids

    def allocate(self, device, dtype: torch.dtype | None = None) -> None:
        """int32 ids whatever the model's dtype (on the device of the embeddings, at the first write)."""
        self.ids = torch.zeros(self.max_rows + 1, self.max_len, dtype=torch.int32, device=device)

    def deallocate(self) -> None:
        self.ids = None

    def mismatched_rows(self, input_ids: torch.Tensor, lengths: list[int], columns: int) -> list[int]:
        """Rows whose held tokens are not the real tokens of ``input_ids[:, :columns]`` (left-padded: a
        row's real tokens are the last ``lengths[b]`` of those columns). One host sync."""
        if not self.complete or self.ids is None:
            return []
        rows = input_ids.shape[0]
        device = self.ids.device
        held = torch.tensor(lengths, device=device)[:, None]
        p = torch.arange(min(columns, self.max_len), device=device)
        column = (columns - held + p).clamp(0, columns - 1)
        given = input_ids[:, :columns].to(device).gather(1, column)
        differ = (given != self.ids[:rows, : p.numel()]) & (p < held)
        return differ.any(dim=1).nonzero().flatten().tolist()

    def grow(self, max_len: int) -> None:
        """Let rows log up to ``max_len`` positions, keeping what they hold."""
        if self.ids is not None and max_len > self.max_len:
            ids = self.ids.new_zeros((self.max_rows + 1, max_len))
            ids[:, : self.max_len] = self.ids
            self.ids = ids
        self.max_len = max(max_len, self.max_len)

    def row_tensors(self) -> list[torch.Tensor]:
        return [] if self.ids is None else [self.ids]

    def nbytes(self) -> dict[str, int]:
        return {"token_log": tensor_bytes(self.ids)}

    def reset(self) -> None:
        self.complete = True
