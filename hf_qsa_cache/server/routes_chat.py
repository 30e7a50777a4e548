"""`/v1/chat/completions`: messages through the chat template, ``n`` choices, a whole answer or a stream."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .checks import check_prompt_ids, max_tokens_of, read_generation
from .errors import error_body
from .runs import Run, kept_now, sse, stream_chunk, stream_response, wait_all
from .schemas import ChatRequest
from .text import Choice

router = APIRouter()


def chat_logprobs(tokenizer, choice: Choice, start: int, end: int) -> dict:
    """The log-probabilities of the choice's tokens ``start:end``, as chat completions give them."""
    content = []
    for token, value in zip(choice.tokens[start:end], choice.logprobs[start:end]):
        text = tokenizer.decode([token])
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    served, body, stop, sampling = await read_generation(request, ChatRequest, chat=True)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    has_media = any(isinstance(m.get("content"), list) and any(p["type"] in ("image_url", "input_audio")
                                                                for p in m["content"]) for m in messages)
    if has_media:  # decoding images and audio takes a while: off the event loop
        prompt = await asyncio.to_thread(served.builder.chat, messages, body.chat_template_kwargs)
    else:
        prompt = served.builder.chat(messages, body.chat_template_kwargs)
    check_prompt_ids(served, prompt.ids, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_of(served, requested, len(prompt.ids), param)
    run = Run(served, [prompt], body.n, [max_tokens], sampling, body.seed, body.logprobs, stop, body.ignore_eos,
              body.stream)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not body.stream:
        await wait_all(request, run)
        choices = []
        for c in run.choices:
            item = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": None}
            if body.logprobs:
                item["logprobs"] = chat_logprobs(served.tokenizer, c, 0, c.kept())
            if body.return_token_ids:
                item["token_ids"] = c.tokens[: c.kept()]
            choices.append(item)
        out = {"id": rid, "object": "chat.completion", "created": created, "model": served.name,
               "choices": choices, "usage": run.usage(), "system_fingerprint": None}
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt.ids
        return JSONResponse(out)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = stream_chunk(rid, "chat.completion.chunk", created, served.name, include_usage)

    async def chunks():
        first = {"role": "assistant", "content": ""}
        head = [{"index": c.index, "delta": first, "logprobs": None, "finish_reason": None} for c in run.choices]
        if body.return_token_ids:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": served.name,
                       "choices": head, "prompt_token_ids": prompt.ids})
        else:
            yield chunk(head)
        sent = [0] * len(run.choices)  # tokens whose log-probabilities / ids went out, per choice
        while not run.done:
            choice, piece = await run.next()
            end = kept_now(choice)
            if piece or end > sent[choice.index]:
                item = {"index": choice.index, "delta": {"content": piece}, "logprobs": None,
                        "finish_reason": None}
                if body.logprobs:
                    item["logprobs"] = chat_logprobs(served.tokenizer, choice, sent[choice.index], end)
                if body.return_token_ids:
                    item["token_ids"] = choice.tokens[sent[choice.index]: end]
                sent[choice.index] = end
                yield chunk([item])
            if choice.finish_reason == "error":
                yield sse(error_body(f"generation failed: {choice.error}", "server_error",
                                     code="generation_failed"))
                return
            if choice.done:
                yield chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                              "finish_reason": choice.finish_reason}])
        if include_usage:
            yield chunk([], run.usage())

    return stream_response(run, chunks())
