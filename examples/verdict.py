"""The examples' check: generated rows against a reference, one OK line or a non-zero exit."""

from __future__ import annotations

import copy
import sys

import torch


def transformers_twin(model, transformers_class):
    """transformers' own class holding ``model``'s weights (its state dict, loaded strictly), fp32 on the CPU."""
    twin = transformers_class(copy.deepcopy(model.config)).eval()
    weights = {name: (t.float() if t.is_floating_point() else t).cpu() for name, t in model.state_dict().items()}
    twin.load_state_dict(weights, strict=True)
    return twin


def compare(name: str, got: list[list[int]], want: list[list[int]], reference: str) -> None:
    """Print ``OK: ...`` when every row of ``got`` equals the same row of ``want``; otherwise print where each
    differing row first differs and exit with status 1."""
    if len(got) != len(want):
        print(f"MISMATCH: {name}: {len(got)} rows generated, {len(want)} in the reference ({reference})",
              file=sys.stderr)
        raise SystemExit(1)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if not bad:
        tokens = sum(len(row) for row in got)
        print(f"OK: {name}: all {len(got)} rows ({tokens} new tokens) equal to {reference}")
        return
    for i in bad:
        a, b = got[i], want[i]
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"MISMATCH: {name} row {i} differs from {reference} at new token {j}: {a[j:j + 8]} "
              f"against {b[j:j + 8]} (lengths {len(a)} and {len(b)})", file=sys.stderr)
    print(f"MISMATCH: {name}: {len(bad)} of {len(got)} rows differ from {reference}", file=sys.stderr)
    raise SystemExit(1)


def greedy(model, new_tokens: int, input_ids: torch.Tensor, **inputs) -> list[int]:
    """``model``'s greedy new tokens for one unpadded row (``[1, n]`` ids, its media in ``inputs``) on the model's
    device, on the model's default cache, with no end-of-sequence id."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs.setdefault("attention_mask", torch.ones_like(input_ids).to(device))
    with torch.no_grad():
        out = model.generate(input_ids.to(device), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **inputs)
    return out[0, input_ids.shape[1]:].tolist()


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row of a padded batch alone, without its pads, as a ``[1, n]`` tensor on the CPU."""
    return [row[keep.bool()].cpu()[None] for row, keep in zip(ids, mask)]
