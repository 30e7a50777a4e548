"""``output_router_logits=True`` on padded batches (right padding, pads between tokens), against transformers'
own classes: each row's router logits at its real tokens equal that row run alone, unpadded; the auxiliary
load-balancing loss (a batch quantity, pads excluded by the mask) equals transformers' on the same padded batch.

A step with pads after real tokens runs reordered (`hf_qsa_cache.padding`), so the flattened ``[B * L, experts]``
router logits must be put back in the caller's columns like every other per-token output.
"""

from __future__ import annotations

import pytest
import torch
from helpers.batches import padded_batch
from helpers.inkling import make_config as inkling_config
from helpers.inkling import make_pair as inkling_pair
from helpers.qwen4 import make_pair as qwen_pair
from helpers.qwen4 import random_prompts
from transformers.models.qwen4_exp.modeling_qwen4_exp import load_balancing_loss_func

LENGTHS = [9, 1, 5]  # a one-token row: its only real token is in column 0 of a right-padded batch


@pytest.fixture(scope="module", params=[
    "qwen4_exp",
    pytest.param("inkling", marks=pytest.mark.xfail(
        strict=True, reason="our Inkling does not record router logits yet (transformers' returns one [B * L, "
                            "experts] tensor per MoE layer)")),
])
def family(request):
    ref, ours = qwen_pair(seed=6) if request.param == "qwen4_exp" else inkling_pair(inkling_config(), seed=6)
    return request.param, ref, ours


@pytest.mark.parametrize("kind", ["right", "middle"])
def test_router_logits_of_a_padded_batch_equal_each_row_alone(family, kind):
    name, ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=21)
    ids, mask = padded_batch(prompts, kind, seed=22)
    B, L = ids.shape
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, output_router_logits=True)
        theirs = ref(ids, attention_mask=mask, output_router_logits=True)
        alone = [ref(torch.tensor([p]), output_router_logits=True) for p in prompts]
    assert got.router_logits is not None and len(got.router_logits) == len(theirs.router_logits) > 0
    for layer, logits in enumerate(got.router_logits):
        assert logits.shape == theirs.router_logits[layer].shape
        per_row = logits.view(B, L, -1)
        for b in range(B):
            real = mask[b].nonzero().flatten()
            torch.testing.assert_close(per_row[b, real], alone[b].router_logits[layer], atol=1e-4, rtol=0,
                                       msg=lambda m: f"layer {layer}, row {b}: {m}")
    if getattr(theirs, "aux_loss", None) is None:
        return
    # The aux loss of the rows alone: their router logits in the batch's real columns (pads masked out).
    assembled = []
    for layer, logits in enumerate(theirs.router_logits):
        full = torch.zeros(B, L, logits.shape[-1])
        for b in range(B):
            full[b, mask[b].bool()] = alone[b].router_logits[layer]
        assembled.append(full.view(B * L, -1))
    expected = load_balancing_loss_func(tuple(assembled), ours.config.num_experts, ours.config.num_experts_per_tok,
                                        mask)
    torch.testing.assert_close(got.aux_loss, expected, atol=1e-5, rtol=0)
    if kind == "right":  # transformers' own right-padded batch gives the same (middle pads differ on purpose)
        torch.testing.assert_close(got.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)


def test_router_logits_with_labels_right_padded(family):
    """The training call: loss and aux loss on a right-padded batch with labels equal transformers'."""
    name, ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=23)
    ids, mask = padded_batch(prompts, "right")
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        theirs = ref(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    torch.testing.assert_close(got.loss, theirs.loss, atol=1e-5, rtol=0)
    assert (got.aux_loss is None) == (getattr(theirs, "aux_loss", None) is None)
    if got.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)
