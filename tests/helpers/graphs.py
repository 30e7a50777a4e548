"""CPU stand-ins for captured CUDA graphs, so that the tests run `DecodeGraphs`' record and replay branches."""

from __future__ import annotations

import torch

from hf_qsa_cache.cuda_graphs import DecodeGraphs


class RerunGraph:
    """A CPU stand-in for a captured CUDA graph: replay re-runs the recorded body against the block
    tables it was recorded with (a real graph reads the addresses it captured)."""

    def __init__(self, runner, entry):
        self.runner, self.entry = runner, entry
        self.tables = {n: t.device_table(entry.ids.shape[0], runner.device) for n, t in runner.cache.tables.items()}
        self.replays = 0

    def replay(self):
        self.replays += 1
        cache, rows = self.runner.cache, self.entry.ids.shape[0]
        cache.copy_rows_aside(rows)
        try:
            self.entry.logits.copy_(self.runner._body(self.entry, tables=self.tables))
        except BaseException:
            # A CUDA graph launch runs whole or raises before running: a fault injected half way here
            # takes the partial run back, so that the runner sees what a real replay would leave.
            cache.copy_rows_back(rows)
            raise


class ReplayingGraphs(DecodeGraphs):
    """`DecodeGraphs` whose captures are `RerunGraph`s, so the replay branch runs on the CPU."""

    def _run_and_capture(self, entry):
        logits = self._eager(entry).clone()
        entry.logits = torch.empty_like(logits)
        entry.graph = RerunGraph(self, entry)
        return logits
