"""Mixed steps (`ContinuousBatchingManager(mixed_steps=True)`, `ModelRunner.mixed`, `DecodeGraphs.mixed_step`):
the prefilling rows' short chunks and every decoding row's token in one recorded step, run here on the path a GPU
replays (`steps_routed_as_on_a_gpu`: the static-buffer step, eagerly), against transformers' own classes on each
prompt alone (fp32, CPU, greedy)."""

from __future__ import annotations

import pytest
from helpers.qwen4 import collect_results, random_prompts
from helpers.serving import FAMILIES, alone, family_pair, greedy, pools_full, steps_routed_as_on_a_gpu
from transformers import ContinuousBatchingConfig

from hf_qsa_cache import cuda_graphs

NEW = 6


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *family_pair(request.param))


@pytest.mark.parametrize("sharing", [False, True], ids=["prefix-caching-off", "prefix-caching-on"])
def test_mixed_steps_give_every_request_its_tokens_alone(family, sharing, monkeypatch):
    """Requests arrive while others decode (three rows, nine requests): each later prompt's chunks ride with the
    decoding rows' tokens in one recorded step, one or two prefilling rows (a power of two, as short prefill steps
    take), chunks of other lengths left-padded inside it, chunks that end inside QSA groups, windows and conv spans.
    Every request's tokens are transformers' on its prompt alone; the pools are whole at the end."""
    name, ref, ours = family
    prompts = random_prompts([4, 4, 21, 5, 3, 6, 6, 9, 2], vocab=90, seed=5)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=60, max_batch_tokens=12, max_requests_per_batch=3,
                                      allow_block_sharing=sharing)
    monkeypatch.setattr(cuda_graphs, "SHORT_PREFILL_MIN_LEN", 4)  # (recorded lengths of 4, 8, 16 at these sizes)
    manager = ours.init_continuous_batching(greedy(NEW), config, mixed_steps=True, prefix_snapshot_gap=0)
    mixed, run = [], manager.runner.mixed
    monkeypatch.setattr(manager.runner, "mixed", lambda chunks: mixed.append(list(chunks)) or run(chunks))
    with steps_routed_as_on_a_gpu() as routed:
        manager.start()
        ids = manager.add_requests(prompts)
        results = collect_results(manager, len(prompts))
        manager.stop()
    for request_id, prompt in zip(ids, prompts):
        assert results[request_id].generated_tokens == alone(ref, prompt, NEW), request_id
    assert manager.stats["mixed_steps"] == len(mixed) == sum(1 for n in routed if isinstance(n, tuple)) >= 4
    assert any(len(chunks) == 2 for chunks in mixed)  # two prefilling rows in one mixed step
    assert any(n & (n - 1) for chunks in mixed for n in chunks)  # a chunk left-padded to its recorded length
    assert pools_full(manager.cache)


def test_without_a_gpu_or_with_drafts_the_loop_takes_separate_steps(family):
    """Mixed steps replay recorded steps: where none replays (no CUDA device, not routed as on one) or decoding rows
    draft (prompt lookup), the loop takes its separate prefill and decode steps, with the same tokens."""
    name, ref, ours = family
    prompts = random_prompts([9, 17, 5, 14], vocab=90, seed=6)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=12, max_requests_per_batch=2)
    for routed, lookup in ((False, None), (True, 2)):
        generation = greedy(NEW, prompt_lookup_num_tokens=lookup) if lookup else greedy(NEW)
        manager = ours.init_continuous_batching(generation, config, mixed_steps=True)
        if routed:
            with steps_routed_as_on_a_gpu():
                results = _serve(manager, prompts)
        else:
            results = _serve(manager, prompts)
        assert [r.generated_tokens for r in results] == [alone(ref, p, NEW) for p in prompts]
        assert manager.stats["mixed_steps"] == 0 and manager.stats["decode_steps"] > 0


def _serve(manager, prompts):
    manager.start()
    ids = manager.add_requests(prompts)
    results = collect_results(manager, len(prompts))
    manager.stop()
    return [results[i] for i in ids]
