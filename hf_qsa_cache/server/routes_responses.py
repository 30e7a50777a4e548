"""`/v1/responses` (OpenAI's Responses API): one text answer to a conversation sent whole, as one response object
or its stream of typed events. Nothing is stored: no tools, no ``previous_response_id``."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .checks import (check_model, check_prompt_ids, max_tokens_of, read_body, refuse_unsupported_responses,
                     sampling_of)
from .prompts import BadRequest
from .runs import Run, sse, stream_response, wait_all
from .schemas import ResponsesRequest
from .served import served_of
from .text import Choice

router = APIRouter()


def responses_messages(body) -> list[dict]:
    """The Responses API's input as chat messages (instructions first, as a system message)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if item.get("type", "message") != "message" or item.get("role") not in ("system", "developer", "user",
                                                                                  "assistant"):
            raise BadRequest("only message items (system, developer, user, assistant) are supported", f"input[{i}]")
        content = item.get("content")
        if isinstance(content, str):
            messages.append({"role": item["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest("a message's content must be a string or a list of parts", f"input[{i}].content")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "input_image" and isinstance(part.get("image_url"), str):
                parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            else:
                raise BadRequest(f"content parts of type {kind!r} are not supported here", f"input[{i}].content[{j}]")
        messages.append({"role": item["role"], "content": parts})
    return messages


@router.post("/v1/responses")
async def responses(request: Request):
    served = served_of(request)
    body: ResponsesRequest = await read_body(served, request, ResponsesRequest)
    check_model(served, body.model)
    refuse_unsupported_responses(body)
    messages = responses_messages(body)
    sampling = sampling_of(served, body.temperature, body.top_p, body.top_k)
    has_media = any(isinstance(m["content"], list) and any(p["type"] != "text" for p in m["content"])
                    for m in messages)
    prompt = (await asyncio.to_thread(served.builder.chat, messages) if has_media
              else served.builder.chat(messages))
    check_prompt_ids(served, prompt.ids, "input")
    max_tokens = max_tokens_of(served, body.max_output_tokens, len(prompt.ids), "max_output_tokens")
    run = Run(served, [prompt], 1, [max_tokens], sampling, body.seed, False, [], False, body.stream)
    rid, mid, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())

    def response(status: str, choice: Choice | None) -> dict:
        out = {"id": rid, "object": "response", "created_at": created, "model": served.name, "status": status,
               "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
               "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": False,
               "temperature": body.temperature, "top_p": body.top_p, "tool_choice": "none", "tools": [],
               "metadata": body.metadata or {}, "text": {"format": {"type": "text"}}, "usage": None}
        if choice is not None:
            out["output"] = [message_item(choice.text, item_status(choice))]
            if choice.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            usage = run.usage()
            out["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                            "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return out

    def item_status(choice: Choice) -> str:
        """A message cut by the length limit is itself ``incomplete``, as its response is."""
        return "incomplete" if choice.finish_reason == "length" else "completed"

    def message_item(text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": content}

    if not body.stream:
        await wait_all(request, run)
        return JSONResponse(response("completed", run.choices[0]))

    async def events():
        number = 0

        def event(kind: str, **payload) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\n" + sse({"type": kind, "sequence_number": number - 1, **payload})

        yield event("response.created", response=response("in_progress", None))
        yield event("response.in_progress", response=response("in_progress", None))
        yield event("response.output_item.added", output_index=0, item=message_item(None, "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", item_id=mid, output_index=0, content_index=0, part=part)
        choice = run.choices[0]
        while not run.done:
            choice, piece = await run.next()
            if choice.finish_reason == "error":
                yield event("error", code="generation_failed", message=f"generation failed: {choice.error}",
                            param=None)
                return
            if piece:
                yield event("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                            delta=piece, logprobs=[])
        yield event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=choice.text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                    part={**part, "text": choice.text})
        yield event("response.output_item.done", output_index=0, item=message_item(choice.text, item_status(choice)))
        final = response("completed", choice)
        yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                    response=final)

    return stream_response(run, events(), done=False)
