"""`ContinuousBatchingManager.warmup` (`hf_qsa_cache.serving.warmup`): dummy requests that meet the shapes a workload
meets first (the decode step of every row count beside the longest announced prompt), then nothing of them left:
no row, no cached prefix, the stats as they were, and later requests' tokens transformers' alone (fp32, CPU)."""

from __future__ import annotations

import pytest
from helpers.qwen4 import collect_results, random_prompts
from helpers.serving import FAMILIES, alone, family_pair, greedy, pools_full
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

ROWS, LONGEST = 3, 60  # (the warm-up's short prompts reach 16 + 8 * (ROWS - 1) tokens: the long one is longer)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return family_pair(request.param)


def _manager(ours, prefix_caching=True, requests=4, longest=LONGEST, **generation):
    # (a prefill budget that takes the warm-up's short prompts in one step: they then decode together)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=400, max_batch_tokens=96, max_requests_per_batch=ROWS,
                                      allow_block_sharing=prefix_caching)
    hints = WorkloadHints(max_prompt_length=longest, max_generated_length=6, num_requests=requests)
    generation_config = GenerationConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=0, **generation) \
        if generation else greedy(6)
    return ours.init_continuous_batching(generation_config, config, hints)


def _decode_steps_seen(manager):
    """The (rows, longest row's tokens) of each decode step the loop runs from now on."""
    runner, seen = manager.runner, []
    decode = runner.decode

    def spied(drafts=None):
        seen.append((len(runner.rows), max(r.held for r in runner.rows)))
        return decode(drafts)

    runner.decode = spied
    return seen


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_warmup_decodes_every_row_count_beside_the_longest_prompt_and_leaves_nothing(family, prefix_caching):
    ref, ours = family
    manager = _manager(ours, prefix_caching)
    seen = _decode_steps_seen(manager)
    stats = dict(manager.stats)
    manager.warmup(run=True)
    assert manager.warmed_up and not manager.is_running()
    # Every row count decoded at the shortest reach, and again beside the long request (its prompt the hints'
    # longest): the decode graphs of both reaches are recorded before the first request on a GPU.
    assert {n for n, longest in seen if longest < LONGEST} == set(range(1, ROWS + 1))
    assert {n for n, longest in seen if longest >= LONGEST} == set(range(1, ROWS + 1))
    assert manager.stats == stats
    assert pools_full(manager.cache)
    if prefix_caching:
        prefix = manager.cache.memory_stats()["prefix_cache"]
        assert prefix["entries"] == prefix["lookup_tokens"] == prefix["blocks"] == 0
    prompts = random_prompts([23, 9, 41], vocab=90, seed=5)
    ids = manager.add_requests(prompts)  # (before start(), as on a manager that never ran: they wait for it)
    manager.start()
    try:
        results = collect_results(manager, len(prompts))
    finally:
        manager.stop()
        manager.destroy()
    for request_id, prompt in zip(ids, prompts):
        assert results[request_id].generated_tokens == alone(ref, prompt, 6), request_id


def test_warmup_reads_every_copy_and_takes_no_more_rows_than_the_hinted_requests(family):
    """With ``num_return_sequences`` each warm-up request has copies: every one's result is read (none is left for
    the user's `get_result()`); a workload of two requests warms two rows, not every row the cache has."""
    _, ours = family
    manager = _manager(ours, requests=2, num_return_sequences=2, do_sample=True)
    seen = _decode_steps_seen(manager)
    manager.warmup(run=True)
    assert not manager.delivery.waiting()
    assert max(n for n, _ in seen) == 2 and max(longest for _, longest in seen) >= LONGEST
    manager.destroy()


def test_warmup_runs_requests_on_a_cuda_model_only_unless_told(family):
    _, ours = family
    manager = _manager(ours)
    seen = _decode_steps_seen(manager)
    manager.warmup()  # (a CPU model: nothing is compiled or recorded, so nothing runs)
    assert manager.warmed_up and seen == [] and manager.scheduler._admissions == 0
    manager.destroy()


def test_warmup_refuses_a_running_loop(family):
    _, ours = family
    manager = _manager(ours)
    manager.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            manager.warmup(run=True)
    finally:
        manager.stop()
        manager.destroy()


def test_a_failed_warmup_request_raises_naming_it(family, monkeypatch):
    _, ours = family
    manager = _manager(ours)
    monkeypatch.setattr(manager.runner, "prefill", lambda chunks: (_ for _ in ()).throw(RuntimeError("kernel fault")))
    with pytest.raises(RuntimeError, match="warm-up request warmup-0-.* failed: .*kernel fault"):
        manager.warmup(run=True)
    assert not manager.is_running() and not manager.delivery.waiting()  # (the other requests' results read too)
    manager.destroy()


