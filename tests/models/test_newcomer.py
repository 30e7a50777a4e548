"""What a new user trips on first, both families: errors that name what the user passed, no warning about
right padding (ours supports it), none about a throwaway cache the user never asked for, and a clear error for
an out-of-vocabulary id in a one-token step (which leaves the cache as it was).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from helpers.faults import host_state
from helpers.inkling import make_config as inkling_config
from helpers.inkling import make_pair as inkling_pair
from helpers.qwen4 import make_pair as qwen_pair

import hf_qsa_cache.generation as generation
from hf_qsa_cache import QSAPagedCache

FAMILIES = ["qwen4_exp", "inkling"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    ref, ours = qwen_pair(seed=2) if request.param == "qwen4_exp" else inkling_pair(inkling_config(), seed=2)
    return request.param, ref, ours


@pytest.mark.parametrize("asked, message", [
    (dict(max_new_tokens=20), r"row 0 needs 22 slots \(3 prompt tokens \+ max_new_tokens=20 - 1: the last new token "
                              r"is never fed back\), cache holds max_cache_len=10"),
    (dict(max_length=23), r"row 0 needs 22 slots \(3 prompt tokens \+ 19 new tokens up to max_length=23, the last "
                          r"one never fed back\), cache holds max_cache_len=10"),
], ids=["max_new_tokens", "max_length"])
def test_cache_too_small_names_what_the_user_passed(pair, asked, message):
    _, _, ours = pair
    cache = QSAPagedCache(ours.config, max_batch_size=1, max_cache_len=10)
    with pytest.raises(ValueError, match=message):
        ours.generate(torch.tensor([[3, 4, 5]]), past_key_values=cache, do_sample=False, **asked)
    assert cache.columns_seen == 0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_right_padded_generate_does_not_warn_for_our_classes_only(pair):
    _, ref, ours = pair
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    handler = _Records()
    logger = logging.getLogger("transformers.generation.utils")
    logger.addHandler(handler)
    try:
        with torch.no_grad():
            out = ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
            ours_messages = list(handler.messages)
            ref.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        logger.removeHandler(handler)
    assert not [m for m in ours_messages if "right-padding was detected" in m]
    # transformers' own model still gets its warning (the filter is scoped to our generate())
    assert [m for m in handler.messages[len(ours_messages):] if "right-padding was detected" in m]
    # and the right-padded row continued from its real length (what makes the warning moot for ours)
    with torch.no_grad():
        alone = ours.generate(ids[1:, :2], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out[1, 4:].tolist() == alone[0, 2:].tolist()


def _checkpointed_loss(model, **kwargs):
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    model.train()
    model.activation_checkpointing_enable()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(ids, labels=ids, **kwargs)
            out.loss.backward()
        assert out.past_key_values is None  # the forward ran on a throwaway cache, as transformers' drops it
    finally:
        model.activation_checkpointing_disable()
        model.eval()
        model.zero_grad(set_to_none=True)
    return [str(w.message) for w in caught if "throwaway cache" in str(w.message)]


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_activation_checkpointing_warns_of_the_throwaway_cache_only_when_asked_for_one(family, monkeypatch):
    _, ours = qwen_pair(seed=2) if family == "qwen4_exp" else inkling_pair(inkling_config(), seed=2)
    monkeypatch.setattr(generation, "_warned_checkpointing", [])
    assert _checkpointed_loss(ours) == []  # no cache, no use_cache: nothing was thrown away
    assert len(_checkpointed_loss(ours, use_cache=True)) == 1
    monkeypatch.setattr(generation, "_warned_checkpointing", [])
    cache = QSAPagedCache(ours.config, max_batch_size=1, max_cache_len=16)
    assert len(_checkpointed_loss(ours, past_key_values=cache)) == 1
    assert cache.columns_seen == 0  # the passed cache was indeed not used


@pytest.mark.parametrize("bad", ["vocab_size", "-1"])
def test_out_of_vocabulary_id_in_a_one_token_step_is_a_value_error_and_changes_nothing(pair, bad):
    _, _, ours = pair
    vocab = ours.config.vocab_size
    token = vocab if bad == "vocab_size" else -1
    prompt = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    cache = QSAPagedCache(ours.config, max_batch_size=2, max_cache_len=16)
    with torch.no_grad():
        ours(prompt, past_key_values=cache)
        before = host_state(cache)
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\) \(vocab_size\), got {token}"):
            ours(torch.tensor([[13], [token]]), past_key_values=cache)
        assert host_state(cache) == before
        # the cache goes on as if the bad step never ran
        got = ours(torch.tensor([[13], [14]]), past_key_values=cache).logits[:, -1]
        expected = ours(torch.cat([prompt, torch.tensor([[13], [14]])], 1)).logits[:, -1]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=rf"\[0, {vocab}\) \(vocab_size\), got {token}"):
            ours(torch.tensor([[token]]))  # a bare one-token forward too
