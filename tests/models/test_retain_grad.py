"""``retain_grad()`` on the returned hidden states and attentions, of any padding (transformers' common test
``test_retain_grad_hidden_states_attentions`` asks it of both families).

A step with pads after real tokens runs reordered and its outputs come back in the caller's columns
(`hf_qsa_cache.padding`): the returned hidden states must still be the tensors the rest of the forward reads,
so a backward from the output reaches them. Their gradients at each row's real tokens equal those of the same
prompts left-padded (no reordering), and are zero at pads.
"""

from __future__ import annotations

import pytest
import torch
from helpers.batches import padded_batch
from helpers.inkling import make_prompts as inkling_prompts
from helpers.qwen4 import random_prompts

KINDS = ["none", "left", "right", "middle"]


@pytest.fixture(scope="module", params=["qwen4_exp", "inkling"])
def family(request, qwen, ink):
    if request.param == "qwen4_exp":
        model, prompts = qwen, [torch.tensor(p) for p in random_prompts([7, 3, 5], seed=5)]
    else:
        model, prompts = ink, inkling_prompts([7, 3, 5], seed=5)
    model.set_attn_implementation("eager")  # only eager attention returns weights
    probe = torch.randn(len(prompts), 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    return model, prompts, probe


def _batch(prompts, kind):
    if kind == "none":  # equal lengths, no mask
        ids = torch.stack([p[:3] for p in prompts])
        return ids, None
    return padded_batch(prompts, kind)


def _run(model, prompts, probe, kind):
    """Hidden states and attentions (each with ``retain_grad()``) after a backward from a loss on the output at
    the real tokens; and the real columns of each row."""
    ids, mask = _batch(prompts, kind)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    model.zero_grad(set_to_none=True)
    out = model.model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1 and len(out.attentions) > 0
    for t in out.hidden_states + out.attentions:
        t.retain_grad()
    cols = [row.nonzero().flatten() for row in real]
    loss = sum((out.last_hidden_state[b, c] * probe[b, : len(c)]).sum() for b, c in enumerate(cols))
    loss.backward()
    return out, cols, real


@pytest.mark.parametrize("kind", KINDS)
def test_returned_hidden_states_and_attentions_get_gradients(family, kind):
    model, prompts, probe = family
    out, cols, real = _run(model, prompts, probe, kind)
    for i, h in enumerate(out.hidden_states):
        assert h.grad is not None, f"hidden_states[{i}]"
        assert h.grad[real].abs().sum() > 0, f"hidden_states[{i}]: no gradient at the real tokens"
        assert not h.grad[~real].any(), f"hidden_states[{i}]: gradient at a pad"
    for i, a in enumerate(out.attentions):
        assert a.grad is not None, f"attentions[{i}]"
    assert out.hidden_states[-1] is out.last_hidden_state
    if kind in ("none", "left"):
        return
    # The same prompts left-padded (run as given): the same hidden states and gradients at each real token.
    want, want_cols, _ = _run(model, prompts, probe, "left")
    for i, (h, w) in enumerate(zip(out.hidden_states, want.hidden_states)):
        for b, (c, wc) in enumerate(zip(cols, want_cols)):
            torch.testing.assert_close(h[b, c], w[b, wc], rtol=1e-4, atol=1e-4, msg=f"hidden_states[{i}] row {b}")
            torch.testing.assert_close(h.grad[b, c], w.grad[b, wc], rtol=1e-4, atol=1e-4,
                                       msg=f"hidden_states[{i}].grad row {b}")


def test_recording_hidden_states_changes_no_output_nor_gradient(family):
    """The recorded hidden states' detour leaves the forward's values and every parameter's gradient as they are
    without ``output_hidden_states`` (right padding: the step runs reordered)."""
    model, prompts, probe = family
    ids, mask = padded_batch(prompts, "right")
    results = []
    for hidden in (False, True):
        model.zero_grad(set_to_none=True)
        out = model.model(ids, attention_mask=mask, output_hidden_states=hidden)
        (out.last_hidden_state * probe[:, : ids.shape[1]]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.last_hidden_state.detach(), grads))
    (plain, plain_grads), (recorded, recorded_grads) = results
    assert torch.equal(plain, recorded)
    assert plain_grads.keys() == recorded_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(recorded_grads[name], plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)
