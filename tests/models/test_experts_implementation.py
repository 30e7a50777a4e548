"""The experts implementation a user chooses runs: transformers' ``eager``, ``batched_mm`` and ``grouped_mm``, named
in the config, in ``from_pretrained(experts_implementation=...)`` or through ``set_experts_implementation``, call
transformers' function registered under that name (patched here as transformers' own test patches them) in our
models' forward and generate(), with the default's outputs; the default is ours (``hf_qsa``); an unknown name is
refused as transformers refuses it.

Each model here is built on a config of its own: a transformers model built on a config writes its default
(``grouped_mm``) into it, which would then read as the user's choice.
"""

from __future__ import annotations

import copy
from unittest.mock import Mock, patch

import pytest
import torch
import transformers
from helpers import inkling
from helpers.qwen4 import left_pad, random_prompts, randomize_, tiny_config
from transformers.integrations import moe

from hf_qsa_cache.ops import experts as experts_ops
from hf_qsa_cache.ops import prompt_experts
from modeling import InklingForCausalLM, Qwen4ExpForCausalLM

NAMES = ["eager", "batched_mm", "grouped_mm"]
WAYS = ["set_experts_implementation", "config", "from_pretrained"]


class Family:
    def __init__(self, name: str):
        self.name = name
        if name == "qwen4_exp":
            self.config = tiny_config()
            self.cls, self.upstream_cls = Qwen4ExpForCausalLM, transformers.Qwen4ExpForCausalLM
            self.ids, self.mask = left_pad(random_prompts([11, 6], seed=5))
        else:
            self.config = inkling.make_config()
            self.cls, self.upstream_cls = InklingForCausalLM, inkling.UpstreamInkling
            self.ids, self.mask = inkling.left_pad(inkling.make_prompts([9, 5], seed=6))
        model = self.build()
        if name == "qwen4_exp":
            randomize_(model, seed=4)
        else:
            gen = torch.Generator().manual_seed(4)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "norm" not in n and "global_scale" not in n:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.state = model.state_dict()
        self.default = self.run(model)

    def build(self, **config_overrides):
        config = copy.deepcopy(self.config)
        for key, value in config_overrides.items():
            setattr(config, key, value)
        model = self.cls(config).eval()
        if hasattr(self, "state"):
            model.load_state_dict(self.state)
        return model

    def run(self, model):
        """(forward logits, greedy tokens) on the left-padded batch."""
        with torch.no_grad():
            logits = model(self.ids, attention_mask=self.mask).logits
            tokens = model.generate(self.ids, attention_mask=self.mask, max_new_tokens=3, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
        return logits, tokens


@pytest.fixture(scope="module", params=["qwen4_exp", "inkling"])
def family(request):
    return Family(request.param)


@pytest.fixture(scope="module")
def saved(family, tmp_path_factory):
    path = tmp_path_factory.mktemp(family.name)
    family.build().save_pretrained(path)
    return path


class Spies:
    """transformers' batched_mm and grouped_mm, and ours, wrapped in mocks where the experts modules look them
    up (the registry's global mapping), as transformers' own test patches them."""

    def __enter__(self):
        self.mocks = {"batched_mm": Mock(wraps=moe.batched_mm_experts_forward),
                      "grouped_mm": Mock(wraps=moe.grouped_mm_experts_forward),
                      experts_ops.OURS: Mock(wraps=prompt_experts.ours_experts_forward)}
        # (and in the registry's own mapping, which an earlier test's monkeypatch may have left filled)
        self._patches = [patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, self.mocks),
                         patch.dict(moe.ALL_EXPERTS_FUNCTIONS._local_mapping, self.mocks)]
        for p in self._patches:
            p.__enter__()
        return self

    def __exit__(self, *exc):
        for p in reversed(self._patches):
            p.__exit__(*exc)

    def called(self) -> set[str]:
        return {name for name, mock in self.mocks.items() if mock.called}

    def reset(self):
        for mock in self.mocks.values():
            mock.reset_mock()


def _choose(family, saved, way: str, name: str):
    if way == "set_experts_implementation":
        model = family.build()
        model.set_experts_implementation(name)
        return model
    if way == "config":
        return family.build(_experts_implementation=name)
    return family.cls.from_pretrained(saved, experts_implementation=name).eval()


def test_the_default_is_ours(family):
    model = family.build()
    assert model.config._experts_implementation == experts_ops.OURS
    assert model.get_experts_implementation()[""] == experts_ops.OURS
    with Spies() as spies:
        family.run(model)
    assert spies.called() == {experts_ops.OURS}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", NAMES)
def test_a_named_transformers_implementation_runs(family, saved, name, way):
    with Spies() as spies:
        model = _choose(family, saved, way, name)
        assert model.config._experts_implementation == name
        with torch.no_grad():
            logits = model(family.ids, attention_mask=family.mask).logits
        expected = set() if name == "eager" else {name}
        assert spies.called() == expected, "forward"
        spies.reset()
        with torch.no_grad():
            tokens = model.generate(family.ids, attention_mask=family.mask, max_new_tokens=3, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
        assert spies.called() == expected, "generate"
    real = family.mask.bool()
    torch.testing.assert_close(logits[real], family.default[0][real], rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, family.default[1])
    # Back to the default: ours again.
    model.set_experts_implementation(experts_ops.OURS)
    with Spies() as spies:
        family.run(model)
    assert spies.called() == {experts_ops.OURS}


def test_an_unknown_name_is_refused_as_transformers_refuses_it(family):
    errors = []
    for cls in (family.cls, family.upstream_cls):
        config = copy.deepcopy(family.config)
        config._experts_implementation = "no_such_experts"
        with pytest.raises(ValueError) as construction:
            cls(config)
        model = cls(copy.deepcopy(family.config))
        with pytest.raises(ValueError) as switch:
            model.set_experts_implementation("no_such_experts")
        errors.append((str(construction.value), str(switch.value)))
    assert errors[0] == errors[1]
    assert "no_such_experts" in errors[0][0] and experts_ops.OURS in errors[0][0]
