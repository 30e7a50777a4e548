"""Continuous batching (`generate_batch`, `init_continuous_batching`) on both families against transformers'
own classes on each prompt alone (fp32, CPU, greedy unless said otherwise).

Pools are tiny and token budgets small so that the engine preempts, chunks prompts inside QSA groups,
windows and conv spans, admits requests while others decode, and gives everything back.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers.qwen4 import make_pair as qwen_pair
from helpers.qwen4 import tiny_config as qwen_config
from helpers.qwen4 import collect_results, random_prompts
from helpers.serving import FAMILIES, alone, family_pair, greedy, pools_full
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from hf_qsa_cache import QSAPagedCache, cuda_graphs

NEW = 6
LENGTHS = [23, 9, 17, 30, 5, 14]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *family_pair(request.param))


def _alone(ref, prompt, new=NEW, eos=None):
    return alone(ref, prompt, new, eos)


def _greedy(new=NEW, **kwargs):
    return greedy(new, **kwargs)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-steps", "prefill-then-decode"])
def test_generate_batch_equals_each_prompt_alone_with_preemption_and_small_chunks(family, grouped):
    name, ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=3)
    # 3 rows, 5-token prefill budget (chunks end inside QSA groups of 2, Inkling windows of 6 and conv
    # spans of 4), a pool too small for three long rows at once: preemption must happen. Grouped steps carry the
    # decoding rows beside the prefill chunks; without them a prefill step (rows padded) and a decode step alternate.
    config = ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=5, max_requests_per_batch=3)
    # prefix_snapshot_gap=0: prefix caching stops each prompt's prefill at its snapshot point, as at longer prompts (the
    # tails pad the steps they share).
    with ours.continuous_batching_context_manager(_greedy(), continuous_batching_config=config,
                                                  grouped_steps=grouped, prefix_snapshot_gap=0) as manager:
        ids = manager.add_requests(prompts)
        results = collect_results(manager, len(prompts))
        stats = dict(manager.stats)
        cache = manager.cache
    for request_id, prompt in zip(ids, prompts):
        result = results[request_id]
        assert result.status == RequestStatus.FINISHED and result.error is None
        assert result.prompt_ids == prompt
        assert result.generated_tokens == _alone(ref, prompt), request_id
    assert stats["preemptions"] > 0 and stats["prefill_steps"] + stats["grouped_steps"] > len(prompts)
    assert (stats["grouped_steps"] > 0) == grouped and (stats["prefill_steps"] > 0) != grouped
    assert stats["pad_tokens"] == 0 if grouped else stats["pad_tokens"] > 0
    assert stats["most_rows"] == 3
    assert pools_full(cache)


def test_steps_the_graphs_take_go_straight_to_them_not_through_the_forward(family, monkeypatch):
    """Routed as on a GPU, the loop hands decode (and short prefill) steps straight to the recorded step: the model's
    forward runs only the other prefill steps (its wrappers and output object cost a decode iteration a fifth of its
    host work), even when the model's config asks for router logits (the loop reads logits alone). Every request's
    tokens are transformers' alone."""
    from helpers.serving import steps_routed_as_on_a_gpu

    name, ref, ours = family
    prompts = random_prompts([40] + LENGTHS, vocab=90, seed=3)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=48, max_requests_per_batch=3)
    forward, through_forward = ours.forward, []
    monkeypatch.setattr(ours, "forward", lambda input_ids=None, **kw: through_forward.append(input_ids.shape[1])
                        or forward(input_ids=input_ids, **kw))
    monkeypatch.setattr(ours.config, "output_router_logits", True, raising=False)
    monkeypatch.setattr(cuda_graphs, "SHORT_PREFILL_TOKENS", 32)  # the 40-token prompt's first chunk runs eagerly
    with steps_routed_as_on_a_gpu() as routed, \
            ours.continuous_batching_context_manager(_greedy(), continuous_batching_config=config) as manager:
        ids = manager.add_requests(prompts)
        results = collect_results(manager, len(prompts))
    for request_id, prompt in zip(ids, prompts):
        assert results[request_id].generated_tokens == _alone(ref, prompt), request_id
    assert routed.count(1) >= NEW and 1 not in through_forward and through_forward
    assert any(n > 1 for n in routed)  # and a one-row prefill step replays


