"""Torch calls a generate() loop makes per token outside the model's forward (CPU, the tests' tiny models).

    python benchmarks/count_loop_calls.py

On a GPU each such call is a kernel launch (or a copy) between two decode steps. Counted under the torch
profiler: the top-level aten ops that compute (views, shapes and allocations left out, as in
`profile_decode_step.py`), outside every forward of the model and outside the cache's crops (a verify
step's rollback, the same in both prompt-lookup loops). Ways to generate 40 tokens (greedy: the same in
every loop) after a prompt whose continuation the random model does not repeat (prompt lookup's drafts are
rejected): plain greedy decoding of one row in transformers' `_sample` and in our loop
(`hf_qsa_cache/decode_loop.py`, what `generate()` runs), the same for 8 rows and for 8 sampled rows (top-k 20),
prompt lookup in transformers' assisted-decoding loop and in ours (`hf_qsa_cache/lookup_decoding.py`). Also the
host reads (``_local_scalar_dense``: each waits for the device) and the number of forwards (the same in all: one
token each).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE, os.path.join(os.path.dirname(HERE), "tests")]

from bench_speculative import build  # noqa: E402
from profile_decode_step import _NO_KERNEL  # noqa: E402

from hf_qsa_cache import QSAPagedCache, decode_loop, lookup_decoding  # noqa: E402

NEW_TOKENS = 40
SAMPLED = {"do_sample": True, "top_k": 20}


def _inside(event, label: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == label:
            return True
        parent = parent.cpu_parent
    return False


def count(model, ids, ours: bool, **kwargs) -> tuple[float, int, Counter]:
    """(computing calls per step outside forwards and crops, forwards, the calls by name and the host reads under
    "host reads")."""
    forwards, ranges = [0], []

    def enter(*_):
        forwards[0] += 1
        ranges.append(record_function("forward"))
        ranges[-1].__enter__()

    def leave(*_):
        ranges.pop().__exit__(None, None, None)

    crop = QSAPagedCache.crop

    def labelled_crop(cache, n):
        with record_function("crop"):
            return crop(cache, n)

    applies, applies_to_rows = lookup_decoding.applies, decode_loop.applies
    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    QSAPagedCache.crop = labelled_crop
    if not ours:
        lookup_decoding.applies = decode_loop.applies = lambda *a, **k: False
    try:
        with torch.no_grad():
            settings = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, **kwargs}
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, **settings)  # warm-up
            forwards[0] = 0
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, **settings)
    finally:
        lookup_decoding.applies = applies
        decode_loop.applies = applies_to_rows
        QSAPagedCache.crop = crop
        for handle in handles:
            handle.remove()
    calls = Counter(
        e.name for e in prof.events()
        if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
        and e.name[len("aten::"):] not in _NO_KERNEL and not _inside(e, "forward") and not _inside(e, "crop"))
    per_step = sum(calls.values()) / NEW_TOKENS
    # A host read (`bool`, `.item()`, `.tolist()` of a device value) waits for the device, at any depth of calls;
    # but not `torch._assert_async`'s (torch.multinomial's check of the probabilities), a read on the CPU only:
    # on CUDA it is an assert in a kernel.
    calls["host reads"] = sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense"
                              and not _inside(e, "forward") and not _inside(e, "crop")
                              and not _inside(e, "aten::_assert_async"))
    return per_step, forwards[0], calls


def main() -> None:
    torch.set_num_threads(1)
    for family in ("qwen4_exp", "inkling"):
        model, _ = build(family, None, "cpu", True)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        passage = torch.randint(3, vocab, (1, 30), generator=torch.Generator().manual_seed(0))
        ids = torch.cat([passage, passage[:, :6]], dim=1)
        for name, ours, rows, kwargs in (("plain greedy, transformers' loop", False, 1, {}),
                                         ("plain greedy, our loop", True, 1, {}),
                                         ("plain greedy 8 rows, transformers' loop", False, 8, {}),
                                         ("plain greedy 8 rows, our loop", True, 8, {}),
                                         ("sampled 8 rows, transformers' loop", False, 8, SAMPLED),
                                         ("sampled 8 rows, our loop", True, 8, SAMPLED),
                                         ("prompt lookup, transformers' loop", False, 1,
                                          {"prompt_lookup_num_tokens": 3}),
                                         ("prompt lookup, our loop", True, 1, {"prompt_lookup_num_tokens": 3})):
            per_token, forwards, calls = count(model, ids.repeat(rows, 1), ours, **kwargs)
            print(f"{family} {name}: {per_token:.1f} calls per step outside the forward, "
                  f"{calls.pop('host reads')} host reads in {NEW_TOKENS} steps ({forwards} forwards); "
                  f"most: {', '.join(f'{k[6:]} {v}' for k, v in calls.most_common(6))}")


if __name__ == "__main__":
    main()
