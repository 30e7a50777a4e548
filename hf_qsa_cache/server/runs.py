"""`Run`: the engine requests of one HTTP request (one per choice) and how their results come back; `wait_all`
for a whole answer, `stream_response` and the server-sent-event helpers for a streamed one."""

from __future__ import annotations

import asyncio
import json
from collections import deque

from fastapi import Request
from fastapi.responses import StreamingResponse

from .engine import EngineDead
from .prompts import BadRequest, Prompt
from .served import Served
from .text import Choice

# No cache, and no buffering by a proxy such as nginx: each event goes out as it is made.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Run:
    """The engine requests of one HTTP request: ``prompts[p]`` with ``n`` choices each, choice ``j`` of a prompt
    seeded ``seed + j``. All are submitted here (none if one is refused)."""

    def __init__(self, served: Served, prompts: list[Prompt], n: int, max_tokens: list[int], sampling, seed,
                 logprobs: bool, stop: list[str], ignore_eos: bool, streaming: bool):
        self.served = served
        self.prompts = prompts
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice index, engine output), as the engine delivers
        self.waiting: deque = deque()  # taken from the queue, not yet handed out
        eos = [] if ignore_eos else served.eos_ids
        self.choices: list[Choice] = []
        self.request_ids: list[str | None] = []
        try:
            for p, prompt in enumerate(prompts):
                for j in range(n):
                    index = len(self.choices)
                    choice = Choice(index, served.tokenizer, stop, eos, max_tokens[p])
                    choice.prompt_index = p
                    self.choices.append(choice)
                    choice.request_id = served.engine.submit(
                        prompt.ids, lambda out, index=index: self.queue.put_nowait((index, out)),
                        max_new_tokens=max_tokens[p], eos_token_id=eos, sampling=sampling,
                        seed=None if seed is None else seed + j, logprobs=logprobs,
                        streaming=streaming or bool(stop), media=prompt.media)
        except ValueError as error:
            self.cancel()
            raise BadRequest(str(error)) from None
        except RuntimeError as error:
            self.cancel()
            raise EngineDead(str(error)) from None
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for choice in self.choices:
            if not choice.done and choice.request_id is not None:
                self.served.engine.cancel(choice.request_id)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    async def next(self) -> tuple[Choice, str]:
        """The next update: (its choice, the text it may send now). Updates of
        the same choice already waiting are taken with it (a server behind its engine sends fewer, longer
        chunks instead of falling further behind)."""
        if not self.waiting:
            self.waiting.append(await self.queue.get())
        while not self.queue.empty():
            self.waiting.append(self.queue.get_nowait())
        index, output = self.waiting.popleft()
        choice = self.choices[index]
        piece = choice.update(output)
        while self.waiting and self.waiting[0][0] == index and not choice.done:
            piece += choice.update(self.waiting.popleft()[1])
        if choice.done and choice.stopped_by_string:
            self.served.engine.cancel(choice.request_id)  # a stop string ends it: its row goes back now
        return choice, piece

    def failure(self) -> str | None:
        return next((c.error for c in self.choices if c.finish_reason == "error"), None)

    def usage(self) -> dict:
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}


async def wait_all(request: Request, run: Run) -> None:
    """Until every choice is done; the client going away cancels them."""
    disconnected = asyncio.ensure_future(_client_gone(request))
    try:
        while not run.done:
            getter = asyncio.ensure_future(run.next())
            await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                raise BadRequest("the client closed the request", status=499, code="client_closed_request")
            getter.result()
            if run.failure() is not None:
                break
    finally:
        disconnected.cancel()
        run.cancel()
    error = run.failure()
    if error is not None:
        run.served.engine.check_alive()
        raise BadRequest(f"generation failed: {error}", status=500, code="generation_failed")


async def _client_gone(request: Request) -> None:
    """Returns once the client has gone away (the body was read before this is awaited)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def kept_now(choice: Choice) -> int:
    """The choice's tokens to report so far: while it runs, those whose text went out (`Choice.released`); once
    done, those whose text is in the answer (not a stop string's)."""
    return choice.kept() if choice.done else choice.released()


# ---------------------------------------------------------------------- streaming
def stream_response(run: Run, chunks, done: bool = True) -> StreamingResponse:
    """The server-sent events ``chunks``, then ``[DONE]`` (``done``; the Responses API ends with its last event
    instead)."""

    async def body():
        try:
            async for chunk in chunks:
                yield chunk
            if done:
                yield "data: [DONE]\n\n"
        finally:
            run.cancel()  # the client went away (or the server stops): nothing of it keeps running

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


def stream_chunk(rid: str, kind: str, created: int, model: str, include_usage: bool):
    """``chunk(choices, usage=None)``: one server-sent event of a streamed response (with usage when asked)."""

    def chunk(choices: list, usage=None) -> str:
        payload = {"id": rid, "object": kind, "created": created, "model": model,
                   "system_fingerprint": None, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return sse(payload)

    return chunk


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
