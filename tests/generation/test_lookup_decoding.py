"""Greedy prompt lookup's own loop (`hf_qsa_cache.lookup_decoding`) against transformers' assisted-decoding loop,
the specification: the same sequences, the same cache afterwards (the next step's logits), the same streamer
calls and the same rounds of the candidate generator, on both families, with drafts accepted and rejected,
an end-of-sequence id, a shorter length, a logits processor and a user's stopping criterion; a round's
verdict (max_length or an end-of-sequence id inside the round) on its own; and the calls it leaves to
transformers' loop."""

from __future__ import annotations

import pytest
import torch
import helpers.inkling as inkling
from helpers.qwen4 import random_prompts
from test_speculative import K, _greedy, _ink_lookup_prompt, _qwen_prompt, ink, qwen  # noqa: F401 (fixtures)
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, SuppressTokensLogitsProcessor

from hf_qsa_cache import QSAPagedCache, lookup_decoding
from hf_qsa_cache.speculative import DraftBudget


class Streamer:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


def _rounds(monkeypatch, model):
    """The (drafts proposed, drafts accepted) of each round, from the candidate generator generate() builds."""
    rounds = []
    build = type(model)._get_candidate_generator

    def logged(self, *args, **kwargs):
        generator = build(self, *args, **kwargs)
        get, update = generator.get_candidates, generator.update_candidate_strategy

        def get_candidates(input_ids, *a, **kw):
            candidates, logits = get(input_ids, *a, **kw)
            rounds.append([candidates.shape[1] - input_ids.shape[1], None])
            return candidates, logits

        def update_candidate_strategy(input_ids, scores, num_matches):
            rounds[-1][1] = int(num_matches)
            return update(input_ids, scores, num_matches)

        generator.get_candidates, generator.update_candidate_strategy = get_candidates, update_candidate_strategy
        return generator

    monkeypatch.setattr(type(model), "_get_candidate_generator", logged)
    return rounds


def _run(monkeypatch, model, ids, n, lean: bool, **kwargs):
    """generate() with prompt lookup through our loop (``lean``) or transformers' one; its output, the
    streamer's calls, the rounds, whether our loop ran, and the logits of one more step on the cache."""
    ran = []
    decode = lookup_decoding.decode_with_prompt_lookup
    with monkeypatch.context() as m:
        if not lean:
            m.setattr(lookup_decoding, "applies", lambda *a, **k: False)
        m.setattr(lookup_decoding, "decode_with_prompt_lookup", lambda *a, **k: ran.append(1) or decode(*a, **k))
        rounds = _rounds(m, model)
        streamer = Streamer()
        out = _greedy(model, ids, n, prompt_lookup_num_tokens=K, streamer=streamer, **kwargs)
    cache = out.past_key_values
    with torch.no_grad():
        # generate() never feeds its last token: the cache holds all but that one.
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        step = model(out.sequences[:, -1:], attention_mask=torch.ones_like(out.sequences), past_key_values=cache)
    return out, streamer, rounds, bool(ran), step.logits


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_our_loop_equals_transformers_loop(family, qwen, ink, monkeypatch):  # noqa: F811
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids = _qwen_prompt(seed=5) if family == "qwen4_exp" else _ink_lookup_prompt(model)
    plain = _greedy(model, ids, 20).sequences[0, ids.shape[1]:].tolist()
    # An end-of-sequence id first generated well inside the continuation; and a length that ends mid-round.
    eos = next(t for i, t in enumerate(plain) if i >= 8 and t not in plain[:i])
    for n, extra in ((20, {}), (20, {"eos_token_id": eos}), (11, {})):
        theirs = _run(monkeypatch, model, ids, n, lean=False, **extra)
        ours = _run(monkeypatch, model, ids, n, lean=True, **extra)
        assert ours[3] and not theirs[3]
        assert torch.equal(ours[0].sequences, theirs[0].sequences), (n, extra)
        assert ours[1].puts == theirs[1].puts and ours[1].ended == theirs[1].ended == 1
        assert ours[2] == theirs[2]
        torch.testing.assert_close(ours[4], theirs[4], rtol=0, atol=0)
        if not extra and n == 20:  # drafts accepted and rejected
            assert any(a for _, a in ours[2]) and any(p and not a for p, a in ours[2]), ours[2]
        if "eos_token_id" in extra:
            assert ours[0].sequences[0, -1] == eos and ours[0].sequences.shape[1] < ids.shape[1] + n