@pytest.mark.parametrize("sharing", [False, True], ids=["prefix-caching-off", "prefix-caching-on"])
def test_a_new_requests_first_short_chunk_replays_a_graph_on_its_fresh_row(family, sharing, monkeypatch):
    """Routed as on a GPU, a short prompt in a row continuous batching placed (`move_rows` gives a new row a fresh
    row's state) takes the recorded step from its first chunk (`cuda_graphs.short_prefill_length`): every prefill
    step of these short prompts replays, the loop's first one and that of the request that waited for a free row
    included, none runs eagerly. Every request's tokens are transformers' alone."""
    from helpers.serving import serve_queued, steps_routed_as_on_a_gpu

    name, ref, ours = family
    prompts = random_prompts([12, 6, 11], vocab=90, seed=8)  # two rows: the third waits for a free one
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=32, max_requests_per_batch=2,
                                      allow_block_sharing=sharing)
    manager = ours.init_continuous_batching(_greedy(), config)
    planned, prefill = [], manager.runner.prefill

    def prefilling(chunks):  # each prefill step's chunks, and whether a row of it starts there
        planned.append((list(chunks), 0 in manager.cache.lengths[:len(chunks)]))
        return prefill(chunks)

    monkeypatch.setattr(manager.runner, "prefill", prefilling)
    ids = manager.add_requests(prompts)  # before the loop starts: its first step takes the first two
    with steps_routed_as_on_a_gpu() as routed:
        results = serve_queued(manager, len(prompts))
    for request_id, prompt in zip(ids, prompts):
        assert results[request_id].generated_tokens == _alone(ref, prompt), request_id
    steps = [(max(chunks), starts) for chunks, starts in planned if chunks]
    assert [starts for _, starts in steps].count(True) == 2  # the first two requests' step, then the third's
    assert [n for n in routed if n > 1] == [n for n, _ in steps]  # every prefill step took the recorded step


@pytest.mark.parametrize("grouped", [False, True], ids=["prefill-steps", "grouped-steps"])
def test_the_loops_own_eager_steps_spare_the_recorded_steps_a_walk_of_every_weight(family, monkeypatch, grouped,
                                                                                   request):
    """A recorded step after steps it did not take walks every weight and hook of the model to see whether it
    changed (`DecodeGraphs._forget_stale_graphs`): milliseconds at the released depths. Inside the loop the eager
    steps between are its own (`DecodeGraphs.steps_were_own`), so the walk comes once per session (after its first
    step), not after every eager step; a hook added between sessions is still seen."""
    from helpers.serving import steps_routed_as_on_a_gpu

    name, ref, ours = family
    walks = []
    fingerprint = cuda_graphs.model_fingerprint
    monkeypatch.setattr(cuda_graphs, "model_fingerprint", lambda model: walks.append(1) or fingerprint(model))
    monkeypatch.setattr(cuda_graphs, "SHORT_PREFILL_TOKENS", 32)  # steps of several rows run eagerly
    prompts = random_prompts(LENGTHS, vocab=90, seed=3)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=8, max_requests_per_batch=3)
    manager = ours.init_continuous_batching(generation_config=_greedy(), continuous_batching_config=config)
    monkeypatch.setattr(manager, "grouped_steps", grouped)
    request.addfinalizer(ours.destroy_cached_continuous_batching_manager)  # (kept on the model between sessions)
    with steps_routed_as_on_a_gpu() as routed:
        manager.start()
        ids = manager.add_requests(prompts)
        results = collect_results(manager, len(prompts))
        manager.stop(keep_for_next_session=True)
        eager_steps = manager.stats["grouped_steps" if grouped else "prefill_steps"]
        assert routed.count(1) >= NEW and eager_steps >= 4
        assert len(walks) == 2  # the recorded steps' first (made, then first step), whatever the eager steps
        for request_id, prompt in zip(ids, prompts):
            assert results[request_id].generated_tokens == _alone(ref, prompt), request_id
        # Between sessions user code may change the model: the next session's first recorded step walks again.
        hooked = next(m for m in ours.modules() if isinstance(m, torch.nn.Linear))
        handle = hooked.register_forward_hook(lambda *args: None)
        manager.start()
        stale = len(walks)
        manager.add_request(prompts[0])
        collect_results(manager, 1)
        manager.stop()
        handle.remove()
    assert len(walks) > stale


def test_requests_arriving_while_others_decode(family):
    name, ref, ours = family
    prompts = random_prompts([19, 7, 26, 11], vocab=90, seed=5)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=8, max_requests_per_batch=4)
    with ours.continuous_batching_context_manager(_greedy(new=10), continuous_batching_config=config) as manager:
        first = manager.add_request(prompts[0], max_new_tokens=10, streaming=True)
        assert next(manager.request_id_iter(first)).status == RequestStatus.DECODING
        late = [manager.add_request(prompt, max_new_tokens=10) for prompt in prompts[1:]]
        results = {}
        while len(results) < len(prompts):
            result = manager.get_result(timeout=60)
            if result.is_finished():
                results[result.request_id] = result
    for request_id, prompt in zip([first, *late], prompts):
        assert results[request_id].generated_tokens == _alone(ref, prompt, new=10), request_id


def test_eos_ends_requests_on_different_steps(family):
    name, ref, ours = family
    prompts = random_prompts([12, 21, 8], vocab=90, seed=7)
    eos = _alone(ref, prompts[1])[2]  # the second prompt's third token ends it; the others wherever it appears
    expected = [_alone(ref, p, eos=eos) for p in prompts]
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, max_requests_per_batch=3)
    results = ours.generate_batch(prompts, GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                                            pad_token_id=0), config)
    got = [results[f"req_{i}"].generated_tokens for i in range(3)]
    assert got == expected
    assert len({len(g) for g in got}) > 1  # they ended on different steps


