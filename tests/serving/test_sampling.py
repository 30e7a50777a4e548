"""A request's next-token scores (`serving.sampling.next_token_scores`) against transformers' own logits
processors and warpers on random logits; OpenAI's presence and frequency penalties against their definition;
the engine's batched warpers (`warp_rows`) against the per-row ones, and its draw (`draw`) against the
probabilities it draws from."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from hf_qsa_cache.serving.requests import Request
from hf_qsa_cache.serving.sampling import (PenaltyTables, Sampling, draw, next_token_scores, penalize, request_seed,
                                           warp, warp_rows)

VOCAB = 50


def _transformers(sampling: Sampling, history: list[int], logits: torch.Tensor) -> torch.Tensor:
    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.do_sample:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            processors.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p is not None:
            processors.append(TopPLogitsWarper(sampling.top_p))
        if sampling.min_p:
            processors.append(MinPLogitsWarper(sampling.min_p))
    return processors(torch.tensor([history]), logits[None].clone())[0]


@pytest.mark.parametrize("sampling", [
    Sampling(repetition_penalty=1.7),
    Sampling(do_sample=True, temperature=0.7),
    Sampling(do_sample=True, temperature=1.3, top_k=7),
    Sampling(do_sample=True, top_p=0.8),
    Sampling(do_sample=True, min_p=0.2),
    Sampling(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
], ids=["repetition", "temperature", "top-k", "top-p", "min-p", "all"])
@pytest.mark.parametrize("seed", range(3))
def test_scores_equal_transformers_processors(sampling, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 3
    prompt, generated = torch.randint(0, VOCAB, (8,), generator=gen).tolist(), [3, 3, 9]
    ours = next_token_scores(logits, sampling, prompt, generated)
    theirs = _transformers(sampling, prompt + generated, logits)
    kept = theirs > torch.finfo(theirs.dtype).min
    assert torch.equal(ours > torch.finfo(ours.dtype).min, kept)
    torch.testing.assert_close(ours[kept], theirs[kept])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(VOCAB)
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.25)
    scores = next_token_scores(logits, sampling, prompt=[7, 7, 8], generated=[3, 3, 3, 9])
    expected = torch.zeros(VOCAB)
    expected[3] = -(0.5 + 3 * 0.25)
    expected[9] = -(0.5 + 0.25)
    assert torch.equal(scores, expected)  # the prompt's 7 and 8 are not penalized
    assert torch.equal(logits, torch.zeros(VOCAB))  # the caller's logits are left alone


def test_request_seeds_depend_on_the_engine_seed_and_the_id_only():
    assert request_seed(0, "req_3") == request_seed(0, "req_3")
    assert len({request_seed(0, "req_3"), request_seed(1, "req_3"), request_seed(0, "req_4")}) == 3
    assert 0 <= request_seed(12345, "x") < 2**63


ROWS = [Sampling(do_sample=True, temperature=0.7), Sampling(do_sample=True, temperature=1.3, top_k=7),
        Sampling(do_sample=True, top_p=0.8), Sampling(do_sample=True, min_p=0.2),
        Sampling(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
        Sampling(do_sample=True, top_k=VOCAB + 5, top_p=1.0), Sampling(do_sample=True, top_k=1),
        Sampling(do_sample=True, top_k=3, top_p=0.5)]


@pytest.mark.parametrize("seed", range(3))
def test_batched_warpers_equal_each_rows_own(seed):
    """Rows with different parameters (none, one or all warpers; top-k past the vocabulary, top-p 1, top-k 1)
    warped at once keep exactly the tokens, and the values, each row's own warpers keep."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROWS), VOCAB, generator=gen) * 3
    batched = warp_rows(logits, ROWS)
    neg = torch.finfo(logits.dtype).min
    for row, sampling in enumerate(ROWS):
        alone = warp(logits[row], sampling)
        assert torch.equal(batched[row] > neg, alone > neg), sampling
        torch.testing.assert_close(batched[row][alone > neg], alone[alone > neg])


def test_a_draw_follows_the_probabilities():
    """The token a uniform number picks is the first whose cumulative probability passes it; over many uniform
    numbers each token comes as often as its probability says, and a filtered-out token never."""
    scores = torch.tensor([[0.0, torch.finfo(torch.float32).min, 1.0, 2.0]])
    probs = scores.softmax(-1)[0].double()
    edges = probs.cumsum(0)
    assert draw(scores, torch.tensor([0.0])).item() == 0  # the first token with any probability
    assert draw(scores[:, [1, 0]], torch.tensor([0.0])).item() == 1  # (not a filtered-out one before it)
    assert draw(scores, torch.tensor([edges[0].item() - 1e-6])).item() == 0
    assert draw(scores, torch.tensor([edges[0].item() + 1e-6])).item() == 2  # token 1 has none: skipped
    assert draw(scores, torch.tensor([1 - 1e-9])).item() == 3
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    tokens = draw(scores.expand(len(uniforms), -1), uniforms)
    counts = torch.bincount(tokens, minlength=4).double() / len(uniforms)
    assert counts[1] == 0
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)


def test_penalty_tables_equal_each_rows_own_penalties_step_after_step():
    """Requests with different penalties (repetition, presence, frequency, all, none) penalized from their history
    tables, step after step as they take tokens, and after one leaves and a new one takes its slot: the scores
    each row's own `penalize` gives on its prompt and generated tokens."""
    gen = torch.Generator().manual_seed(4)
    samplings = [Sampling(repetition_penalty=1.7), Sampling(presence_penalty=0.5), Sampling(frequency_penalty=-0.4),
                 Sampling(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=0.3), Sampling()]
    requests = [Request(f"r{i}", torch.randint(0, VOCAB, (5 + 3 * i,), generator=gen).tolist(), 20, frozenset(), s)
                for i, s in enumerate(samplings)]
    requests[1].generated = [4, 4, 9]  # (a request preempted after it generated: its slot starts from them)
    tables = PenaltyTables(len(requests), VOCAB, torch.device("cpu"))
    for step in range(6):
        if step == 3:  # the first request leaves; a new one takes its slot
            tables.release(requests[0])
            requests[0] = Request("new", [1, 2, 3, 3], 20, frozenset(), Sampling(repetition_penalty=1.3,
                                                                                  frequency_penalty=0.7))
        logits = torch.randn(len(requests), VOCAB, generator=gen) * 3
        slots = tables.slots(requests)
        got = tables.apply(logits, slots, [r.sampling for r in requests])
        for row, request in enumerate(requests):
            want = penalize(logits[row], request.sampling, request.prompt, request.generated)
            torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6, msg=lambda m: f"step {step}, row {row}: {m}")
        tokens = torch.randint(0, VOCAB, (len(requests),), generator=gen)
        tokens[2] = requests[2].prompt[0] if step == 1 else tokens[2]  # a prompt token generated again
        tables.took(slots, tokens)
        for request, token in zip(requests, tokens.tolist()):
            request.generated.append(token)
