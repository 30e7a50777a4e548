"""Qwen4Exp on QSAPagedCache against transformers' own model, row by row, unpadded, fp32."""

from __future__ import annotations

import pytest
import torch
from helpers.qwen4 import EOS, left_pad, make_pair, random_prompts, tiny_config, upstream_generate
from transformers import LlamaConfig

from hf_qsa_cache import QSAPagedCache

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _generate(model, ids, mask, cache=None, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW_TOKENS, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **kwargs,
    )


def _assert_rows_match(ref, out, ids, prompts):
    for i, prompt in enumerate(prompts):
        tokens, logits = upstream_generate(ref, prompt, NEW_TOKENS)
        mine = out.sequences[i, ids.shape[1]:]
        mine_logits = torch.stack([step[i] for step in out.logits])
        assert mine.tolist() == tokens.tolist(), f"row {i}"
        torch.testing.assert_close(mine_logits, logits, atol=1e-4, rtol=0)


def test_ragged_batch_matches_upstream_per_row(pair):
    ref, ours = pair
    config = ours.config
    prompts = random_prompts([29, 7, 18, 33], seed=1)
    # QSA selection must really be active: more complete groups than the top-k keeps.
    assert max(len(p) for p in prompts) // config.indexer_compress_ratio > (
        config.indexer_budget // config.indexer_compress_ratio
    )
    ids, mask = left_pad(prompts)
    cache = QSAPagedCache(config, max_batch_size=4, max_cache_len=64, block_size=4)
    out = _generate(ours, ids, mask, cache)
    assert out.past_key_values is cache
    _assert_rows_match(ref, out, ids, prompts)
    # The last generated token is never fed back, so it is not cached.
    assert cache.lengths[:4] == [len(p) + NEW_TOKENS - 1 for p in prompts]
    assert len(set(out.sequences[:, -NEW_TOKENS:].flatten().tolist())) > 3, "degenerate model output"


def test_group_key_rotary_is_computed_once_per_forward(pair, monkeypatch):
    """Every QSA layer of a forward closes the same groups at the same first positions: the group keys'
    cos/sin come from one rotary call per forward, and the tokens still match upstream per row."""
    from modeling.modeling_qwen4_exp import PagedQSAAttention

    ref, ours = pair
    calls, forwards = [], []
    real = PagedQSAAttention._rotary
    monkeypatch.setattr(PagedQSAAttention, "_rotary", lambda self, *a: calls.append(1) or real(self, *a))
    hook = ours.register_forward_pre_hook(lambda *a: forwards.append(1))
    prompts = random_prompts([29, 7, 18], seed=3)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=64, block_size=4))
    hook.remove()
    assert sum(t == "indexed_attention" for t in ours.config.layer_types) > 1
    assert 0 < len(calls) <= len(forwards)
    _assert_rows_match(ref, out, ids, prompts)


def test_small_chunks_and_copied_metadata_match_upstream(pair, monkeypatch):
    """The score / attention chunk loops split every forward (budget forced tiny), and every layer reads
    step metadata that went through `StepMetadata.to()` (what a split model's second device sees)."""
    from hf_qsa_cache.ops import qsa

    ref, ours = pair
    monkeypatch.setattr(qsa, "_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(QSAPagedCache, "step_metadata", lambda self, device: self.metadata.current.to(device))
    prompts = random_prompts([29, 7, 18], seed=6)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=64, block_size=4))
    _assert_rows_match(ref, out, ids, prompts)


