"""`torch.compile` of a model's forward: the forwards on the paged cache are skipped by dynamo (their steps run
host bookkeeping it would break on at every call), so a user's ``torch.compile(model.forward)`` runs eagerly
with the same tokens instead of tracing each call (it took minutes for a few tokens, and failed in inductor
for Inkling)."""

from __future__ import annotations

import pytest
import torch
from helpers.qwen4 import make_pair as qwen_pair
from helpers.qwen4 import random_prompts
from helpers.inkling import make_config as inkling_config
from helpers.inkling import make_pair as inkling_pair


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_compiled_forward_runs_eagerly_with_the_same_tokens(family):
    torch._dynamo.reset()
    _, ours = qwen_pair() if family == "qwen4_exp" else inkling_pair(inkling_config())
    ids = torch.tensor(random_prompts([19], vocab=90, seed=2))
    with torch.no_grad():
        want = ours.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    ours.forward = torch.compile(ours.forward, backend=counting_backend)
    try:
        with torch.no_grad():
            got = ours.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    finally:
        del ours.forward
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert graphs == []  # dynamo traced nothing of the forward