@pytest.mark.parametrize("warmup", [True, False], ids=["warmup", "no-warmup"])
def test_the_server_warms_its_engine_up_before_starting_it_unless_told(warmup):
    from hf_qsa_cache.server.cli import parser
    from hf_qsa_cache.server.engine import Engine

    calls = []

    class Manager:
        def warmup(self):
            calls.append("warmup")

        def start(self):
            calls.append("start")

    class Model:
        def init_continuous_batching(self, **kwargs):
            return Manager()

    flag = parser().parse_args(["checkpoint"] + ([] if warmup else ["--no-warmup"])).warmup
    Engine(Model(), warmup=flag).start()
    assert calls == (["warmup", "start"] if warmup else ["start"])


@pytest.mark.parametrize("page, blocks, row", [(4, 7, 24), (2, 4, 6)], ids=["24-token-rows", "6-token-rows"])
def test_warmup_fits_its_requests_to_a_small_pool(family, page, blocks, row):
    """Pools whose row holds 24 or 6 tokens: the warm-up's requests are cut to fit a row, and on the smallest fewer
    rows take part (one that did not fit alone would fail the warm-up, and with it a server's start); the manager
    then serves as usual."""
    ref, ours = family
    config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=24,
                                      max_requests_per_batch=ROWS)
    manager = ours.init_continuous_batching(greedy(2), config)
    assert manager.cache.longest_row() == row
    manager.warmup(run=True)
    prompt = random_prompts([row - 2], vocab=90, seed=7)[0]
    manager.start()
    try:
        request_id = manager.add_request(prompt)
        result = collect_results(manager, 1)[request_id]
    finally:
        manager.stop()
        manager.destroy()
    assert result.generated_tokens == alone(ref, prompt, 2)


@pytest.mark.parametrize("asked", [None, True], ids=["default", "warmup-true"])
def test_generate_batch_warms_up_only_when_asked(family, monkeypatch, asked):
    """A batch would pay once what a warm-up pays ahead, so `generate_batch` warms up only when asked (transformers'
    default is on); `continuous_batching_context_manager` warms up by default, as transformers' does."""
    from hf_qsa_cache.serving.manager import ContinuousBatchingManager

    _, ours = family
    calls = []
    monkeypatch.setattr(ContinuousBatchingManager, "warmup", lambda self, run=None: calls.append(run))
    kwargs = {} if asked is None else {"warmup": asked}
    ours.generate_batch(random_prompts([5], vocab=90, seed=2), greedy(2), **kwargs)
    assert len(calls) == (1 if asked else 0)
    with ours.continuous_batching_context_manager(greedy(2)):
        pass
    assert len(calls) == (2 if asked else 1)


@pytest.mark.parametrize("lengths, reaches", [((LONGEST, LONGEST - 1, LONGEST - 2), {64, 128}),
                                               ((200, 120, 60), {64, 128, 256})], ids=["two-reaches", "three-reaches"])
def test_on_the_graph_path_the_hinted_workload_meets_no_decode_shape_the_warmup_did_not(family, monkeypatch, lengths,
                                                                                        reaches):
    """Steps routed as a GPU routes them (decode steps on the recorded step's path, by rows bucket and reach bucket),
    reaches forced small (buckets from 64 tokens, so the hinted rows span two or three, as an 8,192-token prompt
    and its answer pass 8,192 at the real 4,096): every decode step shape a workload of the hinted size meets, its
    rows finishing one after the other, the longest first, was met by the warm-up first (on a GPU: its graph was
    recorded before the first request)."""
    from helpers.serving import steps_routed_as_on_a_gpu

    from hf_qsa_cache import cuda_graphs

    ref, ours = family
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_REACH", 64)
    with steps_routed_as_on_a_gpu():
        manager = _manager(ours, longest=lengths[0])
        manager.warmup(run=True)
        runner = manager.cache.graph_runners[ours]
        warmed = {key for key in runner.buckets if key[1] == 1}
        prompts = random_prompts(lengths, vocab=90, seed=9)
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=6 - i) for i, p in enumerate(prompts)]
            results = collect_results(manager, len(prompts))
        finally:
            manager.stop()
        met = {key for key in runner.buckets if key[1] == 1}
        manager.destroy()
    assert met == warmed, f"decode shapes met after the warm-up: {sorted(met - warmed)}"
    assert {key[2] for key in met} == reaches
    for request_id, prompt, i in zip(ids, prompts, range(3)):
        assert results[request_id].generated_tokens == alone(ref, prompt, 6 - i), request_id