def test_selection_from_tile_maxima_matches_upstream(pair, monkeypatch):
    """The long-context selection (tile maxima ranked, the best tiles' groups scored again), forced on from
    a few groups with tiles of 2, inside whole generate() calls: the same rows as upstream."""
    from hf_qsa_cache.ops import qsa, top_set

    ref, ours = pair
    calls = []
    real = qsa.select_by_tile_maxima
    monkeypatch.setattr(top_set, "TOPK_TILE", 2)
    monkeypatch.setattr(qsa, "selects_by_tiles", lambda q, groups, k: groups >= 2 * k * top_set.TOPK_TILE)
    monkeypatch.setattr(qsa, "select_by_tile_maxima", lambda *a: calls.append(1) or real(*a))
    prompts = random_prompts([29, 7, 18], seed=8)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=64, block_size=4))
    assert calls, "the tile-maxima selection was not taken"
    _assert_rows_match(ref, out, ids, prompts)


def test_selection_changes_the_result(pair):
    """Guard against a test config where sparse selection is a no-op: dense attention must differ."""
    ref, ours = pair
    prompts = random_prompts([31], seed=2)
    ids, mask = left_pad(prompts)
    sparse = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 1, 40)).logits
    layers = [layer.self_attn.indexer for layer in ours.model.layers if layer.layer_type == "indexed_attention"]
    saved = [ix.block_topk for ix in layers]
    try:
        for ix in layers:
            ix.block_topk = 1000
        dense = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 1, 40)).logits
    finally:
        for ix, k in zip(layers, saved):
            ix.block_topk = k
    assert (sparse - dense).abs().max() > 1e-2
    torch.testing.assert_close(sparse, ref(ids).logits, atol=1e-4, rtol=0)


def test_generate_without_cache_builds_a_paged_one(pair):
    ref, ours = pair
    prompts = random_prompts([21, 12, 26], seed=3)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask)
    assert isinstance(out.past_key_values, QSAPagedCache)
    _assert_rows_match(ref, out, ids, prompts)


def test_dense_equivalence_when_everything_fits():
    ref, ours = make_pair(tiny_config(indexer_budget=64), seed=4)
    prompts = random_prompts([20, 11, 15], seed=4)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, 3, 40, block_size=8))
    _assert_rows_match(ref, out, ids, prompts)


