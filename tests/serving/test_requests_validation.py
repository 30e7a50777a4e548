"""Continuous batching checks each request's arguments before anything is built or queued: a bad value is a
`ValueError` that names the argument and the value, never an error about a parameter the user did not set
(the cache the manager sizes from them). A request bounded only by its row's room is reported once per manager.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.qwen4 import make_pair, tiny_config
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_qsa_cache.serving.manager import ContinuousBatchingManager

CB = dict(page_size=4)


@pytest.fixture(scope="module")
def model():
    return make_pair(tiny_config(max_position_embeddings=40), seed=5)[1]


def _greedy(**kwargs):
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("value", [-3, 0, 2.5, "4", True], ids=["negative", "zero", "float", "string", "bool"])
def test_generate_batch_refuses_a_bad_max_new_tokens_by_its_name(model, value, monkeypatch):
    built = []
    monkeypatch.setattr(ContinuousBatchingManager, "__init__",
                        lambda *a, **k: built.append(1) or pytest.fail("a manager was built"))
    with pytest.raises(ValueError, match=rf"^max_new_tokens must be an integer >= 1, got {value!r}$"):
        model.generate_batch([[3, 4, 5]], _greedy(), ContinuousBatchingConfig(**CB), max_new_tokens=value)
    assert not built


@pytest.mark.parametrize("value", [-1, 2.5, "8", True], ids=["negative", "float", "string", "bool"])
def test_a_bad_prefix_snapshot_gap_is_refused_by_name(model, value):
    with pytest.raises(ValueError, match=rf"^prefix_snapshot_gap must be an integer >= 0, got {value!r}$"):
        model.init_continuous_batching(_greedy(), ContinuousBatchingConfig(**CB), prefix_snapshot_gap=value)


@pytest.mark.parametrize("name", ["grouped_steps", "mixed_steps"])
@pytest.mark.parametrize("value", ["no", 1, None], ids=["string", "int", "none"])
def test_a_step_option_that_is_not_a_bool_is_refused_by_name(model, name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be True or False, got {value!r}$"):
        model.init_continuous_batching(_greedy(), ContinuousBatchingConfig(**CB), **{name: value})


def test_generate_batch_names_a_bad_generation_config_value(model):
    config = _greedy(max_new_tokens=4)
    config.max_new_tokens = -2  # GenerationConfig checks its values when built, not when set
    with pytest.raises(ValueError, match=r"GenerationConfig.max_new_tokens must be an integer >= 1, got -2"):
        model.generate_batch([[3, 4, 5]], config, ContinuousBatchingConfig(**CB))


@pytest.mark.parametrize("prompts, message", [
    ([[3, 4], []], r"at least one prompt token, got an empty inputs\[1\]"),
    ([[3, 400]], r"token ids must lie in \[0, 96\) \(vocab_size\), got 400 in inputs\[0\]"),
    ([[3, 96]], r"token ids must lie in \[0, 96\) \(vocab_size\), got 96 in inputs\[0\]"),
    ([[3, -1]], r"token ids must lie in \[0, 96\) \(vocab_size\), got -1 in inputs\[0\]"),
    ([[3, 4.5]], r"inputs\[0\] must hold integer token ids, got 4.5"),
    ([[3, True]], r"inputs\[0\] must hold integer token ids, got True"),
    (["hello"], r"inputs\[0\] must be a list of token ids, got 'hello'"),
], ids=["empty", "too-large", "vocab-size", "negative", "float-id", "bool-id", "text"])
def test_generate_batch_refuses_bad_prompts_before_building_a_manager(model, prompts, message, monkeypatch):
    monkeypatch.setattr(ContinuousBatchingManager, "__init__", lambda *a, **k: pytest.fail("a manager was built"))
    with pytest.raises(ValueError, match=message):
        model.generate_batch(prompts, _greedy(max_new_tokens=2), ContinuousBatchingConfig(**CB))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-3), r"max_new_tokens must be an integer >= 1, got -3"),
    (dict(max_new_tokens=1.5), r"max_new_tokens must be an integer >= 1, got 1.5"),
    (dict(request_id=7), r"request_id must be a string, got 7"),
    (dict(eos_token_id="2"), r"eos_token_id must be an integer or a list of integers, got '2'"),
    (dict(eos_token_id=[2, None, 2.0]), r"eos_token_id must be an integer or a list of integers, got \[2, None, 2.0\]"),
    (dict(input_ids=torch.tensor([3.0, 4.0])), r"input_ids must hold integer token ids, got 3.0"),
    (dict(input_ids=["3", "4"]), r"input_ids must hold integer token ids, got '3'"),
    (dict(seed=-1), r"seed must be an integer >= 0, got -1"),
    (dict(seed=1.5), r"seed must be an integer >= 0, got 1.5"),
    (dict(logprobs="yes"), r"logprobs must be True or False, got 'yes'"),
    (dict(sampling={"temperature": 0.5}), r"sampling must be a hf_qsa_cache.serving.Sampling"),
], ids=["negative-max-new-tokens", "float-max-new-tokens", "int-request-id", "string-eos", "float-eos",
        "float-tensor-ids", "string-ids", "negative-seed", "float-seed", "string-logprobs", "dict-sampling"])
def test_add_request_refuses_bad_arguments_and_queues_nothing(model, kwargs, message):
    manager = model.init_continuous_batching(_greedy(max_new_tokens=2), ContinuousBatchingConfig(**CB))
    input_ids = kwargs.pop("input_ids", [3, 4, 5])
    with pytest.raises(ValueError, match=message):
        manager.add_request(input_ids, **kwargs)
    assert manager.input_queue.empty() and manager._counter == 0 and not manager._in_flight


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0), r"temperature must be a number > 0, got 0"),
    (dict(top_k=2.5), r"top_k must be None or an integer >= 0, got 2.5"),
    (dict(top_p=0), r"top_p must be None or a number in \(0, 1\], got 0"),
    (dict(min_p=1.5), r"min_p must be None or a number in \[0, 1\], got 1.5"),
    (dict(repetition_penalty=0), r"repetition_penalty must be a number > 0, got 0"),
    (dict(presence_penalty=3), r"presence_penalty must be a number in \[-2, 2\], got 3"),
    (dict(frequency_penalty="1"), r"frequency_penalty must be a number in \[-2, 2\], got '1'"),
    (dict(do_sample="yes"), r"do_sample must be True or False, got 'yes'"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_sampling_parameters_are_checked_by_name(kwargs, message):
    from hf_qsa_cache.serving import Sampling

    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def _unbounded_warnings(caplog):
    return [r for r in caplog.records if "neither max_new_tokens nor an eos token" in r.getMessage()]


def test_a_request_bounded_only_by_its_row_is_reported_once_per_manager(model, caplog):
    caplog.set_level(logging.WARNING, logger="hf_qsa_cache.serving.manager")
    manager = model.init_continuous_batching(_greedy(), ContinuousBatchingConfig(**CB))
    manager.add_request([3, 4, 5])
    manager.add_request([6, 7])
    (record,) = _unbounded_warnings(caplog)
    assert "max_cache_len=40, 38 new tokens for a prompt of 3" in record.getMessage()
    # bounded requests are not reported; a second manager reports its own once
    caplog.clear()
    manager.add_request([3, 4], max_new_tokens=3)
    manager.add_request([3, 4], eos_token_id=2)
    assert not _unbounded_warnings(caplog)
    other = model.init_continuous_batching(_greedy(), ContinuousBatchingConfig(**CB))
    other.add_request([3, 4, 5])
    assert len(_unbounded_warnings(caplog)) == 1


def test_generate_batch_without_a_bound_warns_and_still_runs_to_the_rows_room(model, caplog):
    caplog.set_level(logging.WARNING, logger="hf_qsa_cache.serving.manager")
    results = model.generate_batch([[3, 4, 5], [6, 7, 8, 9]], _greedy(), ContinuousBatchingConfig(**CB))
    assert len(_unbounded_warnings(caplog)) == 1
    assert [len(r.generated_tokens) for r in results.values()] == [40 - 3 + 1, 40 - 4 + 1]
    caplog.clear()
    model.generate_batch([[3, 4, 5]], _greedy(max_new_tokens=2), ContinuousBatchingConfig(**CB))
    model.generate_batch([[3, 4, 5]], GenerationConfig(do_sample=False, eos_token_id=2, pad_token_id=0),
                         ContinuousBatchingConfig(**CB))
    assert not _unbounded_warnings(caplog)
