"""What a ForCausalLM class needs to run `generate()` and long prompts on a paged cache."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import warnings

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator, PromptLookupCandidateGenerator
from transformers.generation.configuration_utils import GenerationMode

from . import decode_loop, lookup_decoding, prefix_generation
from .cache import QSAPagedCache
from .padding import as_padding_mask, step_order
from .validation import check_request
from .speculative import (
    DraftBudget, adapt_prompt_lookup, assistant_schedule, cap_heuristic_drafts, check_headroom, draft_tokens_bound,
    overshoot,
)

# Tokens a row may still add after a forward that was called without a cache but with use_cache.
FORWARD_CACHE_HEADROOM = 256

_warned_cache_implementation: list[str] = []  # the warnings below are said once per process
_warned_checkpointing: list[bool] = []

# transformers' generate() warns on every batch whose last mask column holds a pad ("right-padding was
# detected"): its own decoder-only models would continue such rows from the pad. Ours continue each row from its
# real length (`hf_qsa_cache.padding`), so inside a generate() of our classes that warning is dropped; for any
# other model it still prints.
_RIGHT_PADDING_WARNING = "A decoder-only architecture is being used, but right-padding was detected"
_inside_our_generate = threading.local()


class _DropRightPaddingWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(_inside_our_generate, "depth", 0) and str(record.msg).startswith(_RIGHT_PADDING_WARNING):
            return False
        return True


logging.getLogger("transformers.generation.utils").addFilter(_DropRightPaddingWarning())


def check_token_ids(input_ids, vocab_size: int) -> None:
    """Refuse token ids outside the vocabulary before anything runs (one host sync: done for prompts and
    multi-token steps, not for single-token decode steps, whose tokens come from the model's own logits; a bad
    id there fails in the embedding lookup, before the step opens, and `lands_whole` says why)."""
    if input_ids is None or input_ids.numel() == 0 or input_ids.shape[-1] == 1:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}) (vocab_size), got {high if high >= vocab_size else low}")


def raise_if_out_of_vocabulary(model, input_ids, error: IndexError) -> None:
    """After ``error`` (an `IndexError` out of a forward): raise a `ValueError` naming the vocabulary size if
    ``input_ids`` holds an id outside it. A one-token step's ids are not checked up front (`check_token_ids`:
    a host read per decode step); such an id fails in the embedding lookup, before the step opens (the cache
    is untouched), and this says why instead of a bare "index out of range"."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.numel() == 0:
        return
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is None:
        return
    bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
    if bad.numel():
        raise ValueError(f"token ids must lie in [0, {vocab_size}) (vocab_size), got {int(bad.flatten()[0])}"
                         ) from error


def cache_for_bare_forward(config, batch_size: int, length: int, use_cache) -> QSAPagedCache:
    """The cache a forward builds when none is passed: the models always run on paged state."""
    headroom = FORWARD_CACHE_HEADROOM if use_cache is not False else 0
    return QSAPagedCache(config, max_batch_size=batch_size, max_cache_len=max(length, 1) + headroom)


def forward_cache(model, past_key_values, batch_size: int, length: int, use_cache) -> tuple[QSAPagedCache, bool]:
    """``(cache, use_cache)`` a text model's forward runs on: the caller's, or one sized for this call.

    Under activation checkpointing while training, always a throwaway cache (as transformers' layers drop
    the cache there): the layers are rerun during backward, after the step, and must read the state the
    step started from, which only a fresh cache guarantees (`StepMetadata.starts_fresh`)."""
    if past_key_values is not None and not isinstance(past_key_values, QSAPagedCache):
        raise ValueError(
            f"{type(model).__name__} keeps its state in a QSAPagedCache, got {type(past_key_values).__name__} "
            "as past_key_values"
        )
    if model.training and getattr(model, "gradient_checkpointing", False):
        # Said only to a caller who passed a cache or use_cache=True (``use_cache`` is the caller's value, None
        # when not given): one who passed neither loses nothing.
        if (past_key_values is not None or use_cache) and not _warned_checkpointing:
            warnings.warn("activation checkpointing reruns layers during backward: this forward runs on a "
                          "throwaway cache (use_cache=False, past_key_values not used)", stacklevel=3)
            _warned_checkpointing.append(True)
        past_key_values, use_cache = None, False
    if past_key_values is None:
        past_key_values = cache_for_bare_forward(model.config, batch_size, length, use_cache)
    return past_key_values, use_cache