@pytest.mark.parametrize("chunks", [[5, 6, 100], [1, 2, 3, 4, 100], [7, 100]])
def test_prefill_chunked_and_token_by_token_agree(pair, chunks):
    """One-shot prefill = chunked prefill (boundaries inside groups) = token-by-token, padded batch."""
    _, ours = pair
    prompts = random_prompts([27, 13, 22], seed=5)
    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    one_shot = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 3, 64, block_size=4)).logits

    cache = QSAPagedCache(ours.config, 3, 64, block_size=4)
    pieces, start = [], 0
    for size in chunks:
        end = min(width, start + size)
        if start == end:
            break
        pieces.append(ours(ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache).logits)
        start = end
    chunked = torch.cat(pieces, dim=1)

    cache = QSAPagedCache(ours.config, 3, 64, block_size=4)
    steps = [ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits
             for t in range(width)]
    token_by_token = torch.cat(steps, dim=1)
    real = mask.bool()
    torch.testing.assert_close(chunked[real], one_shot[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(token_by_token[real], one_shot[real], atol=1e-5, rtol=0)


def test_mrope_three_axis_positions_match_upstream(pair):
    """Distinct T/H/W positions: compressed keys must be rotated at each group's exact first-token triple,
    also when that token came from an earlier chunk (held in the ring)."""
    ref, ours = pair
    prompt = random_prompts([26], seed=6)[0]
    n = len(prompt)
    base = torch.arange(n)
    pos3 = torch.stack([base, base // 2 + 3, base * 2 + 1])[:, None, :]  # [3, 1, n]
    ids = torch.tensor([prompt])
    expected = ref(ids, position_ids=pos3).logits
    cache = QSAPagedCache(ours.config, 1, 64, block_size=4)
    pieces = []
    for start, end in [(0, 7), (7, 8), (8, 19), (19, n)]:
        pieces.append(ours(ids[:, start:end], position_ids=pos3[..., start:end], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=1e-4, rtol=0)


def test_beam_search_matches_upstream(pair):
    ref, ours = pair
    prompt = random_prompts([19], seed=7)[0]
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0,
                  eos_token_id=None, attention_mask=mask)
    expected = ref.generate(ids, **kwargs)
    mine = ours.generate(ids, past_key_values=QSAPagedCache(ours.config, 3, 40, block_size=4), **kwargs)
    assert mine.tolist() == expected.tolist()
    # Without a cache, generate() sizes one for batch x beams.
    assert ours.generate(ids, **kwargs).tolist() == expected.tolist()


def test_seeded_sampling_matches_upstream(pair):
    ref, ours = pair
    prompt = random_prompts([17], seed=8)[0]
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
    torch.manual_seed(123)
    expected = ref.generate(ids, **kwargs)
    torch.manual_seed(123)
    mine = ours.generate(ids, past_key_values=QSAPagedCache(ours.config, 1, 40), **kwargs)
    assert mine.tolist() == expected.tolist()


def _state_snapshot(cache):
    return (list(cache.lengths), cache.num_rows, cache.columns_seen,
            {n: [list(r) for r in t.rows] for n, t in cache.tables.items()}, cache.memory_stats())


def test_bad_input_raises_and_leaves_cache_usable(pair):
    ref, ours = pair
    config = ours.config
    cache = QSAPagedCache(config, max_batch_size=3, max_cache_len=40, block_size=4)
    before = _state_snapshot(cache)

    prompts = random_prompts([9, 14], seed=9)
    ids, mask = left_pad(prompts)
    right = mask.flip(1)
    with pytest.raises(ValueError, match="not left-padded: row 0"):  # the models reorder such steps first
        cache.check_step(2, ids.shape[1], right)
    with pytest.raises(ValueError, match="only 0 and 1"):
        ours(ids, attention_mask=mask * 2, past_key_values=cache)
    too_many = torch.randint(2, 90, (4, 5))
    with pytest.raises(ValueError, match="batch of 4 rows exceeds max_batch_size=3"):
        ours(too_many, past_key_values=cache)
    long = torch.randint(2, 90, (2, 41))
    with pytest.raises(ValueError, match="row 0 needs 41 slots, cache holds max_cache_len=40"):
        ours(long, past_key_values=cache)
    assert _state_snapshot(cache) == before

    # A valid generate afterwards on the same cache still matches upstream.
    out = _generate(ours, ids, mask, cache)
    _assert_rows_match(ref, out, ids, prompts)

    # A decode step that would overflow a row is rejected without touching the rows.
    mid = _state_snapshot(cache)
    with pytest.raises(ValueError, match="needs 41 slots"):
        for _ in range(40):
            ours(torch.full((2, 1), 5), past_key_values=cache)
            mid = _state_snapshot(cache)
    assert _state_snapshot(cache) == mid
    with pytest.raises(ValueError, match="holds a batch of 2 rows in flight, got 1"):
        ours(torch.full((1, 1), 5), past_key_values=cache)


def test_bad_construction():
    config = tiny_config()
    with pytest.raises(ValueError, match="multiple of indexer_compress_ratio=2, got block_size=5"):
        QSAPagedCache(config, 2, 32, block_size=5)
    with pytest.raises(ValueError, match="cannot serve layer types"):
        QSAPagedCache(LlamaConfig(num_hidden_layers=2, layer_types=["full_attention"] * 2), 2, 32)
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        QSAPagedCache(config, 0, 32)


def test_pool_exhaustion_is_a_clear_error(pair):
    _, ours = pair
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=64, block_size=4, num_blocks=6)
    ids = torch.randint(2, 90, (2, 12))  # 3 blocks per row, 6 needed, 5 usable
    with pytest.raises(ValueError, match="needs 6 free blocks of 4 tokens, 5 are free"):
        ours(ids, past_key_values=cache)
    assert cache.lengths == [0, 0] and cache.tables["main"].blocks_in_use() == 0


def test_memory_stats_show_the_qsa_index_bound(pair):
    _, ours = pair
    config = ours.config
    cache = QSAPagedCache(config, max_batch_size=2, max_cache_len=64, block_size=8, dtype=torch.float32,
                          device="cpu")
    ids = torch.randint(2, 90, (2, 21))
    ours(ids, past_key_values=cache)
    stats = cache.memory_stats()
    num_qsa = config.layer_types.count("indexed_attention")
    table = cache.tables["main"]
    token_capacity = table.num_blocks * table.block_size
    per_token_bound = config.indexer_head_dim * 4 / config.indexer_compress_ratio  # fp32 here
    assert stats["bytes"]["qsa_compressed"] <= num_qsa * token_capacity * per_token_bound
    ring = cache.qsa.ring_capacity
    assert ring == 2  # ratio 2, no speculative tokens
    ring_bytes = num_qsa * (cache.max_batch_size + 1) * ring * (config.indexer_head_dim * 4 + 3 * 8)
    assert stats["bytes"]["qsa_ring"] == ring_bytes
    # Nothing else in a QSA layer grows with the sequence except main K/V.
    assert set(stats["bytes"]) == {"attention_kv", "qsa_ring", "qsa_compressed", "linear_conv",
                                   "linear_recurrent", "ple_conv", "ple_ngram", "step_undo", "token_log"}
    assert stats["bytes"]["token_log"] == (cache.max_batch_size + 1) * cache.max_cache_len * 4
    # The copy a step takes of what it overwrites in place: the ring and the per-row state, once.
    in_place = ("qsa_ring", "linear_conv", "linear_recurrent", "ple_conv", "ple_ngram")
    assert stats["bytes"]["step_undo"] == sum(stats["bytes"][k] for k in in_place)
    assert stats["tables"]["main"]["blocks_used"] == 2 * 3
    assert stats["lengths"] == [21, 21]
    assert QSAPagedCache(config, 2, 64, num_speculative_tokens=3).qsa.ring_capacity == 6


def test_reset_starts_fresh(pair):
    ref, ours = pair
    prompts = random_prompts([15, 10], seed=10)
    ids, mask = left_pad(prompts)
    cache = QSAPagedCache(ours.config, 2, 40, block_size=4)
    _generate(ours, ids, mask, cache)
    cache.reset()
    assert cache.tables["main"].blocks_in_use() == 0 and cache.get_seq_length() == 0
    out = _generate(ours, ids, mask, cache)
    _assert_rows_match(ref, out, ids, prompts)


def test_eos_in_prompt_resets_ngram_context(pair):
    ref, ours = pair
    prompt = random_prompts([14], seed=11)[0]
    prompt[5] = EOS
    ids = torch.tensor([prompt])
    torch.testing.assert_close(ours(ids, past_key_values=QSAPagedCache(ours.config, 1, 20)).logits,
                               ref(ids).logits, atol=1e-4, rtol=0)


def test_long_prompt_runs_as_chunked_prefill(pair, monkeypatch):
    """A prompt over `prefill_chunk_tokens` is split into chunks inside forward; same logits, same tokens."""
    ref, ours = pair
    prompts = random_prompts([25, 12, 19], seed=12)
    ids, mask = left_pad(prompts)
    whole = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 3, 40), logits_to_keep=1)
    monkeypatch.setattr(type(ours), "prefill_chunk_tokens", 3 * 4)  # 4 columns per chunk
    chunked = ours(ids, attention_mask=mask, past_key_values=QSAPagedCache(ours.config, 3, 40), logits_to_keep=1)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-5, rtol=0)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, 3, 40, block_size=4))
    _assert_rows_match(ref, out, ids, prompts)
    # A bad prompt is rejected before the first chunk lands.
    cache = QSAPagedCache(ours.config, 3, 20)
    with pytest.raises(ValueError, match="row 0 needs 25 slots"):
        ours(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1)
    assert cache.lengths == [0, 0, 0] and cache.get_seq_length() == 0


