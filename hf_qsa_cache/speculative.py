"""Speculative decoding in `generate()`: how many drafts one verify step may carry (hence the rollback
headroom a cache needs), the cap on heuristic draft schedules, and the adaptive draft count of prompt
lookup (`DraftBudget`). The rollback itself is in `hf_qsa_cache.rollback`.
"""

from __future__ import annotations

import torch

from .prompt_lookup import HostLookup, searches_on_host

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


class DraftBudget:
    """How many draft tokens prompt lookup proposes in its next round, from how its last rounds went.

    A verify step that carries drafts costs more than a plain decode step (more tokens through every layer,
    then a crop), and a round whose drafts are all rejected yields one token either way. So:

    * every draft of a round accepted: the budget grows by 2, up to ``limit`` (what the caller asked for,
      ``prompt_lookup_num_tokens``: the cache's rollback headroom is sized by it, never exceeded);
    * some accepted, some rejected: the budget shrinks by 1 (at least 1);
    * every draft rejected: the budget halves (at least 1), and the next ``pause`` rounds propose nothing
      (plain one-token steps, without even looking the prompt up). The pause starts at 1 round and doubles
      after each further round whose drafts are all rejected, up to ``max_pause`` (exponential back-off);
      a round with any accepted draft sets it back to 1;
    * a round that proposed nothing (paused, or the lookup found no match) changes nothing.

    The budget starts at ``limit``: while drafts keep being accepted it stays there, as transformers' fixed
    ``num_output_tokens``. When every draft is rejected, only about ``log2(n)`` of ``n`` rounds verify a
    draft (one token each after the first), and past the longest pause one round in ``max_pause + 1``.
    Greedy tokens never depend on it: drafting only decides how many tokens one forward verifies.

    Call `propose` once at the start of every round and `observe` once at its end.
    """

    def __init__(self, limit: int, max_pause: int = 64):
        if limit < 1 or max_pause < 1:
            raise ValueError(f"DraftBudget needs limit >= 1 and max_pause >= 1, got {limit} and {max_pause}")
        self.limit, self.max_pause = int(limit), int(max_pause)
        self.tokens = self.limit  # drafts the next drafting round may propose
        self.paused = 0  # rounds left that propose nothing
        self.pause = 1  # rounds the next all-rejected round pauses for

    def propose(self) -> int:
        """Drafts this round may propose (0: a plain step; a paused round is used up by asking)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.tokens

    def observe(self, proposed: int, accepted: int) -> None:
        """The round proposed ``proposed`` drafts and the model accepted the first ``accepted`` of them."""
        if proposed <= 0:
            return
        accepted = min(max(int(accepted), 0), proposed)
        if accepted == proposed:
            self.tokens = min(self.limit, self.tokens + 2)
            self.pause = 1
        elif accepted:
            self.tokens = max(1, self.tokens - 1)
            self.pause = 1
        else:
            self.tokens = max(1, self.tokens // 2)
            self.paused = self.pause
            self.pause = min(2 * self.pause, self.max_pause)

    def __repr__(self) -> str:
        return (f"DraftBudget(limit={self.limit}, tokens={self.tokens}, paused={self.paused}, "
                f"pause={self.pause}, max_pause={self.max_pause})")


def adapt_prompt_lookup(generator, budget: DraftBudget) -> None:
    """Let ``budget`` decide how many drafts transformers' `PromptLookupCandidateGenerator` proposes each
    round (its ``num_output_tokens``, fixed in transformers), and learn from each round's outcome (its
    ``update_candidate_strategy`` does nothing in transformers): the drafts the verify step carried
    (read off the logits transformers passes) and how many of them the model accepted.

    A round the budget gives no drafts returns the input unchanged without looking the prompt up, as
    transformers does when the lookup finds no match: the verify step is a plain one-token step. A round
    with drafts searches a host copy of the row (`hf_qsa_cache.prompt_lookup`: the same drafts, one small
    device read instead of dozens), unless the generator's logits processors may forbid drafts. The
    budget is kept as ``generator.draft_budget``. One budget serves the one row transformers allows in
    assisted generation (it refuses batches of more than one row).
    """
    get_candidates, update_candidate_strategy = generator.get_candidates, generator.update_candidate_strategy
    on_host = HostLookup(generator)
    proposed = [0]

    def budgeted_candidates(input_ids, *args, **kwargs):
        proposed[0] = 0
        n = budget.propose()
        if n == 0:
            return input_ids, None
        generator.num_output_tokens = n
        lookup = on_host if searches_on_host(generator) else get_candidates
        candidates, logits = lookup(input_ids, *args, **kwargs)
        proposed[0] = candidates.shape[1] - input_ids.shape[1]
        return candidates, logits

    def observed_strategy(input_ids, scores, num_matches):
        update_candidate_strategy(input_ids, scores, num_matches)
        # transformers passes the verify step's logits, one position per draft plus one: the drafts the
        # forward verified, also when a wrapper around this one cut what the lookup proposed.
        verified = scores.shape[1] - 1 if isinstance(scores, torch.Tensor) and scores.dim() == 3 else proposed[0]
        budget.observe(verified, int(num_matches))

    generator.get_candidates = budgeted_candidates
    generator.update_candidate_strategy = observed_strategy
    generator.draft_budget = budget


def drafts_without_placeholders(generator, placeholder_ids: tuple[int, ...]) -> None:
    """Cut the first round's drafts before their first media placeholder id.

    The first round's drafts are verified in the forward that carries the media (prompt lookup copies them from
    the prompt, an assistant model may draft any id), where a placeholder among them would have no features:
    upstream fails there ("Multimodal features and placeholder tokens do not match"). Later rounds carry no
    media and embed a drafted placeholder id as a token, as upstream does. Drafts only decide how many tokens
    one step verifies, never which tokens come out."""
    get_candidates = generator.get_candidates
    first = [True]

    def without_placeholders(input_ids, *args, **kwargs):
        candidates, logits = get_candidates(input_ids, *args, **kwargs)
        if not first[0]:
            return candidates, logits
        first[0] = False
        start = input_ids.shape[1]
        hit = torch.isin(candidates[:, start:], torch.tensor(placeholder_ids, device=candidates.device)).any(dim=0)
        if bool(hit.any()):
            keep = int(hit.int().argmax())
            candidates = candidates[:, : start + keep]
            logits = None if logits is None else logits[:, :keep]
        return candidates, logits

    generator.get_candidates = without_placeholders
