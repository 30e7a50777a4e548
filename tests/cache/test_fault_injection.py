"""A step is a transaction: a fault at any torch call of any kind of step leaves the cache as it was.

For each kind of step (decode, verify of k + 1 drafts, a prompt continued by several tokens, the second
chunk of a chunked prefill, the static-buffer step a CUDA graph records, its replay, a step over a prefix
of rows placed one by one as continuous batching does, a grouped step of a chunk beside one-token rows) and
both families,
a fault is injected at the n-th torch call of the step (`faults.FailAt`), for every n up to the end of
the metadata and an even spread over the rest. After each fault:

* the host state (lengths, rows, columns, crop floors, block tables, free lists) is what it was;
* the same step, retried on the same cache, gives the logits of a cache that never failed, and so does
  the step after it (state that only a later step reads, such as the QSA ring or recurrent state);
* or, where the fault came after earlier chunks of the same forward landed on a cache that held rows,
  the cache refuses every step with an error naming reset(), and after reset() equals a fresh one.

Set HF_QSA_FAULTS=all to try every n (slow; see benchmarks/RESULTS.md for the full sweep's figures).
"""

from __future__ import annotations

import os

import pytest
import helpers.inkling as inkling
import torch
from helpers.faults import FailAt, Injected, count_calls, host_state, sample_points
from helpers.graphs import ReplayingGraphs
from helpers.qwen4 import left_pad, make_pair, random_prompts

from helpers.batches import family_prompts as _prompts

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.cuda_graphs import DecodeGraphs, graphs_of
from hf_qsa_cache.grouped import grouped_logits

EVERY = os.environ.get("HF_QSA_FAULTS") == "all"
K = 2  # drafts per verify step


class Scenario:
    """A cache brought to some state, then one step (``step``) and the step after it (``after``)."""

    def __init__(self, model, family, kind, step_undo=True):
        self.model, self.family, self.kind, self.step_undo = model, family, kind, step_undo

    def build(self):
        model, kind = self.model, self.kind
        spec = K if kind in ("verify", "graph_verify") else 0
        cache = QSAPagedCache(model.config, 4, 96, block_size=4, num_speculative_tokens=spec, step_undo=self.step_undo)
        ids, mask = _prompts(self.family)
        rows = ids.shape[0]
        runner = None
        if kind.startswith("graph") or kind == "replay":
            cls = ReplayingGraphs if kind == "replay" else DecodeGraphs
            runner = cache.graph_runners[model] = cls(model, cache, "cpu", record=kind == "replay")
        gen = torch.Generator().manual_seed(5)

        def tokens(n):
            return torch.randint(2, model.config.vocab_size, (rows, n), generator=gen)

        def forward(step_ids, step_mask):
            if runner is not None and step_ids.shape[1] <= spec + 1 and cache.columns_seen:
                return runner.step(step_ids, None, step_mask)
            if kind == "chunk" and cache.columns_seen == 0:
                # The prompt as a chunked prefill of 4 columns a chunk (chunks end inside QSA groups and windows).
                chunk, model.prefill_chunk_tokens = model.prefill_chunk_tokens, 4 * rows
                try:
                    return model(step_ids, attention_mask=step_mask, past_key_values=cache, logits_to_keep=1).logits
                finally:
                    model.prefill_chunk_tokens = chunk
            return model(step_ids, attention_mask=step_mask, past_key_values=cache).logits

        state = {"mask": mask}

        def run(n):
            step_ids = tokens(n)
            state["mask"] = torch.cat([state["mask"], torch.ones_like(step_ids)], dim=1)
            return step_ids, state["mask"]

        with torch.no_grad():
            if kind in ("managed", "grouped"):  # rows placed one by one, as continuous batching does
                cache.move_rows([-1] * rows)
            if kind != "chunk":  # the chunked prefill is the step itself
                forward(ids, mask)
                for _ in range(4):  # windows evict, groups close
                    forward(*run(1))
                if kind == "replay":
                    forward(*run(1))  # captures; the steps below replay
            if kind == "managed":
                # Row 2 moves to row 0, a fresh row enters at 1, row 1 leaves; the step covers rows [0, 2) only,
                # with pads on row 0, which holds tokens; the step after it decodes all three rows.
                cache.move_rows([2, -1, 0])
                step_ids = tokens(5)[:2]
                step_mask = torch.ones_like(step_ids)
                step_mask[0, :3] = 0
                next_ids = tokens(1)
                return cache, forward, (step_ids, step_mask), lambda: forward(next_ids, None)
            if kind == "grouped":
                # A grouped step: row 0 takes a chunk of 3 tokens (a group of its own), the other rows one token
                # each (one group); the step after it decodes every row.
                chunk, singles = tokens(3)[0], tokens(1)[1:, 0]
                shape, counts = [(1, 3), (rows - 1, 1)], [3] + [1] * (rows - 1)
                step_ids = torch.cat([chunk, singles])[None]
                keep = torch.tensor([2] + [3 + b for b in range(rows - 1)])
                next_ids = tokens(1)

                def grouped(step_ids, keep):
                    return grouped_logits(model, cache, shape, counts, step_ids, keep)

                return cache, grouped, (step_ids, keep), lambda: forward(next_ids, None)
            length = {"decode": 1, "graph": 1, "replay": 1, "verify": K + 1, "graph_verify": K + 1,
                      "continue": 5}.get(kind)
            step = (ids, mask) if kind == "chunk" else run(length)
            drop = K - 1 if length == K + 1 else 0  # a verify step: the model rejects its last K - 1 drafts
            next_ids, next_mask = run(1)
            if drop:
                next_mask = torch.cat([step[1][:, :-drop], next_mask[:, -1:]], dim=1)

        def after():
            if drop:
                cache.crop(-drop)
            return forward(next_ids, next_mask)

        return cache, forward, step, after


