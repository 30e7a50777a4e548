"""The server's per-choice text and its book of requests in flight, without a server process: what a stream may
send of a choice while a stop string could still begin (`text.Choice`), and what `/reset` tells the requests it
cancels (`inflight.InFlight.cancel_all`)."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from hf_qsa_cache.server.inflight import InFlight, Result  # noqa: E402
from hf_qsa_cache.server.runs import kept_now  # noqa: E402
from hf_qsa_cache.server.text import Choice  # noqa: E402
from hf_qsa_cache.server.toy import toy_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer(128)


def streamed(tokenizer, text: str, stop: list[str], eos: int | None = None):
    """Feed ``text``'s tokens (then ``eos``) one news at a time, as a stream does: the ids each chunk reports
    (`kept_now`, after every update) and the text sent; then the ids and text a whole answer reports."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
    choice = Choice(0, tokenizer, stop, [1], max_tokens=len(ids))
    sent_ids, sent_text, reported = [], "", 0
    for k in range(1, len(ids) + 1):
        finished = k == len(ids)
        sent_text += choice.update(Result("r", ids[:k], [-0.5] * k, None, finished))
        end = kept_now(choice)
        assert end >= reported  # a stream never takes back what it reported
        sent_ids += choice.tokens[reported:end]
        reported = end
        text_of_ids = tokenizer.decode(sent_ids, skip_special_tokens=True)
        assert sent_text.startswith(text_of_ids), (sent_text, text_of_ids)  # no id ahead of its text
        if choice.done:
            break
    return sent_ids, sent_text, choice.tokens[: choice.kept()], choice.text


@pytest.mark.parametrize("text, stop", [
    ("hello world", ["o w"]),  # "o" is held back twice before the stop string is found
    ("abcabd", ["abd"]),  # a held-back start that turns out not to be one ("abc"), then the stop string
    ("say hi then", ["xyz", "hi t"]),
    ("no stop here", ["zz"]),
], ids=["found-after-held-back", "false-start-then-found", "second-of-two", "never-found"])
def test_a_stream_reports_a_token_only_with_its_text(tokenizer, text, stop):
    """A token whose text is held back (it may begin a stop string) is not reported while held: its id and
    log-probability go out with its text, or never (a stop string's tokens); the stream ends with the ids and
    text of the whole answer."""
    sent_ids, sent_text, whole_ids, whole_text = streamed(tokenizer, text, stop)
    assert sent_text == whole_text and sent_ids == whole_ids
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    assert whole_text == text[:cut]


def test_a_stream_ended_by_eos_reports_every_token(tokenizer):
    sent_ids, sent_text, whole_ids, _ = streamed(tokenizer, "ab ab", ["ab c"], eos=1)
    assert sent_text == "ab ab" and sent_ids == whole_ids and sent_ids[-1] == 1


def test_cancelling_every_request_gives_each_handler_a_last_failed_result():
    """`/reset` (and shutdown) cancel what is in flight; each request's client still waits on its handler, which
    gets a last result, failed, after the engine was told to cancel it (and never a result after that)."""
    book, events = InFlight(), []
    book.cancel = lambda request_id: events.append(("cancel", request_id, book.cancelled(request_id)))
    first = book.track(lambda result: events.append(("result", result.request_id, result.finished,
                                                     result.error, list(result.generated_tokens))))
    second = book.track(lambda result: events.append(("result", result.request_id, result.finished,
                                                      result.error, [])))
    book.deliver(first, [7, 8], [-1.0, -2.0], False, None)
    assert book.cancel_all() == 2
    assert [e[:3] for e in events[1:]] == [("cancel", first, True), ("result", first, True),
                                          ("cancel", second, True), ("result", second, True)]
    assert events[2][3].startswith("cancelled") and events[2][4] == [7, 8]  # the tokens it had so far
    assert not book.inflight and book.counts["cancelled"] == 2
    book.deliver(first, [9], [-1.0], True, None)  # news the engine sent before it saw the cancel: dropped
    assert len(events) == 5
