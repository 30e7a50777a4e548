"""Greedy and sampled decoding in our loop (`hf_qsa_cache.decode_loop`) against transformers' `_sample`, the
specification: the same sequences and the same cache afterwards (the next step's logits) on both families, for
a left-padded ragged batch and for one row, with no end-of-sequence id, ids that end some rows or all of them
(the flag read at once, or one step late with the extra step cropped), a logits processor, a user's stopping
criterion (called as often) and a streamer (the same calls, in the same order among the forwards); sampled
calls under the same seed, with the random generator left where `_sample` leaves it; when the loop reads the
host; the calls it leaves to transformers; a failed step."""

from __future__ import annotations

import functools

import pytest
import helpers.inkling as inkling
import torch
from helpers.qwen4 import left_pad, random_prompts
from test_lookup_decoding import Streamer
from test_speculative import _greedy, _ink_lookup_prompt, _qwen_prompt, ink, qwen  # noqa: F401 (fixtures)
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_qsa_cache import QSAPagedCache, decode_loop

NEW = 14


def _batch(family):
    if family == "qwen4_exp":
        return left_pad(random_prompts([22, 9, 15], seed=3))
    return inkling.left_pad(inkling.make_prompts([13, 5, 10], seed=4))  # two rows past the window of 6


def _run(monkeypatch, model, ids, mask, lean: bool, headroom: int | None = 0, n: int = NEW, seed: int | None = None,
         **kwargs):
    """generate() through our loop (``lean``) or transformers' `_sample` on a cache with ``headroom`` rollback
    tokens (None: the cache generate() builds), after ``torch.manual_seed(seed)`` if given: (output, whether our
    loop ran, the logits of one more step on the cache, the forwards "f" and our loop's reads "r" in order, the
    crops, the cache's headroom, a draw of the random generator after the call)."""
    ran, events, crops = [], [], []
    decode, read, crop = decode_loop.decode, decode_loop.LateFlag.read, QSAPagedCache.crop
    with monkeypatch.context() as m:
        m.setattr(type(model), "lean_decoding", lean)
        m.setattr(decode_loop, "decode", lambda *a, **k: ran.append(1) or decode(*a, **k))
        m.setattr(decode_loop.LateFlag, "read", lambda flag: events.append("r") or read(flag))
        m.setattr(QSAPagedCache, "crop", lambda cache, drop: crops.append(drop) or crop(cache, drop))
        if headroom is not None:
            kwargs["past_key_values"] = QSAPagedCache(model.config, ids.shape[0], ids.shape[1] + n + 1,
                                                      num_speculative_tokens=headroom)
        hook = model.register_forward_pre_hook(lambda *a: events.append("f"))
        if seed is not None:
            torch.manual_seed(seed)
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=n, return_dict_in_generate=True,
                                     **{"do_sample": False, "pad_token_id": 0, "eos_token_id": None, **kwargs})
        finally:
            hook.remove()
        after = torch.rand(1)
    cache = out.past_key_values
    width = out.sequences.shape[1]
    assert cache.get_seq_length() == width - 1
    full = torch.cat([mask, torch.ones(mask.shape[0], width - mask.shape[1], dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        step = model(out.sequences[:, -1:], attention_mask=full, past_key_values=cache)
    return (out.sequences, bool(ran), step.logits, "".join(events), [d for d in crops if d],
            cache.num_speculative_tokens, after)


class StopAt(StoppingCriteria):
    """Stops every row once the batch is ``length`` columns wide."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_decode_loop_through_our_loop_equals_transformers_loop(family, qwen, ink, monkeypatch):  # noqa: F811
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids, mask = _batch(family)
    width = ids.shape[1]
    plain = _run(monkeypatch, model, ids, mask, lean=False)[0][:, width:].tolist()
    # Each row's id a few steps in: every row ends (at its own id or an earlier one of another row's) before NEW.
    ends_all = [plain[r][2 + 3 * r] for r in range(3)]
    ends_first = plain[0][5]  # may end other rows too, or none
    ended = [min((i for i, t in enumerate(row) if t in ends_all), default=None) for row in plain]
    assert None not in ended and len(set(ended)) > 1, "the rows should end, at different steps"
    cases = [({}, 0), ({"eos_token_id": ends_all}, 0), ({"eos_token_id": ends_all}, 2),
             ({"eos_token_id": ends_first}, 1), ({"repetition_penalty": 1.5}, 0),
             ({"stopping_criteria": StoppingCriteriaList([StopAt(width + 6)])}, 1),
             ({"stopping_criteria": StoppingCriteriaList([StopAt(width + 6)])}, 0), ({}, 0, 1)]
    for extra, headroom, *n in cases:
        n = n[0] if n else NEW
        theirs = _run(monkeypatch, model, ids, mask, lean=False, headroom=headroom, n=n, **extra)
        ours = _run(monkeypatch, model, ids, mask, lean=True, headroom=headroom, n=n, **extra)
        assert ours[1] and not theirs[1]
        assert torch.equal(ours[0], theirs[0]), (extra, headroom)
        torch.testing.assert_close(ours[2], theirs[2], rtol=0, atol=0)
        forwards = theirs[3].count("f")
        stops_early = theirs[0].shape[1] < width + n
        if "eos_token_id" not in extra and "stopping_criteria" not in extra:
            assert ours[3] == "f" * forwards and not ours[4], extra  # nothing read before the call returns
        elif headroom:  # each flag read after the next step is queued; the step queued past the end cropped
            assert ours[3] == "f" + "fr" * (forwards - 1 + stops_early), (extra, ours[3])
            assert ours[4] == ([-1] if stops_early else []), extra
        else:  # each flag read before the next step
            assert ours[3] == "f" + "rf" * (forwards - 1) + "r" * stops_early, (extra, ours[3])
            assert not ours[4], extra
    sequences = _run(monkeypatch, model, ids, mask, lean=True, eos_token_id=ends_all)[0][:, width:]
    for row, end in zip(sequences.tolist(), ended):  # the pad from the step after a row's end
        assert row[end + 1:] == [0] * (len(row) - end - 1) and row[end] in ends_all


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_sampling_through_our_loop_equals_transformers_loop(family, qwen, ink, monkeypatch):  # noqa: F811
    """Sampled calls (temperature and top-k) under the same seed: the same sequences, the same cache afterwards
    and the random generator where `_sample` leaves it (the step queued past the end never draws), for a batch
    and one row, with no end-of-sequence id (nothing read), ids that end every row (read at once, a step late
    with a cache given headroom, and with the cache generate() builds: Inkling's has a token)."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids, mask = _batch(family)
    width = ids.shape[1]
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 20}
    plain = _run(monkeypatch, model, ids, mask, lean=False, seed=5, **sampling)[0][:, width:].tolist()
    greedy = _run(monkeypatch, model, ids, mask, lean=False)[0][:, width:].tolist()
    assert plain != greedy  # it does sample
    # Before its own end a row's tokens do not depend on the other rows' ends (one draw a step for all rows).
    ends_all = [plain[r][2 + 3 * r] for r in range(3)]
    ended = [min((i for i, t in enumerate(row) if t in ends_all), default=None) for row in plain]
    assert None not in ended and len(set(ended)) > 1, "the rows should end, at different steps"
    cases = [({}, 0, 3), ({"eos_token_id": ends_all}, 0, 3), ({"eos_token_id": ends_all}, 2, 3),
             ({"eos_token_id": ends_all}, None, 3), ({}, 0, 1)]
    for extra, headroom, rows in cases:
        label = (extra, headroom, rows)
        args = (monkeypatch, model, ids[:rows], mask[:rows])
        theirs = _run(*args, lean=False, headroom=headroom, seed=5, **sampling, **extra)
        ours = _run(*args, lean=True, headroom=headroom, seed=5, **sampling, **extra)
        assert ours[1] and not theirs[1], label
        assert torch.equal(ours[0], theirs[0]), label
        torch.testing.assert_close(ours[2], theirs[2], rtol=0, atol=0)
        assert torch.equal(ours[6], theirs[6]), label  # as many draws as `_sample`
        forwards = theirs[3].count("f")
        if not extra:
            assert ours[3] == "f" * forwards and not ours[4], label
        elif ours[5]:
            assert ours[3] == "f" + "fr" * forwards and ours[4] == [-1], label
        else:
            assert ours[3] == "f" + "rf" * (forwards - 1) + "r" and not ours[4], label
        if headroom is None:  # generate()'s own cache: a free token for Inkling, none for Qwen4Exp
            assert ours[5] == (family == "inkling"), label
        if rows == 3 and extra:  # each row as sampled without ids up to its end, then pads
            for r, (row, end) in enumerate(zip(ours[0][:, width:].tolist(), ended)):
                assert row[:end + 1] == plain[r][:end + 1] and row[end + 1:] == [0] * (len(row) - end - 1), label
    # Two sequences returned per prompt (rows expanded before the loop) and top-p: the same tokens.
    outs = []
    for lean in (True, False):
        ran = []
        with monkeypatch.context() as m:
            m.setattr(type(model), "lean_decoding", lean)
            decode = decode_loop.decode
            m.setattr(decode_loop, "decode", lambda *a, **k: ran.append(1) or decode(*a, **k))
            torch.manual_seed(7)
            with torch.no_grad():
                outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_p=0.9,
                                           num_return_sequences=2, pad_token_id=0, eos_token_id=ends_all))
        assert bool(ran) == lean
    assert outs[0].shape[0] == 6 and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_generate_gives_inkling_caches_a_token_of_headroom_for_late_reads(family, rows, qwen, ink,  # noqa: F811
                                                                           monkeypatch):
    """With an end-of-sequence id and the cache generate() builds: Inkling's gets one token of rollback headroom
    (free: its stores roll back by position), so each step's flag is read a step late and the step past the
    end cropped; Qwen4Exp's none (headroom would keep a copy of every recurrent state), read after each step.
    The tokens and the cache afterwards are `_sample`'s either way."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids, mask = _batch(family)
    width = ids.shape[1]
    plain = _run(monkeypatch, model, ids, mask, lean=False)[0][:, width:].tolist()
    ends_all = [plain[r][2 + 3 * r] for r in range(3)]  # row 0 ends at its third token
    ids, mask = ids[:rows], mask[:rows]
    theirs = _run(monkeypatch, model, ids, mask, lean=False, headroom=None, eos_token_id=ends_all)
    ours = _run(monkeypatch, model, ids, mask, lean=True, headroom=None, eos_token_id=ends_all)
    assert torch.equal(ours[0], theirs[0]) and ours[0].shape[1] < width + NEW
    torch.testing.assert_close(ours[2], theirs[2], rtol=0, atol=0)
    forwards = theirs[3].count("f")
    assert theirs[5] == 0
    if family == "inkling":
        assert ours[5] == 1 and ours[4] == [-1] and ours[3] == "f" + "fr" * forwards
    else:
        assert ours[5] == 0 and not ours[4] and ours[3] == "f" + "rf" * (forwards - 1) + "r"


def _run_one_row(monkeypatch, model, ids, n, lean: bool, stream: bool = True, **kwargs):
    """One row's greedy generate() through our loop (``lean``) or transformers' `_sample`: its output, the
    streamer's calls (``stream``), whether our loop ran, the logits of one more step on the cache, and the order
    of forwards ("f") and streamer calls ("p")."""
    ran, events = [], []

    class Watching(Streamer):
        def put(self, value):
            events.append("p")
            super().put(value)

    decode = decode_loop.decode
    with monkeypatch.context() as m:
        m.setattr(type(model), "lean_decoding", lean)
        m.setattr(decode_loop, "decode", lambda *a, **k: ran.append(1) or decode(*a, **k))
        streamer = Watching() if stream else None
        cache = QSAPagedCache(model.config, 1, ids.shape[1] + n + 1)  # room for one more step after the call
        hook = model.register_forward_pre_hook(lambda *a: events.append("f"))
        try:
            out = _greedy(model, ids, n, streamer=streamer, past_key_values=cache, **kwargs)
        finally:
            hook.remove()
    with torch.no_grad():
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        step = model(out.sequences[:, -1:], attention_mask=torch.ones_like(out.sequences), past_key_values=cache)
    return out, streamer, bool(ran), step.logits, "".join(events)


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_one_row_through_our_loop_equals_transformers_loop(family, qwen, ink, monkeypatch):  # noqa: F811
    """One row of greedy decoding: the tokens, the streamer's calls (each token as its step ends, before the next
    forward) and the cache after the call are `_sample`'s, with an end-of-sequence id, without one, a shorter
    length, a logits processor, another stopping criterion, with a streamer and without."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids = _qwen_prompt(seed=5) if family == "qwen4_exp" else _ink_lookup_prompt(model)
    plain = _greedy(model, ids, 20).sequences[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(plain) if i >= 8 and t not in plain[:i])
    stop_after = StoppingCriteriaList([StopAt(ids.shape[1] + 7)])
    cases = [(20, {}), (20, {"eos_token_id": eos}), (11, {}), (20, {"repetition_penalty": 1.5}),
             (20, {"stopping_criteria": stop_after}), (20, {"stream": False}),
             (20, {"stream": False, "eos_token_id": eos})]
    for n, extra in cases:
        theirs = _run_one_row(monkeypatch, model, ids, n, lean=False, **extra)
        ours = _run_one_row(monkeypatch, model, ids, n, lean=True, **extra)
        assert ours[2] and not theirs[2]
        assert torch.equal(ours[0].sequences, theirs[0].sequences), (n, extra)
        torch.testing.assert_close(ours[3], theirs[3], rtol=0, atol=0)
        assert ours[4] == theirs[4], (n, extra, ours[4], theirs[4])
        if extra.get("stream", True):
            assert ours[1].puts == theirs[1].puts and ours[1].ended == theirs[1].ended == 1, (n, extra)
        if "eos_token_id" in extra:
            assert ours[0].sequences[0, -1] == eos and ours[0].sequences.shape[1] < ids.shape[1] + n
        if "stopping_criteria" in extra:
            assert ours[0].sequences.shape[1] == ids.shape[1] + 7


