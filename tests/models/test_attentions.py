"""``output_attentions=True`` against transformers' own classes (eager attention, fp32, CPU).

Attentions are ``[batch, heads, query_len, kv_len]`` softmax probabilities over the caller's key columns
(kv_len = the mask's width), for the layers upstream records: Qwen4Exp's QSA layers (over the selected
tokens only; GatedDeltaNet layers give none), every Inkling layer (relative bias, window, log scaling).
Each row is compared with upstream on that row alone, unpadded: upstream's padded Inkling batch counts
pads in its log scaling, so it is no reference for padded rows.

Prompts are long enough that QSA selection is active (> 8 budget tokens) and Inkling's window (6) evicts.
"""

from __future__ import annotations

import pytest
import torch
from helpers.qwen4 import make_pair as qwen_pair
from helpers.qwen4 import random_prompts
from helpers.inkling import make_config as inkling_config
from helpers.inkling import make_pair as inkling_pair
from helpers.inkling import make_prompts as inkling_prompts
from helpers.batches import padded_batch as _layout

from hf_qsa_cache import QSAPagedCache

TOL = dict(rtol=1e-5, atol=1e-5)
NEXT_TOKEN = 7


class Family:
    def __init__(self, name):
        self.name = name
        if name == "qwen4_exp":
            self.ref, self.ours = qwen_pair()
            self.prompts = [torch.tensor(p) for p in random_prompts([25, 12, 21])]
        else:
            self.ref, self.ours = inkling_pair(inkling_config())
            self.prompts = inkling_prompts([14, 5, 9])
        self.ref.set_attn_implementation("eager")  # sdpa returns no attention weights (nor do ours)
        self.ours.set_attn_implementation("eager")
        self._alone = {}

    def upstream_alone(self, b: int):
        """Upstream on prompt ``b`` alone: (prefill attentions, attentions of one decode step)."""
        if b not in self._alone:
            prompt = self.prompts[b][None]
            with torch.no_grad():
                pre = self.ref(prompt, use_cache=True, output_attentions=True)
                step = self.ref(torch.tensor([[NEXT_TOKEN]]), past_key_values=pre.past_key_values,
                                attention_mask=torch.ones(1, prompt.shape[1] + 1, dtype=torch.long),
                                output_attentions=True)
            self._alone[b] = [a[0] for a in pre.attentions], [a[0] for a in step.attentions]
        return self._alone[b]


@pytest.fixture(scope="module", params=["qwen4_exp", "inkling"])
def family(request):
    return Family(request.param)


def _assert_row(got: torch.Tensor, want: torch.Tensor, query_cols, key_cols, msg: str):
    """``got [H, Lq, W]`` at the real query rows and real key columns equals ``want [H, q, k]``; every other
    key column of those rows is zero."""
    rows = got[:, query_cols]
    torch.testing.assert_close(rows[..., key_cols], want, **TOL, msg=lambda m: f"{msg}: {m}")
    others = torch.ones(got.shape[-1], dtype=torch.bool)
    others[key_cols] = False
    assert not rows[..., others].any(), f"{msg}: weight at a key column that is not attended"


