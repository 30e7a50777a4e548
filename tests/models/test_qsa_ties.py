"""Exact ties at the QSA top-k cut, against transformers' own Qwen4Exp row by row, unpadded, fp32 (CPU).

With few index heads (`helpers.qwen4.FEW_INDEX_HEADS`) a group's index score is exactly zero often, and zeros
tie at the cut. transformers keeps the groups its ``torch.topk`` keeps over the query's visible groups; every
forward of ours must keep the same ones: prefill, chunked prefill, decode and verify, left- and right-padded.
Each test counts the ties where that choice matters (``torch.topk`` keeps another set than the lower group
index would) in the forwards it checks, and fails if there were none.
"""

from __future__ import annotations

import pytest
import torch
from helpers.batches import padded_batch
from helpers.qwen4 import few_index_heads_config, make_pair, random_prompts, upstream_generate

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.ops import qsa

NEW_TOKENS = 8

# Per config: the model's seed and the prompts' lengths and seed, chosen so that deciding ties occur (asserted).
CASES = {
    "4-index-heads": dict(seed=1, lengths=[45, 12, 38, 60], prompt_seed=0),
    "2-index-heads": dict(seed=1, lengths=[29, 7, 18, 33], prompt_seed=1),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    ref, ours = make_pair(few_index_heads_config(request.param), seed=CASES[request.param]["seed"])
    return ref, ours, CASES[request.param]


def deciding_ties(scores: torch.Tensor, k: int, visible: torch.Tensor) -> int:
    """Rows of a selection (index scores ``[N, G]``, ``k`` kept, ``visible [N]`` groups scored) where torch.topk over
    the row's visible scores alone keeps another set than the lower group index among equal scores would."""
    count = 0
    for row, width in enumerate(visible.tolist()):
        if width > k:
            scored = scores[row, :width]
            by_topk = set(scored.topk(k).indices.tolist())
            by_lower = set(scored.sort(descending=True, stable=True).indices[:k].tolist())
            count += by_topk != by_lower
    return count


class TieLog:
    """The deciding ties (`deciding_ties`) of every selection a model makes, by the kind of forward: the first is
    the prefill, then one token a row is a decode step, more is a verify step."""

    def __init__(self, monkeypatch, model):
        self.ties = {"prefill": 0, "decode": 0, "verify": 0}
        self.forwards = 0
        self.kind = "prefill"
        real = qsa.top_group_set

        def counted(scores, k, visible=None):
            self.ties[self.kind] += deciding_ties(scores, k, visible)
            return real(scores, k, visible)

        monkeypatch.setattr(qsa, "top_group_set", counted)
        self.hook = model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.kind = "prefill" if self.forwards == 0 else "decode" if ids.shape[1] == 1 else "verify"
        self.forwards += 1

    def close(self) -> dict:
        self.hook.remove()
        return self.ties


def _generate(model, ids, mask, cache=None, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW_TOKENS,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                              eos_token_id=None, **kwargs)


def _assert_rows_match_upstream(ref, out, width, prompts):
    for i, prompt in enumerate(prompts):
        tokens, logits = upstream_generate(ref, prompt, NEW_TOKENS)
        assert out.sequences[i, width:].tolist() == tokens.tolist(), f"row {i}"
        torch.testing.assert_close(torch.stack([step[i] for step in out.logits]), logits, atol=1e-4, rtol=0,
                                   msg=lambda m: f"row {i}: {m}")


@pytest.mark.parametrize("padding", ["left", "right"])
def test_generate_keeps_upstreams_tied_groups(case, padding, monkeypatch):
    """A ragged batch, prefilled at once then decoded: each row's tokens and logits are upstream's on that row
    alone, with deciding ties in the prefill and in the decode steps."""
    ref, ours, spec = case
    prompts = random_prompts(spec["lengths"], seed=spec["prompt_seed"])
    ids, mask = padded_batch(prompts, padding)
    log = TieLog(monkeypatch, ours)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, len(prompts), 96, block_size=8))
    ties = log.close()
    _assert_rows_match_upstream(ref, out, ids.shape[1], prompts)
    assert ties["prefill"] > 0 and ties["decode"] > 0, ties


def test_chunked_prefill_keeps_upstreams_tied_groups(case, monkeypatch):
    """The prompt prefilled in chunks of 5 columns (`prefill_chunk_tokens` forced small), boundaries inside
    groups: the same rows as upstream, with deciding ties inside the chunks."""
    ref, ours, spec = case
    prompts = random_prompts(spec["lengths"], seed=spec["prompt_seed"])
    ids, mask = padded_batch(prompts, "left")
    monkeypatch.setattr(type(ours), "prefill_chunk_tokens", 5 * len(prompts))
    log = TieLog(monkeypatch, ours)
    out = _generate(ours, ids, mask, QSAPagedCache(ours.config, len(prompts), 96, block_size=8))
    ties = log.close()
    _assert_rows_match_upstream(ref, out, ids.shape[1], prompts)
    assert ties["prefill"] > 0, ties


def test_verify_steps_keep_upstreams_tied_groups(case, monkeypatch):
    """Speculative verify steps on a left-padded ragged batch (a cache with ``num_speculative_tokens=3``): each
    step feeds the greedy token and 3 drafts per row, then crops the last 2 (rejected drafts). Every verify
    step's logits are upstream's on each row alone over the tokens it kept, with deciding ties in the verify
    steps."""
    ref, ours, spec = case
    prompts = random_prompts(spec["lengths"], seed=spec["prompt_seed"])
    ids, mask = padded_batch(prompts, "left")
    rows = [list(p) for p in prompts]
    gen = torch.Generator().manual_seed(3)
    cache = QSAPagedCache(ours.config, len(prompts), 96, block_size=8, num_speculative_tokens=3)
    log = TieLog(monkeypatch, ours)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask, past_key_values=cache).logits
        for step in range(4):
            drafts = torch.randint(2, ours.config.vocab_size, (len(prompts), 3), generator=gen)
            fed = torch.cat([logits[:, -1:].argmax(-1), drafts], dim=1)
            mask = torch.cat([mask, torch.ones_like(fed)], dim=1)
            logits = ours(fed, attention_mask=mask, past_key_values=cache).logits
            for b, row in enumerate(rows):
                alone = ref(torch.tensor([row + fed[b].tolist()])).logits[0, -fed.shape[1]:]
                torch.testing.assert_close(logits[b], alone, atol=1e-4, rtol=0,
                                           msg=lambda m: f"verify step {step}, row {b}: {m}")
                row += fed[b, :2].tolist()
            cache.crop(-2)
            mask, logits = mask[:, :-2], logits[:, :2]
    ties = log.close()
    assert ties["verify"] > 0, ties