def test_cancel_mid_prefill_and_mid_decode(family):
    name, ref, ours = family
    prompts = random_prompts([100, 8, 12], vocab=90, seed=9)
    # One-token prefill budget: the long prompt is mid-prefill for about 50 steps (margin on a busy machine).
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=1, max_requests_per_batch=3)
    with ours.continuous_batching_context_manager(_greedy(new=60), continuous_batching_config=config) as manager:
        decoding_id = manager.add_request(prompts[1], max_new_tokens=60, streaming=True)  # prefilled first (FIFO)
        long_id = manager.add_request(prompts[0], max_new_tokens=60)
        keep_id = manager.add_request(prompts[2], max_new_tokens=NEW)
        progress = next(manager.request_id_iter(decoding_id))  # it decodes: a streamed token arrived
        assert progress.status == RequestStatus.DECODING and len(progress.generated_tokens) >= 1
        manager.cancel_request(long_id)
        manager.cancel_request(decoding_id)
        finals = {}
        deadline = time.time() + 60
        while len(finals) < 3 and time.time() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finals[result.request_id] = result
        cache = manager.cache
    assert finals[long_id].status == RequestStatus.FAILED and finals[long_id].error == "cancelled"
    assert len(finals[long_id].generated_tokens) == 0  # cancelled before its prompt was in
    assert finals[decoding_id].status == RequestStatus.FAILED and 1 <= len(finals[decoding_id].generated_tokens) < 60
    assert finals[keep_id].generated_tokens == _alone(ref, prompts[2])
    assert pools_full(cache)


def test_a_request_that_cannot_fit_alone_fails_and_the_others_go_on(family):
    name, ref, ours = family
    prompts = random_prompts([10, 40, 7], vocab=90, seed=11)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=9, max_batch_tokens=64, max_requests_per_batch=2)
    results = ours.generate_batch(prompts, _greedy(), config)
    assert results["req_1"].status == RequestStatus.FAILED
    assert "cannot fit even alone" in results["req_1"].error and "block pool" in results["req_1"].error
    # Refused before its first step: the pools hold 8 blocks of 4 tokens a row (block 0 is nobody's), which is
    # what the cache says a row can hold (the HTTP server's max_model_len), less than its 40 + 6 tokens.
    assert "at most 32 tokens a row" in results["req_1"].error and results["req_1"].generated_tokens == []
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=64, block_size=4, num_blocks=9)
    assert cache.longest_row() == 32
    assert QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=24, block_size=4, num_blocks=9).longest_row() == 24
    for i in (0, 2):
        assert results[f"req_{i}"].generated_tokens == _alone(ref, prompts[i])


@pytest.mark.parametrize("fault", ["once", "always"])
def test_a_failed_step_runs_its_requests_again_or_fails_them(family, monkeypatch, fault):
    """A prefill step that raises: its requests go back to the queue and, run again, equal transformers (a fault
    that comes once); a second failed step fails them with the error (a fault that comes every time their prompts
    are fed). The request decoding beside them and one submitted afterwards are exact; the pools come back full."""
    name, ref, ours = family
    from hf_qsa_cache.serving.runner import ModelRunner

    prompts = random_prompts([15, 9, 20, 11], vocab=90, seed=13)
    doomed_prompts = [tuple(p) for p in prompts[1:3]]
    armed = {"on": False}
    forward = ModelRunner._forward

    forward_grouped = ModelRunner._forward_grouped

    def fail(prefilling):
        if armed["on"] and any(tuple(r.prompt) in doomed_prompts for r in prefilling):
            armed["on"] = fault == "always"
            raise RuntimeError("injected fault")

    def failing(self, rows, ids, mask):
        fail(rows if mask is not None else [])
        return forward(self, rows, ids, mask)

    def failing_grouped(self, rows, shape, counts, ids, last):  # (a grouped step carries the prefill chunks)
        fail([r for r in rows if r.held < len(r.prompt)])
        return forward_grouped(self, rows, shape, counts, ids, last)

    monkeypatch.setattr(ModelRunner, "_forward", failing)
    monkeypatch.setattr(ModelRunner, "_forward_grouped", failing_grouped)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=3)
    with ours.continuous_batching_context_manager(_greedy(new=12), continuous_batching_config=config) as manager:
        first = manager.add_request(prompts[0], max_new_tokens=12, streaming=True)
        next(manager.request_id_iter(first))  # it decodes
        armed["on"] = True
        doomed = manager.add_requests(prompts[1:3], max_new_tokens=12)
        finals = {}
        while len(finals) < 3:
            result = manager.get_result(timeout=60)
            if result.is_finished():
                finals[result.request_id] = result
        armed["on"] = False
        after = manager.add_request(prompts[3], max_new_tokens=12)
        finals[after] = next(r for r in manager.request_id_iter(after) if r.is_finished())
        cache, stats = manager.cache, dict(manager.stats)
    for request_id, prompt in zip(doomed, prompts[1:3]):
        if fault == "once":
            assert finals[request_id].generated_tokens == _alone(ref, prompt, new=12)
        else:
            assert finals[request_id].status == RequestStatus.FAILED and "injected fault" in finals[request_id].error
    assert stats["retried_requests"] >= 1
    assert stats["failed_steps"] == 1 if fault == "once" else stats["failed_steps"] >= 2  # (a second attempt each)
    assert finals[first].generated_tokens == _alone(ref, prompts[0], new=12)
    assert finals[after].generated_tokens == _alone(ref, prompts[3], new=12)
    assert pools_full(cache)


