"""Inkling on QSAPagedCache against transformers' own InklingForCausalLM (CPU, fp32).

Each row of a left-padded batch must generate exactly what upstream generates on that row alone,
unpadded, with per-step logits within 1e-4. The config is small but makes every mechanism act:
sliding layers evict (window 6 < prompts + generation), full and sliding layers have different
KV-head counts and head dims, log scaling is on (n_floor 4), both MLP kinds appear.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import InklingTextConfig, LogitsProcessor, LogitsProcessorList
from transformers import InklingForCausalLM as UpstreamInkling

from hf_qsa_cache import QSAPagedCache
from modeling import InklingForCausalLM

from helpers.inkling import (  # noqa: F401
    BLOCK, KERNEL, PROMPT_LENS, WINDOW, assert_rows_match_upstream, greedy, left_pad, make_config, make_pair,
    make_prompts, upstream_row,
)


@pytest.fixture(scope="module")
def models():
    return make_pair(make_config())


# ----------------------------------------------------------------------------- (a), (b)
def test_ragged_batch_matches_upstream_per_row(models):
    upstream, ours = models
    rows = make_prompts(PROMPT_LENS)
    ids, mask = left_pad(rows)
    n = 12
    cache = QSAPagedCache(ours.config, max_batch_size=len(rows), max_cache_len=ids.shape[1] + n, block_size=BLOCK)
    out = greedy(ours, ids, mask, n=n, past_key_values=cache)
    assert out.past_key_values is cache
    # Not trivially flat: rows and steps disagree.
    assert len(set(out.sequences[:, -n:].flatten().tolist())) > n
    assert_rows_match_upstream(upstream, rows, out, n)
    # Sliding windows evicted: rows longer than the window hold fewer sliding blocks than positions.
    stats = cache.memory_stats()
    assert {"attention_kv", "sliding_kv", "inkling_conv"} <= set(stats["bytes"])
    sliding = cache.tables["sliding"]
    longest = PROMPT_LENS.index(max(PROMPT_LENS))
    assert NULL_in(sliding.rows[longest]), "the longest row's first sliding block should be freed"

    # (b) the same without an explicit cache
    out2 = greedy(ours, ids, mask, n=n)
    assert torch.equal(out2.sequences, out.sequences)
    for a, b in zip(out.logits, out2.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_small_query_chunks_match_upstream(models, monkeypatch):
    """The attention op's query-chunk loop split into many chunks (score budget forced tiny)."""
    from hf_qsa_cache.ops import inkling_attention

    upstream, ours = models
    monkeypatch.setattr(inkling_attention, "SCORE_BUDGET", 64)
    rows = make_prompts(PROMPT_LENS)
    ids, mask = left_pad(rows)
    cache = QSAPagedCache(ours.config, max_batch_size=len(rows), max_cache_len=ids.shape[1] + 8, block_size=BLOCK)
    assert_rows_match_upstream(upstream, rows, greedy(ours, ids, mask, n=8, past_key_values=cache), 8)


def NULL_in(blocks):
    return 0 in blocks


