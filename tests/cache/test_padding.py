"""Any 2-D padding mask, in every forward (no cache, a fresh cache, a cache holding rows, chunked
prefill, generate), against transformers' own classes on each row alone, unpadded (fp32, CPU).

Prompts are long enough that QSA selection is active (Qwen4Exp: > 8 budget tokens) and Inkling's
sliding window (6) evicts.
"""

from __future__ import annotations

import pytest
import torch
from helpers.qwen4 import make_pair as qwen_pair
from helpers.qwen4 import random_prompts
from helpers.inkling import make_config as inkling_config
from helpers.inkling import make_pair as inkling_pair

from helpers.batches import padded_batch as _layout

from hf_qsa_cache import QSAPagedCache
from hf_qsa_cache.padding import step_order

LENGTHS = [23, 9, 17]


@pytest.fixture(scope="module", params=["qwen4_exp", "inkling"])
def family(request):
    if request.param == "qwen4_exp":
        ref, ours = qwen_pair()
    else:
        ref, ours = inkling_pair(inkling_config())
    return ref, ours


def _alone(ref, prompt):
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0]


def test_step_order_reorders_and_restores():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 1, 1]])
    order = step_order(mask, 4)
    assert order.mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]
    assert order.order.tolist() == [[2, 3, 0, 1], [0, 2, 1, 3], [0, 1, 2, 3]]
    # real columns come back from their reordered place; a pad after a real token reads that token
    assert order.source.tolist() == [[2, 3, 3, 3], [0, 2, 2, 3], [0, 1, 2, 3]]
    assert step_order(mask[2:], 4) is None  # already left-padded
    assert step_order(mask, 1) is None


@pytest.mark.parametrize("kind", ["right", "middle"])
def test_forward_without_cache_equals_each_row_alone(family, kind):
    ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=3)
    ids, mask = _layout(prompts, kind, seed=4)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask, use_cache=False).logits
    for b, p in enumerate(prompts):
        real = mask[b].nonzero().flatten()
        torch.testing.assert_close(logits[b, real], _alone(ref, p), rtol=1e-4, atol=1e-4)
        # a pad after real tokens repeats the latest real token's output
        last_real = int(real[-1])
        if last_real < ids.shape[1] - 1:
            torch.testing.assert_close(logits[b, -1], logits[b, last_real])


def test_right_padded_batch_equals_upstreams_own_right_padded_batch(family):
    ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=5)
    ids, mask = _layout(prompts, "right")
    with torch.no_grad():
        theirs = ref(ids, attention_mask=mask).logits
        mine = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], rtol=1e-4, atol=1e-4)


def test_steps_with_pads_on_rows_that_hold_tokens(family):
    """Two ragged steps on one cache: rows that already hold tokens get pads in the second step (left,
    right and in the middle of it); each row's last logits equal the row alone."""
    ref, ours = family
    first = random_prompts([12, 21, 7], vocab=90, seed=6)
    second = random_prompts([5, 1, 9], vocab=90, seed=7)
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=64, block_size=4)
    ids1, mask1 = _layout(first, "left")
    width = 11
    ids2 = torch.zeros(3, width, dtype=torch.long)
    mask2 = torch.zeros_like(ids2)
    layouts = [torch.arange(width - 5, width), torch.tensor([0]), torch.tensor([0, 2, 3, 5, 6, 7, 8, 9, 10])]
    for b, cols in enumerate(layouts):
        ids2[b, cols] = torch.tensor(second[b])
        mask2[b, cols] = 1
    with torch.no_grad():
        ours(ids1, attention_mask=mask1, past_key_values=cache)
        logits = ours(ids2, attention_mask=torch.cat([mask1, mask2], 1), past_key_values=cache).logits
        for b in range(3):
            expect = _alone(ref, first[b] + second[b])[-1]
            torch.testing.assert_close(logits[b, layouts[b][-1]], expect, rtol=1e-4, atol=1e-4)
        assert cache.lengths[:3] == [len(f) + len(s) for f, s in zip(first, second)]
        # and decoding continues from each row's real length
        nxt = torch.tensor([[3], [4], [5]])
        mask3 = torch.cat([mask1, mask2, torch.ones(3, 1, dtype=torch.long)], 1)
        logits = ours(nxt, attention_mask=mask3, past_key_values=cache).logits
    for b in range(3):
        expect = _alone(ref, first[b] + second[b] + [int(nxt[b])])[-1]
        torch.testing.assert_close(logits[b, -1], expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["right", "middle"])