def test_logits_processors_apply_per_verified_position(qwen, monkeypatch):  # noqa: F811
    model = qwen[0]
    ids = _qwen_prompt(seed=5)
    plain = _greedy(model, ids, 12).sequences[0, ids.shape[1]:].tolist()
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor(plain[3:5], device="cpu")])
    theirs = _run(monkeypatch, model, ids, 12, lean=False, logits_processor=processors)
    ours = _run(monkeypatch, model, ids, 12, lean=True, logits_processor=processors)
    assert ours[3]
    assert torch.equal(ours[0].sequences, theirs[0].sequences) and ours[2] == theirs[2]
    assert not set(plain[3:5]) & set(ours[0].sequences[0, ids.shape[1]:].tolist())  # the processor acted


class StopAtToken(StoppingCriteria):
    """Stops a row once its last token is ``token`` (on the device, as a user's criterion would)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_other_stopping_criteria_run_after_every_round_in_our_loop(family, qwen, ink, monkeypatch):  # noqa: F811
    """A stopping criterion of the user's runs in our loop after every round, as in transformers' loop (the
    same output, cache and rounds), for every token of the continuation as the stopping one."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids = _qwen_prompt(seed=5) if family == "qwen4_exp" else _ink_lookup_prompt(model)
    plain = _greedy(model, ids, 14).sequences[0, ids.shape[1]:].tolist()
    early = 0
    for i, token in enumerate(plain):
        if token in plain[:i]:
            continue
        stop = StoppingCriteriaList([StopAtToken(token)])
        theirs = _run(monkeypatch, model, ids, 14, lean=False, stopping_criteria=stop)
        ours = _run(monkeypatch, model, ids, 14, lean=True, stopping_criteria=stop)
        assert ours[3]
        assert torch.equal(ours[0].sequences, theirs[0].sequences)
        assert ours[1].puts == theirs[1].puts and ours[2] == theirs[2]
        torch.testing.assert_close(ours[4], theirs[4], rtol=0, atol=0)
        # (the criterion sees a round's last token: one inside a round of accepted drafts does not stop it)
        early += ours[0].sequences.shape[1] < ids.shape[1] + 14
    assert early, "the criterion never stopped a row"


@pytest.mark.parametrize("case", ["scores", "fixed draft count"])
def test_calls_it_cannot_serve_go_to_transformers_loop(case, qwen, monkeypatch):  # noqa: F811
    model = qwen[0]
    ids = _qwen_prompt(seed=5)
    kwargs = {"scores": {"output_scores": True}, "fixed draft count": {}}[case]
    if case == "fixed draft count":
        monkeypatch.setattr(model, "adaptive_prompt_lookup", False)
    lean = _run(monkeypatch, model, ids, 8, lean=True, **kwargs)
    assert not lean[3]
    assert torch.equal(lean[0].sequences, _greedy(model, ids, 8).sequences)


def test_verdict_keeps_the_accepted_drafts_and_one_more_within_room_and_eos():
    verdict = lookup_decoding.verdict
    assert verdict([5, 6, 7], [5, 6, 7, 8], room=9, eos=set()) == [5, 6, 7, 8]  # all accepted, bonus token
    assert verdict([5, 6, 7], [5, 9, 1, 2], room=9, eos=set()) == [5, 9]  # first disagreement is the last
    assert verdict([], [4], room=9, eos=set()) == [4]  # no drafts: a plain step
    assert verdict([5, 6, 7], [5, 6, 7, 8], room=2, eos=set()) == [5, 6]  # max_length inside the round
    assert verdict([5, 6, 7], [5, 6, 7, 8], room=9, eos={6}) == [5, 6]  # an accepted draft ends the row
    assert verdict([5, 6], [5, 3, 6], room=9, eos={3}) == [5, 3]  # the correction ends it