# ----------------------------------------------------------------------------- (c)
def _forward_chunks(model, ids, mask, bounds, cache):
    logits = []
    with torch.no_grad():
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            out = model(ids[:, c0:c1], attention_mask=mask[:, :c1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def test_prefill_chunked_and_token_by_token_agree():
    # Milder weights than the parity model: with std 0.3 over five layers, fp32 GEMMs of different
    # shapes alone (upstream's own one-shot vs token-by-token included) differ by ~2e-5.
    _, ours = make_pair(make_config(), seed=2, std=0.12)
    rows = make_prompts([13, 5, 17], seed=3)
    ids, mask = left_pad(rows)
    L = ids.shape[1]

    def run(bounds):
        cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=L, block_size=BLOCK)
        return _forward_chunks(ours, ids, mask, bounds, cache)

    one_shot = run([0, L])
    chunked = run([0, 7, 12, L])  # first boundary cuts through row 1's pads, others through the window
    stepwise = run(list(range(L + 1)))
    real = mask.bool()
    assert one_shot[real].std() > 0.5  # not flat
    tol = dict(atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[real], one_shot[real], **tol)
    torch.testing.assert_close(stepwise[real], one_shot[real], **tol)
    # A plain forward without any cache agrees too.
    with torch.no_grad():
        plain = ours(ids, attention_mask=mask, use_cache=False)
    assert plain.past_key_values is None
    torch.testing.assert_close(plain.logits[real], one_shot[real], **tol)


# ----------------------------------------------------------------------------- (d)
class BlockWatcher(LogitsProcessor):
    """Records each row's live blocks per table after every forward of generate()."""

    def __init__(self, cache):
        self.cache = cache
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append({
            name: [t.row_blocks_in_use(b) for b in range(self.cache.num_rows)]
            for name, t in self.cache.tables.items()
        })
        return scores


def test_long_generation_keeps_window_blocks_bounded(models):
    upstream, ours = models
    rows = make_prompts([14, 5], seed=5)
    ids, mask = left_pad(rows)
    n = 60
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=ids.shape[1] + n, block_size=BLOCK)
    watcher = BlockWatcher(cache)
    out = greedy(ours, ids, mask, n=n, past_key_values=cache, logits_processor=LogitsProcessorList([watcher]))
    assert len(watcher.seen) == n
    bounds = {
        "sliding": math.ceil(WINDOW / BLOCK) + 1,
        "conv": math.ceil(KERNEL / KERNEL) + 1,
    }
    for step, seen in enumerate(watcher.seen):
        for name, bound in bounds.items():
            assert max(seen[name]) <= bound, f"step {step}: {name} rows hold {seen[name]} blocks (> {bound})"
    # Full layers keep everything: the main table grows with the sequence.
    final_len = ids.shape[1] + n - 1
    assert cache.lengths[:2] == [len(r) + n - 1 for r in rows]
    assert cache.tables["main"].row_blocks_in_use(0) == math.ceil(cache.lengths[0] / BLOCK)
    stats = cache.memory_stats()
    for name, bound in bounds.items():
        assert stats["tables"][name]["blocks_used"] <= 2 * bound
    # The windowed pools are sized by the window, not by the sequence length.
    assert cache.tables["sliding"].num_blocks - 1 <= 2 * 2 * bounds["sliding"]
    assert cache.tables["conv"].num_blocks - 1 <= 2 * 2 * bounds["conv"]
    assert stats["bytes"]["sliding_kv"] < stats["bytes"]["attention_kv"]
    assert final_len > 10 * WINDOW
    assert_rows_match_upstream(upstream, rows, out, n)


# ----------------------------------------------------------------------------- (e)
def test_bad_input_raises_and_leaves_state_intact(models):
    upstream, ours = models
    rows = make_prompts([7, 4, 9], seed=7)
    ids, mask = left_pad(rows)
    n = 6
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=ids.shape[1] + n, block_size=BLOCK)
    before = cache.memory_stats()

    with pytest.raises(ValueError, match="only 0 and 1"):
        ours(ids, attention_mask=mask * 2, past_key_values=cache)
    big = torch.cat([ids, ids[:1]])
    with pytest.raises(ValueError, match=r"4 rows exceeds max_batch_size=3"):
        ours(big, attention_mask=torch.cat([mask, mask[:1]]), past_key_values=cache)
    long_ids = torch.randint(3, 128, (3, ids.shape[1] + n + 1))
    with pytest.raises(ValueError, match=rf"row 0 needs {ids.shape[1] + n + 1} slots.*max_cache_len={ids.shape[1] + n}"):
        ours(long_ids, past_key_values=cache)
    assert cache.memory_stats() == before
    assert cache.lengths == [0, 0, 0] and cache.columns_seen == 0

    out = greedy(ours, ids, mask, n=n, past_key_values=cache)
    assert_rows_match_upstream(upstream, rows, out, n)

    # Mid-generation: a row overflowing the cache is refused and the rows keep their state.
    lengths = list(cache.lengths)
    with pytest.raises(ValueError, match="max_cache_len"):
        ours(torch.randint(3, 128, (3, 5)), past_key_values=cache)
    assert cache.lengths == lengths


