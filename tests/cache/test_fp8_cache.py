"""fp8 caches (``kv_cache_dtype`` / ``index_cache_dtype``): the quantization's specification, the stores' bytes,
both families against transformers in fp32, and the cache's guarantees (crop, the step transaction, row copies)
on fp8 stores. The ops and their Triton kernels against these torch functions: ``tests/ops/test_fp8_kernels.py``."""

from __future__ import annotations

import copy

import pytest
import torch

import helpers.inkling as ink_helpers
import helpers.qwen4 as q
from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.layout import build_layout
from hf_qsa_cache.ops import fp8

FP8 = torch.float8_e4m3fn
BOTH = dict(kv_cache_dtype=FP8, index_cache_dtype=FP8)


# ----------------------------------------------------------------------------- the quantization
def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    return values.sort().values


def test_quantize_rounds_to_the_nearest_e4m3_value_with_a_power_of_two_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.exp(torch.randn(64, 4, 1, generator=g) * 4)
    x[0, 0] = 0.0  # a zero vector: scale 1, zeros
    x[0, 1, :3] = torch.tensor([-0.0, 1e-30, -1e-30])
    q8, scale = fp8.quantize_fp8(x)
    assert q8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round())), "scales are powers of two"
    amax = x.abs().amax(-1)
    live = amax > 0
    ratio = amax[live] / scale[live]
    assert (ratio <= 448).all() and (ratio > 224).all(), "the scale is the least power of two fitting 448"
    assert (scale[~live] == 1).all()
    # Each value is the e4m3 value nearest x / scale (ties to even): compare against the whole grid.
    y = (x / scale[..., None]).flatten()
    grid = _e4m3_grid()
    signed = torch.cat([-grid.flip(0), grid])
    nearest = signed[(y[:, None] - signed[None, :]).abs().argmin(dim=1)]
    got = q8.float().flatten()
    dist_got, dist_best = (y - got).abs(), (y - nearest).abs()
    assert torch.equal(dist_got, dist_best), "not the nearest e4m3 value"
    # Relative error at most 2**-4 above e4m3's smallest normal.
    back = fp8.dequantize_fp8(q8, scale, torch.float32)
    normal = x.abs() >= scale[..., None] * 2**-6
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2**-4).all()


def test_cache_dtype_values_are_checked():
    config = q.tiny_config()
    for bad in (torch.float16, torch.float8_e5m2, "fp8", torch.int8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be None"):
            QSAPagedCache(config, 1, 16, kv_cache_dtype=bad)
        with pytest.raises(ValueError, match=f"index_cache_dtype must be None.*{bad!r}".replace("(", r"\(")
                           .replace(")", r"\)")):
            QSAPagedCache(config, 1, 16, index_cache_dtype=bad)


# ----------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_memory_stats_and_layout_count_fp8_pages_and_scales(family):
    config = q.tiny_config(head_dim=128, indexer_head_dim=128) if family == "qwen4_exp" else \
        ink_helpers.make_config(head_dim=128, swa_head_dim=128, num_attention_heads=2, swa_num_attention_heads=2)
    kw = BOTH if family == "qwen4_exp" else dict(kv_cache_dtype=FP8)
    stats = {}
    for name, dtype, extra in (("fp32", torch.float32, {}), ("bf16", torch.bfloat16, {}),
                               ("fp8", torch.bfloat16, kw)):
        cache = QSAPagedCache(config, 2, 64, block_size=8, device="cpu", dtype=dtype, **extra)
        got = cache.memory_stats()
        stats[name] = got
        for table in cache.tables:  # the layout's bytes are what the stores allocated
            per_block = cache.layout.bytes_per_block(table, dtype)
            assert got["tables"][table]["bytes_per_token"] * cache.tables[table].block_size == per_block
        assert sum(got["bytes"].values()) - got["bytes"].get("token_log", 0) == cache.layout.nbytes(2, dtype)
    paged = ("attention_kv", "qsa_compressed", "sliding_kv")
    fp8_bytes, bf16_bytes, fp32_bytes = (sum(stats[n]["bytes"].get(k, 0) for k in paged) for n in ("fp8", "bf16",
                                                                                                  "fp32"))
    # head_dim 128: 132 bytes a vector (scale included) against 256 in bf16 and 512 in fp32.
    assert fp8_bytes * 256 == bf16_bytes * 132 and fp8_bytes * 512 == fp32_bytes * 132
    assert fp8_bytes <= 0.55 * bf16_bytes and fp8_bytes <= fp32_bytes / 3
    for kept in ("qsa_ring", "linear_recurrent", "linear_conv", "inkling_conv"):  # stays in the model's dtype
        if kept in stats["bf16"]["bytes"]:
            assert stats["fp8"]["bytes"][kept] == stats["bf16"]["bytes"][kept]


def test_released_layout_bytes_per_token():
    """At the released Qwen4Exp geometry (head_dim 128 K/V and index keys), fp8 pages cost at most 0.55x bf16's
    and a third of fp32's per token, scales included."""
    config = q.tiny_config(head_dim=128, indexer_head_dim=128, num_key_value_heads=2)
    per = {name: build_layout(config, 1, 4096, **kw).bytes_per_token("main", dtype)
           for name, dtype, kw in (("fp32", torch.float32, {}), ("bf16", torch.bfloat16, {}),
                                   ("fp8", torch.bfloat16, BOTH))}
    assert per["fp8"] <= 0.55 * per["bf16"] and per["fp8"] <= per["fp32"] / 3


# ----------------------------------------------------------------------------- both families against transformers
FORCED = 8


def _forced_logits(model, prompts, forced, **cache_kw):
    """Logits of a left-padded prefill, then one decode step per forced token: ``[rows, width + steps, V]``
    aligned as (prompt positions of each row, then its steps)."""
    ids, mask = q.left_pad(prompts)
    width = ids.shape[1]
    cache = QSAPagedCache(model.config, len(prompts), width + FORCED, block_size=4, **cache_kw)
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask, past_key_values=cache).logits.float()
        steps = []
        for t in range(FORCED - 1):
            tok = forced[:, t:t + 1]
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            steps.append(model(tok, attention_mask=mask, past_key_values=cache).logits[:, -1].float())
    return [torch.cat([prefill[i, width - len(p):], torch.stack(steps, 1)[i]]) for i, p in enumerate(prompts)]