@pytest.mark.parametrize("poisoned", [0, 2], ids=["oldest-poisoned", "later-poisoned"])
def test_a_fault_one_request_brings_fails_it_alone(family, monkeypatch, poisoned):
    """Every step that feeds one request its second generated token raises (a fault its content brings): after
    two failed steps beside the others, each of them is fed alone up to where the step failed (in chunks of 6:
    the fault is past the first), so that request fails and the three that shared its steps finish exact
    (without isolation they failed too)."""
    name, ref, ours = family
    from hf_qsa_cache.serving.runner import ModelRunner

    prompts = random_prompts([13, 9, 17, 11], vocab=90, seed=41)
    forward = ModelRunner._forward
    poison = f"req_{poisoned}"

    forward_grouped = ModelRunner._forward_grouped
    fed = []  # the requests of each step

    def fail(rows, counts):
        fed.append({r.request_id for r in rows})
        if any(r.request_id == poison and r.held + n >= len(r.prompt) + 2 for r, n in zip(rows, counts)):
            raise RuntimeError("injected fault")

    def failing(self, rows, ids, mask):
        fail(rows, [ids.shape[1]] * len(rows))
        return forward(self, rows, ids, mask)

    def failing_grouped(self, rows, shape, counts, ids, last):
        fail(rows, counts)
        return forward_grouped(self, rows, shape, counts, ids, last)

    monkeypatch.setattr(ModelRunner, "_forward", failing)
    monkeypatch.setattr(ModelRunner, "_forward_grouped", failing_grouped)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=6, max_requests_per_batch=4)
    # (prefix_snapshot_gap=0: each prompt's prefill also stops at its snapshot point, as longer prompts' do)
    manager = ours.init_continuous_batching(_greedy(new=8), config, prefix_snapshot_gap=0)
    ids = manager.add_requests(prompts, max_new_tokens=8)  # queued first: admitted together, their steps shared
    manager.start()
    try:
        results = {i: manager.get_result(i, timeout=120) for i in ids}
        stats, cache = dict(manager.stats), manager.cache
    finally:
        manager.stop(block=True)
    assert results[poison].status == RequestStatus.FAILED and "injected fault" in results[poison].error
    for request_id, prompt in zip(ids, prompts):
        if request_id != poison:
            assert results[request_id].status == RequestStatus.FINISHED, results[request_id].error
            assert results[request_id].generated_tokens == _alone(ref, prompt, new=8), request_id
    assert stats["isolated_requests"] >= 2 and stats["failed_steps"] >= 3
    # Isolation lasts until a request is fed past its failed step: the others then share steps again.
    last_poisoned = max(i for i, step in enumerate(fed) if poison in step)
    assert fed[last_poisoned] == {poison}, fed  # it failed in a step of its own
    assert any(len(step) >= 2 for step in fed[last_poisoned + 1:]), fed
    assert pools_full(cache)


def test_a_sampled_request_run_again_after_a_failed_step_draws_the_same_tokens(family, monkeypatch):
    """A seeded, sampled request whose decode step fails once goes back to the queue and is fed again: its tokens
    equal a run without the fault (a draw depends on the seed and the token's index, not on what was drawn)."""
    name, ref, ours = family
    from hf_qsa_cache.serving import Sampling
    from hf_qsa_cache.serving.runner import ModelRunner

    prompt = random_prompts([14], vocab=90, seed=23)[0]
    sampling = Sampling(do_sample=True, temperature=1.5, top_k=40)
    forward, calls = ModelRunner._forward, {"n": 0, "fail_at": None}

    def failing(self, rows, ids, mask):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected fault")
        return forward(self, rows, ids, mask)

    monkeypatch.setattr(ModelRunner, "_forward", failing)

    def run(fail_at):
        calls["n"], calls["fail_at"] = 0, fail_at
        config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
        with ours.continuous_batching_context_manager(_greedy(new=10), continuous_batching_config=config) as m:
            result = m.get_result(m.add_request(prompt, max_new_tokens=10, sampling=sampling, seed=77), timeout=60)
            return result, dict(m.stats)

    clean, _ = run(None)
    again, stats = run(5)  # the prefill, then a decode step fails
    assert stats["failed_steps"] == 1 and stats["retried_requests"] == 1
    assert again.status == RequestStatus.FINISHED and again.generated_tokens == clean.generated_tokens
    assert len(set(clean.generated_tokens)) > 3  # (it did sample)


