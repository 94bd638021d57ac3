"""The FastAPI app: OpenAI-compatible routes over one AsyncLLM, plus /health and /metrics."""
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import Response

from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.openai.errors import APIError, add_error_handlers
from nanovllm.serve.openai.serving import OpenAIServing


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
              lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The server's routes; `llm` is shut down when the app's lifespan ends. lora_modules:
    adapter name -> PEFT directory (a bad one raises ValueError or FileNotFoundError here)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            llm.shutdown()  # open requests fail, the engine thread stops, the engine is freed

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    add_error_handlers(app)
    serving = OpenAIServing(llm, model_name, lora_modules)

    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", serving.prometheus_metrics, methods=["GET"])
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorizer(api_key))])
    v1.add_api_route("/models", serving.models, methods=["GET"])
    # :path, as a served name may be a checkpoint's path ("/ckpt/Qwen3-0.6B")
    v1.add_api_route("/models/{model_id:path}", serving.model, methods=["GET"])
    v1.add_api_route("/completions", serving.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", serving.chat_completions, methods=["POST"])
    v1.add_api_route("/load_lora_adapter", serving.load_lora_adapter, methods=["POST"])
    v1.add_api_route("/unload_lora_adapter", serving.unload_lora_adapter, methods=["POST"])
    app.include_router(v1)
    return app


def authorizer(api_key: str | None) -> Callable:
    """A dependency that answers 401 unless `Authorization: Bearer <api_key>` (if one is set)."""

    async def authorize(authorization: str | None = Header(None)) -> None:
        if api_key is not None and authorization != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                           "authentication_error")

    return authorize