def grow_for_request(cache: QSAPagedCache, need: int) -> None:
    """Grow a cache generate() built so that rows can hold ``need`` tokens.

    The new length is ``need`` rounded up to whole blocks of the main table: pools hold whole blocks
    anyway, so the rounding costs no memory and spares short continuations a reallocation each. No
    more than that (no doubling): generate() sized this cache for what its caller asked, and on a long
    context spare capacity is device memory the caller did not ask for.
    """
    if need <= cache.max_cache_len:
        return
    block = cache.tables["main"].block_size
    cache.grow(block * -(-need // block))


# What `torch.compile` of a forward does here (transformers' own compile paths never reach these forwards).
COMPILE_SKIPPED = (
    "the paged cache's steps run host bookkeeping (validation, block tables, the step transaction) that "
    "torch.compile cannot trace without a graph break per call; the forward runs eagerly, and decode steps "
    "already replay CUDA graphs of the whole model (model.use_cuda_graphs)"
)


def lands_whole(forward):
    """Decorator for a model's ``forward``: the cache steps it runs land only if the whole call returns
    (head, loss and outputs included), and are taken back if it raises (`QSAPagedCache.forward_scope`).

    `torch.compile` does not trace into it (`COMPILE_SKIPPED`): a user's ``torch.compile(model.forward)``
    runs the forward eagerly, with the same results, instead of tracing it call after call."""
    names = list(inspect.signature(forward).parameters)
    position = names.index("past_key_values")
    ids_position = names.index("input_ids") if "input_ids" in names else None

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        cache = kwargs.get("past_key_values", args[position] if len(args) > position else None)
        try:
            if not isinstance(cache, QSAPagedCache):
                return forward(*args, **kwargs)
            with cache.forward_scope():
                return forward(*args, **kwargs)
        except IndexError as error:
            ids = kwargs.get("input_ids")
            if ids is None and ids_position is not None and len(args) > ids_position:
                ids = args[ids_position]
            raise_if_out_of_vocabulary(args[0], ids, error)
            raise

    return torch.compiler.disable(wrapper, reason=COMPILE_SKIPPED)


def asked_new_tokens(generation_config, held: int, extra: int) -> str:
    """The new tokens a row must hold, in the caller's words: ``held`` is one less than they asked for (the last
    generated token is never fed back), ``extra`` the speculative verification's overshoot."""
    if generation_config.max_new_tokens is not None and generation_config.max_new_tokens == held + 1:
        words = f"max_new_tokens={generation_config.max_new_tokens} - 1: the last new token is never fed back"
    else:
        words = f"{held} new tokens up to max_length={generation_config.max_length}, the last one never fed back"
    if extra:
        words += f"; + {extra} to verify drafts past the end"
    return words


class PagedCacheGenerationMixin:
    """Put before `GenerationMixin` in the bases of a ForCausalLM class whose `self.model` takes a
    `QSAPagedCache` as ``past_key_values``."""

    # Prompts longer than this many tokens (summed over the batch) run as exact chunked prefill when
    # only the last logits are wanted: the cache makes chunks exact, and activation memory stays bounded.
    prefill_chunk_tokens = 16384
    # Prompt lookup proposes as many drafts as recent rounds had accepted (`DraftBudget`); False: always
    # prompt_lookup_num_tokens, as transformers does (see `_get_candidate_generator`).
    adaptive_prompt_lookup = True
    # Greedy and sampled decoding run our lean loop (`decode_loop.decode`): the same tokens (under the same
    # seed), cache and streamer calls as transformers' `_sample`, fewer torch calls per token and no host read
    # per step where none is needed; False: transformers' loop.
    lean_decoding = True

    def generate(self, inputs=None, *args, **kwargs):
        # A passed cache that holds rows must be continued by this call's input (checked once per call).
        cache = kwargs.get("past_key_values")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(cache, QSAPagedCache) and isinstance(ids, torch.Tensor) and ids.dim() == 2 \
                and not ids.is_floating_point():
            if cache.prefix is not None and cache.columns_seen:
                try:
                    cache.check_continues(ids)
                except ValueError:  # new prompts: the held rows become cached prefixes (no reset() needed)
                    prefix_generation.retire_rows(cache)
            cache.check_continues(ids)
        _inside_our_generate.depth = getattr(_inside_our_generate, "depth", 0) + 1  # (`_DropRightPaddingWarning`)
        try:
            return super().generate(inputs, *args, **kwargs)
        finally:
            _inside_our_generate.depth -= 1

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # transformers numbers real tokens by the mask and gives pads 0, then adds 1 to the last column every
        # step: after a right-padded prompt the generated tokens would restart near 0. A pad takes the
        # position of the latest real token before it instead, so generation continues from each row's real
        # length (real tokens keep their positions; pads are never read).
        position_ids = super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)
        mask = model_kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and position_ids.shape == mask.shape:
            position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
        return position_ids

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)
        # How many tokens the assistant drafts decides the cache's rollback headroom; generate() calls
        # _prepare_cache_for_generation next, without the assistant, so leave it the schedule (plain ints).
        assistant = generation_mode_kwargs.get("assistant_model")
        if generation_config.assistant_early_exit is not None:
            assistant = self
        if generation_mode == GenerationMode.ASSISTED_GENERATION and assistant is not None:
            generation_config._draft_schedule = assistant_schedule(assistant)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        asked = generation_config.cache_implementation
        if asked is not None:
            # A checkpoint's generation_config.json may name a cache; these models only run on QSAPagedCache.
            if not _warned_cache_implementation:
                warnings.warn(
                    f"cache_implementation={asked!r} is ignored: {type(self).__name__} keeps its state in a "
                    "QSAPagedCache", stacklevel=3,
                )
                _warned_cache_implementation.append(asked)
            generation_config.cache_implementation = None
        # generate() passes the batch before it expands rows for beams / returned sequences; the mask it left in
        # model_kwargs is already expanded, or dropped when all ones (the position ids it made still give the width).
        copies = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        rows = batch_size * copies
        cache = model_kwargs.get("past_key_values")
        mask = model_kwargs.get("attention_mask")
        prompt = None
        if mask is not None and mask.dim() == 2:
            prompt = [int(n) for n in mask.sum(dim=1).tolist()]
        elif mask is None and model_kwargs.get("position_ids") is not None:
            # transformers counts the past of a passed cache into these position ids
            past = cache.get_seq_length() if cache is not None else 0
            prompt = [model_kwargs["position_ids"].shape[-1] - past] * rows
        columns = max_cache_length  # generate() never feeds the last token it generates
        new_tokens = columns - (mask.shape[1] if mask is not None else prompt[0] if prompt else 0)
        # Assisted decoding verifies drafts and crops the rejected ones: the cache needs that much rollback
        # headroom (speculative.py), and prompt lookup / MTP may verify a few columns past max_length.
        schedule = generation_config.__dict__.pop("_draft_schedule", None)
        drafting = generation_mode == GenerationMode.ASSISTED_GENERATION
        bound, source = draft_tokens_bound(self, generation_config, schedule, new_tokens) if drafting else (0, "")
        extra = overshoot(generation_config, bound)
        if cache is None and generation_config.use_cache is not False:
            # (our loops read a step late with a token of headroom: `decode_loop.late_read_headroom`)
            headroom = max(bound, decode_loop.late_read_headroom(self, generation_config, generation_mode))
            cache = QSAPagedCache(self.config, max_batch_size=rows, max_cache_len=max_cache_length + extra,
                                  num_speculative_tokens=headroom)
            cache._generate_may_grow = True  # sized for this call only: a call that continues it grows it
            model_kwargs["past_key_values"] = cache
        if isinstance(cache, QSAPagedCache):
            # Refuse a request that cannot fit before the prefill runs, not after tokens were generated.
            if drafting:
                check_headroom(cache, bound, source)
            if prompt is not None and new_tokens >= 0:
                if cache._generate_may_grow:
                    grow_for_request(cache, max(prompt, default=0) + new_tokens + extra)
                check_request(cache, prompt, new_tokens + extra,
                              asked=asked_new_tokens(generation_config, new_tokens, extra))
        return super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        if decode_loop.applies(self, input_ids, generation_config, synced_gpus, model_kwargs):
            return decode_loop.decode(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                      streamer, model_kwargs)
        return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                               synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None,
                           tokenizer=None, **model_kwargs):
        # Greedy prompt lookup runs a lean loop of ours (`lookup_decoding`): same tokens, one host read a round.
        if lookup_decoding.applies(self, input_ids, stopping_criteria, generation_config, synced_gpus,
                                   assistant_model, model_kwargs):
            return lookup_decoding.decode_with_prompt_lookup(
                self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, inputs_tensor,
                tokenizer, model_kwargs)
        return super()._assisted_decoding(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        """transformers' candidate generator, adapted to the paged cache.

        * An assistant model of ours gets a croppable cache sized for the whole generation
          (`attach_assistant_cache`); a heuristic draft schedule is capped (`cap_heuristic_drafts`).
        * Prompt lookup (``prompt_lookup_num_tokens=k``) adapts its draft count to what the model accepts
          (`DraftBudget`): up to ``k`` drafts while they are accepted, fewer after rejections, and none at
          all for a while (plain one-token steps, with an exponential back-off before looking again) after
          rounds whose drafts were all rejected. transformers proposes ``k`` drafts on every round that
          finds a match; when they are rejected each round pays a ``k + 1``-token verify step and a crop
          for the one token it yields. Greedy tokens are the same either way (drafting only changes how
          many tokens a forward verifies). ``model.adaptive_prompt_lookup = False`` keeps transformers'
          fixed ``k`` (e.g. to compare the two). It is a model attribute, not a generate() argument:
          transformers refuses keywords it does not know, and its ``num_assistant_tokens_schedule``
          (``"constant"`` by default) is about assistant models, not prompt lookup.
        """
        generator = super()._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer,
        )
        # An assistant of ours gets a croppable cache sized for the whole generation.
        schedule = assistant_schedule(generator.assistant_model) if hasattr(generator, "assistant_model") else None
        remaining = generation_config.max_length - 1 - input_ids.shape[1]
        bound, _ = draft_tokens_bound(self, generation_config, schedule, remaining)
        attach_assistant_cache(generator, generation_config, *input_ids.shape[:2], bound)
        if schedule is not None and schedule[1]:
            cap_heuristic_drafts(generator, schedule[0])
        if isinstance(generator, PromptLookupCandidateGenerator) and self.adaptive_prompt_lookup:
            adapt_prompt_lookup(generator, DraftBudget(generation_config.prompt_lookup_num_tokens))
        return generator

    def _run_model(self, *, input_ids, inputs_embeds, attention_mask, past_key_values, logits_to_keep, chunkable,
                   per_token: dict, model=None, **model_kwargs):
        """``model(...)`` (default ``self.model``, the text model), split into column chunks for a long prompt
        when ``chunkable``.

        ``per_token`` holds extra ``[..., L]`` inputs (position ids, PLE ids) that are sliced with the
        tokens. Returns the last chunk's outputs, whose last ``logits_to_keep`` positions are the
        prompt's.
        """
        tokens = input_ids if input_ids is not None else inputs_embeds
        B, L = tokens.shape[:2]
        attention_mask = as_padding_mask(attention_mask, L)  # a 4-D causal mask with padding -> its 2-D mask
        chunk = max(1, self.prefill_chunk_tokens // B)
        model = self.model if model is None else model
        if prefix_generation.applies(past_key_values, input_ids, inputs_embeds, attention_mask, logits_to_keep,
                                     chunkable, per_token, model_kwargs):
            # Rows start from the longest cached prefix of their prompts and feed the rest (prefix_caching).
            return prefix_generation.prefill(
                lambda **inputs: model(past_key_values=past_key_values, **inputs, **model_kwargs), past_key_values,
                input_ids, attention_mask, per_token, self.prefill_chunk_tokens)
        if not (chunkable and isinstance(logits_to_keep, int) and 0 < logits_to_keep <= chunk < L):
            return model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                              past_key_values=past_key_values, **per_token, **model_kwargs)
        if past_key_values is None:
            past_key_values = cache_for_bare_forward(self.config, B, L, model_kwargs.get("use_cache"))
        # A mask with pads after real tokens: reorder the whole prompt once (`hf_qsa_cache.padding`), so every
        # chunk is left-padded and the last chunk holds each row's last real tokens.
        order = step_order(attention_mask, L)
        if order is not None:
            input_ids, inputs_embeds = order.inputs(input_ids, 1), order.inputs(inputs_embeds, 1)
            per_token = {k: None if v is None else order.inputs(v[..., -L:], -1, -2) for k, v in per_token.items()}
            attention_mask = order.full_mask(attention_mask)
        past_key_values.check_step(B, L, attention_mask)  # reject a bad prompt before any chunk lands
        past = attention_mask.shape[1] - L if attention_mask is not None else 0
        # Chunks end at L, L - chunk, ...: the last one is whole, so it holds the logits to keep.
        ends = list(range(L, 0, -chunk))[::-1]
        with past_key_values.forward_scope():  # a failed chunk takes the call back (or asks for reset())
            for start, end in zip([0] + ends[:-1], ends):

                def cols(x, dim=-1):
                    return None if x is None else x.narrow(dim, start, end - start)

                outputs = model(
                    input_ids=cols(input_ids), inputs_embeds=cols(inputs_embeds, 1),
                    attention_mask=None if attention_mask is None else attention_mask[:, : past + end],
                    past_key_values=past_key_values, **{k: cols(v) for k, v in per_token.items()}, **model_kwargs,
                )
        if order is not None:  # the last chunk's columns back in the caller's order (they stay in that chunk)
            start = L - outputs.last_hidden_state.shape[1]
            source = order.source[:, start:] - start
            outputs.last_hidden_state = outputs.last_hidden_state.gather(
                1, source[..., None].expand_as(outputs.last_hidden_state))
        return outputs


def attach_assistant_cache(generator, generation_config, batch_size: int, input_length: int, bound: int) -> None:
    """Give an assistant model of ours a cache it can crop, sized for the whole main generation.

    transformers lets the assistant's own ``generate()`` build its cache in the first round, sized for that
    round only and without rollback headroom. Each round transformers crops the assistant's cache to two
    tokens short of the main sequence and re-feeds those: after ``k`` drafts of which ``n`` were accepted
    that drops ``k - n`` tokens, at most ``bound``.
    """
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
