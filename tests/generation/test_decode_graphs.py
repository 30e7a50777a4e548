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
    assert list(runner.buckets) == [(4, 1, 64)] and runner.buckets[4, 1, 64].experts == "batched_mm"


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_static_buffer_verify_steps_equal_the_forward(family):
    """Verify steps of k + 1 tokens (drafts) on a cache with rollback headroom, each followed by a crop of
    a different depth (none, some, all drafts rejected): the recorded path equals the forward."""
    model, (ids, mask) = _pair(family)
    k = 3
    eager = QSAPagedCache(model.config, 4, 96, block_size=4, num_speculative_tokens=k)
    static = QSAPagedCache(model.config, 4, 96, block_size=4, num_speculative_tokens=k)
    runner = graphs_of(model, static, "cpu", record=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=eager)
        model(ids, attention_mask=mask, past_key_values=static)
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
    assert list(runner.buckets) == [(4, k + 1, 96)]


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


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("length, mask, pads", [
    pytest.param(4, _mask([[1] * 6, [1] * 6]), False, id="every-row-takes-all"),
    pytest.param(4, _mask([[1] * 6, [1, 1, 0, 1, 1, 1]]), True, id="ragged-drafts"),
    pytest.param(4, _mask([[1] * 6, [0, 0, 1, 1, 1, 1]]), False, id="pads-before-the-step"),
    pytest.param(1, _mask([[1] * 6, [1] * 5 + [0]]), False, id="one-token-step-not-read"),
    pytest.param(4, None, False, id="no-mask"),
])
def test_a_step_whose_rows_carry_pads_runs_eagerly(length, mask, pads):
    """The recorded step takes every row's columns as real (positions follow its length; no leading pads in its
    metadata), so a verify step in which rows drafted different counts (left-padded: continuous batching with prompt
    lookup) must not replay it. On Qwen4Exp that path gives other logits for such a step (the pads go into the
    conv and n-gram windows, the real tokens' positions shift)."""
    ids = torch.zeros(2, length, dtype=torch.long)
    assert cuda_graphs.carries_pads(ids, mask) is pads


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_the_forward_asks_about_its_step_mask(family, monkeypatch):
    """Each family's forward hands its attention mask to the graphs' choice (`decode_graphs_for`), which refuses a
    step with pads in its columns before anything else is looked at."""
    model, (ids, mask) = _pair(family)
    cache = QSAPagedCache(model.config, 4, 64, block_size=4, num_speculative_tokens=3)
    seen = []
    real = cuda_graphs.carries_pads
    monkeypatch.setattr(cuda_graphs, "carries_pads", lambda i, m: seen.append(m) or real(i, m))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        step = torch.ones(ids.shape[0], 3, dtype=torch.long)
        step[0, 0] = 0  # row 0 drafted one token fewer
        model(torch.full_like(step, 5), attention_mask=torch.cat([mask, step], dim=1), past_key_values=cache)
    assert seen and seen[-1] is not None and seen[-1].shape[1] == mask.shape[1] + 3
    assert real(torch.zeros_like(step), seen[-1])
