"""Shared check of the fusions (`hf_qsa_cache.ops`): generate() with one fusion off and on."""

from __future__ import annotations

import torch


def assert_fused_generate_equals_default(monkeypatch, model, ids, mask, module, fusion: str, fused_function: str,
                                         atol: float) -> None:
    """Greedy generate() with the fusion named ``fusion`` off, then on: ``module.<fused_function>`` (what the fused
    path runs on the CPU) runs only when on, the tokens are equal and the logits within ``atol``."""
    from hf_qsa_cache import fusions

    runs = {}
    for on in (False, True):
        monkeypatch.setitem(fusions.STATE, fusion, on)
        calls = []
        real = getattr(module, fused_function)
        monkeypatch.setattr(module, fused_function, lambda *a, real=real: calls.append(1) or real(*a))
        with torch.no_grad():
            runs[on] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                      output_scores=True, return_dict_in_generate=True)
        monkeypatch.setattr(module, fused_function, real)
        assert bool(calls) == on, f"{fused_function} ran {len(calls)} times with {fusion}={on}"
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    torch.testing.assert_close(torch.stack(runs[True].scores), torch.stack(runs[False].scores), atol=atol, rtol=0)


def fused_generate_mismatch(model, ids, mask, fusion: str, launches: list, atol: float | None,
                            cache=None) -> str | None:
    """Greedy generate() of ``model`` with fusion ``fusion`` off, then on (in a script under the Triton
    interpreter, its kernels' launches counted into ``launches``): None when the fused run launched kernels and
    gave the same tokens and logits (bit for bit when ``atol`` is None, else within it), otherwise what differs.
    ``cache``: builds each run's ``past_key_values`` (default: the one generate() makes)."""
    from hf_qsa_cache.fusions import fused

    def generate():
        extra = {} if cache is None else {"past_key_values": cache()}
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                  eos_token_id=None, output_logits=True, return_dict_in_generate=True, **extra)

    # Off explicitly: a fusion on by default (`FUSIONS`) would otherwise run its kernels in the reference too.
    with fused((fusion,), on=False):
        want = generate()
    launches.clear()
    with fused((fusion,)):
        have = generate()
    if not launches or not torch.equal(have.sequences, want.sequences):
        return f"{len(launches)} launches, tokens {have.sequences.tolist()} != {want.sequences.tolist()}"
    for step, (h, w) in enumerate(zip(have.logits, want.logits, strict=True)):
        if atol is None and not torch.equal(h, w):
            return f"step {step}: logits differ (max {(h - w).abs().max():.3g})"
        if atol is not None:
            try:
                torch.testing.assert_close(h, w, atol=atol, rtol=0)
            except AssertionError as err:
                return f"step {step}: {err}"
    return None
