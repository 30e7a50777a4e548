"""Greedy or sampled decoding in a loop of ours: transformers' `_sample` without its read every step.

After every step `_sample` reads whether any row is still unfinished (``unfinished_sequences.max() == 0``;
transformers defers that read on Apple GPUs only). The read makes the host wait for the step to end, so the
next step's host work (its inputs, the cache's bookkeeping, the graph launch) starts on an idle GPU, and a
step costs the GPU's time plus the host's instead of the larger of the two. Here the loop reads only what
it must:

* no end-of-sequence id and no other stopping criterion: the row length decides the end, and the host knows
  it, so nothing is read before the call returns;
* otherwise each step's all-finished flag is read after the next step has been queued (copied behind the
  step into pinned memory on CUDA): one step late. When it says every row had finished, the step queued
  meanwhile fed one token too many, and the cache takes it back (`QSAPagedCache.crop`); that step's token is
  never picked, so a sampled call draws exactly the random numbers `_sample` draws. That needs one token of
  rollback headroom (``num_speculative_tokens >= 1``), which generate() gives the Inkling caches it builds
  for calls with such criteria (`late_read_headroom`: free there); a cache without it (Qwen4Exp's, where
  headroom keeps a copy of every recurrent state, unless the caller built it with some) is read right after
  each step, as `_sample` reads.

What a call returns and the cache it leaves are `_sample`'s: the same picks (the argmax, or with
``do_sample`` one `torch.multinomial` draw a step from the softmax of the processed fp32 logits, as
`_sample` draws: the same tokens under the same seed), finished rows padded with ``pad_token_id`` from the
step after their end-of-sequence id, the same logits processors on fp32 copies of the logits, the same
stopping criteria (called after every step, the last one too), the same streamer calls (each step's picks as
the step ends: with a streamer every step is read, as in `_sample`), the same experts switch for decode steps
(`_optimize_model_for_decode`). `applies` says for which calls: one beam, greedy or sampled, any number of
rows, a `QSAPagedCache`, the model's ``lean_decoding`` on, no per-step outputs (an assistant's drafting calls
ask for its scores), no synced GPUs. After the first step the loop builds the model's inputs itself where
transformers' preparation would only slice them (`lean_inputs`): 6.4-6.5 torch calls a greedy
step outside the forward against 15.3-15.4 in `_sample` (`benchmarks/count_loop_calls.py`).

The helpers both our loops share (this one and `lookup_decoding`'s) live here too: `wants_step_outputs`,
`stop_rules`, `lean_inputs` and `call_result`.

Each forward is a transaction of the cache; the loop is not. A failure between steps leaves the cache
holding the tokens it was fed; the next `generate()` on it that does not continue them is refused with
``reset()`` named (`QSAPagedCache.check_continues`), as after a failed call of transformers' loop.
"""

from __future__ import annotations

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import QSAPagedCache, rollback_costs_nothing


def applies(model, input_ids: torch.Tensor, generation_config, synced_gpus: bool, model_kwargs: dict) -> bool:
    """Whether `decode` runs this `_sample` call (module docstring)."""
    config = generation_config
    return ((config.num_beams or 1) == 1 and getattr(model, "lean_decoding", False)
            and isinstance(model_kwargs.get("past_key_values"), QSAPagedCache) and model_kwargs.get("use_cache")
            and 0 < input_ids.shape[1] < config.max_length and not synced_gpus and not wants_step_outputs(config))


def wants_step_outputs(config) -> bool:
    """Whether a generate() call asks for per-step scores, logits, attentions or hidden states (our loops keep none)."""
    return bool(config.return_dict_in_generate and (
        config.output_scores or config.output_logits or config.output_attentions or config.output_hidden_states))


def stop_rules(stopping_criteria, generation_config) -> tuple[int, set[int]]:
    """(the length that stops the row, the ids that end it), from the criteria generate() built."""
    max_length = min((c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)),
                     default=generation_config.max_length)
    eos = {int(i) for c in stopping_criteria if isinstance(c, EosTokenCriteria)
           for i in torch.as_tensor(c.eos_token_id).reshape(-1).tolist()}
    return max_length, eos


# The generation kwargs of a decode round whose model inputs `lean_inputs` builds (a text-only call on our cache).
LEAN_KEYS = {"attention_mask", "logits_to_keep", "past_key_values", "position_ids", "use_cache"}