def _outcome(scenario):
    cache, forward, step, after = scenario.build()
    with torch.no_grad():
        return forward(*step), after(), cache


KINDS = ["decode", "verify", "continue", "chunk", "graph", "graph_verify", "replay", "managed", "grouped"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_fault_anywhere_in_a_step_leaves_the_cache_as_it_was(qwen, ink, family, kind):
    model = qwen if family == "qwen4_exp" else ink
    scenario = Scenario(model, family, kind)
    want_step, want_after, clean = _outcome(scenario)

    points = fault_points(scenario)
    for n in points:
        got_step, got_after, cache = _outcome_after_fault(scenario, n)
        torch.testing.assert_close(got_step, want_step, atol=1e-6, rtol=0, msg=lambda m: f"fault at {n}: {m}")
        torch.testing.assert_close(got_after, want_after, atol=1e-6, rtol=0, msg=lambda m: f"after fault at {n}: {m}")
        assert same_but_crop_floor(host_state(cache), host_state(clean))


def fault_points(scenario, dense_until: int = 30, spread: int = 16) -> list[int]:
    """The torch calls of the scenario's step (counted from the step's first, its setup's not counted) to inject
    a fault at (`sample_points`; all with HF_QSA_FAULTS=all)."""

    with torch.no_grad():
        _, forward, step, _ = scenario.build()
        total = count_calls(lambda: forward(*step))
    assert total > 100, "the step must be counted, not only its setup"
    return list(range(1, total + 1)) if EVERY else sample_points(total, dense_until, spread)


def same_but_crop_floor(state, other) -> bool:
    """Host states equal except for the crop floors (an aborted step raises them: see hf_qsa_cache/step.py)."""
    return state[:3] + state[4:] == other[:3] + other[4:]


def _outcome_after_fault(scenario, n):
    """The step fails at its torch call ``n``; then the step and the one after it run again on the same cache.
    (The setup runs outside the counting mode, which would slow its every torch call: the count starts at the
    step, the same call as counting from the setup's start and offsetting by its calls.)"""
    with torch.no_grad():
        cache, forward, step, after = scenario.build()
        before = host_state(cache)
        with pytest.raises(Injected), FailAt(n):
            forward(*step)
    assert same_but_crop_floor(host_state(cache), before), f"a fault at call {n} changed the host state"
    with torch.no_grad():
        return forward(*step), after(), cache


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_fault_in_a_step_without_undo_loses_only_the_rows_it_fed(qwen, ink, family):
    """``step_undo=False`` (continuous batching's cache): a fault at any torch call of a step over rows [0, 2) of
    three managed rows puts the host state back, marks rows 0 and 1 lost (a step that feeds one is refused,
    naming reset()), and leaves row 2, which the step did not feed, exact: moved alone (the lost rows released)
    it decodes as on a cache that never failed, and so do fresh rows placed where the lost ones were."""
    model = qwen if family == "qwen4_exp" else ink
    scenario = Scenario(model, family, "managed", step_undo=False)
    fresh = torch.randint(2, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(9))

    def survivors(cache):
        """Row 2 alone, then two fresh rows beside it: their logits."""
        with torch.no_grad():
            cache.move_rows([2])
            alone = model(torch.full((1, 1), 7), past_key_values=cache).logits
            cache.move_rows([0, -1, -1])
            beside = model(torch.cat([torch.full((1, 6), 7), fresh]), past_key_values=cache).logits
        return alone, beside

    cache, forward, step, _ = scenario.build()
    assert cache.undo.nbytes() == 0 and "step_undo" not in cache.memory_stats()["bytes"]
    with torch.no_grad():
        forward(*step)
    want = survivors(cache)

    # (the host checks before a step begins are covered densely above: here fewer of them, the step itself spread)
    points = fault_points(scenario, dense_until=8, spread=16)
    lost = []  # per point: whether it lost rows (from the step's begin on, every later point must)
    for n in points:
        with torch.no_grad():
            cache, forward, step, after = scenario.build()
            before = host_state(cache)
            with pytest.raises(Injected), FailAt(n):
                forward(*step)
        assert host_state(cache) == before, f"a fault at call {n} changed the host state"
        # A fault before the step began (its checks) loses nothing; from then on the rows it fed are lost.
        assert cache.rows.lost[:3] in ([0, 0, 0], [1, 1, 0]), n
        lost.append(bool(cache.rows.lost[0]))
        if lost[-1]:
            with pytest.raises(ValueError, match=r"row 0 lost its state.*reset\(\)"):
                after()
        for got, expected in zip(survivors(cache), want):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=lambda m: f"fault at {n}: {m}")
    assert lost == sorted(lost) and sum(lost) >= 16, lost


