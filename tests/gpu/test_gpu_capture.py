"""One decode step and one verify step of each model (the benchmark configs, bf16) captured in a CUDA graph: a
capture that fails fails here with its traceback (the graphed runner itself only warns and falls back to eager).
Short prefill steps through the forward replay their graph and give the eager forward's logits.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_capture.py
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.cuda_graphs import capture_failures, graphs_of

pytestmark = pytest.mark.gpu


@pytest.fixture
def bf16_default():
    """bf16 as the default dtype while a test builds and runs its model (the benchmark's setting)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(saved)


@functools.cache
def model(name: str):
    from bench_generate import inkling_config, qwen4_exp_config

    from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

    cls, config = {"inkling": (InklingForCausalLM, inkling_config(6)),
                   "qwen4_exp": (Qwen4ExpForCausalLM, qwen4_exp_config(4))}[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cls(config).eval(), config


@pytest.mark.parametrize("step_len", [1, 4], ids=["decode-step", "verify-step-of-4"])
@pytest.mark.parametrize("name", ["inkling", "qwen4_exp"])
@torch.no_grad()
def test_step_is_captured(name, step_len, bf16_default):
    net, config = model(name)
    cache = QSAPagedCache(config, max_batch_size=2, max_cache_len=1024, num_speculative_tokens=3)
    net(torch.randint(2, 1000, (2, 600), device="cuda"), past_key_values=cache, logits_to_keep=1)
    runner = graphs_of(net, cache, torch.device("cuda", torch.cuda.current_device()))
    tokens = torch.randint(2, 1000, (2, step_len), device="cuda")
    # As the runner's own step does, but capture errors raised here rather than remembered and run eagerly.
    with cache.transaction(2, step_len, None, copy_rows=False) as step:
        prev, counts = step.prev, step.counts
        ptrs = {n: t.device_table(2, runner.device).data_ptr() for n, t in cache.tables.items()}
        reach = runner.reach_bucket(max(p + c for p, c in zip(prev, counts)))
        entry = runner._new_bucket(2, step_len, reach, False, ptrs)
        assert not entry.eager, f"this step failed to capture before: {capture_failures(net)[entry.key]}"
        runner._fill(entry, prev, counts, tokens, None)
        runner._warm_up(entry)  # eager first, on a side stream: compiles the kernels
        runner._capture(entry)


@pytest.mark.parametrize("name", ["inkling", "qwen4_exp"])
@torch.no_grad()
def test_short_prefill_steps_replay_graphs_and_equal_the_eager_forward(name, bf16_default):
    """Steps of 40 tokens over both rows of a cache holding 600 (a short prefill step: recorded at 64 columns,
    left-padded, its last column's logits kept, as serving asks): the first captures, the next two replay. Two bf16
    paths of different shapes drift apart (the recorded step pads to 64 columns, so its chunked kernels split and
    round differently), so each step's bf16 logits, recorded and eager, are judged against the same step of the
    model in fp32 on a third cache: the recorded step's error may not exceed twice the eager one's (plus 1% of the
    logits' range). A stale or misplaced replay is off by the logits' own size."""
    net, config = model(name)
    exact = copy.deepcopy(net).float()
    exact.use_cuda_graphs = False
    eager, graphed, reference = (QSAPagedCache(config, max_batch_size=2, max_cache_len=2048) for _ in range(3))
    prompt = torch.randint(2, 1000, (2, 600), device="cuda")
    for cache in (eager, graphed):
        net(prompt, past_key_values=cache, logits_to_keep=1)
    exact(prompt, past_key_values=reference, logits_to_keep=1)
    try:
        for _ in range(3):
            chunk = torch.randint(2, 1000, (2, 40), device="cuda")
            want = exact(chunk, past_key_values=reference, logits_to_keep=1).logits
            net.use_cuda_graphs = False
            eager_error = (net(chunk, past_key_values=eager, logits_to_keep=1).logits.float() - want).abs().max()
            net.use_cuda_graphs = True
            graph_error = (net(chunk, past_key_values=graphed, logits_to_keep=1).logits.float() - want).abs().max()
            scale = want.abs().max().item()
            assert graph_error.item() <= 2 * eager_error.item() + 0.01 * scale, (graph_error, eager_error, scale)
    finally:
        net.use_cuda_graphs = True
    runner = graphed.graph_runners[net]
    assert list(runner.buckets) == [(2, 64, 2048, True)] and runner.replays == 2


@pytest.mark.parametrize("name", ["inkling", "qwen4_exp"])
@torch.no_grad()
def test_mixed_steps_capture_in_the_serving_loop(name, bf16_default):
    """Continuous batching with ``mixed_steps=True``: requests that arrive while others decode take mixed steps (a
    short prefill chunk and every decoding row's token in one recorded step), which capture (none of them falls
    back to running eagerly) and replay; every request gets its tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from hf_qsa_cache.cuda_graphs import recorded_steps

    net, config = model(name)
    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=24)
    cb = ContinuousBatchingConfig(page_size=64, max_requests_per_batch=8, max_batch_tokens=2048)
    manager = net.init_continuous_batching(gen, cb, mixed_steps=True)
    manager.start()
    try:
        first = [manager.add_request(torch.randint(2, 1000, (300,)).tolist(), max_new_tokens=40, streaming=i == 0)
                 for i in range(3)]
        manager.get_result(first[0], timeout=120)  # (its first token: the three decode)
        later = [manager.add_request(torch.randint(2, 1000, (n,)).tolist()) for n in (100, 60, 200, 30)]
        results = []
        for request_id in first + later:
            result = manager.get_result(request_id, timeout=120)
            while result is not None and not result.is_finished():  # (the streamed one's progress)
                result = manager.get_result(request_id, timeout=120)
            results.append(result)
    finally:
        manager.stop(block=True)
    assert [len(r.generated_tokens) for r in results] == [40] * 3 + [24] * 4
    graphs = recorded_steps(net, manager.cache)
    mixed = [entry for entry in graphs.buckets.values() if entry.prefill_rows]
    assert manager.stats["mixed_steps"] > 0 and mixed, manager.stats
    assert all(entry.graph is not None and not entry.eager for entry in mixed), \
        [capture_failures(net).get(entry.key) for entry in mixed]
