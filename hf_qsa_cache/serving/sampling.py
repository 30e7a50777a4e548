"""How a request picks its next token: its own sampling parameters, its own random stream.

`Sampling` holds one request's parameters (checked when it is built); `next_token_scores` turns a row's logits
into the scores its token is drawn from (or its argmax taken), in transformers' order: repetition penalty on
the prompt and generated tokens, OpenAI's presence and frequency penalties on the generated ones, then
temperature, top-k, top-p and min-p. The engine does the same for a step's rows at once (`PenaltyTables` for
the penalized rows, `warp_rows` for the sampled ones) and draws each row's token with one uniform number, a hash
of the request's seed and the token's index (`token_uniform`, `draw`). `request_seed` gives a request a seed
from its id, so its draws do not depend on how many requests came before it.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
from collections import Counter
from dataclasses import dataclass

import torch


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters. ``do_sample=False`` is greedy (the penalties still apply, as in
    transformers' greedy search). A bad value is a `ValueError` naming the parameter and the value."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        checks = (
            ("temperature", self.temperature, lambda v: _number(v) and v > 0, "a number > 0"),
            ("top_k", self.top_k, lambda v: v is None or (isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                          and v >= 0), "None or an integer >= 0"),
            ("top_p", self.top_p, lambda v: v is None or (_number(v) and 0 < v <= 1), "None or a number in (0, 1]"),
            ("min_p", self.min_p, lambda v: v is None or (_number(v) and 0 <= v <= 1), "None or a number in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty, lambda v: _number(v) and v > 0, "a number > 0"),
            ("presence_penalty", self.presence_penalty, lambda v: _number(v) and -2 <= v <= 2,
             "a number in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, lambda v: _number(v) and -2 <= v <= 2,
             "a number in [-2, 2]"),
        )
        for name, value, ok, what in checks:
            if not ok(value):
                raise ValueError(f"{name} must be {what}, got {value!r}")

    @classmethod
    def from_generation_config(cls, config) -> "Sampling":
        return cls(do_sample=bool(config.do_sample), temperature=config.temperature or 1.0,
                   top_k=config.top_k or None, top_p=config.top_p, min_p=config.min_p,
                   repetition_penalty=config.repetition_penalty or 1.0)

    @functools.cached_property  # (asked per row per step; the parameters never change)
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property  # (asked per row per step; the parameters never change)
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits: no draw, no penalty."""
        return not self.do_sample and not self.penalized


def next_token_scores(logits: torch.Tensor, sampling: Sampling, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One row's ``logits [vocab]`` (fp32) as the scores its next token comes from: penalties, then (when
    sampling) the warpers. Filtered-out tokens get the dtype's lowest value. (The engine runs the same arithmetic
    on a step's rows at once: `PenaltyTables.apply`, `warp_rows`.)"""
    scores = penalize(logits, sampling, prompt, generated)
    if sampling.do_sample:
        scores = warp(scores, sampling)
    return scores