def test_seeded_sampling_is_reproducible_and_independent_of_batching(family):
    name, ref, ours = family
    prompts = random_prompts([12, 18, 7], vocab=90, seed=15)
    sample = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9,
                              eos_token_id=None, pad_token_id=0)

    def run(seed, rows, budget):
        config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=budget, max_requests_per_batch=rows, seed=seed,
                                          return_logprobs=True)
        return ours.generate_batch(prompts, sample, config)

    a, b, c, other = run(0, 3, 16), run(0, 3, 16), run(0, 1, 4), run(1, 3, 16)
    tokens = lambda results: [r.generated_tokens for r in results.values()]  # noqa: E731
    assert tokens(a) == tokens(b) == tokens(c)  # same seed: same tokens, however the requests were batched
    assert tokens(a) != tokens(other)
    assert all(len(r.logprobs) == 8 and all(lp <= 0 for lp in r.logprobs) for r in a.values())


def test_return_sequences_streaming_and_result_order(family):
    name, ref, ours = family
    prompts = random_prompts([11, 16], vocab=90, seed=17)
    top1 = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1, num_return_sequences=2, eos_token_id=None,
                            pad_token_id=0)  # sampling from the top token only: greedy, with two sequences
    results = ours.generate_batch(prompts, top1, ContinuousBatchingConfig(page_size=4, max_requests_per_batch=4))
    assert list(results) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1"]
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == results[f"req_{i}__child#0"].generated_tokens == \
            _alone(ref, prompt)
    with ours.continuous_batching_context_manager(_greedy(), continuous_batching_config=ContinuousBatchingConfig(
            page_size=4)) as manager:
        request_id = manager.add_request(prompts[0], streaming=True)
        stream = list(manager.request_id_iter(request_id))
    assert [len(r.generated_tokens) for r in stream] == list(range(1, NEW + 1))
    assert stream[-1].is_finished() and stream[-1].generated_tokens == _alone(ref, prompts[0])


def test_bad_requests_are_refused_with_the_limit():
    ref, ours = qwen_pair(qwen_config(max_position_embeddings=40))
    manager = ours.init_continuous_batching(_greedy(), ContinuousBatchingConfig(page_size=4))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\).*got 500"):
        manager.add_request([3, 500])
    with pytest.raises(ValueError, match="at least one prompt token"):
        manager.add_request([])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        manager.add_request([3, 4], max_new_tokens=0)
    unlimited = ours.generate_batch([[3, 4, 5]], GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0),
                                    ContinuousBatchingConfig(page_size=4))  # no max_new_tokens: up to the row's room
    assert len(unlimited["req_0"].generated_tokens) == ours.config.max_position_embeddings - 3 + 1
    with pytest.raises(ValueError, match="scheduler_type must be 'fifo' or 'prefill_first'"):
        ours.init_continuous_batching(_greedy(), ContinuousBatchingConfig(page_size=4, scheduler_type="lifo"))


def test_move_rows_hands_blocks_over_without_copying(family):
    name, ref, ours = family
    prompts = random_prompts([13, 6], vocab=90, seed=19)
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=40, block_size=4)
    cache.move_rows([-1, -1])
    ids = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 13 - len(p):], mask[b, 13 - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        ours(ids, attention_mask=mask, past_key_values=cache)
        main = cache.tables["main"]
        held = [list(main.rows[0]), list(main.rows[1])]
        cache.move_rows([1, -1, 0])  # swap, with a fresh row in the middle
        assert [list(main.rows[i]) for i in (0, 2)] == [held[1], held[0]] and main.rows[1] == []
        assert cache.lengths[:3] == [6, 0, 13]
        fresh = random_prompts([9], vocab=90, seed=21)[0]
        step = torch.zeros(3, 9, dtype=torch.long)
        step_mask = torch.zeros_like(step)
        step[0, -1], step[1], step[2, -1] = 5, torch.tensor(fresh), 7
        step_mask[0, -1], step_mask[1], step_mask[2, -1] = 1, 1, 1
        logits = ours(step, attention_mask=step_mask, past_key_values=cache).logits[:, -1]
        expect = [ref(torch.tensor([p])).logits[0, -1] for p in (prompts[1] + [5], fresh, prompts[0] + [7])]
    for got, want in zip(logits, expect):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cache.move_rows([])
    assert pools_full(cache)


def test_prefill_first_scheduling_gives_the_same_tokens(family, monkeypatch):
    """Each iteration runs its prefill step, then its decode step, one of each (never a second prefill step)."""
    from helpers.serving import serve_queued

    name, ref, ours = family
    prompts = random_prompts([21, 6, 13, 27], vocab=90, seed=23)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=7, max_requests_per_batch=2,
                                      scheduler_type="prefill_first")
    results = ours.generate_batch(prompts, _greedy(), config)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == _alone(ref, prompt)
    manager = ours.init_continuous_batching(_greedy(), config)
    ran, runner, iteration = [], manager.runner, manager._iteration
    prefill, decode = runner.prefill, runner.decode
    monkeypatch.setattr(runner, "prefill", lambda chunks: ran.append("p") or prefill(chunks))
    monkeypatch.setattr(runner, "decode", lambda drafts: ran.append("d") or decode(drafts))
    monkeypatch.setattr(manager, "_iteration", lambda: ran.append("|") or iteration())
    manager.add_requests(prompts)
    serve_queued(manager, len(prompts))
    steps = [kinds for kinds in "".join(ran).split("|") if kinds]
    assert set(steps) == {"p", "pd", "d"} and "pd" in steps


