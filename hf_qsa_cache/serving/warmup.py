"""What a serving loop's first requests would otherwise pay for, paid before the first request
(`ContinuousBatchingManager.warmup`).

On a GPU the first step of a new shape is slow: Triton compiles, and autotunes, the kernels of a prefill chunk the
first time a process meets its length (about 20 s for an 8,192-token chunk of Qwen4Exp at 40 layers on an H100),
and a decode step records a CUDA graph the first time it meets a row-count bucket at a reach bucket
(`DecodeGraphs`: 0.15-0.6 s each at 40 layers). Met inside a served workload, those seconds land on the first
requests' time to first token. The warm-up runs dummy requests through the loop instead:

1. ``rows`` short requests, all decoding, then finishing one a step: a decode graph of every row-count bucket at
   the shortest reach;
2. one long request (a prompt of the most tokens a row of the workload holds, its longest prompt and answer as
   the hints announce them, else one prefill budget), and once it decodes, short ones on the other rows that
   again all decode, then finish one a step: the prefill kernels at the whole budget, and the decode graphs of
   every row-count bucket at the reach where a workload's steps of many rows mostly decode (their longest row
   sets it);
3. the same for each reach bucket between the two, a long request decoding inside it.

Short prefill steps (a few rows' last prompt tokens) are still recorded when a workload first meets their shape:
on the CPU proxy of the serving benchmark's workload, none of its decode shapes and 14 prefill shapes
(`benchmarks/HISTORY.md`).
"""

from __future__ import annotations

import torch

from ..cuda_graphs import reach_bucket
from .requests import copy_ids

SHORT_PROMPT = 16  # the first short request's prompt; each next one is 8 tokens longer and decodes one more token


def workload_shape(hints, scheduler) -> tuple[int, int]:
    """``(rows, reach)`` to warm up for: as many rows as the hinted workload has requests (a `generate_batch` of
    four prompts warms four), else every row; the most tokens a row of it holds (its longest prompt and answer, else
    one prefill budget): where its long requests decode, the reach most decode steps of many rows take."""
    rows = getattr(hints, "num_requests", None) or scheduler.max_rows
    reach = (getattr(hints, "max_prompt_length", None) or scheduler.max_batch_tokens) \
        + (getattr(hints, "max_generated_length", None) or 0)
    return rows, reach


def warm_up(manager, rows: int, reach: int, vocab_size: int) -> None:
    """Run the dummy requests on ``rows`` rows at most, for rows of up to ``reach`` tokens (the loop must not be
    running), then leave nothing of them: no row, no cached prefix, no unread result. A warm-up request that fails
    raises a `RuntimeError` naming it."""
    cache = manager.cache
    longest = cache.longest_row()  # (what one row can hold: no warm-up request may need more, or it fails)
    # (no more than the cache's rows; a short request's prompt and answer, up to twice the rows' count, fit a row)
    rows = max(1, min(rows, manager.scheduler.max_rows, (longest - 2) // 2))
    long_new = 3 * rows + 8  # the long requests' new tokens: they outlive the short ones beside them
    copies = manager.num_return_sequences  # (each request's copies are requests too: their results are read)
    vocab = min(vocab_size, 32768)
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:  # (token ids below 32,768: far from a multimodal model's placeholder ids)
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    submitted: list[str] = []  # every warm-up request's id, its copies' too

    def submit(prompt_ids: list[int], request_id: str, **kwargs) -> str:
        manager.add_request(prompt_ids, request_id=request_id, eos_token_id=-1, **kwargs)
        submitted.extend(copy_ids(request_id, copies))
        return request_id

    def shorts(wave: int, count: int) -> list[str]:
        """``count`` short requests. Each decodes ``count`` tokens more than the one before it needs to finish
        after it: all of them are decoding before the first finishes (however many iterations the loop takes to
        admit and prefill them), then they finish one a step."""
        return [submit(prompt(max(1, min(SHORT_PROMPT + 8 * i, longest - count - 3 - i))), f"warmup-{wave}-{i}",
                       max_new_tokens=count + 2 + i) for i in range(count)]

    def finish(ids: list[str]) -> None:
        for request_id in [each for rid in ids for each in copy_ids(rid, copies)]:
            while True:
                result = manager.get_result(request_id, timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError(f"the continuous batching loop ended during the warm-up ({request_id})")
                if result is not None and result.error:
                    raise RuntimeError(f"warm-up request {request_id} failed: {result.error}")
                if result is not None and result.is_finished():
                    break

    def beside_long(wave: int, prompt_tokens: int) -> None:
        """A long request, and once it decodes, short ones on the other rows; it outlives them (they finish within
        about twice the rows' count of decode steps)."""
        long_id = submit(prompt(prompt_tokens), f"warmup-long-{wave}", streaming=True, max_new_tokens=long_new)
        first = manager.get_result(long_id, timeout=None)
        if first is None or first.error:
            raise RuntimeError(f"warm-up request {long_id} failed: {first.error if first else 'no result'}")
        finish(shorts(wave, -(-(rows - copies) // copies)))
        finish([long_id])

    # The long requests' prompts: the workload's longest row, and below its reach bucket one for each bucket the
    # short requests do not reach, each decoding inside its bucket (a decode step's reach is its longest row's).
    top = min(reach, longest - long_new)
    short_reach = reach_bucket(SHORT_PROMPT + 8 * rows + 2 * rows + 2, cache.max_cache_len)
    top_reach = reach_bucket(top + long_new, cache.max_cache_len)
    prompts = [top] if top > SHORT_PROMPT + 8 * rows else []  # (also the prefill kernels at the whole budget)
    bucket = short_reach
    while (bucket := reach_bucket(2 * bucket, cache.max_cache_len)) < top_reach:
        if bucket - long_new > bucket // 2:
            prompts.insert(-1, bucket - long_new)
    first_wave = shorts(0, -(-rows // copies))  # (queued before the loop starts: its first iteration admits them)
    manager.start()
    try:
        finish(first_wave)
        for wave, prompt_tokens in enumerate(prompts, start=1):
            beside_long(wave, prompt_tokens)
    finally:
        manager.stop(block=True)
        for request_id in submitted:  # (after a failed one, the others' results are left unread: none may reach
            while manager.get_result(request_id, timeout=0) is not None:  # the user's get_result())
                pass
        if cache.prefix is not None:
            cache.reset(prefixes=True)