class RecordingStop(StoppingCriteria):
    """Records the length of every ``input_ids`` it is called with; stops rows at ``stop_at`` tokens."""

    def __init__(self, stop_at: int):
        self.stop_at, self.seen = stop_at, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.shape[1])
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.stop_at, dtype=torch.bool)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("stops", [True, False])
@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_other_criteria_are_called_as_by_transformers_loop(family, stops, rows, qwen, ink, monkeypatch):  # noqa: F811
    """A user's stopping criterion is called once per token, the last one too, as by `_sample`: whether it
    stops the rows or the length limit does."""
    model = (qwen if family == "qwen4_exp" else ink)[0]
    ids, mask = _batch(family)
    ids, mask = ids[:rows], mask[:rows]
    seen = {}
    for lean in (False, True):
        criterion = RecordingStop(ids.shape[1] + (7 if stops else 100))
        _run(monkeypatch, model, ids, mask, lean=lean, n=12, stopping_criteria=StoppingCriteriaList([criterion]))
        seen[lean] = criterion.seen
    assert seen[True] == seen[False] == list(range(ids.shape[1] + 1, ids.shape[1] + (8 if stops else 13)))


def test_later_steps_build_their_inputs_in_our_loop(qwen, monkeypatch):  # noqa: F811
    """After the prefill and one step through transformers' input preparation, a text-only call's steps build
    their inputs themselves: the keys and values the preparation would build (a left-padded batch: positions
    by row)."""
    model = qwen[0]
    ids, mask = _batch("qwen4_exp")
    calls, checked = [], []
    prepare = type(model).prepare_inputs_for_generation
    lean = decode_loop.lean_inputs

    def compared(input_ids, step_length, kwargs):
        have = lean(input_ids, step_length, kwargs)
        want = prepare(model, input_ids, next_sequence_length=step_length, **kwargs)
        assert sorted(have) == sorted(want), (sorted(have), sorted(want))
        for key, value in want.items():
            assert torch.equal(have[key], value) if isinstance(value, torch.Tensor) else have[key] is value, key
        checked.append(1)
        return have

    monkeypatch.setattr(decode_loop, "lean_inputs", compared)

    @functools.wraps(prepare)  # generate() checks its kwargs against this signature
    def counted(self, *args, **kwargs):
        calls.append(1)
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "prepare_inputs_for_generation", counted)
    with torch.no_grad():
        lean = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        assert len(calls) == 2 and len(checked) == 6  # the prefill and the first step, then the lean steps
        # A kwarg the lean inputs would not carry: every step through transformers' preparation.
        calls.clear()
        monkeypatch.setattr(decode_loop, "LEAN_KEYS", decode_loop.LEAN_KEYS - {"position_ids"})
        prepared = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
        assert len(calls) == 8 and torch.equal(prepared, lean)


