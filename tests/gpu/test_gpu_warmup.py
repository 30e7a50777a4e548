"""`ContinuousBatchingManager.warmup` on a GPU (the benchmark configs, bf16): the decode graphs it records are the
ones a workload of the hinted shape then replays (no decode step records again), and the workload's tokens equal
those of a manager that never warmed up.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_warmup.py
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

pytestmark = pytest.mark.gpu

ROWS, PROMPT, NEW = 4, 5000, 8  # (prompts past 4,096 tokens: the long wave's reach, not the short one's)


@functools.cache
def model(name: str):
    from bench_generate import inkling_config, qwen4_exp_config

    from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

    cls, config = {"inkling": (InklingForCausalLM, inkling_config(6)),
                   "qwen4_exp": (Qwen4ExpForCausalLM, qwen4_exp_config(4))}[name]
    torch.manual_seed(0)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return cls(config).eval(), config
    finally:
        torch.set_default_dtype(saved)


def _serve(net, prompts, warm: bool):
    """Each prompt's tokens (the requests decode together, then finish one after the other), and the decode-step
    graphs recorded while they ran."""
    config = ContinuousBatchingConfig(page_size=64, max_requests_per_batch=ROWS, max_batch_tokens=2048)
    generation = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=NEW + ROWS)
    hints = WorkloadHints(max_prompt_length=PROMPT, max_generated_length=NEW + ROWS, num_requests=ROWS)
    manager = net.init_continuous_batching(generation, config, hints)
    if warm:
        manager.warmup()
    runners = list(manager.cache.graph_runners.values())
    before = {key for r in runners for key in r.buckets if key[1] == 1}
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=NEW + i) for i, p in enumerate(prompts)]
        tokens = {}
        while len(tokens) < len(ids):
            result = manager.get_result(timeout=120)
            assert result is not None and result.error is None, result
            tokens[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True)
    runners = list(manager.cache.graph_runners.values())
    after = {key for r in runners for key in r.buckets if key[1] == 1}
    manager.destroy()
    return [tokens[i] for i in ids], before, after


@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
@torch.no_grad()
def test_a_warmed_manager_replays_the_decode_graphs_it_warmed_and_gives_the_same_tokens(name):
    net, config = model(name)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1000, (PROMPT - 8 * i,), generator=gen).tolist() for i in range(ROWS)]
    warmed, before, after = _serve(net, prompts, warm=True)
    assert before, "the warm-up recorded no decode graph"
    assert after == before, f"decode steps recorded after the warm-up: {sorted(after - before)}"
    cold, _, _ = _serve(net, prompts, warm=False)
    assert warmed == cold