def test_manager_lifecycle_persistent_hard_stop_and_iteration(family):
    name, ref, ours = family
    prompts = random_prompts([10, 15, 8], vocab=90, seed=25)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    # A persistent manager is kept on the model and reused by the next call, its cache with it.
    first = ours.generate_batch(prompts[:1], _greedy(), config, persistent_manager=True)
    manager = ours._cached_continuous_batching_manager
    second = ours.generate_batch(prompts[1:], _greedy(), config, persistent_manager=True)
    assert ours.init_continuous_batching() is manager
    ours.destroy_cached_continuous_batching_manager()
    assert not hasattr(ours, "_cached_continuous_batching_manager")
    assert first["req_0"].generated_tokens == _alone(ref, prompts[0])
    assert [r.generated_tokens for r in second.values()] == [_alone(ref, p) for p in prompts[1:]]
    # Iterating the manager yields every result; a hard stop fails what is left and gives the rows back.
    manager = ours.init_continuous_batching(_greedy(new=200), config)
    manager.start()
    ids = manager.add_requests(prompts, max_new_tokens=200)
    seen = next(iter(manager))
    manager.stop(block=True, hard_stop=True)
    results = {seen.request_id: seen}
    while (result := manager.get_result(timeout=0.5)) is not None:
        results[result.request_id] = result
    assert set(ids) <= set(results)
    assert any(r.status == RequestStatus.FAILED and "hard_stop" in r.error for r in results.values())
    assert pools_full(manager.cache) and not manager.is_running()


def test_a_replayed_prefill_step_that_ends_a_prompt_goes_before_the_decode_step():
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    def first(pending, replays=lambda rows, length: length <= 8, prefill_first=False, then_ends=True, unit=None):
        scheduler = Scheduler(max_rows=8, max_batch_tokens=16, prefill_first=prefill_first, replays=replays, unit=unit)
        scheduler.rows = [Request(f"r{i}", [5] * n, 4, frozenset()) for i, n in enumerate(pending)]
        for request in scheduler.rows if unit else ():  # (placed rows: the runner has the scheduler plan their stops)
            scheduler.plan_prefix_stop(request, matched=0)
        return scheduler.prefill_goes_first(then_ends=then_ends)

    everything = lambda rows, length: True  # noqa: E731
    assert first([6])  # a short prompt's whole prefill, replayed: its first token without a decode step between
    assert first([8, 30])  # [8, 8]: the first row's prompt ends
    assert not first([6], replays=lambda rows, length: False)  # an eager step (host work) keeps its place
    assert not first([12])  # its step would run eagerly (12 columns)
    assert not first([1, 1])  # nothing to prefill (one pending token: the decode step feeds it)
    assert first([30], prefill_first=True)  # scheduler_type="prefill_first": always
    # A step that leaves a row one short step from its end goes first too (the manager runs that step next).
    assert first([17], replays=everything)  # [16]: one token left, which the decode step feeds
    assert first([20], replays=everything)  # [16], then [4], which replays
    assert not first([20], replays=lambda rows, length: length in (16, 8))  # [4] would run eagerly
    assert not first([40], replays=everything)  # [16], then 24 tokens: more than the budget, two steps
    assert first([20], replays=everything, unit=8)  # [16] to its snapshot point (16), then [4], which replays
    assert not first([22], replays=everything, unit=4)  # [16], then [4] to its snapshot point (20), then [2]
    # Asked again after such a step, only a step that ends a prompt goes first.
    assert not first([17], replays=everything, then_ends=False) and first([16], replays=everything, then_ends=False)


