"""The decode step a CUDA graph records, run eagerly on the CPU against the ordinary forward.

`DecodeGraphs(record=False)` runs exactly what a graph captures: metadata from static buffers with
no host lengths (shapes sized for the cache's capacity, group compression always on), a batch
padded to its bucket, positions from the buffer. Each step's logits must equal the ordinary
forward's, over steps that close QSA groups and evict window blocks. These fp32 models' experts run
``batched_mm`` in that step (``grouped_mm``, which the forward runs, cannot be captured in fp32:
`cuda_graphs.graph_experts`), so the comparison covers that substitution too.
"""

from __future__ import annotations

import pytest
import helpers.inkling as inkling
import torch
from helpers.graphs import ReplayingGraphs
from helpers.qwen4 import left_pad, make_pair, random_prompts

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache import cuda_graphs
from hf_qsa_cache.cuda_graphs import graphs_of

STEPS = 9


def _pair(family):
    if family == "qwen4_exp":
        _, ours = make_pair(seed=7)
        return ours, left_pad(random_prompts([25, 9, 19], seed=8))
    _, ours = inkling.make_pair(inkling.make_config(), seed=9)
    return ours, inkling.left_pad(inkling.make_prompts([11, 4, 8], seed=10))


def _prompt_on_twin_caches(model, ids, mask, capacity: int, k: int):
    """``(eager, static, runner)``: two caches of four rows with rollback headroom ``k``, each holding the prompt, and
    the recorded step's runner on ``static`` (run from its static buffers)."""
    eager, static = (QSAPagedCache(model.config, 4, capacity, block_size=4, num_speculative_tokens=k) for _ in range(2))
    runner = graphs_of(model, static, "cpu", record=False)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=eager)
        model(ids, attention_mask=mask, past_key_values=static)
    return eager, static, runner


@pytest.mark.parametrize("family, positions", [("qwen4_exp", "implicit"), ("qwen4_exp", "passed"),
                                               ("inkling", "implicit")])  # Inkling has no position ids
