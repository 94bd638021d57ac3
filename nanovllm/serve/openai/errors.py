"""OpenAI's error body, and the handlers that turn every failure of a request into one."""
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanovllm.serve.async_llm import EngineDeadError


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.status}}, self.status)


def error_body(error: RuntimeError) -> dict:
    """OpenAI's error object for an engine failure: 503 once the engine is gone, else 500."""
    dead = isinstance(error, EngineDeadError)
    return {"message": str(error), "type": "service_unavailable" if dead else "internal_error",
            "param": None, "code": 503 if dead else 500}


def bad_request(error: ValueError) -> APIError:
    """A 400 naming the field: a FieldError's, else the one the engine's message starts with
    ("top_p=2 is ...")."""
    message = str(error)
    if hasattr(error, "param"):  # validation.FieldError
        return APIError(400, message, "invalid_request_error", error.param)
    match = re.match(r"(?:request \d+: )?([a-z_]+)[=:]", message)
    param = match.group(1) if match else None
    if param is None and message.startswith(("prompt", "token id")):
        param = "prompt"
    return APIError(400, message, "invalid_request_error", param)


# pydantic's names for the member of a union that failed ("str", "list[int]"): not fields
_UNION_MEMBER = re.compile(r"^(str|int|float|bool)$|\[")


def invalid_body(error: RequestValidationError) -> APIError:
    """A 400 for a body that fails validation: not JSON (no param), or the field it names."""
    # A union's members each fail: the deepest error is the member the client meant.
    first = max(error.errors(), key=lambda e: len(e["loc"]))
    if first["type"] == "json_invalid":  # its loc holds a character offset, not a field
        reason = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"the request body is not valid JSON ({reason})",
                        "invalid_request_error")
    parts = [str(p) for p in first["loc"][1:] if not _UNION_MEMBER.search(str(p))]
    param = ".".join(parts) or None
    where = param or "the request body"
    return APIError(400, f"{where}: {first['msg']}", "invalid_request_error", param)


def http_error(request: Request, error: HTTPException) -> APIError:
    """Starlette's 404 (no such route) and 405 (wrong method) in OpenAI's words and body."""
    where = f"({request.method} {request.url.path})"
    if error.status_code == 404:
        return APIError(404, f"Invalid URL {where}", "invalid_request_error")
    if error.status_code == 405:
        return APIError(405, f"Invalid method for URL {where}", "invalid_request_error")
    return APIError(error.status_code, str(error.detail), "invalid_request_error")


def add_error_handlers(app: FastAPI) -> None:
    """APIError as itself, a body that fails validation as a 400 naming the field, unknown
    routes and methods as 404 and 405, anything else as a 500: all in OpenAI's body, and a
    request never takes the server down."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return invalid_body(error).response()

    @app.exception_handler(HTTPException)
    async def route_error(request: Request, error: HTTPException) -> JSONResponse:
        response = http_error(request, error).response()
        response.headers.update(error.headers or {})  # 405's Allow
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        body = error_body(error)
        return JSONResponse({"error": body}, body["code"])

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {error!r}", "internal_error").response()