@pytest.mark.parametrize("overrides", [
    # No PLE, ratio 4, a QSA layer first, sigmoid-free GDN gate: another corner of the config space.
    dict(ple_layer_ids=[], indexer_compress_ratio=4, indexer_budget=8, output_gate_type="silu",
         layer_types=["indexed_attention", "linear_attention", "indexed_attention"], num_hidden_layers=3),
    # Ratio 3 (not a power of two) with a block size that is a multiple of it.
    dict(indexer_compress_ratio=3, indexer_budget=9),
])
def test_other_geometries_match_upstream(overrides):
    ref, ours = make_pair(tiny_config(**overrides), seed=13)
    r = ours.config.indexer_compress_ratio
    prompts = random_prompts([31, 14, 22], seed=13)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, 3, 48, block_size=2 * r))
    _assert_rows_match(ref, out, ids, prompts)


def test_speculative_headroom_ring_generates_the_same(pair):
    """A ring sized for speculative tokens (capacity 6 for ratio 2, 3 drafts) changes nothing."""
    ref, ours = pair
    prompts = random_prompts([24, 15, 9], seed=14)
    ids, mask = left_pad(prompts)
    cache = QSAPagedCache(ours.config, 3, 48, block_size=4, num_speculative_tokens=3)
    assert cache.qsa.ring_capacity == 6
    out = _generate(ours, ids, mask, cache)
    _assert_rows_match(ref, out, ids, prompts)


