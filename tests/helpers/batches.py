"""Batches the tests share: padded layouts of prompts, and each family's ragged prompts."""

from __future__ import annotations

import torch

from . import inkling
from .qwen4 import left_pad, random_prompts


def padded_batch(prompts, kind: str, seed: int = 0):
    """A batch with pads where ``kind`` says: "left", "right" or "middle" (random pads between tokens)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(len(p) for p in prompts) + (4 if kind == "middle" else 0)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        n = len(p)
        if kind == "left":
            cols = torch.arange(width - n, width)
        elif kind == "right":
            cols = torch.arange(n)
        else:
            cols = torch.randperm(width - 1, generator=gen)[: n - 1].sort().values
            cols = torch.cat([cols, torch.tensor([width - 1])])  # last column real, pads in between
        ids[b, cols] = torch.as_tensor(p)
        mask[b, cols] = 1
    return ids, mask


def family_prompts(family: str):
    """A left-padded ragged batch of three prompts for ``family`` (``"qwen4_exp"`` or ``"inkling"``)."""
    if family == "qwen4_exp":
        return left_pad(random_prompts([23, 9, 17], seed=11))
    return inkling.left_pad(inkling.make_prompts([11, 4, 8], seed=12))
