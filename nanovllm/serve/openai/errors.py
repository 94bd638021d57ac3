"""OpenAI's error body, and the handlers that turn every failure of a request into one."""
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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
    """A 400 naming the field the engine's message starts with ("top_p=2 is ...")."""
    message = str(error)
    match = re.match(r"(?:request \d+: )?([a-z_]+)[=:]", message)
    param = match.group(1) if match else None
    if param is None and message.startswith(("prompt", "token id")):
        param = "prompt"
    return APIError(400, message, "invalid_request_error", param)


def add_error_handlers(app: FastAPI) -> None:
    """APIError as itself, a body that fails validation as a 400 naming the field, anything
    else as a 500: a request never takes the server down."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        return APIError(400, f"{param}: {first['msg']}", "invalid_request_error",
                        param).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        body = error_body(error)
        return JSONResponse({"error": body}, body["code"])

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {error!r}", "internal_error").response()
