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


@pytest.fixture(scope="module", params=["qwen4_exp", "inkling"])
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
    """The training call: loss, router logits and aux loss on a right-padded batch with labels equal
    transformers'."""
    name, ref, ours = family
    prompts = random_prompts(LENGTHS, vocab=90, seed=23)
    ids, mask = padded_batch(prompts, "right")
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        theirs = ref(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    torch.testing.assert_close(got.loss, theirs.loss, atol=1e-5, rtol=0)
    # The router logits come back beside the loss, equal to transformers' at the real tokens of its right-padded
    # batch (a right-padded row's real tokens never see its pads).
    real = mask.flatten().bool()
    assert len(got.router_logits) == len(theirs.router_logits) > 0
    for layer, logits in enumerate(got.router_logits):
        torch.testing.assert_close(logits[real], theirs.router_logits[layer][real], atol=1e-4, rtol=0,
                                   msg=lambda m: f"layer {layer}: {m}")
    # Inkling's output has no aux loss field (transformers computes none for it); Qwen4Exp's must equal theirs.
    assert hasattr(got, "aux_loss") == hasattr(theirs, "aux_loss")
    aux = getattr(got, "aux_loss", None)
    assert (aux is None) == (getattr(theirs, "aux_loss", None) is None)
    if aux is not None:
        torch.testing.assert_close(aux, theirs.aux_loss, atol=1e-5, rtol=0)
