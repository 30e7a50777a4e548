"""`benchmarks/bench_without.py`: the dropped ops are really not run by the Inkling layers, and come back after."""

from __future__ import annotations

import os
import sys

import pytest
import helpers.inkling as inkling
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
import bench_without  # noqa: E402

from hf_qsa_cache.ops import conv_norm  # noqa: E402


def test_dropped_ops_do_not_run_and_come_back(monkeypatch):
    _, model = inkling.make_pair(inkling.make_config(), seed=4)
    ids, mask = inkling.left_pad(inkling.make_prompts([7], seed=5))
    calls = []
    for name in ("conv_add_rms_norm_torch", "attention_inputs_torch"):  # what the fused ops run on the CPU
        real = getattr(conv_norm, name)
        monkeypatch.setattr(conv_norm, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))

    def generate():
        calls.clear()
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)

    want = generate()
    assert set(calls) == {"conv_add_rms_norm_torch", "attention_inputs_torch"}
    with bench_without.dropped(["conv_add_rms_norm", "attention_inputs"]):
        generate()
        assert not calls
    assert torch.equal(generate(), want) and calls
    with pytest.raises(ValueError, match="unknown op"):
        with bench_without.dropped(["rms_norm"]):
            pass
