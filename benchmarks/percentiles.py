"""The percentile the serving benchmarks report (a light module: load-test client processes import it)."""

from __future__ import annotations


def pct(values, q: float):
    """The ``q`` quantile of ``values`` (the value at rank ``int(q * n)`` of the sorted ``n``), None if empty."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None
