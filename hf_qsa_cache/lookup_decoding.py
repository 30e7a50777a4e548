"""Greedy prompt lookup of one row in a loop of ours, with at most one small host read per round.

transformers runs prompt lookup in its assisted-decoding loop, written for any drafter and for sampling.
Each round, besides the forward, it copies the verified logits to fp32 and clones them, counts the
accepted drafts with five device ops, looks for an end-of-sequence id with two more and reads the answer
once, then runs the stopping criteria on the device and reads their verdict: 23 computing torch calls
per token outside the forward when every draft is rejected, against 15 in plain greedy decoding
(`benchmarks/count_loop_calls.py`), and two host reads a round (the accepted count, used as a slice
bound, and the stop flag), three with an end-of-sequence id. Greedy prompt lookup needs far less: the
drafts come from a host search, so the verdict is a host comparison of the drafts with the model's
argmax at each verified position (9.5-9.7 calls per token, at most one read a round).

A read makes the host wait for the step, where plain decoding queues the next step before the last one
ends. So a round that drafts nothing (the adaptive budget's pauses) leaves its pick on the device and
feeds it to the next step unread; the picks are read when a round may draft again (the search needs
them), when the row is full, or before the unread steps could run past the cache's rollback headroom
(``num_speculative_tokens``) beyond an end-of-sequence id among them: then all but the newest pick, whose
step the device may still be running, so that the read does not wait for it. One found late ends the row there:
the steps that ran past it are cropped, and the output and the cache are what transformers' loop leaves
(its candidate generator saw a few more paused rounds, which change nothing after the end). Stopping
criteria other than the length and end-of-sequence ones (stop strings, a time limit, a user's) run on the
device after every round, as in transformers' loop, and every round is then read.

`decode_with_prompt_lookup` is that loop for greedy prompt lookup on a `QSAPagedCache` (`applies` says
when; `PagedCacheGenerationMixin._assisted_decoding` takes it then, and transformers' loop otherwise).
Per round: the drafts from the candidate generator generate() builds (`_get_candidate_generator`: the
adaptive `DraftBudget` and the host search, or transformers' own search when logits processors may
veto drafts), one forward over the last token and the drafts, the logits processors per position if
there are any (as transformers applies them), one argmax and one read of the picks with the drafts, then
on the host: the accepted prefix, the bonus token, the cut at ``max_length`` and at the first
end-of-sequence id, the crop of the rejected drafts, and the stop. The tokens, the cache after the call,
the streamer's calls and the candidate generator's calls are those of transformers' loop (below: a
paused round's streamer call may come a few steps late): the drafts only decide how many tokens a forward
verifies.

Each forward is a transaction of the cache; a round is not. A failure after a verify forward and before its
crop, or while a run of paused picks is read, leaves the cache holding exactly the tokens it was fed (drafts
or picks the caller never got): the next `generate()` on it that does not continue them is refused with
`reset()` named (`QSAPagedCache.check_continues`), as after a failed call of transformers' own loop.
"""

from __future__ import annotations

import copy

