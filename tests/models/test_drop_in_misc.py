"""Drop-in details beside the forward itself, each against transformers' own class with the same weights:

* ``return_dict=False`` gives the output's ``to_tuple()`` (text models and causal LMs, eager and decode-graph
  paths), after our padding reorder: a right-padded step's tuple holds the caller's columns;
* a base-model checkpoint loads into the causal LM without its head when the config ties it, and a
  missing untied head is refused (transformers reports it missing and initialises it randomly);
* tensor- and pipeline-parallel plans equal transformers'.
"""

from __future__ import annotations

import pytest
import helpers.qwen4 as qh
import helpers.inkling as ih
import torch
import transformers

import modeling
from hf_qsa_cache import QSAPagedCache
from modeling import modeling_inkling, modeling_qwen4_exp

FAMILIES = ["qwen4_exp", "inkling"]


@pytest.fixture(scope="module")
def pairs():
    return {"qwen4_exp": qh.make_pair(seed=2), "inkling": ih.make_pair(ih.make_config(), seed=3)}


def _batch(family, right_padded=False):
    if family == "qwen4_exp":
        ids, mask = qh.left_pad(qh.random_prompts([24, 9, 17], seed=4))
    else:
        ids, mask = ih.left_pad(ih.make_prompts([11, 4, 8], seed=5))
    if right_padded:  # pads after the real tokens: the models reorder the step and put outputs back
        ids, mask = ids.flip(1), mask.flip(1)
    return ids, mask


def _assert_tuple_is_dict(got, expected):
    """``got`` (a tuple) holds ``expected.to_tuple()``'s values (a cache compares by type: each call has its own)."""
    want = expected.to_tuple()
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, QSAPagedCache):
            assert isinstance(g, QSAPagedCache)
        elif isinstance(w, tuple):
            assert len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w))
        else:
            assert torch.equal(g, w)


