"""A continuous-batching step that fails hands its requests' rows back before the iteration's next step: with
``prefill_first`` a failed prefill step is followed by a decode step, which must not carry its requests (sent back
to the queue, or failed at their second failed step): it would feed them their next prompt token."""

from __future__ import annotations

from helpers.qwen4 import make_pair, random_prompts
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from hf_qsa_cache.serving.runner import ModelRunner


def test_a_failed_prefill_steps_requests_are_not_decoded(monkeypatch):
    doomed = ["doomed0", "doomed1"]  # every prefill step that feeds one of them fails
    ref, ours = make_pair()
    ours.generation_config.eos_token_id = None
    prompts = random_prompts([15, 9, 20], vocab=90, seed=13)
    armed = {"on": False}
    fed_after_failing = []
    forward = ModelRunner._forward

    def failing(self, rows, ids, mask):
        # Neither a failed request nor one sent back to the queue (pending again) may be fed.
        fed_after_failing.extend(r.request_id for r in rows if r.status in (RequestStatus.FAILED,
                                                                           RequestStatus.PENDING))
        if armed["on"] and mask is not None and any(r.request_id in doomed for r in rows):  # their prefill steps
            raise RuntimeError("injected fault")
        return forward(self, rows, ids, mask)

    monkeypatch.setattr(ModelRunner, "_forward", failing)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=3,
                                      scheduler_type="prefill_first")
    # The rectangular path: a prefill step, then a decode step in the same iteration (grouped steps are one step).
    with ours.continuous_batching_context_manager(gen, continuous_batching_config=config,
                                                  grouped_steps=False) as manager:
        first = manager.add_request(prompts[0], max_new_tokens=8, streaming=True)
        next(manager.request_id_iter(first))  # it decodes
        armed["on"] = True
        for request_id, prompt in zip(doomed, prompts[1:]):
            manager.add_request(prompt, request_id=request_id, max_new_tokens=8)
        results = []
        while sum(r.is_finished() for r in results) < 3:
            results.append(manager.get_result(timeout=60))
        stats = dict(manager.stats)
    assert stats["failed_steps"] >= 2 and stats["retried_requests"] >= 1 and fed_after_failing == []
    for request_id in doomed:
        ends = [r for r in results if r.request_id == request_id]
        assert [r.status for r in ends] == [RequestStatus.FAILED], ends
