"""A short run of the model-based stress test (tests/helpers/stress.py) per family; the long runs' figures are in
benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
from helpers.stress import Stress


@pytest.mark.parametrize("family, seed", [("qwen4_exp", 0), ("inkling", 1)])
def test_random_operations_match_the_reference(family, seed):
    stress = Stress(family, seed)
    stress.run(ops=40)
    assert stress.checked > 20
    assert {"decode", "verify", "crop"} <= set(stress.counts), stress.counts
    assert any(k.endswith("+fault") for k in stress.counts), stress.counts


@pytest.mark.parametrize("family, seed, gap", [("qwen4_exp", 5, 0), ("inkling", 6, 0), ("qwen4_exp", 7, 8)],
                         ids=["qwen4_exp-stops", "inkling-stops", "qwen4_exp-gap8"])
def test_random_operations_with_shared_prefixes(family, seed, gap):
    """``gap``: the prefill from cached prefixes stops at each prompt's snapshot point (0), or only where that lies
    more than 8 tokens past the row's restore."""
    stress = Stress(family, seed, prefix=True, snapshot_gap=gap)
    stress.run(ops=40, fault_rate=0.3)
    stats = stress.cache.memory_stats()["prefix_cache"]
    assert stress.counts.get("prefix batch", 0) >= 3 and stats["hit_tokens"] > 0, (stress.counts, stats)
    assert stats["evictions"] + stats["snapshot_evictions"] > 0, stats
    assert "prefix batch+fault" in stress.counts, stress.counts
