"""Speculative decoding in `generate()`: how many drafts one verify step may carry (hence the rollback
headroom a cache needs), and the cap on heuristic draft schedules. The rollback itself is in
`hf_qsa_cache.rollback`.
"""

from __future__ import annotations

# transformers' default `num_assistant_tokens` (GenerationConfig defaults) when the assistant sets none.
DEFAULT_NUM_ASSISTANT_TOKENS = 20
HEURISTIC_SCHEDULES = ("heuristic", "heuristic_transient")


def assistant_schedule(assistant) -> tuple[int, bool]:
    """``(num_assistant_tokens, grows)`` of an assistant model: what it drafts in its first round, and
    whether the heuristic schedules may raise that (by 2 after every fully accepted round, without bound)."""
    config = assistant.generation_config
    k = config.num_assistant_tokens
    k = DEFAULT_NUM_ASSISTANT_TOKENS if k is None else int(k)
    return k, config.num_assistant_tokens_schedule in HEURISTIC_SCHEDULES


def draft_tokens_bound(model, generation_config, schedule: tuple[int, bool] | None, new_tokens: int) -> tuple[int, str]:
    """``(bound, source)``: the most draft tokens one verify step of `generate()` can carry, hence the
    deepest `crop` it asks for, and the setting that decides it.

    * ``prompt_lookup_num_tokens=k``: k (its candidates are not capped by the remaining length).
    * ``use_mtp``: ``num_mtp_layers`` (one draft per MTP layer).
    * ``assistant_model``: its ``num_assistant_tokens`` (20 by default), capped by ``new_tokens`` (transformers
      never drafts past ``max_length``); with the heuristic schedules the count grows after every fully
      accepted round, without bound in transformers; our generate() caps it at twice the starting count
      (`heuristic_draft_cap`), so the bound is ``min(2 * k, new_tokens)``.
    """
    if generation_config.prompt_lookup_num_tokens is not None:
        return int(generation_config.prompt_lookup_num_tokens), "prompt_lookup_num_tokens"
    if generation_config.use_mtp:
        layers = getattr(model.config.get_text_config(decoder=True), "num_mtp_layers", None) or 0
        return int(layers), "num_mtp_layers"
    if schedule is not None:
        k, grows = schedule
        if grows:
            return max(min(heuristic_draft_cap(k), new_tokens), 0), (
                "the assistant's heuristic num_assistant_tokens_schedule (at most twice its num_assistant_tokens)")
        return max(min(k, new_tokens), 0), "the assistant's num_assistant_tokens"
    return 0, "no drafting"


def heuristic_draft_cap(k: int) -> int:
    """Most drafts per round a heuristic schedule may reach, starting from ``k``. transformers grows the count
    by 2 after every fully accepted round without bound, which would size every row's rollback history
    (Qwen4Exp: the whole recurrent state per kept position) by ``max_new_tokens``."""
    return 2 * max(k, 1)


def cap_heuristic_drafts(generator, k: int) -> None:
    """Keep an assistant's heuristic draft count within `heuristic_draft_cap` (greedy tokens do not depend
    on it; the count only decides how much is verified per step)."""
    update = generator.update_candidate_strategy

    def capped(*args, **kwargs):
        update(*args, **kwargs)
        generator.num_assistant_tokens = min(generator.num_assistant_tokens, heuristic_draft_cap(k))

    generator.update_candidate_strategy = capped


def overshoot(generation_config, bound: int) -> int:
    """Columns a verify step may write past ``max_length - 1``: prompt lookup and MTP draft without
    looking at the remaining length (transformers trims the accepted tokens afterwards)."""
    if generation_config.prompt_lookup_num_tokens is not None or generation_config.use_mtp:
        return bound
    return 0


def check_headroom(cache, bound: int, source: str) -> None:
    if cache.num_speculative_tokens < bound:
        raise ValueError(
            f"assisted generation verifies up to {bound} draft tokens per step ({source}) and then crops the "
            f"rejected ones, but the cache has num_speculative_tokens={cache.num_speculative_tokens}: build the "
            f"QSAPagedCache with num_speculative_tokens={bound} (or more)"
        )