def test_prefill_chunks_serve_the_oldest_first_within_budget_and_padding():
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    def chunks(pending, budget, replays=None):
        scheduler = Scheduler(max_rows=8, max_batch_tokens=budget, prefill_first=False, replays=replays)
        scheduler.rows = [Request(f"r{i}", [5] * n, 4, frozenset()) for i, n in enumerate(pending)]
        return scheduler.prefill_chunks()

    assert chunks([30, 5, 9], budget=8) == [8]  # the oldest takes the whole budget
    assert chunks([4, 4, 2, 4], budget=10) == [4, 4]  # a third row of 4 columns would exceed the budget
    assert chunks([8, 2, 8, 8], budget=100) == [8, 2, 8, 8]  # pads 6 of 32 columns
    assert chunks([8, 2, 2, 2], budget=100) == [8, 2, 2]  # pads 12 of 24; a fourth short row: 18 of 32
    assert chunks([1, 1], budget=4) == []  # rows with one pending token decode; nothing to prefill
    # A short oldest chunk (a prompt's tail after its snapshot point, say) rides along, padded, when the next
    # row's longer chunk feeds more tokens: 44 tokens in one step, not 12 in a step of 4 columns.
    assert chunks([4, 40, 40], budget=100) == [4, 40]  # a third row of 40 columns would exceed the budget
    assert chunks([4, 40, 40], budget=64) == [4, 32]  # the next row's chunk: at most half the budget
    assert chunks([4, 5, 40], budget=100) == [4, 5, 5]
    assert chunks([3, 3, 3, 3, 3, 3, 40], budget=64) == [3] * 7  # (the next row is no longer: nothing changes)
    assert chunks([2, 3, 3, 3], budget=9) == [2, 2, 2, 2]  # 8 tokens either way: the fewer pads
    # Unless the short chunk's own step replays a recorded graph (a fraction of an eager step's host work): then
    # it steps with the rows that join it at its length, as many of them as still replay (a power of two: a step of
    # three rows runs eagerly), and the others wait for the next step.
    asked = []

    def replays_up_to(cells):
        def replays(rows, length):
            asked.append((rows, length))
            return rows * length <= cells
        return replays

    assert chunks([4, 40], budget=100) == [4, 40]
    assert chunks([4, 40], budget=100, replays=replays_up_to(8)) == [4, 4]
    assert chunks([4, 40, 40], budget=100, replays=replays_up_to(8)) == [4, 4]  # 3 x 4 is eager: 2 x 4 replays
    assert chunks([4, 4, 4], budget=100, replays=replays_up_to(4)) == [4]  # only one row's step replays
    assert asked == [(2, 4), (2, 4), (2, 4), (1, 4)]
    asked.clear()
    assert chunks([6, 40], budget=100, replays=replays_up_to(4)) == [6, 40]  # none replays: it rides along
    assert asked == [(2, 6), (1, 6)]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-steps", "prefill-then-decode"])
def test_stats_count_the_prefill_tokens_their_pads_and_step_time(grouped):
    """Two prompts admitted together: one prefill step feeds both (a prompt of n tokens is prefilled whole, its
    first token sampled there); a rectangular one pads the shorter to the longer, a grouped one nothing."""
    _, ours = qwen_pair()
    prompts = random_prompts([10, 4], vocab=90, seed=17)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=2,
                                      allow_block_sharing=False)
    manager = ours.init_continuous_batching(greedy(3), config, grouped_steps=grouped)
    manager.add_requests(prompts, max_new_tokens=3)  # queued before the loop starts: admitted together
    manager.start()
    try:
        collect_results(manager, 2)
        stats = dict(manager.stats)
    finally:
        manager.stop(block=True)
    kind = "grouped" if grouped else "prefill"
    assert stats[f"{kind}_steps"] == 1 and stats["prefill_tokens"] == 14, stats
    assert stats["pad_tokens"] == (0 if grouped else 6), stats
    assert stats[f"{kind}_s"] > 0 and stats["decode_s"] > 0  # the steps' wall time, by kind


def test_a_request_that_fills_the_row_exactly_runs():
    """prompt + max_new_tokens - 1 == max_cache_len: the row never holds more (its last token is not fed)."""
    ref, ours = qwen_pair(qwen_config(max_position_embeddings=24))
    ref.generation_config.eos_token_id = ours.generation_config.eos_token_id = None
    prompt = random_prompts([20], vocab=90, seed=27)[0]
    results = ours.generate_batch([prompt], _greedy(new=5), ContinuousBatchingConfig(page_size=4))
    assert results["req_0"].status == RequestStatus.FINISHED
    assert results["req_0"].generated_tokens == _alone(ref, prompt, new=5)
    # Without workload hints the rows hold max_position_embeddings tokens: a 24-token prompt still gets its
    # one new token (never fed), one more new token does not fit.
    full = random_prompts([24], vocab=90, seed=29)[0]
    with ours.continuous_batching_context_manager(_greedy(new=6), continuous_batching_config=ContinuousBatchingConfig(
            page_size=4)) as manager:
        one = manager.add_request(full, max_new_tokens=1)
        done = next(r for r in manager.request_id_iter(one) if r.is_finished())
        too_many = manager.add_request(prompt, max_new_tokens=6)
        result = next(r for r in manager.request_id_iter(too_many) if r.is_finished())
    assert done.status == RequestStatus.FINISHED and done.generated_tokens == _alone(ref, full, new=1)
    assert result.status == RequestStatus.FAILED and "needs 25 slots" in result.error


