"""One request's life in the continuous-batching engine: host state, plus the media tensors a multimodal
prompt carries (encoded by the runner when the request first runs)."""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import numpy as np

from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from ..prompt_lookup import lookup_drafts
from .sampling import Sampling


# (module constants: an enum member looked up on its class costs more than the rest of `done`, asked per row per step)
_DONE = (RequestStatus.FINISHED, RequestStatus.FAILED)
_DECODING = RequestStatus.DECODING


def _is_int(value) -> bool:
    # Plain ints first: a prompt's every token passes here, and the abstract-class check costs ten times more.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_max_new_tokens(value, name: str = "max_new_tokens") -> int | None:
    """``value`` as an int (None stays None: no bound but eos and the row's room); a `ValueError` naming
    ``name`` and the value unless it is an integer >= 1."""
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_prompt(input_ids, vocab_size: int, name: str = "input_ids") -> list[int]:
    """A request's prompt as a list of ints; a `ValueError` naming ``name`` and the value unless it is a
    non-empty sequence of integer token ids in ``[0, vocab_size)``."""
    if hasattr(input_ids, "tolist"):  # a tensor or an array
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids, got {input_ids!r}")
    prompt = list(input_ids)
    if not prompt:
        raise ValueError(f"a request needs at least one prompt token, got an empty {name}")
    # Plain ints in range, the usual case, checked in C loops (an 8,192-token prompt in under half the time token by
    # token takes); anything else goes token by token, which names the first bad one.
    if set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < vocab_size:
        return prompt
    for token in prompt:
        if not _is_int(token):
            raise ValueError(f"{name} must hold integer token ids, got {token!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}) (vocab_size), got {token} in {name}")
    return [int(t) for t in prompt]


# Media inputs of the multimodal models: refused (not ignored) by a text-only model.
MEDIA_NAMES = {"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids",
               "mm_encoder_outputs", "audio_input_ids", "audio_input_ids_mask"}


def check_media(kwargs: dict, accepted, model_name: str) -> dict | None:
    """The media among a request's keyword arguments (the names in ``accepted``, the model's `media_inputs`; None
    values dropped), or None: a `ValueError` for media a text-only model (``model_name``) cannot take, a
    `TypeError` for any other name. ``kwargs`` is not changed."""
    media = {name: value for name, value in kwargs.items() if name in accepted and value is not None} or None
    rest = sorted(name for name in kwargs if name not in accepted)
    named_media = [name for name in rest if name in MEDIA_NAMES]
    if named_media:
        raise ValueError(f"{model_name} takes no media ({named_media} given): load the model's "
                         f"ConditionalGeneration class for images, video or audio")
    if rest:
        raise TypeError(f"add_request got unexpected keyword arguments {rest}")
    return media


def check_options(sampling, seed, logprobs) -> None:
    """A request's own sampling parameters (None or a `Sampling`), seed (None or an integer >= 0) and
    log-probabilities switch: a `ValueError` naming the bad one."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a hf_qsa_cache.serving.Sampling, got {sampling!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if not isinstance(logprobs, bool):
        raise ValueError(f"logprobs must be True or False, got {logprobs!r}")


def copy_ids(request_id: str, copies: int) -> list[str]:
    """The ids of a request with ``copies`` return sequences: its copies ``{id}__child#{i}``, then itself (transformers'
    names and order)."""
    return [f"{request_id}__child#{i}" for i in range(copies - 1)] + [request_id]


def check_eos(eos_token_id) -> frozenset[int]:
    """The eos ids (one id, a list of ids, or None); negative ids mean none, as in transformers' configs."""
    eos = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    for e in eos:
        if e is not None and not _is_int(e):
            raise ValueError(f"eos_token_id must be an integer or a list of integers, got {eos_token_id!r}")
    return frozenset(int(e) for e in eos if e is not None and e >= 0)


