"""QSAPagedCache under accelerate's big-model hooks (CPU): offloaded layers generate the same tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import helpers.inkling as inkling
from accelerate import cpu_offload, dispatch_model
from helpers.qwen4 import left_pad, make_pair, random_prompts

from hf_qsa_cache import QSAPagedCache

NEW = 8


def _generate(model, ids, mask):
    cache = QSAPagedCache(model.config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[1] + NEW, block_size=4)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1)


def _model_and_batch(family: str, seed: int):
    if family == "qwen4_exp":
        _, ours = make_pair(seed=seed)
        return ours, left_pad(random_prompts([26, 11, 19], seed=seed))
    _, ours = inkling.make_pair(inkling.make_config(), seed=seed)
    return ours, inkling.left_pad(inkling.make_prompts([13, 5, 9], seed=seed))


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_disk_offloaded_layers_generate_the_same_tokens(tmp_path, family):
    ours, (ids, mask) = _model_and_batch(family, seed=21)
    expected, expected_logits = _generate(ours, ids, mask)

    offloaded = copy.deepcopy(ours)
    device_map = {f"model.{name}": "cpu" for name, _ in offloaded.model.named_children() if name != "layers"}
    device_map["lm_head"] = "cpu"
    for i in range(offloaded.config.num_hidden_layers):
        device_map[f"model.layers.{i}"] = "disk" if i % 2 else "cpu"
    dispatch_model(offloaded, device_map=device_map, offload_dir=str(tmp_path))
    # The offloaded layers really run from the offload folder (their weights are on the meta device).
    assert offloaded.model.layers[1].self_attn.o_proj.weight.device.type == "meta"
    assert any(tmp_path.iterdir())
    tokens, logits = _generate(offloaded, ids, mask)
    assert tokens.tolist() == expected.tolist()
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_cpu_offload_hooks_generate_the_same_tokens(family):
    ours, (ids, mask) = _model_and_batch(family, seed=22)
    expected, _ = _generate(ours, ids, mask)
    hooked = cpu_offload(copy.deepcopy(ours), execution_device="cpu")
    tokens, _ = _generate(hooked, ids, mask)
    assert tokens.tolist() == expected.tolist()