import torch
from transformers.generation.candidate_generator import (
    _prepare_attention_mask, _prepare_position_ids, _prepare_token_type_ids,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .cache import QSAPagedCache
from .decode_loop import LEAN_KEYS, call_result, lean_inputs, stop_rules, wants_step_outputs

# The stopping criteria this loop evaluates on the host; any other one (stop strings, a time limit, a user's)
# runs on the device after every round, as in transformers' loop, and turns off the unread paused rounds.
HOST_STOPS = (MaxLengthCriteria, EosTokenCriteria)


def applies(model, input_ids: torch.Tensor, stopping_criteria, generation_config, synced_gpus: bool,
            assistant_model, model_kwargs: dict) -> bool:
    """Whether `decode_with_prompt_lookup` runs this assisted generate() call: greedy prompt lookup (no
    assistant model), one row with room for a token, the model's adaptive draft count on, a
    `QSAPagedCache`, no per-step outputs asked for, and no synced GPUs."""
    config = generation_config
    return (config.prompt_lookup_num_tokens is not None and assistant_model is None
            and config.assistant_early_exit is None and not config.do_sample
            and getattr(config, "assistant_ensemble_weight", None) is None
            and getattr(model, "adaptive_prompt_lookup", False)
            and isinstance(model_kwargs.get("past_key_values"), QSAPagedCache) and model_kwargs.get("use_cache")
            and input_ids.shape[0] == 1 and input_ids.shape[1] < config.max_length
            and not synced_gpus and not wants_step_outputs(config))


def verdict(drafts: list[int], picks: list[int], room: int, eos: set[int]) -> list[int]:
    """The tokens a round adds: the model's picks up to and including its first disagreement with the drafts
    (all of them plus a bonus token when every draft is accepted), at most ``room``, cut after the first
    end-of-sequence id."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == picks[accepted]:
        accepted += 1
    tokens = picks[:accepted + 1][:room]
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1]
    return tokens


def decode_with_prompt_lookup(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                              inputs_tensor, tokenizer, model_kwargs: dict):
    """transformers' `_assisted_decoding` for the calls `applies` accepts (module docstring)."""
    generator = model._get_candidate_generator(
        generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
        assistant_model=None, logits_processor=logits_processor, target_tokenizer=tokenizer,
        assistant_tokenizer=None, model_kwargs=model_kwargs)
    return _decode(model, generator, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                   model_kwargs)


def _first_step_length(cache, model_kwargs: dict, generation_config, length: int, drafted: int) -> int | None:
    """Tokens the first round feeds, as transformers' `_prefill` decides: when the call's input ids repeat what
    the cache already holds (a conversation continued on its cache: the attention mask, or the mask length
    the config records, as long as the ids), only the positions past the cached ones, and the drafts; else
    None (all of them). (Embeddings passed beside the ids hold the same positions, so the same count.)"""
    past = cache.get_seq_length()
    if not past:
        return None
    mask = model_kwargs.get("attention_mask")
    mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
    return length - past + drafted if mask_length == length else None


def _decode(model, generator, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
            model_kwargs: dict):
    """The loop (module docstring), drafting with ``generator`` (its ``draft_budget`` says when it may). The
    streamer gets ``[1, n]`` tokens, as from transformers' assisted loop (a paused round's may come late)."""
    cache = model_kwargs["past_key_values"]
    cache.activate_past_recording()  # as transformers' assisted loop does before its first crop (a no-op here)
    budget = generator.draft_budget
    max_length, eos = stop_rules(stopping_criteria, generation_config)
    other_stops = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, HOST_STOPS)])
    # Paused rounds leave their pick on the device (`unread`) until a round may draft, the row is full, or
    # (with end-of-sequence ids) one more step would feed more tokens after the first unread pick than the
    # cache can take back (num_speculative_tokens): were that pick an end-of-sequence id, those are cropped.
    headroom = cache.num_speculative_tokens if eos else max_length
    unread: list[torch.Tensor] = []

    def settle(keep: int = 0) -> bool:
        """Read the unread picks but the newest ``keep`` (whose steps may still run: reading the older ones
        does not wait for them): the streamer gets them; at an end-of-sequence id the row ends there (the steps
        run past it are cropped, the kept picks' too). Returns whether the row ended."""
        nonlocal input_ids
        picks = torch.cat(unread[:len(unread) - keep]).tolist()
        del unread[:len(unread) - keep]
        for i, token in enumerate(picks):
            if streamer is not None:
                streamer.put(torch.tensor([[token]], dtype=input_ids.dtype))
            if token in eos:
                past = len(picks) - 1 - i + len(unread)  # steps that fed this token and the ones after it
                unread.clear()
                cache.crop(-past)
                input_ids = input_ids[:, :input_ids.shape[1] - past]
                return True
        return False

    first, lean_rounds = True, False
    while True:
        length = input_ids.shape[1]
        # Read before a round that may draft, that ends the row, or that would run past the headroom: a round
        # that reads its own picks starts with none unread. Past the headroom alone, the newest pick stays
        # unread (its step is the one the GPU runs now) where the cache can take one more step back.
        if unread and (budget.paused == 0 or length + 1 >= max_length):
            if settle():
                break
        elif unread and len(unread) > headroom:
            if settle(keep=1 if headroom else 0):
                break
        candidates, _ = generator.get_candidates(input_ids)
        candidates = candidates.to(input_ids.device)
        drafted = candidates.shape[1] - length
        kwargs = _prepare_attention_mask(copy.copy(model_kwargs), candidates.shape[1], False)
        kwargs = _prepare_token_type_ids(kwargs, candidates.shape[1])
        if kwargs.get("position_ids") is not None and drafted > 0:
            kwargs = _prepare_position_ids(kwargs, drafted + kwargs["position_ids"].shape[-1], False)
        step_length = _first_step_length(cache, model_kwargs, generation_config, length, drafted) if first else drafted + 1
        if lean_rounds and not first:
            inputs = lean_inputs(candidates, step_length, kwargs)
        else:
            inputs = model.prepare_inputs_for_generation(
                candidates, next_sequence_length=step_length, is_first_iteration=first, **kwargs)
            # Later rounds build their inputs here when transformers' preparation would only slice them.
            lean_rounds = set(kwargs) <= LEAN_KEYS and inputs["input_ids"].device == candidates.device
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = drafted + 1
        outputs = model(**inputs)
        logits = outputs.logits[:, -drafted - 1:]
        if len(logits_processor):  # as transformers: in fp32, position by position
            logits = logits.to(torch.float32)
            for i in range(drafted + 1):
                logits[:, i, :] = logits_processor(candidates[:, :length + i], logits[:, i, :])
        first = False
        if drafted == 0 and length + 1 < max_length and not other_stops:
            # Its pick stays on the device for now.
            pick = logits.argmax(dim=-1)
            input_ids = torch.cat([input_ids, pick], dim=-1)
            unread.append(pick[0])
            generator.update_candidate_strategy(input_ids, outputs.logits[:, -1:], 0)
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False,
                                                                     num_new_tokens=1)
            continue
        # The round's one read: the model's pick at each verified position, then the drafts.
        read = torch.cat([logits.argmax(dim=-1)[0], candidates[0, length:]]).tolist()
        picks, drafts = read[:drafted + 1], read[drafted + 1:]
        tokens = verdict(drafts, picks, max_length - length, eos)
        accepted = len(tokens) - 1
        new = torch.tensor([tokens], dtype=input_ids.dtype)
        input_ids = torch.cat([input_ids, new.to(input_ids.device, non_blocking=True)], dim=-1)
        if streamer is not None:
            streamer.put(new)
        cache.crop(accepted - drafted)  # the drafts after the accepted ones (crop(0) changes nothing)
        generator.update_candidate_strategy(input_ids, outputs.logits[:, -drafted - 1:], accepted)
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False,
                                                                 num_new_tokens=accepted + 1)
        del outputs
        # The user's criteria see every round, the last one too, as in transformers' loops (scores: None, as
        # none are kept).
        stopped = bool(other_stops(input_ids, None).any()) if other_stops else False
        if stopped or input_ids.shape[1] >= max_length or tokens[-1] in eos:
            break
    return call_result(input_ids, cache, generation_config, streamer)