def test_a_lost_row_is_neither_cached_nor_restored_into(qwen):
    """With prefix caching, a row a failed step left lost (``step_undo=False``) is refused as a prefix and as a
    target of a cached one; released, its place takes a cached prefix again."""
    model = qwen
    cache = QSAPagedCache(model.config, 2, 96, block_size=4, step_undo=False, prefix_caching=True)
    prompt = torch.randint(2, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache.move_rows([-1, -1])
        model(prompt, past_key_values=cache)
        cache.cache_prefix(1, prompt[1].tolist())
        with pytest.raises(Injected), FailAt(400):
            model(torch.full((2, 1), 7), past_key_values=cache)
    assert cache.rows.lost[:2] == [1, 1]
    for use in (lambda: cache.cache_prefix(0, prompt[0].tolist()), lambda: cache.snapshot_row(0),
                lambda: cache.restore_prefix(0, prompt[1].tolist())):
        with pytest.raises(ValueError, match="row 0 lost its state"):
            use()
    cache.move_rows([-1])  # both released, a fresh row in their place
    assert cache.restore_prefix(0, prompt[1].tolist()) == 8


ROW_OPS = {
    "crop": lambda cache: cache.crop(-(K - 1)),
    "reorder": lambda cache: cache.reorder_cache(torch.tensor([2, 0, 0])),
    "select": lambda cache: cache.batch_select_indices(torch.tensor([2, 0])),
    "repeat": lambda cache: cache.batch_repeat_interleave(2),
    "move": lambda cache: cache.move_rows([2, -1, 0]),  # continuous batching's placement, a fresh row in the middle
}


@pytest.mark.parametrize("op", list(ROW_OPS))
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_fault_anywhere_in_a_crop_or_row_move(qwen, ink, family, op):
    """Crops and row moves (beam reorder, select, repeat) between steps: a fault at any torch call of the
    operation leaves the cache as it was (the operation then works and the next step equals a cache that
    never failed), or, for row moves whose writes had begun, refusing with reset() named."""
    model = qwen if family == "qwen4_exp" else ink
    scenario = Scenario(model, family, "verify")
    apply = ROW_OPS[op]

    def prepared():
        cache, forward, step, _ = scenario.build()
        with torch.no_grad():
            forward(*step)
        if op == "repeat":  # two rows, so that repeating them stays within max_batch_size
            cache.batch_select_indices(torch.tensor([1, 2]))
        return cache

    def next_logits(cache):
        rows, columns = cache.num_rows, cache.columns_seen
        mask = torch.ones(rows, columns + 1, dtype=torch.long)
        for b in range(rows):
            mask[b, : columns - cache.lengths[b]] = 0
        with torch.no_grad():
            return model(torch.full((rows, 1), 7), attention_mask=mask, past_key_values=cache).logits

    clean = prepared()
    apply(clean)
    want = next_logits(clean)
    ready = prepared()  # (prepared outside the counting mode: only the operation's calls are counted)
    total = count_calls(lambda: apply(ready))
    if family == "inkling" and op == "crop":
        assert total == 0  # host bookkeeping only: every state is addressed by position
        return
    assert total > 5
    for n in range(1, total + 1) if EVERY else sample_points(total, dense_until=12, spread=10):
        cache = prepared()
        before = host_state(cache)
        with pytest.raises(Injected), FailAt(n):
            apply(cache)
        if cache._unusable is not None:
            assert op != "crop" and "call cache.reset()" in cache._unusable
            continue
        assert host_state(cache) == before, f"{op}: a fault at call {n} changed the host state"
        apply(cache)
        torch.testing.assert_close(next_logits(cache), want, atol=1e-6, rtol=0, msg=lambda m: f"{op}, fault at {n}: {m}")


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_fault_while_a_store_allocates_leaves_it_unallocated(qwen, ink, family, monkeypatch):
    """Stores of a cache built without device/dtype allocate inside the first forward: a fault at any
    torch call of an allocation must leave that store wholly unallocated, so the retried prompt (here a
    chunked prefill) allocates it again and equals a cache that never failed."""
    model = qwen if family == "qwen4_exp" else ink
    ids, mask = _prompts(family)
    monkeypatch.setattr(model, "prefill_chunk_tokens", 4 * ids.shape[0])

    def prefill(cache):
        with torch.no_grad():
            return model(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits

    want = prefill(QSAPagedCache(model.config, 4, 96, block_size=4))
    kinds = {type(s) for layer in QSAPagedCache(model.config, 4, 96).layers for s in layer.stores.values()}
    for kind in kinds:
        original = kind.allocate
        for n in range(1, 8):
            first = [True]

            def failing(self, device, dtype, n=n, first=first, original=original):
                if first[0]:
                    first[0] = False
                    with FailAt(n):
                        return original(self, device, dtype)
                return original(self, device, dtype)

            cache = QSAPagedCache(model.config, 4, 96, block_size=4)
            monkeypatch.setattr(kind, "allocate", failing)
            try:
                prefill(cache)
                failed = False
            except Injected:
                failed = True
            monkeypatch.setattr(kind, "allocate", original)
            if not failed:
                assert n > 1, f"{kind.__name__}: a fault at its allocation's first call did not raise"
                break  # n is past the allocation's last call
            torch.testing.assert_close(prefill(cache), want, atol=1e-6, rtol=0,
                                       msg=lambda m: f"{kind.__name__}, fault at call {n}: {m}")
