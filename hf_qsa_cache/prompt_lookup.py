"""Prompt lookup's n-gram search on a host copy of the tokens.

transformers' `PromptLookupCandidateGenerator.get_candidates` searches the sequence on its device: for each
n-gram size it compares every window, then walks the matches one by one, and each step of that walk reads
a device value on the host (a sync). On a GPU one lookup costs dozens of syncs, several milliseconds: more
than the decode step it tries to save (measured in benchmarks/RESULTS.md, "Prompt lookup").

`lookup_drafts` is the same search on a numpy copy of the row, and `HostTokens` keeps that copy up to
date by reading only the tokens appended since the last round (one small device read per drafting round).

The search, as transformers defines it, for a row of ``L`` tokens ``t``: for n-gram sizes ``n`` from
``min(max_ngram, L - 1)`` down to 1, the first position ``i`` (left to right) where ``t[i:i+n]`` equals the
row's last ``n`` tokens and ``i + n < min(L, max_length)``; the drafts are ``t[i+n : min(i+n+k, L,
max_length)]``, cut before their first end-of-sequence id. The first size with a match decides (even when
the cut leaves nothing); no match, or ``max_length == L + 1``, means no drafts.
"""

from __future__ import annotations

import numpy as np
import torch


def lookup_drafts(tokens: np.ndarray, num_drafts: int, max_ngram: int, max_length: int,
                  eos_ids: np.ndarray | None = None) -> np.ndarray:
    """The drafts prompt lookup proposes after ``tokens`` (one row, int64), as transformers' search does
    (module docstring); empty when it proposes none."""
    length = len(tokens)
    none = tokens[:0]
    if max_length == length + 1:
        return none
    for n in range(min(max_ngram, length - 1), 0, -1):
        last = tokens[length - n:]
        candidates = length - n + 1  # window starts, the row's own last n-gram included
        hit = tokens[:candidates] == last[0]
        for j in range(1, n):
            hit &= tokens[j:candidates + j] == last[j]
        starts = np.flatnonzero(hit)
        # Windows are in order, so the first start is the first valid one if any is (the bound is one number).
        if len(starts) == 0 or starts[0] + n >= min(length, max_length):
            continue
        begin = int(starts[0]) + n
        drafts = tokens[begin:min(begin + num_drafts, length, max_length)]
        if eos_ids is not None and len(eos_ids):
            stops = np.flatnonzero(np.isin(drafts, eos_ids))
            if len(stops):
                drafts = drafts[:stops[0]]
        return drafts
    return none


class HostTokens:
    """A host copy of the one row assisted generation grows, refreshed from its device tensor.

    The row only grows within a `generate()` call (accepted tokens are appended, never changed), so a
    refresh reads the tokens after the copy's last one, plus that one to check that the copy still is a
    prefix of the row (else, a shorter row or another row, it copies the whole row again).
    """

    def __init__(self):
        self._buffer = np.zeros(0, dtype=np.int64)
        self.length = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._buffer[:self.length]

    def refresh(self, input_ids: torch.Tensor) -> np.ndarray:
        """The host copy of ``input_ids`` (``[1, L]``), reading as little of it as the last refresh allows."""
        row = input_ids[0]
        total = row.shape[0]
        if 0 < self.length <= total:
            tail = row[self.length - 1:].cpu().numpy()
            if tail[0] == self._buffer[self.length - 1]:
                self._append(tail[1:])
                return self.tokens
        self.length = 0
        self._append(row.cpu().numpy())
        return self.tokens

    def _append(self, values: np.ndarray) -> None:
        end = self.length + len(values)
        if end > len(self._buffer):  # grow by doubling: appends cost O(1) amortised
            grown = np.zeros(max(end, 2 * len(self._buffer)), dtype=np.int64)
            grown[:self.length] = self._buffer[:self.length]
            self._buffer = grown
        self._buffer[self.length:end] = values
        self.length = end


def searches_on_host(generator) -> bool:
    """Whether ``generator`` (transformers' `PromptLookupCandidateGenerator`) may search on the host: its
    logits processors, if any, can forbid drafts (transformers runs them on made-up logits for each draft),
    which only its own search applies; an empty list or None forbids nothing."""
    return not generator.logits_processor


class HostLookup:
    """transformers' ``get_candidates`` for one `generate()` call's generator, searched on a host copy of the
    row (`searches_on_host` must hold): returns ``(input_ids + drafts, None)`` as it does. The generator's
    end-of-sequence ids are read once, here."""

    def __init__(self, generator):
        self.generator = generator
        eos = generator.eos_token_id
        self.eos = None if eos is None else np.asarray(torch.as_tensor(eos).reshape(-1).cpu(), dtype=np.int64)
        self.host = HostTokens()

    def __call__(self, input_ids: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        g = self.generator
        drafts = lookup_drafts(self.host.refresh(input_ids), g.num_output_tokens, g.max_matching_ngram_size,
                               g.max_length, self.eos)
        if len(drafts) == 0:
            return input_ids, None
        drafts = torch.from_numpy(drafts.copy()).to(device=input_ids.device, dtype=input_ids.dtype)
        return torch.cat([input_ids, drafts[None]], dim=1), None
