"""The OpenAI-compatible HTTP routes over one AsyncLLM."""
import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from nanovllm.engine.async_llm import AsyncLLM, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.metrics import ServerMetrics
from nanovllm.serve.protocol import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from nanovllm.serve.responses import ResponseFormat


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.status}}, self.status)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def bad_request(error: ValueError) -> APIError:
    """A 400 naming the field the engine's message starts with ("top_p=2 is ...")."""
    message = str(error)
    match = re.match(r"(?:request \d+: )?([a-z_]+)[=:]", message)
    param = match.group(1) if match else None
    if param is None and message.startswith(("prompt", "token id")):
        param = "prompt"
    return APIError(400, message, "invalid_request_error", param)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The server's routes; `llm` is shut down when the app's lifespan ends."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            llm.shutdown()  # open requests fail, the engine thread stops, the engine is freed

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    metrics = ServerMetrics(model_name)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        return APIError(400, f"{param}: {first['msg']}", "invalid_request_error",
                        param).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {error!r}", "internal_error").response()

    async def authorize(authorization: str | None = Header(None)) -> None:
        if api_key is not None and authorization != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                           "authentication_error")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(llm.stats), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "nanovllm",
                                            "max_model_len": llm.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        try:
            prompt = body.single_prompt()
            params = body.sampling_params(default_max_tokens=16)  # OpenAI's default
        except ValueError as e:
            raise bad_request(e) from None
        return await serve(request, body, prompt, params, ResponseFormat(model_name, chat=False))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body)
        try:
            prompt = chat_prompt(llm, body)
            default_max_tokens = llm.max_model_len - len(prompt)  # the rest of the context
            if body.max_completion_tokens is not None:
                default_max_tokens = body.max_completion_tokens
            params = body.sampling_params(default_max_tokens)
        except ValueError as e:
            raise bad_request(e) from None
        return await serve(request, body, prompt, params, ResponseFormat(model_name, chat=True))

    def check_model(body: _SamplingRequest) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{model_name!r}", "not_found_error", "model")

    async def serve(request: Request, body: _SamplingRequest, prompt: str | list[int],
                    params: SamplingParams, fmt: ResponseFormat) -> Response:
        outputs = metrics.track(llm.generate(prompt, params, fmt.id))
        try:
            # Validation runs before the first output: a bad request is a 400, not a stream.
            first = await until_disconnect(request, anext(outputs))
        except ValueError as e:
            raise bad_request(e) from None
        except ClientDisconnected:
            await outputs.aclose()
            return Response(status_code=499)  # nobody reads it
        if body.stream:
            return StreamingResponse(fmt.sse(first, outputs, body.include_usage),
                                     media_type="text/event-stream")
        try:
            last = await until_disconnect(request, collect(first, outputs))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(fmt.full(*last))

    app.include_router(v1)
    return app


def chat_prompt(llm: AsyncLLM, body: ChatCompletionRequest) -> list[int]:
    """The conversation through the tokenizer's chat template, as LLM.chat encodes it."""
    tokenizer = llm.tokenizer
    if tokenizer.chat_template is None:
        raise ValueError("messages: this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template([m.as_dict() for m in body.messages],
                                             tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may raise anything (jinja2's errors, its own)
        raise ValueError(f"messages: the chat template failed: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


async def collect(first: RequestOutput,
                  outputs: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput]:
    """The whole text and the last output."""
    pieces, last = [first.new_text], first
    async with aclosing(outputs):
        async for last in outputs:
            pieces.append(last.new_text)
    return "".join(pieces), last


async def until_disconnect(request: Request, awaitable: Awaitable):
    """Await `awaitable`, cancelling it (and so aborting its request) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

