"""A request body checked whole and turned into engine arguments: each check raises `BadRequest` (a 4xx with the
field it names) before anything is queued, so a bad request changes nothing."""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import ValidationError

from ..serving.requests import check_prompt
from .prompts import BadRequest
from .schemas import describe
from .served import Served, served_of

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256


async def read_body(served: Served, request: Request, schema):
    """The body as ``schema``: read in chunks, so that a body sent without Content-Length still meets the limit."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > served.limits.max_body_bytes:
            raise BadRequest(f"the request body is larger than the limit {served.limits.max_body_bytes} bytes",
                             status=413)
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise BadRequest("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        where = _lone_surrogate(data)
    except RecursionError:  # (parsed, but too deep to walk beneath the server's own frames)
        raise BadRequest("the request body is not valid JSON: nested too deeply") from None
    if where is not None:  # valid JSON (an escape such as \ud800), but no text: a tokenizer cannot take it
        raise BadRequest(f"the request body holds a lone surrogate escape (not a character) at {where}", where)
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        message, param = describe(error)
        raise BadRequest(message, param, status=422) from None


def _lone_surrogate(value, where: str = "body") -> str | None:
    """Where a string of the parsed body holds a lone UTF-16 surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, where) or _lone_surrogate(item, f"{where}.{key}" if where != "body" else key)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}.{i}")
            if found:
                return found
    return None


def check_model(served: Served, name: str | None) -> None:
    if name is not None and name != served.name:
        raise BadRequest(f"model {name!r} is not served here: this server serves only {served.name!r}", "model",
                         status=404, code="model_not_found")


def refuse_unsupported(body, chat: bool) -> None:
    """OpenAI fields that ask for what this server does not do: a 400 naming the field."""
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported by this server", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise BadRequest("continuous_usage_stats is not supported (include_usage gives usage with the last chunk)",
                         "stream_options.continuous_usage_stats")
    if chat:
        if body.reasoning_effort is not None:
            raise BadRequest("reasoning_effort is not supported by this server", "reasoning_effort")
        if body.tools:
            raise BadRequest("tools are not supported by this server", "tools")
        if body.tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice is not supported by this server", "tool_choice")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise BadRequest("response_format other than text is not supported by this server", "response_format")
        if body.top_logprobs:
            raise BadRequest("top_logprobs is not supported (logprobs gives the chosen tokens' log-probabilities)",
                             "top_logprobs")
        if body.modalities and set(body.modalities) - {"text"}:
            raise BadRequest("this server answers in text only", "modalities")
        for i, message in enumerate(body.messages):
            if message.tool_calls or message.role == "tool":
                raise BadRequest("tool messages are not supported by this server", f"messages[{i}]")
    else:
        if body.echo:
            raise BadRequest("echo is not supported by this server", "echo")
        if body.suffix:
            raise BadRequest("suffix is not supported by this server", "suffix")
        if body.best_of not in (None, body.n):
            raise BadRequest("best_of other than n is not supported by this server", "best_of")
        if body.logprobs not in (None, 0):
            raise BadRequest("top log-probabilities are not supported: logprobs=0 gives the chosen tokens' "
                             "log-probabilities", "logprobs")


def sampling_of(served: Served, temperature, top_p, top_k=None, min_p=None, presence=None, frequency=None,
                repetition=None):
    """The request's sampling parameters; a field it leaves out takes the checkpoint's generation config."""
    from hf_qsa_cache.serving import Sampling

    base = Sampling.from_generation_config(served.generation_config)
    if temperature is not None and not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must lie in [0, 2], got {temperature}", "temperature")
    do_sample = base.do_sample if temperature is None else temperature > 0
    values = dict(do_sample=do_sample,
                  temperature=float(temperature) if temperature else base.temperature,
                  top_k=base.top_k if top_k is None else (None if top_k in (0, -1) else top_k),
                  top_p=base.top_p if top_p is None else top_p,
                  min_p=base.min_p if min_p is None else min_p,
                  repetition_penalty=base.repetition_penalty if repetition is None else repetition,
                  presence_penalty=base.presence_penalty if presence is None else presence,
                  frequency_penalty=base.frequency_penalty if frequency is None else frequency)
    try:
        return Sampling(**values)
    except ValueError as error:
        param = str(error).split(" ", 1)[0]
        raise BadRequest(str(error), param if param in values else None) from None


