"""Fault injection for the step-transaction tests: raise at the n-th torch call of a forward.

`FailAt(n)` is a `TorchFunctionMode`: every torch function and tensor method called while it is active
counts as one call (host-side validation, metadata, stores, every layer, the LM head); the n-th raises
`Injected`, as an out-of-memory error or a kernel failure there would. ``FailAt(None)`` only counts.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class Injected(RuntimeError):
    pass


class FailAt(TorchFunctionMode):
    def __init__(self, n: int | None = None):
        super().__init__()
        self.n = n
        self.calls = 0
        self.where = None  # the function that raised

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.n:
            self.where = getattr(func, "__name__", repr(func))
            raise Injected(f"injected fault at torch call {self.n} ({self.where})")
        return func(*args, **(kwargs or {}))


def count_calls(fn) -> int:
    with FailAt() as mode:
        fn()
    return mode.calls


def sample_points(total: int, dense_until: int, spread: int) -> list[int]:
    """Every call up to ``dense_until`` (host checks and metadata come first), then ``spread`` calls
    evenly over the rest of the step, the last call included."""
    head = list(range(1, min(dense_until, total) + 1))
    if total <= dense_until:
        return head
    rest = [dense_until + round(i * (total - dense_until) / spread) for i in range(1, spread + 1)]
    return sorted(set(head + rest))


def host_state(cache) -> tuple:
    """Everything host-side a later step reads: lengths, rows, columns, crop floors, block tables, pools."""
    return (
        list(cache.lengths), cache.num_rows, cache.columns_seen, list(cache.rows.crop_floor),
        {n: ([list(r) for r in t.rows], list(t.base), sorted(t.free)) for n, t in cache.tables.items()},
    )