def test_neighbouring_chunks_of_one_length_share_a_rectangle(monkeypatch):
    """A grouped step's prefill rows with chunks of one length run as one rectangle (no pads either way; fewer
    launches of the per-row ops); the tokens equal transformers alone."""
    from hf_qsa_cache.serving.runner import ModelRunner

    ref, ours = qwen_pair()
    ref.generation_config.eos_token_id = ours.generation_config.eos_token_id = None
    prompts = random_prompts([9, 9, 5], vocab=90, seed=43)
    shapes, forward_grouped = [], ModelRunner._forward_grouped

    def spy(self, rows, shape, counts, ids, last):
        shapes.append(list(shape))
        return forward_grouped(self, rows, shape, counts, ids, last)

    monkeypatch.setattr(ModelRunner, "_forward_grouped", spy)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=3)
    manager = ours.init_continuous_batching(_greedy(new=4), config, grouped_steps=True, prefix_snapshot_gap=0)
    ids = manager.add_requests(prompts, max_new_tokens=4)  # queued before the loop starts: admitted together
    manager.start()
    try:
        results = collect_results(manager, 3)
    finally:
        manager.stop(block=True)
    assert shapes[0] == [(2, 8), (1, 4)]  # (prefix caching stops each chunk at its last unit boundary, 4 tokens)
    for request_id, prompt in zip(ids, prompts):
        assert results[request_id].generated_tokens == _alone(ref, prompt, new=4)


def test_a_prefilling_row_without_a_chunk_takes_nothing_in_a_grouped_step(monkeypatch):
    """A grouped step feeds the prefill chunks and the decoding rows; a row still prefilling that got no chunk (the
    budget went to older rows) takes nothing, so it may still start from a prefix an older row caches meanwhile;
    every request equals transformers alone."""
    from hf_qsa_cache.serving.runner import ModelRunner

    ref, ours = qwen_pair()
    ref.generation_config.eos_token_id = ours.generation_config.eos_token_id = None
    prompts = random_prompts([5, 12, 10, 9], vocab=90, seed=45)
    steps, forward_grouped = [], ModelRunner._forward_grouped

    def spy(self, rows, shape, counts, ids, keep):
        steps.append([(r.in_prefill, n) for r, n in zip(rows, counts)])
        return forward_grouped(self, rows, shape, counts, ids, keep)

    monkeypatch.setattr(ModelRunner, "_forward_grouped", spy)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=6, max_requests_per_batch=4,
                                      allow_block_sharing=False)
    with ours.continuous_batching_context_manager(_greedy(new=6), continuous_batching_config=config,
                                                  grouped_steps=True) as manager:
        first = manager.add_request(prompts[0], max_new_tokens=6, streaming=True)
        next(manager.request_id_iter(first))  # it decodes
        ids = manager.add_requests(prompts[1:], max_new_tokens=6)
        results = {i: r for i, r in collect_results(manager, 4).items()}
    waited = [n for step in steps for prefilling, n in step[1:] if prefilling and n == 0]
    assert waited, steps  # rows waited beside a chunk and decoding rows
    assert all(n == 1 for step in steps for prefilling, n in step if not prefilling), steps
    for request_id, prompt in zip([first, *ids], prompts):
        assert results[request_id].generated_tokens == _alone(ref, prompt, new=6)


def test_prefill_chunks_share_the_budget_when_packed_and_stay_a_half_padded_rectangle_otherwise():
    """A grouped step's chunks (``packed``) take what is left of the token budget, each row as much as it can use;
    a rectangular prefill step's rows join only while ``k`` chunks of the first's length fit and pads stay at most
    half the step."""
    from hf_qsa_cache.serving.requests import Request
    from hf_qsa_cache.serving.scheduler import Scheduler

    scheduler = Scheduler(max_rows=4, max_batch_tokens=32, prefill_first=False)
    for i, n in enumerate([30, 3, 20]):
        scheduler.submit(Request(f"r{i}", list(range(1, n + 1)), 4, frozenset()))
    scheduler.admit()
    assert scheduler.prefill_chunks(packed=True) == [30, 2]
    assert scheduler.prefill_chunks() == [30]
    small = Scheduler(max_rows=4, max_batch_tokens=32, prefill_first=False)
    for i, n in enumerate([10, 9, 2, 8]):
        small.submit(Request(f"s{i}", list(range(1, n + 1)), 4, frozenset()))
    small.admit()
    assert small.prefill_chunks(packed=True) == [10, 9, 2, 8]
    assert small.prefill_chunks() == [10, 9, 2]  # a fourth row of 10 columns would not fit 32 tokens