def lean_inputs(candidates: torch.Tensor, step_length: int, kwargs: dict) -> dict:
    """What transformers' ``prepare_inputs_for_generation`` returns for a round after the first of a text-only
    call whose kwargs are `LEAN_KEYS` and whose ids already sit on the model's device: the round's last
    ``step_length`` ids and positions, the rest passed on. Without its per-round clone of the ids, its device
    lookups and its checks of what this call cannot hold: host work a graphed decode step cannot hide."""
    inputs = {"input_ids": candidates[:, -step_length:]}
    for key in ("past_key_values", "use_cache", "attention_mask", "logits_to_keep"):
        if kwargs.get(key) is not None:
            inputs[key] = kwargs[key]
    if kwargs.get("position_ids") is not None:
        inputs["position_ids"] = kwargs["position_ids"][..., -step_length:]
    return inputs


def late_read_headroom(model, generation_config, generation_mode) -> int:
    """Rollback headroom for a cache generate() builds (tokens): one for a greedy or sampled call with an
    end-of-sequence id or stop strings, where keeping it costs nothing (`QSAPagedCache`'s
    `rollback_costs_nothing`: Inkling); else none. With it `decode` reads each step's flag a step late instead
    of right after the step."""
    config = generation_config
    stops = config.eos_token_id is not None or bool(getattr(config, "stop_strings", None))
    loops = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
    return int(generation_mode in loops and stops
               and getattr(model, "lean_decoding", False) and rollback_costs_nothing(model.config))


class LateFlag:
    """A step's boolean verdict, read by the host later than it was computed: copied behind the step into pinned
    memory on CUDA, so that reading it waits for that step only, not for the steps queued after it. One per
    call: each step's flag is read before the next step posts its own."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.value = torch.empty((), dtype=torch.bool, pin_memory=True) if cuda else None
        self.ready = torch.cuda.Event() if cuda else None

    def post(self, flag: torch.Tensor) -> "LateFlag":
        if self.ready is not None:
            self.value.copy_(flag, non_blocking=True)
            self.ready.record()
        else:
            self.value = flag
        return self

    def read(self) -> bool:
        if self.ready is not None:
            self.ready.synchronize()
        return bool(self.value)


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs: dict):
    """transformers' `_sample` for the calls `applies` accepts, with the reads of the module docstring."""
    cache: QSAPagedCache = model_kwargs["past_key_values"]
    sampled = generation_config.do_sample
    max_length, _ = stop_rules(stopping_criteria, generation_config)
    # The length is the host's to check; every other criterion (end-of-sequence ids, stop strings, a user's)
    # runs on the device after each step, as in `_sample`, and then the loop must read whether all rows ended.
    device_stops = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)])
    pads_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    pad = generation_config._pad_token_tensor
    if pads_finished:
        pad = pad.to(input_ids.device)
    late = bool(device_stops) and cache.num_speculative_tokens >= 1
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    flag = LateFlag(input_ids.device) if device_stops else None

    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    lean = None  # whether later steps' inputs are built here (`lean_inputs`)
    with model._optimize_model_for_decode():
        while True:
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
            logits = outputs.logits[:, -1].to(input_ids.device)  # (a model split over devices: its last one)
            del outputs
            if sampled:  # as `_sample`: from the softmax of the processed fp32 copy
                scores = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32))
                picks = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                if len(logits_processor):  # as `_sample`: on an fp32 copy (the argmax of the raw logits is theirs)
                    logits = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32))
                picks = logits.argmax(dim=-1)
            if pads_finished:  # a finished row gets the pad token
                picks = picks * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, picks[:, None]], dim=-1)
            if device_stops:  # after every step, the last one too, as in `_sample` (a user's criterion may count)
                unfinished = unfinished & ~device_stops(input_ids, None)
            if streamer is not None:  # each step's picks as the step ends, as from `_sample` (a read)
                streamer.put(picks.cpu())
            if input_ids.shape[1] >= max_length:
                break
            ended = None
            if device_stops:
                ended = flag.post(unfinished.max() == 0)
                if not late and ended.read():
                    break
            if lean is None:
                inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
                lean = set(model_kwargs) <= LEAN_KEYS and inputs["input_ids"].device == input_ids.device
            else:
                inputs = (lean_inputs(input_ids, 1, model_kwargs) if lean
                          else model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs))
            outputs = model(**inputs, return_dict=True)
            if late and ended.read():  # every row had ended: the step just queued fed a token too many
                del outputs
                cache.crop(-1)
                break
    return call_result(input_ids, cache, generation_config, streamer)


def call_result(input_ids: torch.Tensor, cache, generation_config, streamer):
    """What generate() returns from one of our loops, as from transformers' (the streamer told the end)."""
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=input_ids, past_key_values=cache)
    return input_ids