def test_static_buffer_step_equals_the_forward(family, positions):
    model, (ids, mask) = _pair(family)
    rows = ids.shape[0]
    # Four cache rows for three sequences: the bucket pads one row that must stay inert.
    eager = QSAPagedCache(model.config, 4, 64, block_size=4)
    static = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = graphs_of(model, static, "cpu", record=False)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=eager).logits[:, -1:]
        model(ids, attention_mask=mask, past_key_values=static)
        lengths = mask.sum(1)
        for step in range(STEPS):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = (lengths + step).view(rows, 1) if positions == "passed" else None
            logits = model(nxt, attention_mask=mask, past_key_values=eager, position_ids=pos).logits
            got = runner.step(nxt, pos, mask)
            # The recorded step reduces over capacity-sized, masked key sets: another fp32 summation
            # order than the forward (Inkling differed by up to 1.6e-5 on one CPU).
            torch.testing.assert_close(got, logits, atol=5e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert static.lengths == eager.lengths and static.columns_seen == eager.columns_seen
    assert list(runner.buckets) == [(4, 1, 64, False)] and runner.buckets[4, 1, 64, False].experts == "batched_mm"


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_static_buffer_verify_steps_equal_the_forward(family):
    """Verify steps of k + 1 tokens (drafts) on a cache with rollback headroom, each followed by a crop of
    a different depth (none, some, all drafts rejected): the recorded path equals the forward."""
    model, (ids, mask) = _pair(family)
    k = 3
    eager, static, runner = _prompt_on_twin_caches(model, ids, mask, 96, k)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for step in range(6):
            drafts = torch.randint(2, model.config.vocab_size, (ids.shape[0], k + 1), generator=gen)
            mask = torch.cat([mask, torch.ones_like(drafts)], dim=1)
            want = model(drafts, attention_mask=mask, past_key_values=eager).logits
            got = runner.step(drafts, None, mask)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
            drop = step % (k + 1)
            if drop:
                eager.crop(-drop)
                static.crop(-drop)
                mask = mask[:, :-drop]
    assert static.lengths == eager.lengths
    assert list(runner.buckets) == [(4, k + 1, 96, False)]


def test_buckets_are_powers_of_two_up_to_the_cache_rows():
    model, _ = _pair("inkling")
    cache = QSAPagedCache(model.config, 6, 32)
    runner = graphs_of(model, cache, "cpu", record=False)
    assert [runner.bucket(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_step_is_sized_for_its_reach_not_the_cache_capacity(family, monkeypatch):
    """On a cache sized for far more than its rows hold, the recorded step's length-sized shapes (QSA
    scores and top-k, Inkling's key span) cover the longest row after the step rounded up to a power of
    two, so a long-capacity cache decodes a short prompt at a short prompt's cost. Decode and verify steps
    cross reaches (a new bucket each) and equal the forward on a cache sized for the prompt."""
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_REACH", 16)
    model, (ids, mask) = _pair(family)
    k = 3
    eager = QSAPagedCache(model.config, 4, 96, block_size=4, num_speculative_tokens=k)
    static = QSAPagedCache(model.config, 4, 4096, block_size=4, num_speculative_tokens=k)
    runner = graphs_of(model, static, "cpu", record=False)
    sized = []  # (reach the step's metadata was sized for, longest row after the step)
    build = static.graph_step_metadata
    monkeypatch.setattr(static, "graph_step_metadata", lambda lengths, *a, **kw: (
        sized.append((kw["reach"], int((lengths[0] + lengths[1]).max()))), build(lengths, *a, **kw))[1])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=eager)
        model(ids, attention_mask=mask, past_key_values=static)
        for step in range(12):
            length = k + 1 if step % 2 else 1
            drafts = torch.randint(2, model.config.vocab_size, (ids.shape[0], length), generator=gen)
            mask = torch.cat([mask, torch.ones_like(drafts)], dim=1)
            want = model(drafts, attention_mask=mask, past_key_values=eager).logits
            got = runner.step(drafts, None, mask)
            torch.testing.assert_close(got, want, atol=5e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
            if length > 1:  # a verify step keeps one or two of its tokens
                drop = 3 if step % 4 == 1 else 2
                eager.crop(-drop)
                static.crop(-drop)
                mask = mask[:, :-drop]
    assert all(longest <= reach < max(2 * longest, 17) for reach, longest in sized), sized
    assert len({reach for reach, _ in sized}) >= 2  # the rows crossed a power of two
    assert {key[2] for key in runner.buckets} == {reach for reach, _ in sized}



@pytest.mark.parametrize("length, pads", [(4, [0, 2, 3]), (20, [0, 7, 13])], ids=["verify-sized", "longer"])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_static_buffer_step_with_padded_rows_equals_the_forward(family, length, pads):
    """Rows that take fewer tokens than the step (continuous batching's verify steps when rows drafted different
    counts: left-padded): the recorded step puts each row's real tokens after its length (positions) and moves its
    pads in front of its conv and n-gram windows (the metadata's leading pads), as the forward does. Logits of the
    real columns equal the forward's."""
    model, (ids, mask) = _pair(family)
    eager, static, runner = _prompt_on_twin_caches(model, ids, mask, 128, 3)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(2):
            step = torch.randint(2, model.config.vocab_size, (ids.shape[0], length), generator=gen)
            real = torch.ones_like(step)
            for row, n in enumerate(pads):
                real[row, :n] = 0
            mask = torch.cat([mask, real], dim=1)
            want = model(step, attention_mask=mask, past_key_values=eager).logits
            got = runner.step(step, None, mask)
            keep = real.bool()
            torch.testing.assert_close(got[keep], want[keep], atol=5e-5, rtol=0)
    assert static.lengths == eager.lengths
    assert list(runner.buckets) == [(4, length, 128, True)]  # recorded apart from steps without pads


@pytest.mark.parametrize("length", [20, 64], ids=["padded-to-32", "a-power-of-two"])
@pytest.mark.parametrize("family, positions", [("qwen4_exp", "implicit"), ("qwen4_exp", "passed"),
                                               ("inkling", "implicit")])
def test_short_prefill_steps_take_the_recorded_step_at_a_power_of_two_length(family, positions, length):
    """A prefill step of two started rows (a power of two) and at most `SHORT_PREFILL_TOKENS` tokens once its length
    is rounded up to a power of two, whose caller keeps the last column's logits (``logits_to_keep=1``), goes through
    the forward to the recorded step (`takes_graph_step`), its tokens left-padded to that length; its logits equal
    the forward's, over steps that close QSA groups and evict window blocks. A caller that keeps every column runs
    the forward (the recorded step computes the last column alone)."""
    from helpers.serving import steps_routed_as_on_a_gpu

    model, (ids, mask) = _pair(family)
    ids, mask = ids[:2], mask[:2]
    eager, static, runner = _prompt_on_twin_caches(model, ids, mask, 160, 0)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(2):
            step = torch.randint(2, model.config.vocab_size, (2, length), generator=gen)
            pos = mask.sum(1, keepdim=True) + torch.arange(length) if positions == "passed" else None
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            want = model(step, attention_mask=mask, past_key_values=eager, position_ids=pos, logits_to_keep=1).logits
            with steps_routed_as_on_a_gpu() as routed:
                got = model(step, attention_mask=mask, past_key_values=static, position_ids=pos, logits_to_keep=1)
            assert routed == [length] and got.logits.shape == want.shape == (2, 1, model.config.vocab_size)
            torch.testing.assert_close(got.logits, want, atol=5e-5, rtol=0)
            assert not cuda_graphs.takes_graph_step(static, step, None, False, logits_to_keep=0)
            assert not cuda_graphs.takes_graph_step(static, step, None, False, logits_to_keep=2)
    assert static.lengths == eager.lengths
    recorded = max(length, cuda_graphs.SHORT_PREFILL_MIN_LEN)
    assert list(runner.buckets) == [(2, recorded, 160, recorded > length)]


@pytest.mark.parametrize("rows, length, lengths, spec, managed, recorded", [
    (4, 1, [5, 5, 5, 5], 0, False, 1),  # a decode step
    (4, 3, [5, 5, 5, 5], 3, False, 3),  # a verify step
    (2, 1, [5, 5, 5, 5], 0, False, None),  # one token for some rows only: not a decode step
    (1, 20, [5, 5, 5, 5], 0, False, 32),  # short prefill steps, rounded up to a power of two of at least 32
    (1, 256, [5, 5, 5, 5], 0, False, 256),
    (1, 257, [5, 5, 5, 5], 0, False, None),  # longer than SHORT_PREFILL_TOKENS
    (2, 128, [5, 5, 5, 5], 0, False, 128),
    (2, 129, [5, 5, 5, 5], 0, False, None),
    (4, 3, [5, 5, 5, 5], 0, False, 32),  # no drafts on this cache: a three-token step is a prefill step
    (3, 20, [5, 5, 5, 5], 0, False, None),  # three rows: the rows bucket (4) would take a live row as its padding
    (2, 20, [5, 0, 5, 5], 0, False, None),  # a row's first tokens take the eager prefill
    (2, 20, [5, 0, 5, 5], 0, True, 32),  # unless continuous batching placed it (a fresh row's state: move_rows)
], ids=["decode", "verify", "decode-of-some-rows", "short", "short-at-the-limit", "too-long", "two-rows",
        "two-rows-too-long", "three-tokens-without-drafts", "three-rows", "a-row-not-started",
        "a-new-row-placed-by-continuous-batching"])
def test_which_steps_the_recorded_step_takes(rows, length, lengths, spec, managed, recorded):
    from types import SimpleNamespace

    cache = SimpleNamespace(num_rows=len(lengths), lengths=lengths, num_speculative_tokens=spec,
                            rows=SimpleNamespace(managed=managed))
    assert cuda_graphs.recorded_length(cache, rows, length) == recorded


def test_the_runner_names_its_device_with_its_index(monkeypatch):
    """``"cuda"`` and ``"cuda:0"`` are unequal devices: a runner that kept ``"cuda"`` would ask the block tables for a
    copy on another device than theirs every step (a new tensor each time), and drop and capture its graphs again
    (their recorded table addresses changed), never replaying one."""
    model, _ = _pair("qwen4_exp")
    cache = QSAPagedCache(model.config, 2, 32, block_size=4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert graphs_of(model, cache, "cuda", record=False).device == torch.device("cuda", 0)


def test_the_recorded_step_sees_the_model_move_to_another_dtype():
    """The runner keeps the model's dtype from its last full check (reading it walks every parameter); a model cast
    to another dtype between two steps still meets the cache's check at the next one, as the forward does."""
    model, (ids, mask) = _pair("qwen4_exp")
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = graphs_of(model, cache, "cpu", record=False)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        runner.step(nxt, None, mask)
        model.to(torch.float64)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        with pytest.raises(ValueError, match="this one runs in dtype=torch.float64"):
            runner.step(nxt, None, mask)


def test_the_runner_counts_the_steps_that_record_a_graph():
    """A shape's first step records its graph, counted with its host seconds (what meeting a new shape costs a serving
    loop: `bench_serving` reports both); the later steps of that shape replay it."""
    model, (ids, mask) = _pair("qwen4_exp")
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = ReplayingGraphs(model, cache, "cpu", record=True)
    with torch.no_grad():
        nxt = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            runner.step(nxt, None, mask)
    assert (runner.recordings, runner.replays) == (1, 2) and runner.recording_s > 0


def test_a_hook_added_to_a_block_between_two_recorded_steps_drops_the_graphs():
    """A graph bypasses hooks, so one registered on a decoder layer between two recorded steps (no other step in
    between: only the per-step probe sees it) makes the next step record again, and the hook then runs."""
    model, (ids, mask) = _pair("qwen4_exp")
    cache = QSAPagedCache(model.config, 4, 64, block_size=4)
    runner = ReplayingGraphs(model, cache, "cpu", record=True)
    calls = []
    with torch.no_grad():
        nxt = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        for step in range(4):
            if step == 2:
                handle = model.model.layers[1].register_forward_hook(lambda *a: calls.append(step))
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            nxt = runner.step(nxt, None, mask)[:, -1].argmax(-1, keepdim=True)
    handle.remove()
    assert (runner.recordings, runner.replays) == (2, 2) and calls


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_prefill_sized_recorded_step_keeps_its_last_column_alone(family):
    """A short prefill step's graph computes and keeps the last column's logits only (a buffer of every column would
    hold rows x length x vocabulary per recorded shape): the recording step's logits and the replay's equal the
    forward's last column."""
    model, (ids, mask) = _pair(family)
    ids, mask = ids[:2], mask[:2]
    eager, static, _ = _prompt_on_twin_caches(model, ids, mask, 160, 0)
    runner = ReplayingGraphs(model, static, "cpu", record=True)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for _ in range(2):
            step = torch.randint(2, model.config.vocab_size, (2, 20), generator=gen)
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            want = model(step, attention_mask=mask, past_key_values=eager, logits_to_keep=1).logits
            got = runner.step(step, None, mask)
            assert got.shape == (2, 1, model.config.vocab_size)
            torch.testing.assert_close(got, want, atol=5e-5, rtol=0)
    (entry,) = runner.buckets.values()
    assert entry.ids.shape == (2, 32) and entry.logits.shape == (2, 1, model.config.vocab_size)
    assert (runner.recordings, runner.replays) == (1, 1)
