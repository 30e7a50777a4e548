"""The routes about the server rather than generation: `/health`, `/v1/models`, `/load_model` (transformers
serve's), `/reset`."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .checks import check_model
from .prompts import BadRequest
from .runs import sse
from .served import Served, served_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    served = served_of(request)
    state = await served.engine.health()
    healthy = state.get("running") and state.get("fatal_error") is None
    state = {"status": "ok" if healthy else "unhealthy", "model": served.name, **state}
    return JSONResponse(state, status_code=200 if healthy else 503)


def model_card(served: Served) -> dict:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "hf-qsa-cache",
            "max_model_len": served.max_len}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(served_of(request))]}


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str):
    served = served_of(request)
    check_model(served, name)
    return model_card(served)


@router.post("/load_model")
async def load_model(request: Request):
    served = served_of(request)
    try:
        data = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        raise BadRequest("the body must name a model: {\"model\": ...}", "model", status=422)
    check_model(served, data["model"])  # nothing is ever loaded: the served model is ready, any other is refused

    async def ready():
        yield sse({"status": "ready", "model": served.name, "cached": True})

    return StreamingResponse(ready(), media_type="text/event-stream")


@router.post("/reset")
async def reset(request: Request):
    return {"status": "ok", "cancelled": served_of(request).engine.cancel_all()}