def _family(family):
    if family == "qwen4_exp":
        # Every expert routed (no discrete routing choice left to flip, as in test_bf16_accuracy); budget 8 of
        # 30+ groups: the selection is active.
        upstream, ours = q.make_pair(q.tiny_config(num_experts_per_tok=4), seed=1)
        prompts = q.random_prompts([64, 45, 30], seed=2)
        kw = BOTH
    else:
        upstream, ours = ink_helpers.make_pair(ink_helpers.make_config(num_experts_per_tok=4), seed=1)
        prompts = [p.tolist() for p in ink_helpers.make_prompts([64, 45, 30], seed=2)]  # windows of 6 evict
        kw = dict(kv_cache_dtype=FP8)
    return upstream, ours, prompts, kw


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_fp8_cache_error_against_fp32_is_bounded_by_bf16s(family):
    """Teacher-forced logits of our fp32 model on an fp32 cache (exact), on an fp8 cache, and of transformers' model
    in bf16, each against transformers' fp32: the fp8 cache's mean error at most twice the bf16 model's."""
    upstream, ours, prompts, kw = _family(family)
    forced = torch.randint(3, 90, (len(prompts), FORCED), generator=torch.Generator().manual_seed(4))
    exact = _forced_logits(ours, prompts, forced)
    quantized = _forced_logits(ours, prompts, forced, **kw)
    up16 = copy.deepcopy(upstream).to(torch.bfloat16)
    errors = torch.zeros(3)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            seq = torch.tensor([p + forced[i, :FORCED - 1].tolist()])
            ref = upstream(seq).logits[0].float()
            errors += torch.stack([(exact[i] - ref).abs().mean(), (quantized[i] - ref).abs().mean(),
                                   (up16(seq).logits[0].float() - ref).abs().mean()])
    exact_err, fp8_err, bf16_err = errors.tolist()
    assert exact_err < 1e-3 * bf16_err, errors
    assert 0 < fp8_err <= 2 * bf16_err, (f"{family}: fp8 cache error {fp8_err:.3e}, bf16 model {bf16_err:.3e}: "
                                         f"ratio {fp8_err / bf16_err:.2f}")


