"""The JSON error body every failure gets (OpenAI's shape), and the JSON response that carries it."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# The error "type" OpenAI's clients expect for each status.
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, _KINDS.get(status, "invalid_request_error"), param, code),
                        status_code=status)
