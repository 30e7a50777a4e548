"""`benchmarks/bench_generate.py` `decode_ms_end_to_end`: the calls it times continue the prompt the cache holds
(their own prefill is one token), and they generate what one uninterrupted generate() does."""

from __future__ import annotations

import os
import sys

import torch
from helpers.qwen4 import make_pair, random_prompts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import bench_generate  # noqa: E402

from hf_qsa_cache import fusions
from hf_qsa_cache import QSAPagedCache  # noqa: E402


def test_timed_calls_continue_the_prefilled_prompt(monkeypatch):
    _, model = make_pair(seed=5)
    ids = torch.tensor([random_prompts([12], seed=6)[0]])
    mask = torch.ones_like(ids)
    cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=40)
    real, calls = model.generate, []

    def recording(input_ids, **kwargs):
        out = real(input_ids, **kwargs)
        calls.append((input_ids.shape[1], kwargs["max_new_tokens"], out))
        return out

    monkeypatch.setattr(model, "generate", recording)
    with torch.no_grad():
        bench_generate.decode_ms_end_to_end(model, ids, mask, 5, cache)  # its time on the CPU is not judged
        want = real(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    timed = calls[1::2]  # each timed call follows its untimed one-token prefill
    assert [c[:2] for c in calls[0::2]] == [(12, 1)] * 6 and [c[:2] for c in timed] == [(13, 1)] * 3 + [(13, 5)] * 3
    assert torch.equal(timed[-1][2], want)  # continuing generates what one call does
    # --sample: the timed calls sample; the prefilling ones stay greedy.
    calls.clear()
    seen = []
    monkeypatch.setattr(model, "generate", lambda input_ids, **kwargs: seen.append(kwargs) or real(input_ids, **kwargs))
    with torch.no_grad():
        bench_generate.decode_ms_end_to_end(model, ids, mask, 3, cache, sample=True)
    assert [(k["do_sample"], k.get("top_k")) for k in seen[1::2]] == [(True, 50)] * 6
    assert all(not k["do_sample"] for k in seen[0::2])


def test_projection_choices_set_the_kernel_defaults_and_are_recorded(monkeypatch):
    from hf_qsa_cache.ops import linears, linears_triton

    for name in ("ONE_TOKEN_TILES", "ONE_TOKEN_WIDE_TILES"):
        monkeypatch.setattr(linears_triton, name, getattr(linears_triton, name))
    monkeypatch.setattr(linears, "ALONE_MAX_TOKENS", linears.ALONE_MAX_TOKENS)
    shipped = linears_triton.default_tiles(1, 2048), linears_triton.default_tiles(1, 4096)
    assert all(tiles[3] for tiles in shipped)  # the GEMV form
    assert bench_generate.choose_projections(None, None) == {}
    assert bench_generate.choose_projections("gemv", 1) == {}
    assert (linears_triton.default_tiles(1, 2048), linears_triton.default_tiles(1, 4096)) == shipped
    assert linears.ALONE_MAX_TOKENS == 1
    assert bench_generate.choose_projections("dot", 0) == {"one_token_projections": "dot", "alone_max_tokens": 0}
    dot = linears_triton.ONE_TOKEN_DOT_TILES
    assert (linears_triton.default_tiles(1, 2048), linears_triton.default_tiles(1, 4096)) == (dot, dot)
    assert linears.ALONE_MAX_TOKENS == 0


def test_mix_tiles_choice_sets_the_one_token_tiles_and_is_recorded(monkeypatch):
    from hf_qsa_cache.ops import hyper_connection_triton as hct

    monkeypatch.setattr(hct, "ONE_TOKEN_MIX_TILES", hct.ONE_TOKEN_MIX_TILES)
    shipped = hct.ONE_TOKEN_MIX_TILES
    assert bench_generate.choose_mix_tiles(None) == {} and hct.ONE_TOKEN_MIX_TILES == shipped
    assert shipped.gemv
    assert bench_generate.choose_mix_tiles("dot")["one_token_mix_tiles"]["gemv"] is False
    assert hct.ONE_TOKEN_MIX_TILES == hct.ONE_TOKEN_DOT_MIX_TILES
    chosen = bench_generate.choose_mix_tiles('{"splits": 4, "block_n": 2, "block_k": 512, "down_warps": 2, '
                                             '"block_h": 8, "r_chunk": 64, "up_warps": 4, "gemv": true}')
    assert chosen == {"one_token_mix_tiles": {"splits": 4, "block_n": 2, "block_k": 512, "down_warps": 2,
                                              "block_h": 8, "r_chunk": 64, "up_warps": 4, "gemv": True}}
    assert hct.ONE_TOKEN_MIX_TILES == hct.MixTiles(4, 2, 512, 2, 8, 64, 4, True)


def test_the_kernel_list_without_pdl_comes_from_a_step_captured_without_it(monkeypatch):
    """Under ``pdl`` a profiled kernel's time holds its wait for the kernel before: the benchmark lists the step's
    kernels again from a fresh cache whose graph is captured with early launch off, then turns it back on."""
    from hf_qsa_cache.ops import triton_common

    _, model = make_pair(seed=5)
    ids = torch.tensor([random_prompts([12], seed=6)[0]])
    seen = {}

    def run(model, ids, mask, new_tokens, cache):
        seen.update(run_pdl=fusions.enabled("pdl"), new_tokens=new_tokens, room=cache.max_cache_len - ids.shape[1])

    def stats(model, cache):
        seen["stats_pdl"] = fusions.enabled("pdl")
        return {"graph_top_kernels": [["_linears_kernel", 1, 2.0]]}

    monkeypatch.setitem(fusions.STATE, "pdl", True)
    monkeypatch.setattr(bench_generate, "run", run)
    monkeypatch.setattr(bench_generate, "graphed_step_stats", stats)
    listed = bench_generate.kernels_without_pdl(model, model.config, ids, torch.ones_like(ids))
    assert listed == [["_linears_kernel", 1, 2.0]]
    assert seen == {"run_pdl": False, "new_tokens": 1, "room": 16, "stats_pdl": False}
    assert fusions.enabled("pdl")
