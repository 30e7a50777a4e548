"""Grouped steps on the CUDA path (Triton kernels reading a group's view of the stores: GatedDeltaNet/PLE state and
rings, the QSA ring from the group's first row): random schedules of chunks beside one-token rows, fp32, every
fed token's logits within 1e-3 of transformers' own model on that row's sequence alone (CPU, fp32), with and
without rollback history; continuous batching with grouped steps and without gives the same tokens; and prompt
lookup inside the loop, whose verify steps carry pads where rows drafted different counts (replayed from graphs
like the others), gives each prompt transformers' tokens alone.

    python -m pytest -m gpu -n 0 tests/gpu/test_gpu_grouped.py
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers.grouped import run_schedule
from helpers.qwen4 import random_prompts
from helpers.serving import FAMILIES, alone, family_pair, greedy
from transformers import ContinuousBatchingConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed, spec", [(0, 0), (1, 0), (2, 2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_grouped_steps_equal_transformers_alone(family, seed, spec):
    ref, ours = family_pair(family)
    gpu = copy.deepcopy(ours).cuda()
    rng = random.Random(seed)
    sequences = [[rng.randrange(1, 90) for _ in range(rng.randint(20, 40))] for _ in range(4)]
    got, _, dropped = run_schedule(gpu, sequences, 9, seed, spec, device="cuda")
    with torch.no_grad():
        expected = [ref(input_ids=torch.tensor([s])).logits[0] for s in sequences]
    worst = max((value.cpu() - expected[r][p]).abs().max().item() for (r, p), value in got.items())
    assert worst < 1e-3, worst
    assert len(got) > 24 and (dropped > 0) == bool(spec)


@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_gives_the_same_tokens_with_grouped_steps_and_without(family):
    _, ours = family_pair(family)
    gpu = copy.deepcopy(ours).cuda()
    prompts = random_prompts([23, 9, 17, 30, 5, 14], vocab=90, seed=3)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=8, max_requests_per_batch=3)
    tokens = {}
    for grouped in (True, False):
        results = gpu.generate_batch(prompts, greedy(8), config, grouped_steps=grouped)
        tokens[grouped] = [results[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        gpu.destroy_cached_continuous_batching_manager()
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_inside_the_loop_with_ragged_drafts_equals_transformers_alone(family):
    ref, ours = family_pair(family)
    gpu = copy.deepcopy(ours).cuda()
    base = random_prompts([8, 5, 12], vocab=90, seed=51)
    prompts = [p * 3 for p in base] + random_prompts([15, 9], vocab=90, seed=52)  # repeats: lookup finds n-grams
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, max_requests_per_batch=4)
    results = gpu.generate_batch(prompts, greedy(12, prompt_lookup_num_tokens=3), config)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == alone(ref, prompt, 12), f"request {i}"