def test_config_the_cache_cannot_serve():
    with pytest.raises(ValueError, match="conv_kernel_size must be an integer >= 1, got 0"):
        QSAPagedCache(make_config(conv_kernel_size=0), max_batch_size=1, max_cache_len=8)
    with pytest.raises(ValueError, match="sliding_window_size must be an integer >= 1, got 0"):
        QSAPagedCache(make_config(sliding_window_size=0), max_batch_size=1, max_cache_len=8)
    with pytest.raises(ValueError, match="hidden_size=64 over 3 KV heads"):
        QSAPagedCache(make_config(swa_num_key_value_heads=3, swa_num_attention_heads=6), max_batch_size=1,
                      max_cache_len=8)


def test_cache_for_another_kernel_or_window_is_refused(models):
    _, ours = models
    ids = torch.randint(3, 128, (1, 5))
    for bad, msg in (
        (make_config(conv_kernel_size=3), "built for conv_kernel_size=3, the model has conv_kernel_size=4"),
        (make_config(sliding_window_size=9), "built for sliding_window_size=9, the model has sliding_window_size=6"),
    ):
        cache = QSAPagedCache(bad, max_batch_size=1, max_cache_len=16)
        with pytest.raises(ValueError, match=msg):
            ours(ids, past_key_values=cache)
        assert cache.columns_seen == 0


# ----------------------------------------------------------------------------- (f)
def test_beam_search_matches_upstream(models):
    upstream, ours = models
    row = make_prompts([8], seed=11)[0][None]
    with torch.no_grad():
        ref = upstream.generate(row, max_new_tokens=8, num_beams=2, do_sample=False)
        got = ours.generate(row, max_new_tokens=8, num_beams=2, do_sample=False)
    assert torch.equal(got, ref)


# ----------------------------------------------------------------------------- (g)
def test_crop_rolls_back_by_position(models):
    upstream, ours = models
    rows = make_prompts([10, 7], seed=13)
    ids, mask = left_pad(rows)
    k, n = 3, 10
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=ids.shape[1] + 2 * n,
                          block_size=BLOCK, num_speculative_tokens=k)
    first = greedy(ours, ids, mask, n=n, past_key_values=cache)
    cache.crop(-k)
    keep = first.sequences[:, : ids.shape[1] + n - k]
    keep_mask = torch.cat([mask, torch.ones(2, n - k, dtype=mask.dtype)], dim=1)
    m = 6
    second = greedy(ours, keep, keep_mask, n=m, past_key_values=cache)
    for i, row in enumerate(rows):
        prefix = keep[i][keep_mask[i].bool()]
        ref_tokens, ref_logits = upstream_row(upstream, prefix, m)
        assert torch.equal(second.sequences[i, keep.shape[1]:], ref_tokens)
        torch.testing.assert_close(torch.stack([s[i] for s in second.logits]), ref_logits, atol=1e-4, rtol=0)

    # Without speculative slack, a rollback deeper than the retained window is refused.
    tight = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=ids.shape[1] + n, block_size=BLOCK)
    greedy(ours, ids, mask, n=n, past_key_values=tight)
    lengths = list(tight.lengths)
    with pytest.raises(ValueError, match="already freed"):
        tight.crop(-(WINDOW + BLOCK))
    assert tight.lengths == lengths


# ----------------------------------------------------------------------------- checkpoint round trip
def test_from_pretrained_of_upstream_checkpoint(models, tmp_path):
    upstream, ours = models
    upstream.save_pretrained(tmp_path)
    loaded = InklingForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        ref = upstream(ids).logits
        got = loaded(ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert loaded.model.layers[0].self_attn.k_sconv.conv1d.weight.dtype == torch.float32


def test_long_prompt_runs_as_chunked_prefill(models, monkeypatch):
    """A prompt over `prefill_chunk_tokens` is split into chunks inside forward; same logits, same tokens."""
    upstream, ours = models
    rows = make_prompts([17, 6, 12], seed=7)
    ids, mask = left_pad(rows)
    whole = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 3, 40), logits_to_keep=1)
    monkeypatch.setattr(type(ours), "prefill_chunk_tokens", 3 * 5)  # 5 columns per chunk
    chunked = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 3, 40), logits_to_keep=1)
    # fp32 summation order differs between chunkings (~2e-5 at these weight scales, see test (c)).
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-4, rtol=0)
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=ids.shape[1] + 8, block_size=BLOCK)
    out = greedy(ours, ids, mask, n=8, past_key_values=cache)
    assert_rows_match_upstream(upstream, rows, out, 8)
