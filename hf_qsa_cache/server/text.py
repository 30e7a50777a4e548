"""One choice's text as its tokens arrive: incremental decoding, stop strings (found across token boundaries,
cut from the text, never sent even in part), finish reasons and log-probabilities."""

from __future__ import annotations


class TextDecoder:
    """Text of a growing token sequence, piece by piece (special tokens skipped)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=True)
        self._tokens: list[int] = []
        self._text = ""

    def step(self, token: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token) or ""
        self._tokens.append(token)  # a slow tokenizer: decode everything, send what is new and complete
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self._text):
            return ""
        piece, self._text = text[len(self._text):], text
        return piece


class Choice:
    """One choice of a request: feed it the engine's outputs with `update`; it gives back the text that may be
    sent now. ``finish_reason`` is set once it is done: ``stop`` (eos or a stop string), ``length``, or
    ``error`` (``error`` holds the engine's message)."""

    def __init__(self, index: int, tokenizer, stop: list[str], eos_ids, max_tokens: int):
        self.index = index
        self.decoder = TextDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.eos_ids = frozenset(eos_ids)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.pieces: list[str] = []  # each kept token's text (for log-probabilities and text offsets)
        self.text = ""  # all decoded text (stop strings included until one is found)
        self.sent = 0  # characters of ``text`` given out
        self._released = self._released_chars = 0  # tokens whose text is all given out, and that text's length
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.error: str | None = None
        self.request_id: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, output) -> str:
        """Take a `GenerationOutput` of this choice's request; return the text that is now safe to send."""
        if self.done:
            return ""
        new = output.generated_tokens[len(self.tokens):]
        new_logprobs = (output.logprobs or [])[len(self.tokens):]
        for k, token in enumerate(new):
            piece = self.decoder.step(token)
            self.tokens.append(int(token))
            if k < len(new_logprobs):
                self.logprobs.append(float(new_logprobs[k]))
            self.pieces.append(piece)
            before = len(self.text)
            self.text += piece
            cut = self._find_stop(before)
            if cut is not None:
                self.text = self.text[:cut]
                self.finish_reason, self.stopped_by_string = "stop", True
                return self._take(len(self.text))
        if output.error is not None:
            self.finish_reason, self.error = "error", str(output.error)
            return self._take(len(self.text))
        if output.is_finished():
            self.finish_reason = "stop" if self.tokens and self.tokens[-1] in self.eos_ids else "length"
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def _find_stop(self, before: int) -> int | None:
        if not self.stop:
            return None
        start = max(0, before - self.longest_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Characters at the end that could begin a stop string: not sent until the next tokens tell."""
        for n in range(min(self.longest_stop - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        return piece

    # ------------------------------------------------------------------ log-probabilities
    def released(self) -> int:
        """Tokens whose text has all been given out. While the choice runs, a token whose text is held back (it
        may begin a stop string) is not reported yet: its id and log-probability go out with its text, or never
        (a stop string's tokens)."""
        while self._released < len(self.pieces) and \
                self._released_chars + len(self.pieces[self._released]) <= self.sent:
            self._released_chars += len(self.pieces[self._released])
            self._released += 1
        return self._released

    def kept(self) -> int:
        """Tokens whose text is in the answer (a stop string's tokens are not)."""
        if not self.stopped_by_string:
            return len(self.tokens)
        length = 0
        for k, piece in enumerate(self.pieces):
            if length >= len(self.text):
                return k
            length += len(piece)
        return len(self.pieces)

