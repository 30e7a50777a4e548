"""`/v1/completions`: one prompt or several (text or token ids), ``n`` choices each, a whole answer or a stream."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .checks import check_prompt_ids, max_tokens_of, read_generation
from .errors import error_body
from .prompts import BadRequest, Prompt
from .runs import Run, kept_now, sse, stream_chunk, stream_response, wait_all
from .schemas import CompletionRequest
from .text import Choice

router = APIRouter()


def completion_logprobs(tokenizer, choice: Choice, start: int, end: int, offset: int) -> dict:
    """The log-probabilities of the choice's tokens ``start:end``, as completions give them (``offset``: the
    text's length before token ``start``)."""
    tokens, values, offsets = [], [], []
    for k in range(start, end):
        tokens.append(tokenizer.decode([choice.tokens[k]]))
        values.append(choice.logprobs[k] if k < len(choice.logprobs) else None)
        offsets.append(offset)
        offset += len(choice.pieces[k])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(request: Request):
    served, body, stop, sampling = await read_generation(request, CompletionRequest, chat=False)
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        raw = [raw]
    if not raw:
        raise BadRequest("the prompt is empty", "prompt")
    if len(raw) * body.n > served.limits.max_n * 8:
        raise BadRequest(f"{len(raw)} prompts x n={body.n} is more than {served.limits.max_n * 8} choices",
                         "prompt")
    prompts = []
    for item in raw:
        ids = served.builder.encode_text(item) if isinstance(item, str) else list(item)
        check_prompt_ids(served, ids, "prompt")
        prompts.append(Prompt(ids))
    max_tokens = [max_tokens_of(served, body.max_tokens, len(p.ids), "max_tokens") for p in prompts]
    want_logprobs = body.logprobs is not None
    run = Run(served, prompts, body.n, max_tokens, sampling, body.seed, want_logprobs, stop, body.ignore_eos,
              body.stream)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if not body.stream:
        await wait_all(request, run)
        choices = []
        for c in run.choices:
            item = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
            if want_logprobs:
                item["logprobs"] = completion_logprobs(served.tokenizer, c, 0, c.kept(), 0)
            if body.return_token_ids:
                item["token_ids"] = c.tokens[: c.kept()]
                item["prompt_token_ids"] = prompts[c.prompt_index].ids
            choices.append(item)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": served.name,
                             "choices": choices, "usage": run.usage(), "system_fingerprint": None})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = stream_chunk(rid, "text_completion", created, served.name, include_usage)

    async def chunks():
        sent = [0] * len(run.choices)  # tokens whose log-probabilities / ids went out, per choice
        offsets = [0] * len(run.choices)  # text sent, per choice
        while not run.done:
            choice, piece = await run.next()
            end = kept_now(choice)
            if choice.finish_reason == "error":
                yield sse(error_body(f"generation failed: {choice.error}", "server_error",
                                     code="generation_failed"))
                return
            if piece or end > sent[choice.index] or choice.done:
                item = {"index": choice.index, "text": piece, "logprobs": None,
                        "finish_reason": choice.finish_reason if choice.done else None}
                if want_logprobs:
                    item["logprobs"] = completion_logprobs(served.tokenizer, choice, sent[choice.index], end,
                                                           offsets[choice.index])
                if body.return_token_ids:
                    item["token_ids"] = choice.tokens[sent[choice.index]: end]
                offsets[choice.index] += len(piece)
                sent[choice.index] = end
                yield chunk([item])
        if include_usage:
            yield chunk([], run.usage())

    return stream_response(run, chunks())
