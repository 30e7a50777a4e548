"""Prefix caching in `generate()`: a cache built with ``prefix_caching=True`` keeps each prefill's prompts, and a
later call with other prompts needs no ``reset()``: each row starts from the longest cached prefix of its prompt
and prefills the rest. Tokens and logits equal transformers' own model on each prompt alone (fp32), on both
families, with prefixes that diverge inside a unit (a QSA group, Inkling's window and conv span), rows restored
to different lengths in one batch, and chunked prefill."""

from __future__ import annotations

import pytest
import torch

import helpers.inkling as inkling
from helpers.qwen4 import left_pad, make_pair, random_prompts

from hf_qsa_cache import QSAPagedCache

NEW = 4
# Every prompt here is shorter than the default `prefix_snapshot_gap` (256 tokens), which would then never stop a
# prefill at its snapshot point: these tests of that stop force the gap to 0 (`test_a_restore_within_the_gap...`
# keeps the default).
STOP = {"prefix_snapshot_gap": 0}


def family(name: str):
    if name == "qwen4_exp":
        ref, ours = make_pair()
        return ref, ours, lambda n, seed: random_prompts([n], seed=seed)[0]
    ref, ours = inkling.make_pair(inkling.make_config())
    return ref, ours, lambda n, seed: inkling.make_prompts([n], seed=seed)[0].tolist()


def alone(ref, prompt: list[int]):
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):], torch.stack([s[0] for s in out.logits])


def generate(model, cache, prompts):
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out, ids.shape[1]


def check_rows(ref, prompts, out, width):
    for i, p in enumerate(prompts):
        tokens, logits = alone(ref, p)
        assert out.sequences[i, width:].tolist() == tokens.tolist(), f"row {i}"
        torch.testing.assert_close(torch.stack([s[i] for s in out.logits]), logits, atol=1e-4, rtol=0,
                                   msg=lambda m: f"row {i}: {m}")


@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
def test_second_call_starts_from_cached_prefixes(name):
    ref, ours, prompt = family(name)
    cache = QSAPagedCache(ours.config, 3, 64, block_size=4, prefix_caching=True, **STOP)
    a, c = prompt(21, 1), prompt(14, 2)
    first = [a, c]
    out, width = generate(ours, cache, first)
    check_rows(ref, first, out, width)
    stats = cache.memory_stats()["prefix_cache"]
    assert stats["hit_tokens"] == 0 and stats["snapshots"] == 2  # a at 20 tokens, c at 12

    # No reset(): the held rows are retired, the new rows start from cached prefixes of 20, 12 and 8 tokens.
    b = a[:22] + prompt(3, 3)  # a, all of it, and more
    d = a[:13] + prompt(6, 4)  # diverges inside the unit after 12 (no snapshot there: restores 12? no: 20 is a's)
    e = c[:12] + prompt(2, 5)
    second = [b, d, e]
    out, width = generate(ours, cache, second)
    check_rows(ref, second, out, width)
    stats = cache.memory_stats()["prefix_cache"]
    assert stats["hit_tokens"] == 20 + 12
    for table in cache.tables.values():
        table.check_accounting()


def test_chunked_prefill_from_cached_prefixes():
    ref, ours, prompt = family("qwen4_exp")
    ours.prefill_chunk_tokens = 10  # 5 tokens a row a step: several steps before and after the boundary
    cache = QSAPagedCache(ours.config, 2, 64, block_size=4, prefix_caching=True, **STOP)
    a = prompt(27, 6)
    out, width = generate(ours, cache, [a, a[:9]])
    check_rows(ref, [a, a[:9]], out, width)
    second = [a[:17] + prompt(9, 7), a + prompt(2, 8)]
    out, width = generate(ours, cache, second)
    check_rows(ref, second, out, width)
    assert cache.memory_stats()["prefix_cache"]["hit_tokens"] == 8 + 24


@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
def test_next_turn_restores_what_the_last_call_decoded(name):
    ref, ours, prompt = family(name)
    cache = QSAPagedCache(ours.config, 2, 64, block_size=4, prefix_caching=True, **STOP)
    a, c = prompt(18, 11), prompt(11, 12)
    out, width = generate(ours, cache, [a, c])
    check_rows(ref, [a, c], out, width)
    # The rows hold 21 and 14 tokens: decoding took them past 20 and 12, where they kept their state.
    histories = [p + out.sequences[i, width:].tolist() for i, p in enumerate([a, c])]
    second = [histories[0] + prompt(3, 13), histories[1] + prompt(2, 14)]
    hits = cache.memory_stats()["prefix_cache"]["hit_tokens"]
    out, width = generate(ours, cache, second)
    check_rows(ref, second, out, width)
    assert cache.memory_stats()["prefix_cache"]["hit_tokens"] - hits == 20 + 12


def test_a_held_row_that_cannot_be_cached_is_released_all_the_same(monkeypatch):
    """A call with new prompts retires the held rows into cached prefixes (`prefix_generation.retire_rows`); an
    insert that raises only loses that prefix: the rows are released and the call runs exactly."""
    ref, ours, prompt = family("qwen4_exp")
    cache = QSAPagedCache(ours.config, 2, 64, block_size=4, prefix_caching=True, **STOP)
    generate(ours, cache, [prompt(21, 1), prompt(14, 2)])

    def refuse(*args, **kwargs):
        raise RuntimeError("no memory for a snapshot")

    monkeypatch.setattr(cache, "cache_prefix", refuse)
    second = [prompt(9, 3), prompt(17, 4)]
    out, width = generate(ours, cache, second)
    check_rows(ref, second, out, width)


@pytest.mark.parametrize("name", ["qwen4_exp", "inkling"])
def test_a_restore_within_the_gap_prefills_in_one_step(name):
    """``prefix_snapshot_gap=5`` (units of 4): a first call's 13-token prompt stops at its snapshot point (13 tokens to
    feed) and caches 12; a second call's prompt that continues its first 12 tokens by 5 restores 12 and prefills the
    rest in one step (5 tokens to feed), so nothing new is cached at its snapshot point (16). With the gap at 4 it
    stops there (a step more) and caches it. Tokens and logits equal transformers'."""
    ref, ours, prompt = family(name)
    a = prompt(13, 1)
    b = a[:12] + prompt(5, 2)

    def run(gap: int) -> tuple[list[int], int]:
        cache = QSAPagedCache(ours.config, 1, 64, block_size=4, prefix_caching=True, prefix_snapshot_gap=gap)
        widths = []  # each step's columns
        hook = ours.model.register_forward_pre_hook(
            lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        try:
            generate(ours, cache, [a])
            widths.clear()
            out, width = generate(ours, cache, [b])
        finally:
            hook.remove()
        check_rows(ref, [b], out, width)
        cache.reset()
        return widths, cache.restore_prefix(0, b + [7], limit=len(b))

    decode = [1] * (NEW - 1)
    assert run(gap=5) == ([5] + decode, 12)
    assert run(gap=4) == ([4, 1] + decode, 16)  # to the snapshot point, then the prompt's last token