@pytest.mark.parametrize("kind", ["left", "right", "middle"])
def test_forward_matches_upstream_per_row(family, kind):
    ids, mask = _layout(family.prompts, kind)
    with torch.no_grad():
        out = family.ours(ids, attention_mask=mask, output_attentions=True)
        text = family.ours.model(ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == len(family.upstream_alone(0)[0]) == len(text.attentions)
    for layer, (a, t) in enumerate(zip(out.attentions, text.attentions)):
        assert a.shape == (ids.shape[0], a.shape[1], ids.shape[1], ids.shape[1])
        torch.testing.assert_close(a, t, rtol=0, atol=0)
    for b in range(len(family.prompts)):
        cols = mask[b].nonzero().flatten()
        for layer, want in enumerate(family.upstream_alone(b)[0]):
            _assert_row(out.attentions[layer][b], want, cols, cols, f"{kind} row {b} layer {layer}")


@pytest.mark.parametrize("kind", ["left", "right"])
def test_decode_step_matches_upstream_per_row(family, kind):
    ids, mask = _layout(family.prompts, kind)
    B, W = ids.shape
    cache = QSAPagedCache(family.ours.config, max_batch_size=B, max_cache_len=W + 4)
    mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
    with torch.no_grad():
        family.ours(ids, attention_mask=mask[:, :-1], past_key_values=cache)
        out = family.ours(torch.full((B, 1), NEXT_TOKEN), attention_mask=mask, past_key_values=cache,
                          output_attentions=True)
    for b in range(B):
        cols = mask[b].nonzero().flatten()
        for layer, want in enumerate(family.upstream_alone(b)[1]):
            got = out.attentions[layer][b]
            assert got.shape[-2:] == (1, W + 1)
            # Upstream's sliding layers keep only the window's keys: its key columns are the row's last ones.
            _assert_row(got, want, [0], cols[cols.numel() - want.shape[-1]:], f"{kind} row {b} layer {layer}")


def _sliding(family, layer: int) -> bool:
    return family.name == "inkling" and family.ours.config.layer_types[layer] == "hybrid_sliding"


def test_generate_attentions_have_upstream_structure(family):
    ids, mask = _layout(family.prompts, "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                  output_attentions=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ours = family.ours.generate(ids, **kwargs)
        ref = family.ref.generate(ids, **kwargs)
    assert len(ours.attentions) == len(ref.attentions) == 3
    for step, (mine, theirs) in enumerate(zip(ours.attentions, ref.attentions)):
        assert len(mine) == len(theirs)
        for layer, (a, t) in enumerate(zip(mine, theirs)):
            assert a.dtype == t.dtype
            if step > 0 and _sliding(family, layer):
                # Upstream's sliding cache keeps the window only: its decode steps have that many key columns.
                # Ours have every key column (zero outside the window), as its full layers and the mask do.
                assert t.shape[-1] == family.ours.config.sliding_window_size
                assert a.shape == t.shape[:-1] + (ids.shape[1] + step,)
            else:
                assert a.shape == t.shape, f"step {step} layer {layer}"


def test_assisted_decoding_returns_attentions(family):
    prompt = family.prompts[0]
    ids = torch.cat([prompt, prompt[:8]])[None]  # a repeat, so that prompt lookup drafts
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_attentions=True,
                  pad_token_id=0, eos_token_id=None)
    verify_steps = []
    hook = family.ours.model.register_forward_pre_hook(
        lambda module, args, kw: verify_steps.append(kw["input_ids"].shape[1] > 1), with_kwargs=True)
    try:
        with torch.no_grad():
            plain = family.ours.generate(ids, **kwargs)
            verify_steps.clear()
            assisted = family.ours.generate(ids, prompt_lookup_num_tokens=3, **kwargs)
    finally:
        hook.remove()
    assert any(verify_steps[1:]), "no multi-token verify step ran"
    assert torch.equal(assisted.sequences, plain.sequences)
    assert len(assisted.attentions) == len(plain.attentions)
    for step, (a_step, p_step) in enumerate(zip(assisted.attentions, plain.attentions)):
        for layer, (a, p) in enumerate(zip(a_step, p_step)):
            torch.testing.assert_close(a, p, **TOL, msg=lambda m: f"step {step} layer {layer}: {m}")


# ----------------------------------------------------------------------------- autograd
@pytest.mark.parametrize("kind", ["left", "right", "middle"])
def test_returned_weights_are_on_the_outputs_autograd_path(family, kind):
    """As transformers' eager attention: a backward from the output alone (``last_hidden_state[0, 0, 0]``, a real
    token's or not) reaches the returned weights, so ``retain_grad()`` on them gets a gradient, of any padding."""
    ids, mask = _layout(family.prompts, kind)
    out = family.ours.model(ids, attention_mask=mask, output_attentions=True)
    assert all(a.requires_grad for a in out.attentions)
    with torch.no_grad():  # the output computed from the weights equals the layers' usual op's, and so do they
        plain = family.ours.model(ids, attention_mask=mask, output_attentions=True)
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], plain.last_hidden_state[real], **TOL)
    for a, p in zip(out.attentions, plain.attentions):
        torch.testing.assert_close(a, p, **TOL)
    for a in out.attentions:
        a.retain_grad()
    row = int(mask[:, -1].nonzero()[0])  # a row whose last column is real: its output reads every layer
    out.last_hidden_state[row, -1].sum().backward()
    for layer, a in enumerate(out.attentions):
        assert a.grad is not None, f"layer {layer}"
        assert a.grad[row, :, -1].abs().sum() > 0, f"layer {layer}: no gradient reached the last query's weights"