def test_crop_is_refused_for_recurrent_state(pair):
    _, ours = pair
    cache = QSAPagedCache(ours.config, 1, 20)
    ours(torch.randint(2, 90, (1, 6)), past_key_values=cache)
    cache.crop(0)  # transformers' "shrink to working size": nothing to do
    with pytest.raises(ValueError, match=r"no rollback history .*num_speculative_tokens=0"):
        cache.crop(-2)
    assert cache.lengths[0] == 6


def test_generate_with_prefill_chunk_size(pair):
    """transformers' own chunked prefill (`prefill_chunk_size`) drives the cache chunk by chunk."""
    ref, ours = pair
    prompts = random_prompts([23, 9, 30], seed=15)
    ids, mask = left_pad(prompts)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, 3, 64, block_size=4), prefill_chunk_size=7)
    _assert_rows_match(ref, out, ids, prompts)


def test_index_rows_are_computed_once_per_step(pair, monkeypatch):
    """Where a step's group tokens live, the store rows its closed groups and ring writes go to: the same in
    every QSA layer, computed once per forward (and afresh for the next, whose positions differ)."""
    from hf_qsa_cache.ops import qsa
    from hf_qsa_cache.stores.qsa_index import QSAIndexStore

    _, ours = pair
    calls = {"sources": 0, "group_rows": 0, "ring_rows": 0}

    def counting(name, real):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or real(*a, **k)

    monkeypatch.setattr(qsa, "group_token_sources", counting("sources", qsa.group_token_sources))
    monkeypatch.setattr(QSAIndexStore, "group_rows", counting("group_rows", QSAIndexStore.group_rows))
    monkeypatch.setattr(QSAIndexStore, "ring_rows", counting("ring_rows", QSAIndexStore.ring_rows))
    ids, mask = left_pad(random_prompts([13, 9], seed=4))
    cache = QSAPagedCache(ours.config, 2, 40, block_size=4)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask, past_key_values=cache).logits
        for _ in range(2):
            nxt = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            logits = ours(nxt, attention_mask=mask, past_key_values=cache).logits
    assert sum(t == "indexed_attention" for t in ours.config.layer_types) > 1
    assert calls["ring_rows"] == 3 and 1 <= calls["group_rows"] == calls["sources"] <= 3, calls
