"""Prefix caching in `generate()` (a cache built with ``prefix_caching=True``; `docs/prefix_caching.md`).

* A `generate()` call whose input does not continue the rows the cache holds retires them (`retire_rows`):
  what they hold at a unit boundary becomes a cached prefix, and the rows are released (no `reset()` needed).
* The prefill of a call on an empty cache (`prefill`) starts each row from the longest cached prefix of its
  prompt (`QSAPagedCache.restore_prefix`, at most all but its last token) and feeds only the rest. Where a
  row's prompt passes a unit boundary beyond what was restored, and more than ``prefix_snapshot_gap`` of its
  tokens come after that, the prefill is split so that a step ends exactly at the prompt's last boundary (one
  extra step): the row's state is captured there, and once the whole forward has landed the prefix up to that
  boundary is cached with that snapshot.

Rows of one step are left-padded spans of their own tokens, so rows restored to different lengths share steps;
chunks of at most ``prefill_chunk_tokens`` tokens per step, as the plain prefill.
"""

from __future__ import annotations

import logging

import torch

from .cache import QSAPagedCache
from .prefix_cache import snapshot_point
from .prefix_rows import capture

logger = logging.getLogger(__name__)


def retire_rows(cache: QSAPagedCache) -> None:
    """The rows the cache holds become cached prefixes up to the last unit boundary they reached while decoding
    (their prompts' boundaries were cached by their prefill), then every row is released; cached prefixes
    stay."""
    log = cache.token_log
    try:
        if cache._unusable is None and cache.prefix_rows_from_ids and log.complete and log.ids is not None:
            for row in range(cache.num_rows):
                length = cache.lengths[row]
                tail = cache.prefix_tails.get(row)
                if cache.rope_deltas[row]:
                    continue  # a row with media: its token ids do not say what its state holds
                try:
                    if length and length % cache.prefix.unit == 0:
                        cache.cache_prefix(row, log.ids[row, :length].tolist())
                    elif tail is not None and tail.length <= length:
                        cache.cache_prefix(row, log.ids[row, :tail.length].tolist(), snapshot=tail)
                except Exception as error:  # a prefix that cannot be kept is only a later miss
                    logger.warning("caching the prefix of row %d failed: %s", row, error)
    finally:
        cache.reset()


def applies(cache, input_ids, inputs_embeds, attention_mask, logits_to_keep, chunkable, per_token: dict,
            model_kwargs: dict) -> bool:
    """Whether a forward's prefill runs from cached prefixes: a prefix-caching cache that holds nothing, token
    ids, only the last logits kept, a left-padded 2-D mask (or none) as wide as the input, per-token inputs of
    the input's width (2-D position ids), no multimodal offsets."""
    if not isinstance(cache, QSAPagedCache) or cache.prefix is None or input_ids is None or inputs_embeds is not None:
        return False
    if not chunkable or logits_to_keep != 1 or isinstance(logits_to_keep, bool):
        return False
    rows = cache.rows
    if rows.columns or rows.managed or any(rows.lengths) or cache._unusable is not None:
        return False
    if model_kwargs.get("rope_deltas") is not None or input_ids.dim() != 2:
        return False
    B, L = input_ids.shape
    if L <= cache.prefix.unit:
        return False  # no prompt of this call reaches a unit boundary before its last token
    for value in per_token.values():
        if value is not None and (value.dim() != 2 or value.shape != (B, L)):
            return False
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (B, L):
            return False
        mask = attention_mask.to(torch.int64)
        if bool(((mask[:, 1:] - mask[:, :-1]) < 0).any()) or bool((mask.sum(dim=1) == 0).any()):
            return False  # pads after real tokens, or a row without any: the plain prefill handles (or refuses) it
    return True


def _cuts(start: int, end: int, chunk: int) -> list[int]:
    """Ends of the chunks covering ``[start, end)``, counted from the end (the last chunk is whole)."""
    return list(range(end, start, -chunk))[::-1]


def plan(held: list[int], marks: list[int], counts: list[int], chunk: int) -> list[list[tuple[int, int]]]:
    """The steps of a prefill: per step, each row's ``(start, end)`` span of its real tokens. Rows go from
    ``held`` to ``marks`` (their snapshot points), then to ``counts``; every row's last token is in the last
    step, so it holds the logits."""
    steps = []
    for lo, hi in ((held, marks), (marks, counts)):
        ends = [_cuts(a, b, chunk) for a, b in zip(lo, hi)]
        n = max((len(e) for e in ends), default=0)
        for k in range(n):
            spans = []
            for a, e in zip(lo, ends):
                j = k - (n - len(e))  # rows with fewer chunks join late: their last chunk is in the phase's last step
                spans.append((a if j <= 0 else e[j - 1], e[j]) if j >= 0 else (a, a))
            steps.append(spans)
    return steps


def prefill(model_call, cache: QSAPagedCache, input_ids: torch.Tensor, attention_mask, per_token: dict,
            chunk_tokens: int):
    """Run a prompt's prefill from cached prefixes (`applies` said yes); ``model_call(input_ids=, attention_mask=,
    **per_token)`` runs one step. Returns the last step's outputs (each row's last token in its last column)."""
    B, L = input_ids.shape
    counts = attention_mask.sum(dim=1).tolist() if attention_mask is not None else [L] * B
    host = input_ids.tolist()  # one host copy of the prompt ids
    tokens = [host[b][L - n:] for b, n in enumerate(counts)]
    unit = cache.prefix.unit
    held = [cache.restore_prefix(b, tokens[b], limit=counts[b] - 1) for b in range(B)]
    marks = [snapshot_point(h, n, unit, cache.prefix.snapshot_gap) for h, n in zip(held, counts)]
    steps = plan(held, marks, counts, max(1, chunk_tokens // B))
    snapshots: dict[int, object] = {}
    device = input_ids.device
    outputs = None
    for spans in steps:
        width = max(e - s for s, e in spans)
        if width == 0:
            continue
        if width == 1 and any(s == e for s, e in spans):
            width = 2  # a one-column step counts one token a row (decode steps trust that): pad it to two
        index = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)
        for b, (s, e) in enumerate(spans):
            n = e - s
            if n:
                index[b, width - n:] = torch.arange(s, e) + (L - counts[b])
                mask[b, width - n:] = 1
            index[b, : width - n] = L - counts[b]  # pads: any real column of the row (masked)
        index, mask = index.to(device), mask.to(device)
        outputs = model_call(input_ids=input_ids.gather(1, index), attention_mask=mask,
                             **{k: None if v is None else v.gather(1, index) for k, v in per_token.items()})
        for b, (s, e) in enumerate(spans):
            if e == marks[b] and e > held[b] and b not in snapshots:
                snapshots[b] = capture(cache, b)  # the row's state at its last boundary, before a step moves on

    def land():
        cache.rows.set_columns(L)  # transformers counts the prompt's columns as held
        cache.prefix_rows_from_ids = True
        for b, snapshot in snapshots.items():
            try:
                cache.cache_prefix(b, tokens[b], snapshot=snapshot)
            except Exception as error:  # the forward landed: a prefix that cannot be kept is only a later miss
                logger.warning("caching the prefix of row %d failed: %s", b, error)

    cache.after_forward(land)
    return outputs