def test_generate_from_any_padding_equals_each_row_alone(family, kind, monkeypatch):
    """generate() on right- or middle-padded prompts, the prompt prefilled in small chunks: each row's
    tokens equal upstream's generate on that row alone."""
    ref, ours = family
    monkeypatch.setattr(type(ours), "prefill_chunk_tokens", 3 * 5)  # 5-column chunks
    prompts = random_prompts(LENGTHS, vocab=90, seed=8)
    ids, mask = _layout(prompts, kind, seed=9)
    with torch.no_grad():
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
        for b, p in enumerate(prompts):
            alone = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
            assert out[b, ids.shape[1]:].tolist() == alone[0, len(p):].tolist(), b


def _causal_4d(mask, dtype):
    """transformers' 4-D form of a 2-D padding mask: [B, 1, L, W], key j visible to query i iff j <= i and
    j is real (bool True = visible; float 0 = visible, min = masked)."""
    B, W = mask.shape
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    visible = causal[None] & mask.bool()[:, None, :]
    if dtype == torch.bool:
        return visible[:, None]
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_4d_causal_mask_with_padding_equals_its_2d_mask(family, dtype):
    ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=10)
    ids, mask = _layout(prompts, "right")
    with torch.no_grad():
        expected = ours(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=_causal_4d(mask, dtype)).logits
    torch.testing.assert_close(got, expected)


def test_other_4d_masks_are_refused_with_what_is_supported(family):
    ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=10)
    ids, mask = _layout(prompts, "right")
    bidirectional = mask.bool()[:, None, None, :].expand(-1, 1, ids.shape[1], -1)
    with pytest.raises(ValueError, match="must be a causal mask with padding.*row 0, query 0, key 1.*2-D padding mask"):
        ours(ids, attention_mask=bidirectional)


# A real token in column 0 followed by pads: the pads must read that token's output (the reorder's "latest real
# column" is 0 there, a value a careless test for "no real token yet" would take for absent).
def test_right_padded_row_of_one_token_generates_as_alone(family):
    ref, ours = family
    prompts = random_prompts([7, 1, 4], vocab=90, seed=12)
    ids, mask = _layout(prompts, "right")
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask, use_cache=False).logits
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                            eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        for b, p in enumerate(prompts):
            alone = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None,
                                 output_logits=True, return_dict_in_generate=True)
            # the last column (a pad for rows 1 and 2) predicts the row's next token
            torch.testing.assert_close(logits[b, -1], _alone(ref, p)[-1], rtol=1e-4, atol=1e-4)
            assert out.sequences[b, ids.shape[1]:].tolist() == alone.sequences[0, len(p):].tolist(), b
            torch.testing.assert_close(torch.stack([s[b] for s in out.logits]), torch.stack(alone.logits)[:, 0],
                                       rtol=1e-4, atol=1e-4)


def test_a_chunk_whose_only_real_token_is_first(family):
    """A step on rows that hold tokens, where one row's only real token is the step's first column (pads after
    it) and another's is the last: every row's last column equals the row alone, and decoding continues."""
    ref, ours = family
    first = random_prompts([9, 5, 12], vocab=90, seed=13)
    second = random_prompts([1, 3, 1], vocab=90, seed=14)
    cache = QSAPagedCache(ours.config, max_batch_size=3, max_cache_len=32, block_size=4)
    ids1, mask1 = _layout(first, "left")
    width = 4
    layouts = [torch.tensor([0]), torch.tensor([0, 1, 2]), torch.tensor([3])]
    ids2 = torch.zeros(3, width, dtype=torch.long)
    mask2 = torch.zeros_like(ids2)
    for b, cols in enumerate(layouts):
        ids2[b, cols] = torch.tensor(second[b])
        mask2[b, cols] = 1
    with torch.no_grad():
        ours(ids1, attention_mask=mask1, past_key_values=cache)
        mask12 = torch.cat([mask1, mask2], 1)
        logits = ours(ids2, attention_mask=mask12, past_key_values=cache).logits
        for b in range(3):
            torch.testing.assert_close(logits[b, -1], _alone(ref, first[b] + second[b])[-1], rtol=1e-4, atol=1e-4)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = ours(nxt, attention_mask=torch.cat([mask12, torch.ones(3, 1, dtype=torch.long)], 1),
                      past_key_values=cache).logits
    for b in range(3):
        expect = _alone(ref, first[b] + second[b] + [int(nxt[b])])[-1]
        torch.testing.assert_close(logits[b, -1], expect, rtol=1e-4, atol=1e-4)