@dataclass(eq=False, slots=True)  # a request is itself: compared and hashed by identity, never field by field
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    sampling: Sampling = Sampling()
    seed: int = 0  # its draws' seed (`sampling.token_uniform`: independent of how it is batched or retried)
    want_logprobs: bool = False  # its result carries the log-probability of each generated token
    streaming: bool = False
    record_timestamps: bool = False
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    created: float = field(default_factory=time.perf_counter)
    started: float = -1.0  # no longer pending (first admitted)
    ended: float = -1.0
    held: int = 0  # tokens its cache row holds (0 without a row, or after preemption)
    # Prefix caching (planned by `Scheduler.plan_prefix_stop` when its row is placed): where its prefill also stops to
    # cache a prefix (blocks others cached reach there, no snapshot does: 0 if none) and a hash of its tokens up to
    # there (`stop_prefix_at`), its snapshot point; the prefix cache's version at its last lookup (-1: none since it
    # got a row), and the hit tokens its lookups counted since (where its row was restored from).
    prefix_stop: int = 0
    prefix_key: int = 0
    snapshot_at: int = 0  # and where it stops once to keep a snapshot for a later prompt that continues it (0: nowhere)
    prefix_seen: int = -1
    prefix_hit: int = 0
    admitted: int = -1  # admission number (the latest admitted is preempted first)
    step_failures: int = 0  # steps that failed while it was in them (a second one fails it, or isolates it)
    # Isolation (`ContinuousBatchingManager._run`): after failed steps shared with others, its steps feed it alone
    # until it holds ``alone_until`` tokens (what it held and fed when the step failed); 0 when not isolated.
    alone_until: int = 0
    isolations: int = 0  # times it was isolated (bounded: a fault that needs other rows fails it in the end)
    media: dict | None = None  # a multimodal prompt's media inputs (the model's `media_inputs`), or None
    _eos: object = None  # `eos_array`, made once
    _array: object = None  # `token_array`'s buffer (prompt, then generated tokens as they come), and its fill
    _filled: int = 0
    _head: tuple = (0, None)  # `prompt_head`'s (unit, hash), made once
    # The most tokens its row ever holds (the last token it generates is never fed): its prompt and limit never change,
    # and the loop's room checks read it for every row every step.
    most_held: int = field(init=False)

    def __post_init__(self):
        self.most_held = len(self.prompt) + self.max_new_tokens - 1

    @property
    def total(self) -> int:
        """Tokens the row must hold before the next token can be sampled."""
        return len(self.prompt) + len(self.generated)

    def prompt_head(self, unit: int) -> int | None:
        """A hash of its prompt's first ``unit`` tokens (None if the prompt is shorter), made once: the scheduler
        indexes the requests in flight or waiting by it (`Scheduler.sharing_head`)."""
        if self._head[0] != unit:
            self._head = (unit, hash(tuple(self.prompt[:unit])) if len(self.prompt) >= unit else None)
        return self._head[1]

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.generated) - self.held  # (`total` - held: asked per row per step)

    @property
    def in_prefill(self) -> bool:
        """More than one token to feed: its prompt (or, after preemption, its tokens so far) is not all in."""
        return len(self.prompt) + len(self.generated) - self.held > 1

    def eos_array(self):
        """Its eos ids, sorted, as an int64 numpy array (what prompt lookup takes every decode step)."""
        if self._eos is None:
            self._eos = np.asarray(sorted(self.eos_token_ids), dtype=np.int64)
        return self._eos

    def drafts(self, most: int, ngram: int) -> list[int]:
        """Prompt lookup's drafts for its next tokens, at most ``most`` (`prompt_lookup.lookup_drafts`, transformers'
        search): none while it prefills or samples, never past its last token."""
        room = self.max_new_tokens - len(self.generated) - 1
        if self.in_prefill or not self.sampling.plain_greedy or room < 1:
            return []
        return lookup_drafts(self.token_array(), min(most, room), ngram, len(self.prompt) + self.max_new_tokens,
                             self.eos_array()).tolist()

    def token_array(self):
        """Its prompt and generated tokens as an int64 numpy array (prompt lookup searches it every decode
        step: kept across steps, only new tokens are copied in)."""
        if self._array is None:
            self._array = np.empty(len(self.prompt) + self.max_new_tokens, dtype=np.int64)
            self._array[: len(self.prompt)] = self.prompt
            self._filled = len(self.prompt)
        total = self.total
        if self._filled < total:
            self._array[self._filled: total] = self.generated[self._filled - len(self.prompt):]
            self._filled = total
        return self._array[:total]

    def first_tokens(self, n: int) -> list[int]:
        """Its first ``n`` tokens (its prompt, then what it generated)."""
        tokens = self.prompt[:n]
        return tokens + self.generated[: n - len(tokens)]

    def next_tokens(self, n: int) -> list[int]:
        """The next ``n`` tokens its row has not held yet."""
        start, split = self.held, len(self.prompt)
        head = self.prompt[start: start + n] if start < split else []
        tail_start = max(0, start - split)
        return head + self.generated[tail_start: tail_start + n - len(head)]

    def stop_prefix_at(self, stop: int) -> None:
        """Its prefill stops at ``stop`` (0: nowhere) to cache the prefix there. Requests with the same stop and
        key (a hash of the prefix's tokens) share that prefix: one computes it, the others wait and restore it
        (`Scheduler`); a collision only makes a request wait for a prefix it then does not find."""
        self.prefix_stop = stop
        self.prefix_key = hash(tuple(self.first_tokens(stop))) if stop else 0

    def next_token(self) -> int:
        """The next token its row has not held yet (a decode step's one token)."""
        held, split = self.held, len(self.prompt)
        return self.prompt[held] if held < split else self.generated[held - split]

    @property
    def done(self) -> bool:
        return self.status in _DONE

    def add_token(self, token: int, logprob: float | None) -> None:
        """A sampled token; ends the request at an eos token or at ``max_new_tokens``."""
        self.generated.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.record_timestamps:
            self.timestamps.append(time.perf_counter())
        if token in self.eos_token_ids or len(self.generated) >= self.max_new_tokens:
            self.finish(RequestStatus.FINISHED)
        else:
            self.status = _DECODING

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        self.status, self.error, self.ended = status, error, time.perf_counter()

    def output(self) -> GenerationOutput:
        """transformers' result for this request, as of now (its token lists are copies: later tokens do not
        change it)."""
        return GenerationOutput(
            # The prompt is shared, as transformers shares it: it never changes, and a copy per streamed token
            # costs the engine thread ~3 us per 1024 prompt tokens per row, every step.
            request_id=self.request_id, prompt_ids=self.prompt, generated_tokens=list(self.generated),
            logprobs=list(self.logprobs), error=self.error, status=self.status, created_time=self.created,
            lifespan=(self.started, self.ended), timestamps=list(self.timestamps) if self.record_timestamps else None,
        )