def test_our_loop_makes_fewer_torch_calls_between_forwards(monkeypatch):
    """benchmarks/count_loop_calls.py: the same forwards, fewer computing torch calls per token outside them
    than transformers' loop (each a kernel launch on a GPU), no more than transformers' plain greedy decoding;
    and plain greedy decoding through our loop fewer than through transformers' `_sample`."""
    import os
    import sys

    from helpers.qwen4 import make_pair, tiny_config

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
    try:
        import count_loop_calls as script
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(script, "NEW_TOKENS", 12)
    # One layer of each kind: the loop's calls are outside the forwards, and the profiler's events inside them
    # (every layer's ops, parsed and then left out) were most of the time.
    model = make_pair(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"]))[1]
    ids = _qwen_prompt(seed=7)
    plain, plain_forwards, _ = script.count(model, ids, False)
    our_plain, our_plain_forwards, _ = script.count(model, ids, True)
    theirs, forwards, _ = script.count(model, ids, False, prompt_lookup_num_tokens=K)
    ours, our_forwards, calls = script.count(model, ids, True, prompt_lookup_num_tokens=K)
    assert our_forwards == forwards and our_plain_forwards == plain_forwards
    assert ours < theirs and ours <= plain, (ours, theirs, plain, calls)
    assert our_plain < plain, (our_plain, plain)


@pytest.mark.parametrize("pauses", ["adaptive", "endless"])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_an_end_of_sequence_id_read_late_is_taken_back(family, pauses, qwen, ink, monkeypatch):  # noqa: F811
    """Paused rounds leave their picks unread for up to num_speculative_tokens steps past a possible
    end-of-sequence id: one among them is found late, the steps after it are cropped and the result is
    transformers' loop's. Every token of a continuation the model does not draft right is tried as the
    end-of-sequence id: some fall inside a pause, late. With pauses that never end, reads come only from
    the headroom, and the first token ends a longest unread run (the deepest crop)."""
    if pauses == "endless":
        init = DraftBudget.__init__

        def paused_for_good(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.paused = 10 ** 9

        monkeypatch.setattr(DraftBudget, "__init__", paused_for_good)
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids = (torch.tensor([random_prompts([12], seed=11)[0]]) if family == "qwen4_exp"
           else inkling.make_prompts([12], seed=11)[0][None])
    plain = _greedy(model, ids, 16).sequences[0, ids.shape[1]:].tolist()
    crops = []
    real_crop = QSAPagedCache.crop
    monkeypatch.setattr(QSAPagedCache, "crop", lambda cache, n: crops.append(n) or real_crop(cache, n))
    late = 0
    for i, eos in enumerate(plain):
        if eos in plain[:i]:
            continue
        crops.clear()
        theirs = _run(monkeypatch, model, ids, 16, lean=False, eos_token_id=eos)
        their_crops = [n for n in crops if n]
        crops.clear()
        ours = _run(monkeypatch, model, ids, 16, lean=True, eos_token_id=eos)
        assert torch.equal(ours[0].sequences, theirs[0].sequences), eos
        assert ours[1].puts == theirs[1].puts
        torch.testing.assert_close(ours[4], theirs[4], rtol=0, atol=0)
        assert ours[2][:len(theirs[2])] == theirs[2] and all(r == [0, 0] for r in ours[2][len(theirs[2]):])
        late += len([n for n in crops if n]) > len(their_crops)
    assert late, "no end-of-sequence id was read late"


@pytest.mark.parametrize("where", ["between_verify_and_crop", "reading_paused_picks"])
def test_a_failed_round_leaves_a_cache_that_refuses_a_new_call_naming_reset(where, qwen, monkeypatch):  # noqa: F811
    """generate() through our loop fails after a verify forward, before its crop (the rejected drafts are still
    held), or while it reads a run of paused picks (steps the caller never sees): the error reaches the caller,
    the cache holds more than the prompt, the same call on it again is refused with `reset()` named (nothing
    silently continues tokens the caller never got), and after `reset()` it gives plain greedy's tokens."""
    model = qwen[0]
    ids = _qwen_prompt(seed=5)
    plain = _greedy(model, ids, 20).sequences
    kwargs = {"prompt_lookup_num_tokens": K}
    if where == "between_verify_and_crop":
        real = lookup_decoding.verdict

        def failing_verdict(drafts, picks, room, eos):
            if drafts and drafts[0] != picks[0]:  # a round whose first draft is rejected: its drafts are held
                raise RuntimeError("injected fault before the crop")
            return real(drafts, picks, room, eos)

        monkeypatch.setattr(lookup_decoding, "verdict", failing_verdict)
    else:
        init = DraftBudget.__init__

        def paused_for_good(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.paused = 10 ** 9

        class FailingStreamer(Streamer):
            def put(self, value):
                if len(self.puts) == 1:  # the prompt first, then the first read of paused picks
                    raise RuntimeError("injected fault while reading paused picks")
                super().put(value)

        monkeypatch.setattr(DraftBudget, "__init__", paused_for_good)
        kwargs.update(streamer=FailingStreamer(), eos_token_id=int(plain[0, -1]))  # an id: reads every K + 1 steps
    cache = QSAPagedCache(model.config, 1, ids.shape[1] + 40, num_speculative_tokens=K)
    with pytest.raises(RuntimeError, match="injected fault"):
        _greedy(model, ids, 20, past_key_values=cache, **kwargs)
    assert cache.get_seq_length() > ids.shape[1]
    with pytest.raises(ValueError, match=r"reset\(\)"):
        _greedy(model, ids, 20, past_key_values=cache, **kwargs)
    monkeypatch.undo()
    cache.reset()
    out = _greedy(model, ids, 20, past_key_values=cache, prompt_lookup_num_tokens=K)
    assert torch.equal(out.sequences, plain)


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_a_call_continuing_on_its_cache_feeds_only_the_new_ids(family, lookup, qwen, ink, monkeypatch):  # noqa: F811
    """A conversation continued on its cache passes the whole sequence again (the attention mask as long as the
    ids): our loop's first round feeds only the ids the cache does not hold, as transformers' `_prefill` does,
    and the row goes on exactly as one uninterrupted call (the cache then holds each token once). Before this,
    the first round fed the cached prompt again."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids = _qwen_prompt(seed=5) if family == "qwen4_exp" else _ink_lookup_prompt(model)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    extra = {"prompt_lookup_num_tokens": K} if lookup else {}
    fed, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: fed.append(k["input_ids"].shape[1]) or forward(*a, **k))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=9, **kwargs)
        cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=ids.shape[1] + 32,
                              num_speculative_tokens=K + 1)
        first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, **kwargs)
        fed.clear()
        more = torch.cat([mask, torch.ones_like(first[:, ids.shape[1]:])], dim=1)
        have = model.generate(first, attention_mask=more, past_key_values=cache, max_new_tokens=5, **kwargs, **extra)
    assert fed[0] == 1 + (K if lookup and fed[0] > 1 else 0) and max(fed) <= K + 1, fed
    assert torch.equal(have, want)
    assert cache.get_seq_length() == want.shape[1] - 1


def test_a_call_continuing_on_its_cache_with_embeddings_feeds_only_the_new_position(qwen, monkeypatch):  # noqa: F811
    """The same with the sequence passed as embeddings too (they always hold the whole sequence)."""
    model = qwen[0]
    ids = _qwen_prompt(seed=5)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    fed, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: fed.append(
        (k["inputs_embeds"] if k.get("inputs_embeds") is not None else k["input_ids"]).shape[1]) or forward(*a, **k))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)
        cache = QSAPagedCache(model.config, max_batch_size=1, max_cache_len=ids.shape[1] + 16)
        first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, **kwargs)
        fed.clear()
        have = model.generate(first, inputs_embeds=model.get_input_embeddings()(first),
                              attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1),
                              past_key_values=cache, max_new_tokens=5, **kwargs)
    assert fed == [1] * 5 and torch.equal(have[:, -6:], want[:, -6:])


def test_rounds_after_the_first_build_what_transformers_preparation_builds(qwen, monkeypatch):  # noqa: F811
    """Rounds after the first skip ``prepare_inputs_for_generation`` (`lean_inputs`): each builds the same keys
    and values it would, and the first round still goes through it. (Plain decoding: `tests/test_decode_loop.py`.)"""
    model = qwen[0]
    ids = _qwen_prompt(seed=5)
    prepare, lean, rounds = type(model).prepare_inputs_for_generation, lookup_decoding.lean_inputs, []

    def checked(candidates, step_length, kwargs):
        have = lean(candidates, step_length, kwargs)
        want = prepare(model, candidates, next_sequence_length=step_length, is_first_iteration=False, **kwargs)
        assert sorted(have) == sorted(want), (sorted(have), sorted(want))
        for key, value in want.items():
            assert torch.equal(have[key], value) if isinstance(value, torch.Tensor) else have[key] is value, key
        rounds.append(step_length)
        return have

    monkeypatch.setattr(lookup_decoding, "lean_inputs", checked)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=0, eos_token_id=None, prompt_lookup_num_tokens=K)
    assert rounds and out.shape[1] == ids.shape[1] + 12
