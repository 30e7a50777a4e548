"""Shared pieces of the continuous-batching tests: both families' model pairs, each prompt's tokens from
transformers' own model alone (the reference), greedy configs, the pools-are-full check and steps routed as a GPU
routes them."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from transformers import GenerationConfig

from hf_qsa_cache import QSAPagedCache, cuda_graphs

from .inkling import make_config as inkling_config
from .inkling import make_pair as inkling_pair
from .qwen4 import collect_results
from .qwen4 import make_pair as qwen_pair

FAMILIES = ["qwen4_exp", "inkling"]


def family_pair(name: str):
    """(transformers' model, ours) with the same random weights, fp32, no eos unless a test sets one:
    generate() falls back to the model's eos when a GenerationConfig leaves it unset, continuous batching (as
    transformers') treats unset as no eos."""
    ref, ours = qwen_pair() if name == "qwen4_exp" else inkling_pair(inkling_config())
    ref.generation_config.eos_token_id = ours.generation_config.eos_token_id = None
    return ref, ours


_alone_cache: dict = {}


def alone(ref, prompt: list[int], new: int, eos=None, **kwargs) -> list[int]:
    """transformers' greedy tokens for ``prompt`` alone, unpadded (cached)."""
    # The key holds the model itself, not its id: a freed model's id could be the next one's.
    key = (ref, tuple(prompt), new, eos, tuple(sorted(kwargs.items())))
    if key not in _alone_cache:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eos, **kwargs)
        _alone_cache[key] = out[0, len(prompt):].tolist()
    return _alone_cache[key]


def greedy(new: int, **kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def pools_full(cache: QSAPagedCache) -> bool:
    """No row held, every block back in its pool: free, or cached by prefix caching and idle (the pool takes
    those back whenever a step needs them)."""
    for t in cache.tables.values():
        t.check_accounting()
    return all(t.available() == t.num_blocks - 1 and not any(t.refs) for t in cache.tables.values()) \
        and cache.num_rows == 0


def serve_queued(manager, count: int) -> dict:
    """Start ``manager`` on the requests queued before (its first iteration sees them all), collect ``count``
    results by id, then stop it and empty its cache."""
    manager.start()
    try:
        return collect_results(manager, count)
    finally:
        manager.stop()
        manager.destroy()


@contextlib.contextmanager
def steps_routed_as_on_a_gpu():
    """While open, each family's forward runs every step the recorded CUDA-graph step computes
    (`cuda_graphs.takes_graph_step`: decode, verify and short prefill steps) on that path, from its static buffers
    (`DecodeGraphs(record=False)`), as a GPU replays it, and the serving scheduler plans for those replays
    (`cuda_graphs.graphs_device`); the CPU otherwise never takes it. Yields the lengths of the steps so routed (a
    list that grows; a mixed step of the serving loop, `ModelRunner.mixed`, as ``("mixed", rows)``)."""
    import modeling.modeling_inkling as inkling_module
    import modeling.modeling_qwen4_exp as qwen_module

    import hf_qsa_cache.serving.runner as runner_module

    lengths = []

    def as_on_a_gpu(model, cache, input_ids, inputs_embeds, extra_outputs, logits_to_keep=0):
        if not cuda_graphs.takes_graph_step(cache, input_ids, inputs_embeds, extra_outputs, logits_to_keep):
            return None
        lengths.append(input_ids.shape[1])
        return cuda_graphs.graphs_of(model, cache, "cpu", record=False)

    def recorded_on_the_cpu(model, cache):  # (the serving loop's mixed steps)
        lengths.append(("mixed", cache.num_rows))
        return cuda_graphs.graphs_of(model, cache, "cpu", record=False)

    with mock.patch.object(qwen_module, "decode_graphs_for", as_on_a_gpu), \
            mock.patch.object(inkling_module, "decode_graphs_for", as_on_a_gpu), \
            mock.patch.object(runner_module, "decode_graphs_for", as_on_a_gpu), \
            mock.patch.object(runner_module, "recorded_steps", recorded_on_the_cpu), \
            mock.patch.object(cuda_graphs, "graphs_device", lambda model: torch.device("cpu")):
        yield lengths
