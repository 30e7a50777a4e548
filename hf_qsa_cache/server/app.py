"""The HTTP app: OpenAI's chat completions, completions and responses routes on our continuous-batching engine.

Each HTTP request is checked whole before anything is queued: its fields (`schemas`), its model (only the one
served), its prompt (the chat template, media), its limits (body size, prompt length, ``max_tokens``, ``n``,
stop strings). A bad one gets a 4xx and changes nothing. Then each of its ``n`` choices is one engine request
with its own sampling parameters and seed (``seed + i``), delivered to its own handler. A client that goes away
cancels its requests at once (their rows are free before the engine's next step). A request that fails fails
alone: the server goes on. A dead engine answers 503, on `/health` too.

The engine is an `engine_process.EngineProcess` (the model and its manager in a process of their own: what
`hf-qsa-serve` runs) or an `engine.Engine` (in this process), behind the same interface; this process needs only
the checkpoint's config, generation config and tokenizer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from .engine import Engine, EngineDead
from .engine_process import EngineProcess
from .prompts import BadRequest, Prompt, PromptBuilder
from .schemas import ChatRequest, CompletionRequest, ResponsesRequest, describe
from .text import Choice

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256


@dataclass
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompt_tokens: int | None = None  # None: the model's length less one
    max_tokens: int = 4096
    default_max_tokens: int = 1024
    max_n: int = 8


@dataclass
class Served:
    """What one server serves: the model under one name (its config and generation config: the weights live
    with the engine), its prompts, its engine, its limits."""

    name: str
    config: object
    generation_config: object
    tokenizer: object
    builder: PromptBuilder
    engine: Engine | EngineProcess
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_len(self) -> int:
        length = self.engine.max_len  # the engine's cache, once it started
        if length is not None:
            return int(length)
        config = self.config.get_text_config()
        return int(getattr(config, "max_position_embeddings", None) or 32768)

    @property
    def eos_ids(self) -> list[int]:
        eos = self.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        return [int(e) for e in eos if e is not None and e >= 0]


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 500: "server_error", 503: "server_error"}


def build_app(served: Served, enable_cors: bool = False, start_engine: bool = True):
    from contextlib import asynccontextmanager

    def fail(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, _KINDS.get(status, "invalid_request_error"), param, code),
                            status_code=status)

    @asynccontextmanager
    async def lifespan(app):
        if start_engine:
            served.engine.start()  # already started by the command: attaches a process engine to this loop
        try:
            yield
        finally:
            cancelled = len(served.engine.inflight)
            served.engine.stop(timeout=2)
            if cancelled:
                logger.warning("shutdown: cancelled %d request(s) still running", cancelled)
            logger.warning("shutdown: the engine stopped")

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    if enable_cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    def refusal(request: Request) -> JSONResponse | None:
        """The answer to a request that may not reach a route (a missing or wrong API key, a body over the
        limit), else None."""
        if served.api_key is not None and request.url.path != "/health" and request.method != "OPTIONS":
            header = request.headers.get("authorization", "")
            scheme, _, key = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
                response = fail(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return fail(400, "bad Content-Length header")
            if int(length) > served.limits.max_body_bytes:
                return fail(413, f"the request body has {length} bytes, more than the limit "
                                 f"{served.limits.max_body_bytes}")
        return None

    class Guard:
        """`refusal` before any route, as a plain ASGI middleware: Starlette's ``@app.middleware("http")`` relays
        every chunk of a streamed response through a memory stream, a cost per token and stream that the
        engine thread pays too (one interpreter lock)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                response = refusal(Request(scope))
                if response is not None:
                    await response(scope, receive, send)
                    return
            await self.inner(scope, receive, send)

    app.add_middleware(Guard)

    @app.exception_handler(BadRequest)
    async def _bad(_request, error: BadRequest):
        return fail(error.status, error.message, error.param, error.code)

    @app.exception_handler(EngineDead)
    async def _dead(_request, error: EngineDead):
        return fail(503, str(error), code="engine_unavailable")

    @app.exception_handler(Exception)
    async def _unexpected(_request, error: Exception):
        logger.error("request failed: %s", error, exc_info=True)
        return fail(500, f"internal error: {type(error).__name__}: {error}")

    # ------------------------------------------------------------------ bodies
    async def read_body(request: Request, schema):
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
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as error:
            message, param = describe(error)
            raise BadRequest(message, param, status=422) from None

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise BadRequest(f"model {name!r} is not served here: this server serves only {served.name!r}", "model",
                             status=404, code="model_not_found")

    # ------------------------------------------------------------------ shared checks
    def sampling_of(body, temperature, top_p, top_k=None, min_p=None, presence=None, frequency=None,
                    repetition=None):
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

    def max_tokens_of(requested: int | None, prompt_len: int, param: str) -> int:
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

    def check_n(n: int) -> None:
        if not 1 <= n <= served.limits.max_n:
            raise BadRequest(f"n must lie in [1, {served.limits.max_n}], got {n}", "n")

    def check_prompt_ids(ids: list[int], param: str) -> None:
        if not ids:
            raise BadRequest("the prompt is empty", param)
        vocab = served.config.get_text_config().vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param)

    # ------------------------------------------------------------------ running choices
    class Run:
        """The engine requests of one HTTP request: ``prompts[p]`` with ``n`` choices each."""

        def __init__(self, prompts: list[Prompt], n: int, max_tokens: list[int], sampling, seed, logprobs: bool,
                     stop: list[str], ignore_eos: bool, streaming: bool):
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
                    served.engine.cancel(choice.request_id)

        @property
        def done(self) -> bool:
            return all(c.done for c in self.choices)

        async def next(self) -> tuple[Choice, str, int]:
            """The next update: (its choice, the text it may send now, how many tokens it had before). Updates of
            the same choice already waiting are taken with it (a server behind its engine sends fewer, longer
            chunks instead of falling further behind)."""
            if not self.waiting:
                self.waiting.append(await self.queue.get())
            while not self.queue.empty():
                self.waiting.append(self.queue.get_nowait())
            index, output = self.waiting.popleft()
            choice = self.choices[index]
            before = len(choice.tokens)
            piece = choice.update(output)
            while self.waiting and self.waiting[0][0] == index and not choice.done:
                piece += choice.update(self.waiting.popleft()[1])
            if choice.done and choice.stopped_by_string:
                served.engine.cancel(choice.request_id)  # a stop string ends it: its row goes back now
            return choice, piece, before

        def failure(self) -> str | None:
            return next((c.error for c in self.choices if c.finish_reason == "error"), None)

        def usage(self) -> dict:
            prompt_tokens = sum(len(p.ids) for p in self.prompts)
            completion = sum(len(c.tokens) for c in self.choices)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

    async def wait_all(request: Request, run: Run) -> None:
        """Until every choice is done; the client going away cancels them."""
        disconnected = asyncio.ensure_future(_disconnect(request))
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
            served.engine.check_alive()
            raise BadRequest(f"generation failed: {error}", status=500, code="generation_failed")

    def stream_response(run: Run, chunks):
        async def body():
            try:
                async for chunk in chunks:
                    yield chunk
                yield "data: [DONE]\n\n"
            finally:
                run.cancel()  # the client went away (or the server stops): nothing of it keeps running

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def stream_chunk(rid: str, kind: str, created: int, include_usage: bool):
        """``chunk(choices, usage=None)``: one server-sent event of a streamed response (with usage when asked)."""

        def chunk(choices: list, usage=None) -> str:
            payload = {"id": rid, "object": kind, "created": created, "model": served.name,
                       "system_fingerprint": None, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return sse(payload)

        return chunk

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def chat_logprobs(choice: Choice, start: int, end: int) -> dict:
        content = []
        for token, value in zip(choice.tokens[start:end], choice.logprobs[start:end]):
            text = served.tokenizer.decode([token])
            content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content, "refusal": None}

    def completion_logprobs(choice: Choice, start: int, end: int, offset: int) -> dict:
        tokens, values, offsets = [], [], []
        for k in range(start, end):
            tokens.append(served.tokenizer.decode([choice.tokens[k]]))
            values.append(choice.logprobs[k] if k < len(choice.logprobs) else None)
            offsets.append(offset)
            offset += len(choice.pieces[k])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}

    def kept_now(choice: Choice) -> int:
        return choice.kept() if choice.done else len(choice.tokens)

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        state = await served.engine.health()
        healthy = state.get("running") and state.get("fatal_error") is None
        state = {"status": "ok" if healthy else "unhealthy", "model": served.name, **state}
        return JSONResponse(state, status_code=200 if healthy else 503)

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "hf-qsa-cache",
                "max_model_len": served.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    @app.post("/load_model")
    async def load_model(request: Request):
        try:
            data = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            raise BadRequest("the body must name a model: {\"model\": ...}", "model", status=422)
        check_model(data["model"])  # nothing is ever loaded: the served model is ready, any other is refused

        async def ready():
            yield sse({"status": "ready", "model": served.name, "cached": True})

        return StreamingResponse(ready(), media_type="text/event-stream")

    @app.post("/reset")
    async def reset():
        return {"status": "ok", "cancelled": served.engine.cancel_all()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatRequest = await read_body(request, ChatRequest)
        check_model(body.model)
        refuse_unsupported(body, chat=True)
        check_n(body.n)
        stop = stops_of(body.stop)
        sampling = sampling_of(body, body.temperature, body.top_p, body.top_k, body.min_p, body.presence_penalty,
                               body.frequency_penalty, body.repetition_penalty)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        has_media = any(isinstance(m.get("content"), list) and any(p["type"] in ("image_url", "input_audio")
                                                                    for p in m["content"]) for m in messages)
        if has_media:
            prompt = await asyncio.to_thread(served.builder.chat, messages, body.chat_template_kwargs)
        else:
            prompt = served.builder.chat(messages, body.chat_template_kwargs)
        check_prompt_ids(prompt.ids, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = max_tokens_of(requested, len(prompt.ids), param)
        run = Run([prompt], body.n, [max_tokens], sampling, body.seed, body.logprobs, stop, body.ignore_eos,
                  body.stream)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            await wait_all(request, run)
            choices = []
            for c in run.choices:
                item = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish_reason, "logprobs": None}
                if body.logprobs:
                    item["logprobs"] = chat_logprobs(c, 0, c.kept())
                if body.return_token_ids:
                    item["token_ids"] = c.tokens[: c.kept()]
                choices.append(item)
            out = {"id": rid, "object": "chat.completion", "created": created, "model": served.name,
                   "choices": choices, "usage": run.usage(), "system_fingerprint": None}
            if body.return_token_ids:
                out["prompt_token_ids"] = prompt.ids
            return JSONResponse(out)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk = stream_chunk(rid, "chat.completion.chunk", created, include_usage)

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
                choice, piece, _ = await run.next()
                end = kept_now(choice)
                if piece or end > sent[choice.index]:
                    item = {"index": choice.index, "delta": {"content": piece}, "logprobs": None,
                            "finish_reason": None}
                    if body.logprobs:
                        item["logprobs"] = chat_logprobs(choice, sent[choice.index], end)
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await read_body(request, CompletionRequest)
        check_model(body.model)
        refuse_unsupported(body, chat=False)
        check_n(body.n)
        stop = stops_of(body.stop)
        sampling = sampling_of(body, body.temperature, body.top_p, body.top_k, body.min_p, body.presence_penalty,
                               body.frequency_penalty, body.repetition_penalty)
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
            check_prompt_ids(ids, "prompt")
            prompts.append(Prompt(ids))
        max_tokens = [max_tokens_of(body.max_tokens, len(p.ids), "max_tokens") for p in prompts]
        want_logprobs = body.logprobs is not None
        run = Run(prompts, body.n, max_tokens, sampling, body.seed, want_logprobs, stop, body.ignore_eos,
                  body.stream)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            await wait_all(request, run)
            choices = []
            for c in run.choices:
                item = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                if want_logprobs:
                    item["logprobs"] = completion_logprobs(c, 0, c.kept(), 0)
                if body.return_token_ids:
                    item["token_ids"] = c.tokens[: c.kept()]
                    item["prompt_token_ids"] = prompts[c.prompt_index].ids
                choices.append(item)
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": served.name,
                                 "choices": choices, "usage": run.usage(), "system_fingerprint": None})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk = stream_chunk(rid, "text_completion", created, include_usage)

        async def chunks():
            sent = [0] * len(run.choices)
            offsets = [0] * len(run.choices)
            while not run.done:
                choice, piece, _ = await run.next()
                end = kept_now(choice)
                if choice.finish_reason == "error":
                    yield sse(error_body(f"generation failed: {choice.error}", "server_error",
                                         code="generation_failed"))
                    return
                if piece or end > sent[choice.index] or choice.done:
                    item = {"index": choice.index, "text": piece, "logprobs": None,
                            "finish_reason": choice.finish_reason if choice.done else None}
                    if want_logprobs:
                        item["logprobs"] = completion_logprobs(choice, sent[choice.index], end, offsets[choice.index])
                    if body.return_token_ids:
                        item["token_ids"] = choice.tokens[sent[choice.index]: end]
                    offsets[choice.index] += len(piece)
                    sent[choice.index] = end
                    yield chunk([item])
            if include_usage:
                yield chunk([], run.usage())

        return stream_response(run, chunks())

    @app.post("/v1/responses")
    async def responses(request: Request):
        body: ResponsesRequest = await read_body(request, ResponsesRequest)
        check_model(body.model)
        if body.tools:
            raise BadRequest("tools are not supported by this server", "tools")
        if body.previous_response_id is not None:
            raise BadRequest("this server keeps no responses: send the whole conversation in 'input'",
                             "previous_response_id")
        messages = responses_messages(body)
        sampling = sampling_of(body, body.temperature, body.top_p, body.top_k)
        has_media = any(isinstance(m["content"], list) and any(p["type"] != "text" for p in m["content"])
                        for m in messages)
        prompt = (await asyncio.to_thread(served.builder.chat, messages) if has_media
                  else served.builder.chat(messages))
        check_prompt_ids(prompt.ids, "input")
        max_tokens = max_tokens_of(body.max_output_tokens, len(prompt.ids), "max_output_tokens")
        run = Run([prompt], 1, [max_tokens], sampling, body.seed, False, [], False, body.stream)
        rid, mid, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())

        def response(status: str, choice: Choice | None) -> dict:
            out = {"id": rid, "object": "response", "created_at": created, "model": served.name, "status": status,
                   "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
                   "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": False,
                   "temperature": body.temperature, "top_p": body.top_p, "tool_choice": "none", "tools": [],
                   "metadata": body.metadata or {}, "text": {"format": {"type": "text"}}, "usage": None}
            if choice is not None:
                out["output"] = [message_item(choice.text, "completed")]
                if choice.finish_reason == "length":
                    out["status"] = "incomplete"
                    out["incomplete_details"] = {"reason": "max_output_tokens"}
                usage = run.usage()
                out["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                                "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                                "output_tokens_details": {"reasoning_tokens": 0}}
            return out

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
                choice, piece, _ = await run.next()
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
            yield event("response.output_item.done", output_index=0, item=message_item(choice.text, "completed"))
            final = response("completed", choice)
            yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                        response=final)

        async def body_stream():
            try:
                async for item in events():
                    yield item
            finally:
                run.cancel()

        return StreamingResponse(body_stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _disconnect(request) -> None:
    """Returns once the client has gone away (the body was read before this is awaited)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def refuse_unsupported(body, chat: bool) -> None:
    """OpenAI fields that ask for what this server does not do: a 400 naming the field."""
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported by this server", "logit_bias")
    if chat:
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