def _param_grads(model, loss_of) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_through_the_returned_weights_equal_upstreams(family):
    """A loss on the logits and on the returned weights themselves: every parameter's gradient equals upstream's
    (eager, fp32) on the same unpadded prompt."""
    prompt = family.prompts[0][None]

    def loss_of(model):
        out = model(prompt, output_attentions=True)
        weighted = sum((a * torch.linspace(0, 1, a.shape[-1])).sum() for a in out.attentions)
        return out.logits.logsumexp(-1).sum() + weighted

    want = _param_grads(family.ref, loss_of)
    have = _param_grads(family.ours, loss_of)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_no_weights_and_no_extra_work_without_grad(family, monkeypatch):
    """Without autograd the output runs the layers' usual attention op (the weights are a side computation)."""
    from hf_qsa_cache import attentions as module

    calls = []
    real = module.StepColumns.output
    monkeypatch.setattr(module.StepColumns, "output", lambda *a: calls.append(1) or real(*a))
    ids, mask = _layout(family.prompts, "right")
    with torch.no_grad():
        out = family.ours(ids, attention_mask=mask, output_attentions=True)
    assert out.attentions and not calls
    family.ours(ids, attention_mask=mask, output_attentions=True)
    assert calls


# ----------------------------------------------------------------------------- other attention implementations
@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
def test_sdpa_returns_what_transformers_returns(name):
    """With ``attn_implementation="sdpa"`` (transformers' default) transformers returns no weights (an empty
    tuple) and the same outputs: so do ours, on a left-padded batch, in forward and generate()."""
    if name == "qwen4_exp":
        ref, ours = qwen_pair()
        ids, mask = _layout([torch.tensor(p) for p in random_prompts([25, 12, 21])], "left")
    else:
        ref, ours = inkling_pair(inkling_config())
        ids, mask = _layout(inkling_prompts([14, 5, 9]), "left")
    for model in (ref, ours):
        model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, output_attentions=True)
        have = ours(ids, attention_mask=mask, output_attentions=True)
        text = ours.model(ids, attention_mask=mask, output_attentions=True)
    assert want.attentions == () and have.attentions == () and text.attentions == ()
    # Rows without pads (upstream's padded Inkling rows count pads in their log scaling: module docstring).
    whole = mask.all(dim=1)
    assert whole.any()
    torch.testing.assert_close(have.logits[whole], want.logits[whole], rtol=1e-4, atol=1e-4)  # upstream: sdpa
    kwargs = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                  output_attentions=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert ours.generate(ids, **kwargs).attentions == ref.generate(ids, **kwargs).attentions == ((), ())


def test_text_model_forward_names_output_attentions():
    """transformers' common tests pass ``output_attentions`` only to a forward that names it (its signature, or
    its typed kwargs): both text models name it."""
    import inspect

    from modeling import InklingTextModel, Qwen4ExpTextModel

    for cls in (Qwen4ExpTextModel, InklingTextModel):
        assert "output_attentions" in inspect.signature(cls.forward).parameters, cls.__name__
