"""Request bodies of the OpenAI routes, checked before anything is queued.

Unknown fields are refused (422, naming them). Fields of OpenAI's schema that this server does not honour are
refused when they ask for something (400, naming the field), and accepted when they ask for nothing (``tools``
empty, ``logit_bias`` empty, ``echo`` false, ...). Extensions: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``return_token_ids``, ``chat_template_kwargs``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data):
        """OpenAI's schema lets a client send null for an optional field (some send every field): it means the
        default. Required fields stay required."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(Strict):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class ImageURL(Strict):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(Strict):
    data: StrictStr
    format: StrictStr = "wav"


class ContentPart(Strict):
    type: Literal["text", "image_url", "input_audio", "refusal", "input_text", "output_text"]
    text: StrictStr | None = None
    refusal: StrictStr | None = None
    image_url: Union[ImageURL, StrictStr, None] = None
    input_audio: InputAudio | None = None
    annotations: list | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: StrictStr | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None


class Sampled(Strict):
    """Fields every generating route shares."""

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    metadata: dict | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    modalities: list[StrictStr] | None = None


class CompletionRequest(Sampled):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ResponsesRequest(Strict):
    model: StrictStr | None = None
    input: Union[StrictStr, list[dict]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    tools: list | None = None
    tool_choice: Any = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict | None = None
    user: StrictStr | None = None
    text: dict | None = None
    reasoning: dict | None = None
    truncation: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: StrictStr | None = None


def describe(error) -> tuple[str, str | None]:
    """A pydantic `ValidationError` as one sentence, and the first field it names."""
    unknown, other = [], []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            unknown.append(where)
        else:
            other.append(f"{where or 'body'}: {item['msg']}")
    parts = []
    if unknown:
        parts.append(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}")
    parts += other[:5]
    first = (unknown or [item.split(":")[0] for item in other] or [None])[0]
    return "; ".join(parts), first
