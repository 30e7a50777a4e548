"""Shared check of the fusions (`hf_qsa_cache.ops`): generate() with one fusion off and on."""

from __future__ import annotations

import torch


def assert_fused_generate_equals_default(monkeypatch, model, ids, mask, module, flag: str, fused_function: str,
                                         atol: float) -> None:
    """Greedy generate() with ``module.<flag>`` False, then True: ``module.<fused_function>`` (what the fused path
    runs on the CPU) runs only when on, the tokens are equal and the logits within ``atol``."""
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(module, flag, on)
        calls = []
        real = getattr(module, fused_function)
        monkeypatch.setattr(module, fused_function, lambda *a, real=real: calls.append(1) or real(*a))
        with torch.no_grad():
            runs[on] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                      output_scores=True, return_dict_in_generate=True)
        monkeypatch.setattr(module, fused_function, real)
        assert bool(calls) == on, f"{fused_function} ran {len(calls)} times with {flag}={on}"
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    torch.testing.assert_close(torch.stack(runs[True].scores), torch.stack(runs[False].scores), atol=atol, rtol=0)