def penalize(logits: torch.Tensor, sampling: Sampling, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One row's ``logits [vocab]`` after its repetition, presence and frequency penalties (the logits themselves,
    unchanged, when it has none)."""
    scores = logits
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long, device=logits.device)
        picked = scores[seen]
        scores = scores.clone()
        scores[seen] = torch.where(picked < 0, picked * sampling.repetition_penalty, picked / sampling.repetition_penalty)
    if generated and (sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0):
        counts = Counter(generated)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        n = torch.tensor(list(counts.values()), dtype=scores.dtype, device=logits.device)
        scores = scores.clone()
        scores[ids] -= sampling.presence_penalty + sampling.frequency_penalty * n
    return scores


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (transformers' warpers, in its order): the filtered logits."""
    scores = logits / sampling.temperature
    neg = torch.finfo(scores.dtype).min
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, neg)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        order = scores.argsort(descending=False)
        cumulative = scores[order].softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), neg)
    if sampling.min_p:
        probs = scores.softmax(-1)
        drop = probs < sampling.min_p * probs.max()
        drop[probs.argmax()] = False
        scores = scores.masked_fill(drop, neg)
    return scores


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step's per-row values as a ``[rows, 1]`` tensor on ``device``: one copy, which the host does not wait for
    (a decode step's sampling makes a few)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)[:, None]


class PenaltyTables:
    """The token history the penalties read, for the penalized requests that hold rows, as device tables with one
    slot a request: ``seen [slots, vocab]`` (its prompt and generated tokens: the repetition penalty) and
    ``counts [slots, vocab]`` (how often it generated each: presence and frequency penalties). A slot is filled
    from the request's tokens once (`slots`) and then takes each token as it comes (`took`), so a step's penalties
    are a few batched ops (`apply`), not a pass over every row's prompt (``set(prompt)`` of an 8k-token prompt
    costs ~1 ms a row a step). `release` frees a request's slot when it leaves its row."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(slots, vocab, dtype=torch.float32, device=device)
        self.slot: dict = {}  # request -> its slot (requests hash by identity)
        self.free = list(range(slots - 1, -1, -1))

    def slots(self, requests: list) -> torch.Tensor:
        """The requests' slots (a new one filled from its prompt and generated tokens)."""
        device = self.seen.device
        for request in requests:
            if request not in self.slot:
                slot = self.slot[request] = self.free.pop()
                self.seen[slot] = False
                self.counts[slot] = 0.0
                history = torch.tensor(request.prompt + request.generated, dtype=torch.long, device=device)
                self.seen[slot, history] = True
                if request.generated:
                    generated = torch.tensor(request.generated, dtype=torch.long, device=device)
                    self.counts[slot].index_add_(0, generated, torch.ones(len(generated), device=device))
        return _column([self.slot[r] for r in requests], torch.long, device)[:, 0]

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
        """`penalize` of every row of ``logits [rows, vocab]`` (fp32) with its slot's history and its parameters."""
        def column(values):
            return _column(values, logits.dtype, logits.device)

        scores = logits
        if any(s.repetition_penalty != 1.0 for s in samplings):
            repetition = column([s.repetition_penalty for s in samplings])
            scores = torch.where(self.seen[slots], torch.where(scores < 0, scores * repetition, scores / repetition),
                                 scores)
        if any(s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 for s in samplings):
            counts = self.counts[slots]
            scores = scores - (column([s.presence_penalty for s in samplings]) * (counts > 0)
                               + column([s.frequency_penalty for s in samplings]) * counts)
        return scores

    def took(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each slot's request took its token."""
        self.seen[slots, tokens] = True
        self.counts.index_put_((slots, tokens), torch.ones(len(tokens), device=tokens.device), accumulate=True)

    def release(self, request) -> None:
        slot = self.slot.pop(request, None)
        if slot is not None:
            self.free.append(slot)


def warp_rows(logits: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """`warp` of every row of ``logits [rows, vocab]`` (fp32) with its own parameters, in a few batched ops (a
    step's sampled rows: per-row warpers cost ~10 launches a row)."""
    rows, vocab = logits.shape
    neg = torch.finfo(logits.dtype).min

    def column(values, dtype=logits.dtype):
        return _column(values, dtype, logits.device)

    scores = logits / column([s.temperature for s in samplings])
    top_k = [s.top_k if s.top_k and s.top_k < vocab else 0 for s in samplings]
    if any(top_k):
        values = torch.topk(scores, max(top_k), dim=-1).values  # [rows, most k], descending
        kth = values.gather(1, column([max(k, 1) - 1 for k in top_k], torch.long))
        scores = scores.masked_fill((scores < kth) & column([k > 0 for k in top_k], torch.bool), neg)
    top_p = [s.top_p if s.top_p is not None else 1.0 for s in samplings]
    if any(p < 1.0 for p in top_p):
        ordered, order = scores.sort(dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - column(top_p)
        drop[:, -1] = False  # the most likely token always stays
        drop &= column([p < 1.0 for p in top_p], torch.bool)
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), neg)
    min_p = [s.min_p or 0.0 for s in samplings]
    if any(min_p):
        probs = scores.softmax(-1)
        drop = probs < column(min_p) * probs.max(-1, keepdim=True).values
        drop.scatter_(1, probs.argmax(-1, keepdim=True), False)
        scores = scores.masked_fill(drop, neg)
    return scores


def draw(scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row ``r``'s token from ``softmax(scores[r])`` for its uniform number ``uniforms[r]`` in [0, 1): the first
    token whose cumulative probability passes it (in fp64, so no token's share is lost to rounding)."""
    cumulative = scores.softmax(-1).double().cumsum(-1)
    target = uniforms.to(cumulative.device, torch.float64)[:, None] * cumulative[:, -1:]
    return (cumulative <= target).sum(-1).clamp_max(scores.shape[-1] - 1)


_MASK64 = 2**64 - 1


def token_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) a request with ``seed`` draws its ``index``-th generated token with: a hash
    (SplitMix64) of the two, no generator state, so a token is the same however its request was batched, and when a
    failed step's requests are run again (`ContinuousBatchingManager`) or a preempted one recomputed."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def request_seed(base: int, request_id: str) -> int:
    """A request's seed from the engine's ``base`` seed and its id (stable across processes, unlike hash())."""
    digest = hashlib.blake2b(f"{base}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