def stops_of(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise BadRequest(f"a stop string may have at most {MAX_STOP_LENGTH} characters", "stop")
    return [s for s in stops if s]


def max_tokens_of(served: Served, requested: int | None, prompt_len: int, param: str) -> int:
    """How many tokens a choice may generate: ``requested`` (the field ``param``) once checked against the
    server's limits and the room the prompt leaves, else the server's default."""
    limits = served.limits
    max_prompt = limits.max_prompt_tokens or served.max_len - 1
    if prompt_len > max_prompt:
        raise BadRequest(f"the prompt has {prompt_len} tokens, more than the limit {max_prompt}", "prompt",
                         code="context_length_exceeded")
    room = served.max_len - prompt_len
    if room < 1:
        raise BadRequest(f"the prompt of {prompt_len} tokens leaves no room to generate (the model holds "
                         f"{served.max_len} tokens)", "prompt", code="context_length_exceeded")
    if requested is None:
        return min(limits.default_max_tokens, limits.max_tokens, room)
    if requested < 1:
        raise BadRequest(f"{param} must be at least 1, got {requested}", param)
    if requested > limits.max_tokens:
        raise BadRequest(f"{param}={requested} is more than this server's limit {limits.max_tokens}", param)
    if requested > room:
        raise BadRequest(f"the prompt of {prompt_len} tokens and {param}={requested} need more than the "
                         f"{served.max_len} tokens the model holds", param, code="context_length_exceeded")
    return requested


def check_n(served: Served, n: int) -> None:
    if not 1 <= n <= served.limits.max_n:
        raise BadRequest(f"n must lie in [1, {served.limits.max_n}], got {n}", "n")


async def read_generation(request: Request, schema, chat: bool):
    """``(served, body, stop, sampling)`` of a chat or text completion request: its body read and checked (the
    model it names, fields the server does not do, ``n``), its stop strings and sampling parameters."""
    served = served_of(request)
    body = await read_body(served, request, schema)
    check_model(served, body.model)
    refuse_unsupported(body, chat=chat)
    check_n(served, body.n)
    sampling = sampling_of(served, body.temperature, body.top_p, body.top_k, body.min_p, body.presence_penalty,
                           body.frequency_penalty, body.repetition_penalty)
    return served, body, stops_of(body.stop), sampling


def check_prompt_ids(served: Served, ids: list[int], param: str) -> None:
    """The engine's own prompt check (`serving.requests.check_prompt`), answered as a 400 naming ``param``."""
    try:
        check_prompt(ids, served.config.get_text_config().vocab_size, param)
    except ValueError as error:
        raise BadRequest(str(error), param) from None


def refuse_unsupported_responses(body) -> None:
    """The Responses API's fields that ask for what this server does not do: a 400 naming the field."""
    if body.tools:
        raise BadRequest("tools are not supported by this server", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise BadRequest("tool_choice is not supported by this server", "tool_choice")
    if body.previous_response_id is not None:
        raise BadRequest("this server keeps no responses: send the whole conversation in 'input'",
                         "previous_response_id")
    if body.text and (body.text.get("format") or {}).get("type", "text") != "text":
        raise BadRequest("text formats other than text are not supported by this server", "text.format")
    if body.reasoning:
        raise BadRequest("reasoning is not supported by this server", "reasoning")
    if body.truncation not in (None, "disabled"):
        raise BadRequest("truncation is not supported: a prompt over the limit is refused", "truncation")