# ----------------------------------------------------------------------------- the cache's guarantees on fp8
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_crop_then_the_same_tokens_give_the_same_logits(family, qwen, ink):
    model = qwen if family == "qwen4_exp" else ink
    kw = BOTH if family == "qwen4_exp" else dict(kv_cache_dtype=FP8)
    prompts = q.random_prompts([23, 17], seed=5) if family == "qwen4_exp" else \
        [p.tolist() for p in ink_helpers.make_prompts([23, 17])]
    ids, mask = q.left_pad(prompts)
    cache = QSAPagedCache(model.config, 2, 64, block_size=4, num_speculative_tokens=3, **kw)
    drafts = torch.randint(3, 90, (2, 3), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        mask = torch.cat([mask, torch.ones_like(drafts)], 1)
        first = model(drafts, attention_mask=mask, past_key_values=cache).logits
        cache.crop(-3)
        again = model(drafts, attention_mask=mask, past_key_values=cache).logits
    assert torch.equal(first, again)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_fault_in_a_step_on_an_fp8_cache_leaves_it_as_it_was(family, qwen, ink, monkeypatch):
    """The transaction covers the fp8 pages and their scales unchanged (they are written by position, like bf16
    pages): a decode and a verify step failing at sampled torch calls, retried, give a clean cache's logits."""
    import test_fault_injection as faults

    kw = BOTH if family == "qwen4_exp" else dict(kv_cache_dtype=FP8)
    monkeypatch.setattr(faults, "QSAPagedCache", lambda *a, **k: QSAPagedCache(*a, **k, **kw))
    model = qwen if family == "qwen4_exp" else ink
    for kind in ("decode", "verify"):
        scenario = faults.Scenario(model, family, kind)
        want_step, want_after, clean = faults._outcome(scenario)
        assert clean.layers[-1].kv.keys.dtype == FP8

        with torch.no_grad():
            _, forward, step, _ = scenario.build()
            total = faults.count_calls(lambda: forward(*step))
        for n in faults.sample_points(total, dense_until=4, spread=5):
            got_step, got_after, cache = faults._outcome_after_fault(scenario, n)
            assert torch.equal(got_step, want_step) and torch.equal(got_after, want_after), f"{kind}: fault at {n}"


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_copied_rows_carry_their_fp8_pages_and_scales(family, qwen, ink):
    """Beam-search row copies (`select_rows`) copy an fp8 store's bytes and scales: a copied row continues as its
    source does."""
    model = qwen if family == "qwen4_exp" else ink
    kw = BOTH if family == "qwen4_exp" else dict(kv_cache_dtype=FP8)
    prompts = q.random_prompts([21, 14], seed=7) if family == "qwen4_exp" else \
        [p.tolist() for p in ink_helpers.make_prompts([21, 14])]
    ids, mask = q.left_pad(prompts)
    cache = QSAPagedCache(model.config, 3, 48, block_size=4, **kw)
    tok = torch.tensor([[5], [7]])
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        cache.select_rows([0, 1, 0])
        mask3 = torch.cat([mask, mask[:1]])
        out = model(torch.cat([tok, tok[:1]]), attention_mask=torch.cat([mask3, torch.ones(3, 1, dtype=torch.long)],
                                                                         1), past_key_values=cache).logits
    torch.testing.assert_close(out[2], out[0], atol=1e-5, rtol=0)  # a copy of row 0 (batch rounding aside)
    assert not torch.allclose(out[1], out[0], atol=1e-2)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_restored_prefix_on_an_fp8_cache_gives_what_its_chunks_give_without_prefix_caching(family, qwen, ink):
    """Prefix caching on fp8 stores: a row restored from a cached prefix (the prefix's fp8 pages and scales
    shared, its state from the snapshot) then fed the rest gives the logits of a cache without prefix caching fed
    the prefix and then the rest (the rest's step reads the prefix from fp8 pages in both); the shared pages and
    scales are not written."""
    model = qwen if family == "qwen4_exp" else ink
    kw = BOTH if family == "qwen4_exp" else dict(kv_cache_dtype=FP8)
    prompt = q.random_prompts([19], seed=9)[0] if family == "qwen4_exp" else ink_helpers.make_prompts([19])[0].tolist()
    prefix, rest = prompt[:8], prompt[8:]

    def feed(cache, ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0]

    plain = QSAPagedCache(model.config, 1, 32, block_size=4, **kw)
    feed(plain, prefix)
    want = feed(plain, rest)
    cached = QSAPagedCache(model.config, 1, 32, block_size=4, prefix_caching=True, **kw)
    feed(cached, prefix)
    assert cached.cache_prefix(0, prefix) == 8
    cached.reset()  # the row goes, its prefix stays cached

    def paged(name):  # the paged tensors of table ``name``'s stores: fp8 pages (kept as their bytes), scales
        return [t for store in cached.layer_stores() if store.table == name and store.allocated
                for t in store.paged_tensors()]

    def shared_pages():  # their rows in the blocks the prefix cache keeps
        return [t[sorted(table.cached)].clone() for name, table in cached.tables.items() for t in paged(name)]

    before = shared_pages()
    assert any(t.dtype == torch.uint8 for t in before)
    for name, table in cached.tables.items():  # freed window blocks keep their bytes: the restore must write them
        for t in paged(name) if table.window is not None else []:
            t[sorted(table.free)] = 1
    assert cached.restore_prefix(0, prompt, limit=len(prompt) - 1) == 8
    got = feed(cached, rest)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(before, shared_pages()))
