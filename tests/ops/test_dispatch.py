"""What makes a fused op leave a module to its own forward (`hf_qsa_cache.ops.keeps_own_forward`)."""

from __future__ import annotations

import torch
from helpers import inkling
from torch import nn
from transformers.utils.output_capturing import _active_collector

from hf_qsa_cache.ops import keeps_own_forward, sees_forward


def _recorder_hook():
    def output_capturing_hook(module, args, output):  # the name transformers' recorder hooks carry
        return None

    return output_capturing_hook


def test_an_idle_output_recorder_lets_the_fused_path_run_and_a_collecting_one_does_not():
    module = nn.Linear(4, 4)
    assert not keeps_own_forward(module, module.weight)
    handle = module.register_forward_hook(_recorder_hook())
    assert not sees_forward(module) and not keeps_own_forward(module, module.weight)  # installed, idle
    token = _active_collector.set({"router_logits": []})
    try:
        assert sees_forward(module) and keeps_own_forward(module, module.weight)  # a call collects outputs
    finally:
        _active_collector.reset(token)
    handle.remove()
    user = module.register_forward_hook(lambda *a: None)  # a user's hook always sees the module run
    assert keeps_own_forward(module, module.weight)
    user.remove()
    pre = module.register_forward_pre_hook(lambda *a: None)
    assert keeps_own_forward(module, module.weight)
    pre.remove()


def test_router_logits_asked_once_leave_the_routers_idle_afterwards():
    """After one call with ``output_router_logits=True`` transformers' recorder hooks stay on the routers: a later
    plain call must find them idle (on CUDA the fused routing then runs again)."""
    _, model = inkling.make_pair(inkling.make_config(), seed=2)
    ids, mask = inkling.left_pad(inkling.make_prompts([5, 3], seed=3))
    with torch.no_grad():
        model(ids, attention_mask=mask, output_router_logits=True)
    routers = [m for m in model.modules() if m._forward_hooks]
    assert routers, "transformers installed no recorder hook"
    assert not any(sees_forward(m) for m in routers)
