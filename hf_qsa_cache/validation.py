"""What a cache checks before it takes a `generate()` call or a model: each check raises a `ValueError` that
names the limit and the value (and `reset()` where that is the way out) before anything changes."""

from __future__ import annotations

import torch

from .layout import state_geometry, text_config


def check_request(cache, prompt_lengths: list[int], max_new_tokens: int, asked: str | None = None) -> None:
    """Raise before any forward unless rows of ``prompt_lengths`` real tokens can each add
    ``max_new_tokens`` more (what `generate()` checks before its prefill). ``asked``: those new tokens in the
    caller's words, for the message (default ``max_new_tokens=<max_new_tokens>``)."""
    asked = asked if asked is not None else f"max_new_tokens={max_new_tokens}"
    cache.check_usable()
    if len(prompt_lengths) > cache.max_batch_size:
        raise ValueError(f"batch of {len(prompt_lengths)} rows exceeds max_batch_size={cache.max_batch_size}")
    for b, n in enumerate(prompt_lengths):
        if n == 0:
            raise ValueError(f"row {b} of attention_mask has no real token (all zeros): nothing to generate from")
        if n + max_new_tokens > cache.max_cache_len:
            raise ValueError(
                f"row {b} needs {n + max_new_tokens} slots ({n} prompt tokens + {asked}), "
                f"cache holds max_cache_len={cache.max_cache_len}"
            )
    problem = cache.why_not_fits([max(cache.lengths[b], n + max_new_tokens) for b, n in enumerate(prompt_lengths)],
                                what="this generate() call")
    if problem is not None:
        raise ValueError(problem)


def check_model(cache, config, dtype: torch.dtype) -> None:
    """Raise unless a model of ``config`` running in ``dtype`` lays out its state as this cache does.
    Checked before the first step changes anything."""
    theirs = state_geometry(text_config(config))
    for field in dict.fromkeys([*cache.geometry, *theirs]):
        mine, other = cache.geometry.get(field), theirs.get(field)
        if mine != other:
            raise ValueError(f"the cache was built for {field}={mine!r}, the model has {field}={other!r}")
    held = cache.dtype or next((s.dtype for s in cache.layer_stores() if s.allocated), None)
    if held is not None and held != dtype and cache.dtype is None and cache.columns_seen == 0:
        # Built to follow the model, and empty (new or reset): follow it into its new dtype.
        if cache.prefix is not None:  # snapshots and cached blocks hold the old dtype's state
            cache.prefix.clear()
        for store in cache.layer_stores():
            store.deallocate()
        cache.undo.track()
    elif held is not None and held != dtype:
        if cache.dtype is None:
            raise ValueError(
                f"the cache holds state of a model that ran in dtype={held}, this one runs in dtype={dtype}: "
                f"call cache.reset() first (an empty cache built without device/dtype follows the model)"
            )
        raise ValueError(
            f"the cache holds state in dtype={held}, the model runs in dtype={dtype}: build the cache with "
            f"dtype={dtype} (or without device/dtype, to follow the model)"
        )


def check_continues(cache, input_ids: torch.Tensor) -> None:
    """Raise, naming `reset()`, unless ``input_ids`` ``[B, W]`` (a new `generate()` call's whole input)
    extends what the cache holds: the same rows, more columns, and the held tokens first. transformers
    feeds a passed cache only the columns past what it holds, so anything else would silently continue
    the old sequences. Once per `generate()` call (one host sync)."""
    if cache.columns_seen == 0:
        return
    rows, width = input_ids.shape[:2]
    if rows != cache.num_rows:
        raise ValueError(f"the cache holds {cache.num_rows} rows of an earlier call, this call has {rows}: "
                         f"call cache.reset() before a new batch")
    if width <= cache.columns_seen:
        raise ValueError(f"the cache holds {cache.columns_seen} columns of an earlier call and input_ids has "
                         f"{width}, so it does not continue them: call cache.reset() before a new prompt")
    bad = cache.token_log.mismatched_rows(input_ids, cache.lengths[:rows], cache.columns_seen)
    if bad:
        raise ValueError(f"row {bad[0]} of input_ids does not start with the tokens the cache holds for it: "
                         f"call cache.reset() before a new prompt")
