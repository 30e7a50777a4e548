"""Prompt lookup's search on a host copy of the row (`hf_qsa_cache.prompt_lookup`) against transformers' own
`PromptLookupCandidateGenerator.get_candidates`, the specification: the same drafts on rows built to hit
every branch (many matches, n-grams found only at a smaller size, the row's own last n-gram, the
``max_length`` bounds, end-of-sequence cuts), and the host copy kept right while the row grows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList, MinLengthLogitsProcessor
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_qsa_cache.prompt_lookup import HostLookup, HostTokens, lookup_drafts
from hf_qsa_cache.speculative import DraftBudget, adapt_prompt_lookup


def _upstream(row, k, ngram, max_length, eos):
    generator = PromptLookupCandidateGenerator(
        eos_token_id=None if eos is None else torch.tensor(eos), num_output_tokens=k,
        max_matching_ngram_size=ngram, max_length=max_length)
    ids = torch.tensor([row])
    candidates, _ = generator.get_candidates(ids)
    return candidates[0, len(row):].tolist()


def _cases(count=1500, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        length = int(rng.integers(1, 24))
        vocab = int(rng.integers(2, 8))  # small vocabularies: many matches, at every n-gram size
        row = rng.integers(0, vocab, length).tolist()
        k = int(rng.integers(1, 6))
        ngram = int(rng.integers(1, 4))
        # max_length below, at and above the row: the cut of the drafts and the early return (L + 1)
        max_length = int(rng.integers(max(1, length - 3), length + 8))
        eos = None if rng.random() < 0.4 else rng.choice(vocab, size=int(rng.integers(1, 3)), replace=False).tolist()
        yield row, k, ngram, max_length, eos


def _match_size(row, ngram, max_length):
    """The n-gram size whose match decides, by brute force (0: none)."""
    for n in range(min(ngram, len(row) - 1), 0, -1):
        if any(row[i:i + n] == row[-n:] and i + n < min(len(row), max_length) for i in range(len(row) - n + 1)):
            return n
    return 0


def test_host_search_proposes_what_transformers_proposes():
    kinds = {"drafts": 0, "none": 0, "cut by eos": 0, "smaller n-gram": 0}
    for row, k, ngram, max_length, eos in _cases():
        want = _upstream(row, k, ngram, max_length, eos)
        have = lookup_drafts(np.array(row, dtype=np.int64), k, ngram, max_length,
                             None if eos is None else np.array(eos, dtype=np.int64)).tolist()
        assert have == want, (row, k, ngram, max_length, eos)
        kinds["drafts" if want else "none"] += 1
        if eos is not None and not want and _upstream(row, k, ngram, max_length, None):
            kinds["cut by eos"] += 1
        size = _match_size(row, ngram, max_length)
        if size and size < min(ngram, len(row) - 1):
            kinds["smaller n-gram"] += 1
    assert all(kinds.values()), kinds  # the cases reached every branch


def test_host_copy_reads_only_new_tokens_and_recopies_a_row_that_changed(monkeypatch):
    host = HostTokens()
    row = torch.arange(5)[None]
    reads = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(self.numel()) or real(self, *a, **k))
    assert host.refresh(row).tolist() == list(range(5))
    for grown in (7, 8, 8, 40):  # appended tokens, none, and past the buffer's doubling
        row = torch.cat([row, torch.arange(row.shape[1], grown)[None]], dim=1)
        assert host.refresh(row).tolist() == list(range(grown))
    assert reads == [5, 3, 2, 1, 33]  # the whole row once, then the new tokens and the last copied one
    other = torch.tensor([[9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9,
                           9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]])
    assert host.refresh(other).tolist() == other[0].tolist()  # last copied token differs: copied again
    assert host.refresh(torch.tensor([[4, 5]])).tolist() == [4, 5]  # a shorter row: copied again


def test_host_lookup_follows_a_growing_row_as_transformers_would():
    rng = np.random.default_rng(3)
    generator = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([2]), num_output_tokens=3,
                                               max_matching_ngram_size=2, max_length=60)
    lookup = HostLookup(generator)
    row = torch.tensor([rng.integers(0, 6, 12).tolist()])
    while row.shape[1] < 59:
        for k in (1, 3):
            generator.num_output_tokens = k
            want, _ = PromptLookupCandidateGenerator.get_candidates(generator, row)
            have, logits = lookup(row)
            assert logits is None and torch.equal(have, want)
        row = torch.cat([row, torch.tensor([rng.integers(0, 6, int(rng.integers(1, 4))).tolist()])], dim=1)[:, :59]


@pytest.mark.parametrize("processors", [None, LogitsProcessorList()])
def test_budgeted_rounds_search_on_the_host_unless_processors_may_forbid_drafts(monkeypatch, processors):
    """Without logits processors (None or an empty list, which forbid nothing) the wrapper searches on the
    host; with one it runs transformers' search, which applies them."""
    ran = []
    real = PromptLookupCandidateGenerator.get_candidates
    monkeypatch.setattr(PromptLookupCandidateGenerator, "get_candidates",
                        lambda self, ids, **kw: ran.append(1) or real(self, ids, **kw))
    row = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    for forbidding in (False, True):
        ran.clear()
        min_length = LogitsProcessorList([MinLengthLogitsProcessor(20, eos_token_id=9)])
        generator = PromptLookupCandidateGenerator(num_output_tokens=3, max_length=64, vocab_size=16,
                                                   logits_processor=min_length if forbidding else processors)
        adapt_prompt_lookup(generator, DraftBudget(3))
        candidates, _ = generator.get_candidates(row)
        # MinLength forbids the end-of-sequence id 9 before 20 tokens: transformers' search cuts the drafts there
        assert candidates[0, 7:].tolist() == ([7, 8] if forbidding else [7, 8, 9])
        assert len(ran) == int(forbidding)
