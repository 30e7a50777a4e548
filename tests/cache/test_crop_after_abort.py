"""A crop after a failed step (Qwen4Exp with rollback headroom).

An aborted verify step may have overwritten entries of the per-row rollback rings (the state after each of a
row's last ``k + 1`` positions) that the abort does not copy back. So after an abort a row may no longer be
cropped to the length it had then or below (`Step.abort` raises each row's crop floor to length + 1): such a
crop would restore another position's recurrent state. A crop above that floor stays exact.
"""

from __future__ import annotations

import pytest
import torch
from helpers.faults import FailAt, Injected, count_calls, host_state
from helpers.qwen4 import left_pad, random_prompts

from hf_qsa_cache import QSAPagedCache

K = 2  # drafts per verify step: the rings keep K + 1 positions


def _tokens(seed: int, rows: int, n: int) -> torch.Tensor:
    return torch.randint(2, 90, (rows, n), generator=torch.Generator().manual_seed(seed))


class Run:
    """A ragged batch on a cache with K tokens of rollback headroom; every step's tokens are remembered, so the
    rows a cache holds can be rerun on a fresh cache."""

    def __init__(self, model):
        self.model = model
        self.ids, self.mask = left_pad(random_prompts([11, 6], vocab=90, seed=31))
        self.cache = QSAPagedCache(model.config, 2, 64, block_size=4, num_speculative_tokens=K)
        self.forward(self.ids[:, :0], prompt=True)

    def forward(self, ids, prompt=False):
        if not prompt:
            self.ids = torch.cat([self.ids, ids], 1)
            self.mask = torch.cat([self.mask, torch.ones_like(ids)], 1)
        with torch.no_grad():
            return self.model(ids if not prompt else self.ids, attention_mask=self.mask,
                              past_key_values=self.cache).logits

    def undo(self, n):
        """Forget the last ``n`` columns (the step that failed, or the ones a crop drops)."""
        self.ids, self.mask = self.ids[:, :-n], self.mask[:, :-n]

    def fresh_logits(self, ids):
        """The logits of ``ids`` after every token this run holds, on a fresh cache (one prompt, no crops)."""
        with torch.no_grad():
            ids_all = torch.cat([self.ids, ids], 1)
            mask = torch.cat([self.mask, torch.ones_like(ids)], 1)
            return self.model(ids_all, attention_mask=mask).logits[:, -ids.shape[1]:]


def _prepared(model):
    run = Run(model)
    for seed in range(3):  # the rings fill up
        run.forward(_tokens(seed, 2, 1))
    return run


def test_crop_below_a_failed_step_is_refused_and_an_allowed_crop_is_exact(qwen):
    verify = _tokens(10, 2, K + 1)
    # The fault hits the verify forward's last torch call (the LM head; the very last call counted is leaving
    # no_grad): every layer has written its rings by then.
    probe = _prepared(qwen)
    total = count_calls(lambda: probe.forward(verify))
    run = _prepared(qwen)
    length = list(run.cache.lengths)
    with pytest.raises(Injected), FailAt(total - 1):
        run.forward(verify)
    run.undo(K + 1)
    assert run.cache.lengths == length
    assert run.cache.rows.crop_floor[:2] == [n + 1 for n in length]

    # Below the failed step: refused, before anything changes (even one token later), blaming the failed step
    # (not the headroom, which would allow it) and naming the shortest length the row may be cropped to.
    before = host_state(run.cache)
    refused = (rf"cannot drop 1 tokens: row 0 can go back 0 at most: it holds {length[0]} tokens and may be "
               rf"cropped to length {length[0] + 1} at the shortest, once longer, because a failed step overwrote "
               r"its rollback state$")
    with pytest.raises(ValueError, match=refused):
        run.cache.crop(-1)
    assert host_state(run.cache) == before
    run.forward(_tokens(11, 2, 1))
    before = host_state(run.cache)
    refused = (rf"cannot drop 1 tokens: row 0 can go back 0 at most: it holds {length[0] + 1} tokens and may be "
               rf"cropped to length {length[0] + 1} at the shortest, because a failed step overwrote its rollback "
               r"state of shorter lengths")
    with pytest.raises(ValueError, match=refused):
        run.cache.crop(-1)  # back to the length the failed step started from
    assert host_state(run.cache) == before

    # Above it: a verify step whose last draft is rejected, then a crop to length + 2 (allowed), then a step.
    run.forward(_tokens(12, 2, K))
    run.cache.crop(-1)
    run.undo(1)
    assert run.cache.lengths == [n + K for n in length]
    nxt = _tokens(13, 2, 1)
    expected = run.fresh_logits(nxt)
    torch.testing.assert_close(run.forward(nxt), expected, atol=1e-5, rtol=0)