def test_calls_our_loop_leaves_to_transformers(qwen, monkeypatch):  # noqa: F811
    model = qwen[0]
    ids, mask = _batch("qwen4_exp")
    ran = []
    real = decode_loop.decode
    monkeypatch.setattr(decode_loop, "decode", lambda *a, **k: ran.append(1) or real(*a, **k))

    def generate(ids, mask, **kwargs):
        ran.clear()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, eos_token_id=None,
                                 **{"do_sample": False, **kwargs})
        assert (out if isinstance(out, torch.Tensor) else out.sequences).shape[1] == ids.shape[1] + 3
        return bool(ran)

    for rows in (3, 1):
        assert generate(ids[:rows], mask[:rows]) and generate(ids[:rows], mask[:rows], do_sample=True)
        assert generate(ids[:rows], mask[:rows], streamer=Streamer())
        assert not generate(ids[:rows], mask[:rows], num_beams=2)
        assert not generate(ids[:rows], mask[:rows], return_dict_in_generate=True, output_scores=True)
        assert generate(ids[:rows], mask[:rows], return_dict_in_generate=True)
    monkeypatch.setattr(type(model), "lean_decoding", False)
    assert not generate(ids, mask) and not generate(ids[:1], mask[:1])


@pytest.mark.parametrize("where", ["forward", "late_read", "late_crop"])
def test_a_failure_in_the_loop_leaves_a_cache_that_refuses_a_new_call(where, ink, monkeypatch):  # noqa: F811
    """A failure in the middle of the loop (a forward; the late read of a step's flag; the crop of the step that
    ran past the end) reaches the caller; the cache then holds tokens the caller never got, so the same call on
    it is refused with `reset()` named, and after `reset()` it gives the tokens of an unbroken call."""
    model = ink[0]
    ids, mask = _batch("inkling")
    width = ids.shape[1]
    plain = _run(monkeypatch, model, ids, mask, lean=False)[0][:, width:].tolist()
    ends_all = [plain[r][2 + 3 * r] for r in range(3)]  # every row ends before NEW: the late path crops once
    cache = QSAPagedCache(model.config, 3, width + NEW + 1, num_speculative_tokens=1)
    kwargs = dict(attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                  eos_token_id=ends_all)
    with torch.no_grad():
        unbroken = model.generate(ids, **kwargs)
        cache.reset()
        calls = []

        def fail_on(n):
            def fail(*args):
                calls.append(1)
                if len(calls) == n:
                    raise RuntimeError("injected")
            return fail

        with monkeypatch.context() as m:
            if where == "forward":
                hook = model.register_forward_pre_hook(fail_on(4))
            elif where == "late_read":
                read = decode_loop.LateFlag.read
                fail = fail_on(3)
                m.setattr(decode_loop.LateFlag, "read", lambda flag: fail() or read(flag))
            else:
                crop = QSAPagedCache.crop
                fail = fail_on(1)
                m.setattr(QSAPagedCache, "crop", lambda c, n: fail() or crop(c, n))
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    model.generate(ids, **kwargs)
            finally:
                if where == "forward":
                    hook.remove()
        assert cache.get_seq_length() > width
        with pytest.raises(ValueError, match=r"reset\(\)"):
            model.generate(ids, **kwargs)
        cache.reset()
        assert torch.equal(model.generate(ids, **kwargs), unbroken)


def test_our_loop_reads_the_host_once_and_makes_fewer_torch_calls(monkeypatch):
    """benchmarks/count_loop_calls.py on three rows, greedy and sampled: the same forwards, fewer computing torch
    calls per step outside them, and no host read in the loop where `_sample` reads after every step."""
    import os
    import sys

    from helpers.qwen4 import make_pair, tiny_config

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
    try:
        import count_loop_calls as script
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(script, "NEW_TOKENS", 6)
    # One layer of each kind: the loop's calls are outside the forwards, and the profiler's events inside them
    # (every layer's ops, parsed and then left out) were most of the time.
    model = make_pair(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"]))[1]
    ids = torch.tensor(random_prompts([12], seed=9)).repeat(3, 1)
    for settings in ({}, script.SAMPLED):
        theirs, forwards, their_calls = script.count(model, ids, False, **settings)
        ours, our_forwards, our_calls = script.count(model, ids, True, **settings)
        assert our_forwards == forwards == 6
        assert ours < theirs, (settings, ours, theirs, our_calls)
        reads = "host reads"
        assert their_calls[reads] >= 6 and our_calls[reads] <= their_calls[reads] - 5, (their_calls, our_calls)
