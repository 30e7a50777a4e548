"""Speculative decoding on `QSAPagedCache`: exact rollback of every kind of state, and drafting in `generate()`.

A verify step writes ``k + 1`` tokens (the last accepted one and ``k`` drafts); `QSAPagedCache.crop`
then drops the rejected drafts. What makes that exact, per kind of state:

* Paged K/V (main, sliding), Inkling's conv taps, QSA compressed keys: addressed by position, so
  shortening a row is enough. Windowed tables keep ``num_speculative_tokens`` positions more than the
  next query reads (`stores.inkling`), the QSA raw-key ring as many more keys (`stores.qsa_index`).
* GatedDeltaNet recurrent state and conv window, PLE conv window and n-gram context (Qwen4Exp):
  overwritten in place every step. With ``num_speculative_tokens = k`` each forward keeps the state
  after each of a row's last ``k + 1`` positions in a per-row ring (`stores.linear_state`); the
  recurrent states of those positions come from running the recurrence one token at a time
  (`gated_delta_keeping_states`). ``crop(-n)`` copies back the state after position ``length - 1 - n``.

How far back a row can go: the ring holds the state after each of the last ``k + 1`` positions the row
reached, so it can be cropped to any length down to ``k`` below the longest length it has had; crops in
a row share that budget (`rollback_floor`).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------- rollback


def step_history(cache, state, device, num_rows: int, query_len: int):
    """``(m, slots)`` for a linear-state store that keeps rollback history, else None."""
    if not state.history:
        return None
    return state.history_slots(cache.step_metadata(device).position, num_rows, query_len)


def gated_delta_keeping_states(chunk_rule, recurrent_rule, query, key, value, g, beta, initial_state, keep: int):
    """The gated delta rule over ``[B, L, ...]`` inputs, also returning the recurrent state after each of
    the last ``keep`` tokens.

    The first ``L - keep`` tokens run as one chunked pass; the last ``keep`` run one at a time through
    the recurrent rule (a decode step does exactly that, so verifying a draft costs the same arithmetic
    as decoding it). Returns ``(core [B, L, Hv, Dv], final state, states [B, keep, Hv, Dk, Dv])``.
    """
    L = query.shape[1]
    head = L - keep
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs, states = [], []
    state = initial_state
    if head > 0:
        out, state = chunk_rule(query[:, :head], key[:, :head], value[:, :head], g=g[:, :head], beta=beta[:, :head],
                                initial_state=state, **kwargs)
        outs.append(out)
    for t in range(head, L):
        s = slice(t, t + 1)
        out, state = recurrent_rule(query[:, s], key[:, s], value[:, s], g=g[:, s], beta=beta[:, s],
                                    initial_state=state, **kwargs)
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=1), state, torch.stack(states, dim=1)


def rollback_floor(cache, row: int) -> int:
    """The shortest length ``row`` can be cropped to on a Qwen4Exp cache (ring history and QSA ring)."""
    if cache.num_speculative_tokens == 0:
        return cache.lengths[row]
    return max(0, cache._crop_floor[row], cache.lengths[row] - cache.num_speculative_tokens)


def check_linear_rollback(cache, drop: int) -> None:
    """Raise unless every row of a Qwen4Exp cache can drop ``drop`` tokens (before anything changes)."""
    limit = cache.num_speculative_tokens
    if limit == 0:
        raise ValueError(
            f"cannot drop {drop} tokens: this Qwen4Exp cache keeps no rollback history for its recurrent state "
            f"(num_speculative_tokens=0); build it with num_speculative_tokens={drop} or more"
        )
    for b in range(cache.num_rows):
        deepest = cache.lengths[b] - rollback_floor(cache, b)
        if drop > deepest:
            raise ValueError(
                f"cannot drop {drop} tokens: row {b} can go back {deepest} at most (num_speculative_tokens={limit}: "
                f"the cache keeps the state after each of the last {limit + 1} positions a row reached)"
            )


def restore_linear_states(cache, new_lengths: list[int]) -> None:
    """Every row of a Qwen4Exp cache takes its recurrent / conv / PLE state after ``new_lengths[b] - 1``."""
    rows = list(range(cache.num_rows))
    for b in rows:
        # What the ring held before this crop bounds every later crop until the row grows past it.
        cache._crop_floor[b] = max(cache._crop_floor[b], cache.lengths[b] - cache.num_speculative_tokens)
    for layer in cache.layers:
        linear = layer.stores.get("linear")
        if linear is not None:
            linear.restore(rows, new_lengths)


# ---------------------------------------------------------------------------------------------- generate()

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


def attach_assistant_cache(generator, generation_config, batch_size: int, input_length: int, bound: int) -> None:
    """Give an assistant model of ours a cache it can crop, sized for the whole main generation.

    transformers lets the assistant's own ``generate()`` build its cache in the first round, sized for that
    round only and without rollback headroom. Each round transformers crops the assistant's cache to two
    tokens short of the main sequence and re-feeds those: after ``k`` drafts of which ``n`` were accepted
    that drops ``k - n`` tokens, at most ``bound``.
    """
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    from .cache import QSAPagedCache
    from .generation import PagedCacheGenerationMixin

    if not isinstance(generator, AssistedCandidateGenerator):
        return
    assistant = generator.assistant_model
    if not isinstance(assistant, PagedCacheGenerationMixin):
        return
    if generator.assistant_kwargs.get("past_key_values") is not None:
        return
    kwargs = generator.assistant_kwargs
    # The assistant never holds more than max_length - 2 columns (it drafts up to the main model's limit).
    kwargs["past_key_values"] = QSAPagedCache(
        assistant.config, max_batch_size=batch_size, max_cache_len=generation_config.max_length,
        num_speculative_tokens=bound,
    )
    if kwargs.get("attention_mask") is None:
        # generate() drops an all-ones mask; the assistant's own generate() would then infer one from pad ids,
        # masking any generated token that equals pad_token_id. The main model treats every token as real: so
        # does the assistant (transformers extends this mask with ones every round).
        kwargs["attention_mask"] = torch.ones(batch_size, input_length, dtype=torch.long, device=assistant.device)
