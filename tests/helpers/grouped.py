"""Random schedules of grouped steps (`hf_qsa_cache.grouped`) for the CPU and GPU tests: each row a fixed token
sequence fed in chunks, every fed token's logits kept by (row, position), rows dropping fresh tokens when the
cache keeps rollback history."""

from __future__ import annotations

import random

import torch

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.grouped import grouped_logits
from hf_qsa_cache.rollback import crop_rows


def schedule(rng: random.Random, fed: list[int], total: list[int]):
    """One grouped step: rows fed one token or none (a run of them makes one group: a row fed none is all pads, as a
    prefilling row beside decoding ones), rows fed a chunk (alone, or with the next row in one group of the longer
    chunk, the shorter left-padded)."""
    chunks = [min(total[b] - fed[b], 1 if rng.random() < 0.4 else rng.randint(2, 8)) for b in range(len(fed))]
    chunks = [0 if c == 1 and rng.random() < 0.3 else c for c in chunks]
    if not any(chunks):
        chunks[0] = 1
    shape, counts, b = [], [], 0
    while b < len(fed):
        if chunks[b] <= 1:
            run = 1
            while b + run < len(fed) and chunks[b + run] <= 1:
                run += 1
            shape.append((run, 1))
            counts += chunks[b:b + run]
        elif b + 1 < len(fed) and rng.random() < 0.5:  # (a one-token neighbour: pads in its last columns)
            run = 2
            shape.append((2, max(chunks[b], chunks[b + 1])))
            counts += chunks[b:b + 2]
        else:
            run = 1
            shape.append((1, chunks[b]))
            counts.append(chunks[b])
        b += run
    return shape, counts


def run_schedule(model, sequences: list[list[int]], steps: int, seed: int, spec: int = 0, device="cpu"):
    """Feed ``sequences`` (one per row) to ``model`` through ``steps`` random grouped steps on a fresh cache (with
    ``spec`` tokens of rollback history: rows then drop up to that many fresh tokens after each step, fed again
    later). Returns ``(logits by (row, position), the cache, tokens dropped)``."""
    rng = random.Random(seed)
    rows, total = len(sequences), [len(s) for s in sequences]
    cache = QSAPagedCache(model.config, max_batch_size=rows, max_cache_len=48, block_size=4,
                          num_speculative_tokens=spec)
    cache.move_rows([-1] * rows)
    fed, dropped, got = [0] * rows, 0, {}
    for _ in range(steps):
        if min(t - f for t, f in zip(total, fed)) == 0:
            break
        shape, counts = schedule(rng, fed, total)
        ids, keep, where = [], [], []
        start = b = 0
        for group_rows, length in shape:
            for r in range(b, b + group_rows):
                pads = length - counts[r]
                ids += [0] * pads + sequences[r][fed[r]:fed[r] + counts[r]]
                keep += range(start + pads, start + length)
                where += [(r, fed[r] + j) for j in range(counts[r])]
                start += length
            b += group_rows
        with torch.no_grad():
            logits = grouped_logits(model, cache, shape, counts, torch.tensor([ids], device=device),
                                    torch.tensor(keep, device=device))
        got.update({rw: logits[i] for i, rw in enumerate(where)})
        fed = [f + c for f, c in zip(fed, counts)]
        if spec:
            drops = [rng.randint(0, min(spec, max(c - 1, 0))) for c in counts]
            crop_rows(cache, drops)
            fed = [f - d for f, d in zip(fed, drops)]
            dropped += sum(drops)
    assert cache.lengths[:rows] == fed
    return got, cache, dropped