# ----------------------------------------------------------------------------- return_dict=False
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("right_padded", [False, True])
@pytest.mark.parametrize("part", ["causal_lm", "text_model"])
def test_return_dict_false_gives_the_outputs_tuple(pairs, family, right_padded, part):
    ref, ours = pairs[family]
    model = ours if part == "causal_lm" else ours.model
    ids, mask = _batch(family, right_padded)
    kwargs = dict(attention_mask=mask, output_hidden_states=True)
    if part == "causal_lm":
        kwargs["labels"] = ids
    with torch.no_grad():
        as_dict = model(ids, **kwargs)
        as_tuple = model(ids, return_dict=False, **kwargs)
    assert not isinstance(as_dict, tuple)
    _assert_tuple_is_dict(as_tuple, as_dict)
    if right_padded:
        return
    # transformers' own class gives the same tuple (one unpadded row: upstream does not promise padded rows
    # exact; no cache, as upstream Inkling returns none and the cache types differ).
    upstream = ref if part == "causal_lm" else ref.model
    row = mask[0].bool()
    single = dict(kwargs, attention_mask=None, use_cache=False)
    if part == "causal_lm":
        single["labels"] = ids[:1, row]
    with torch.no_grad():
        theirs = upstream(ids[:1, row], return_dict=False, **single)
        mine = model(ids[:1, row], return_dict=False, **single)
    assert isinstance(theirs, tuple) and len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        for x, y in zip(*((a, b) if isinstance(a, tuple) else ((a,), (b,)))):  # hidden states: one per layer
            # fp32 rounding grows with the magnitudes summed, not with the element: a layer whose states reach
            # hundreds differs by ~1e-4 anywhere in it, however small the element, on some CPUs' BLAS.
            torch.testing.assert_close(x, y, atol=1e-4 + 2e-6 * y.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_return_dict_false_on_the_decode_graph_path(pairs, family, monkeypatch):
    """The causal LMs' decode-graph branch (CUDA only) returns a tuple too: a stand-in runner takes its place."""
    _, model = pairs[family]
    logits = torch.randn(3, 1, model.config.vocab_size)

    class Runner:
        def step(self, input_ids, position_ids, attention_mask):
            return logits

    module = modeling_qwen4_exp if family == "qwen4_exp" else modeling_inkling
    monkeypatch.setattr(module, "decode_graphs_for", lambda *args, **kwargs: Runner())
    cache = QSAPagedCache(model.config, 3, 8)
    ids = torch.ones(3, 1, dtype=torch.long)
    as_dict = model(ids, past_key_values=cache)
    as_tuple = model(ids, past_key_values=cache, return_dict=False)
    assert torch.equal(as_dict.logits, logits)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
    assert torch.equal(as_tuple[0], logits) and as_tuple[1] is cache


# ----------------------------------------------------------------------------- base checkpoints, tied heads
def _base_model(cls, config, seed):
    model = cls(config).eval()
    qh.randomize_(model, seed)
    return model


@pytest.mark.parametrize("source", ["ours", "transformers"])
@pytest.mark.parametrize("tied", [True, False])
def test_qwen4_base_checkpoint_loads_into_the_causal_lm_when_tied(tmp_path, source, tied):
    config = qh.tiny_config(tie_word_embeddings=tied)
    cls = modeling.Qwen4ExpTextModel if source == "ours" else transformers.Qwen4ExpTextModel
    _base_model(cls, config, seed=6).save_pretrained(tmp_path)
    theirs, info = transformers.Qwen4ExpForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    if not tied:
        # The head is missing: initialised and reported, by ours as by transformers.
        _, our_info = modeling.Qwen4ExpForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
        assert our_info["missing_keys"] == {"lm_head.weight"}
        assert our_info == info
        return
    assert not any(info.values())
    ours, info = modeling.Qwen4ExpForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values())
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    mine = ours.state_dict()
    assert mine.keys() == theirs.state_dict().keys()
    assert all(torch.equal(mine[k], v) for k, v in theirs.state_dict().items())
    ids = torch.tensor([qh.random_prompts([12], seed=7)[0]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("source", ["ours", "transformers"])
def test_inkling_base_checkpoint_lacks_its_untied_head(tmp_path, source):
    """Inkling never ties its head (no tie_word_embeddings, no tied keys, as upstream): a base checkpoint
    lacks it, and ours reports it missing (and initialises it) as transformers does."""
    config = ih.make_config()
    assert modeling.InklingForCausalLM._tied_weights_keys == transformers.InklingForCausalLM._tied_weights_keys == {}
    assert not getattr(config, "tie_word_embeddings", False)
    cls = modeling_inkling.InklingTextModel if source == "ours" else transformers.InklingTextModel
    _base_model(cls, config, seed=8).save_pretrained(tmp_path)
    _, their_info = transformers.InklingForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    _, info = modeling.InklingForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}
    assert info == their_info


# ----------------------------------------------------------------------------- parallel plans
@pytest.mark.parametrize("ours_cls, config", [
    (modeling.Qwen4ExpForCausalLM, qh.tiny_config),
    (modeling.Qwen4ExpTextModel, qh.tiny_config),
    (modeling.InklingForCausalLM, ih.make_config),
    (modeling_inkling.InklingTextModel, ih.make_config),
])
def test_parallel_plans_equal_transformers(ours_cls, config):
    upstream_cls = getattr(transformers, ours_cls.__name__)
    assert ours_cls._tp_plan == upstream_cls._tp_plan and ours_cls._pp_plan == upstream_cls._pp_plan
    config = config()
    ours, theirs = ours_cls(config), upstream_cls(config)
    expected = dict(theirs.tp_plan)
    if "Inkling" in ours_cls.__name__:
        # Except where transformers' Inkling plan fails (modeling_inkling.TP_PLAN_FIXES; tests/test_tensor_parallel.py)
        prefix = "model." if hasattr(ours, "lm_head") else ""
        expected.pop(prefix + "layers.*.mlp.shared_experts", None)
        expected.update({prefix + k: v for k, v in modeling_inkling.TP_PLAN_FIXES.items()})
    assert ours.tp_plan == expected and ours.pp_plan == theirs.pp_plan
    assert ours.tp_plan  # not trivially equal
    if ours_cls is modeling.Qwen4ExpForCausalLM:
        assert ours.tp_plan["lm_head"] == "colwise_gather_output"
        assert ours.pp_plan == {"lm_head": (["hidden_states"], ["logits"])}
    if not hasattr(ours, "lm_head") and "Inkling" not in ours_cls.__name__:  # a base model's plan: its config's
        assert config.base_model_tp_plan.items() <= ours.tp_plan.items()
