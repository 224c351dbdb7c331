"""The FastAPI application: OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/responses (JSON or SSE),
/v1/embeddings, /v1/models; vLLM's /tokenize, /detokenize, /tokenizer_info, /v1/score (and /score) and the rerank
routes /rerank, /v1/rerank (Jina's shape) and /v2/rerank (Cohere's); /health, /ready, /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from netra_jax.engine.async_engine import AsyncEngine, EngineDeadError
from netra_jax.engine.scheduler import QueueFullError
from netra_jax.lora_request import LoRARequest
from netra_jax.serving import preprocess as pre
from netra_jax.serving.chat import chat_response, prepare_chat, render_chat
from netra_jax.serving.chat_output import ChatOutputConfig
from netra_jax.serving.completion import completion_response, prepare_completion
from netra_jax.serving.context import ServingContext
from netra_jax.serving.embeddings import EmbeddingRequest, EmbeddingResponse, check_task, create_embeddings
from netra_jax.serving.errors import APIError, envelope, install_error_handlers
from netra_jax.serving.generation import ClientDisconnected, Generation, race_disconnect
from netra_jax.serving.lora_modules import ServedAdapters
from netra_jax.serving.lora_routes import install_lora_routes
from netra_jax.serving.metrics import ServerMetrics
from netra_jax.serving.middleware import APIKeyMiddleware, BodyLimitMiddleware
from netra_jax.serving.openapi import doc, install_openapi
from netra_jax.serving.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ProbeStatus,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from netra_jax.serving.protocol_scoring import (
    RerankRequest,
    RerankResponse,
    RerankV2Response,
    ScoreRequest,
    ScoreResponse,
)
from netra_jax.serving.responses import install_responses_routes
from netra_jax.serving.scoring import create_rerank, create_scores
from netra_jax.serving.state import ServerState
from netra_jax.serving.streaming import StreamContext, chat_stream, completion_stream
from netra_jax.serving.tokenizer_info import tokenizer_info
from netra_jax.structured_output import StructuredOutputError

CLIENT_CLOSED = 499  # nginx's status for "client closed request"; never reaches the (gone) client
DEFAULT_MAX_BODY = 4 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def parse_body[M: BaseModel](raw: Request, model: type[M]) -> M:
    """The JSON body as `model`, whatever the Content-Type (curl -d sends form-encoded); errors become 400."""
    try:
        return model.model_validate_json(await raw.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def _engine_error(e: BaseException, retry_after: int) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(
            429, f"server is busy: {e}; retry later", code="queue_full", headers={"Retry-After": str(retry_after)}
        )
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine is not running: {e}", code="engine_dead")
    if isinstance(e, StructuredOutputError):  # the schema failed to compile when the engine admitted the request
        return pre.bad(str(e), "response_format", "invalid_response_format")
    if isinstance(e, ValueError):
        return pre.bad(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    chat_template: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    cors_origins: list[str] | None = None,
    ready: Callable[[], bool] | None = None,
    retry_after: int = 1,
    chat_output: ChatOutputConfig | None = None,
    adapters: ServedAdapters | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """An app serving `engine` as the model `served_model_name`. `chat_template`: Jinja source replacing the
    checkpoint's (requests cannot supply one). `ready`: warm-up finished (default: the engine's `ready` flag).
    `chat_output`: tool-call and reasoning parsers for chat answers (--enable-auto-tool-choice and friends).
    `adapters`: the LoRA adapters requests may name as their `model` (--lora-modules, already registered with the
    engine); `allow_runtime_lora_updating`: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    metrics = ServerMetrics(engine)
    st = ServerState(
        engine,
        ServingContext.of(engine.engine, served_model_name, chat_template, chat_output, adapters),
        metrics,
        ready or (lambda: engine.engine.ready),
        retry_after,
        created=int(time.time()),
    )
    app = FastAPI(title="netra_jax", version="0.1.0")
    app.state.server = st
    install_openapi(app)
    install_error_handlers(app, metrics.count_error)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_error=metrics.count_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, on_error=metrics.count_error)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

    def check_model(model: str | None) -> LoRARequest | None:
        return pre.check_model(st.ctx, model)

    def check_serving(task: str = "generate") -> None:
        check_task(st.llm, task)  # 400: a text-generation route on an embedding server, or the other way round
        if not engine.is_alive:
            raise APIError(503, "engine is not running", code="engine_dead")
        if st.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if not st.ready():
            raise APIError(
                503, "model is warming up; retry shortly", code="warming_up", headers={"Retry-After": str(retry_after)}
            )

    # ------------------------------------------------------------------ probes and metadata
    @app.get("/health", openapi_extra=doc(response=ProbeStatus))
    async def health() -> Response:
        if engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(envelope(503, f"engine is not running: {engine.dead!r}", code="engine_dead"), 503)

    @app.get("/ready", openapi_extra=doc(response=ProbeStatus))
    async def ready_probe() -> Response:
        if engine.is_alive and st.ready() and not st.draining:
            return JSONResponse({"status": "ready"})
        why = "engine is not running" if not engine.is_alive else "shutting down" if st.draining else "warming up"
        return JSONResponse(envelope(503, why, code="not_ready"), 503)

    @app.get("/metrics", openapi_extra=doc(media_type="text/plain"))
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(lora: LoRARequest | None = None) -> ModelCard:
        if lora is not None:  # an adapter: its directory, and the base model as its parent (vLLM's cards)
            root = lora.lora_path or lora.lora_name
            return ModelCard(id=lora.lora_name, created=st.created, root=root, parent=st.model_name)
        return ModelCard(
            id=st.model_name,
            created=st.created,
            root=str(st.llm.config.model or st.model_name),
            max_model_len=st.llm.max_model_len,
        )

    @app.get("/v1/models", openapi_extra=doc(response=ModelList))
    async def models() -> ModelList:
        return ModelList(data=[card(), *(card(a) for a in st.ctx.adapters.all())])

    @app.get("/v1/models/{model_id:path}", openapi_extra=doc(response=ModelCard))
    async def model(model_id: str) -> ModelCard:
        return card(check_model(model_id))

    if allow_runtime_lora_updating:
        install_lora_routes(app, st, parse_body)

    @app.post("/tokenize", openapi_extra=doc(TokenizeRequest, TokenizeResponse))
    async def tokenize(raw: Request) -> TokenizeResponse:
        req = await parse_body(raw, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise pre.bad("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            fields = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
            given = req.model_fields_set & set(fields)  # (whether add_generation_prompt was given matters)
            chat = ChatCompletionRequest.model_construct(given, **{f: getattr(req, f) for f in fields})
            _, _, ids = await asyncio.to_thread(render_chat, st.ctx, chat, req.tools)
        else:
            ids = st.llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [st.tokens.text(i) for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=st.llm.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", openapi_extra=doc(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(raw: Request) -> DetokenizeResponse:
        req = await parse_body(raw, DetokenizeRequest)
        check_model(req.model)
        ids = [] if not req.tokens else pre.check_ids(st.llm, req.tokens, "tokens")
        return DetokenizeResponse(prompt=st.llm.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens))

    @app.get("/tokenizer_info", openapi_extra=doc(response=TokenizerInfoResponse))
    async def tokenizer_info_route() -> TokenizerInfoResponse:
        return tokenizer_info(st.ctx)

    # ------------------------------------------------------------------ generation
    async def start(raw: Request, gen: Generation, stream: bool):
        """Non-streaming: every output. Streaming: the first event (so admission errors still get a status)."""
        try:
            if stream:
                it = gen.events()
                return await race_disconnect(raw, it.__anext__()), it
            return await race_disconnect(raw, gen.collect())
        except ClientDisconnected:
            gen.close()
            return None
        except BaseException as e:
            gen.close()
            raise _engine_error(e, retry_after) from None

    def sse(body, gen: Generation) -> StreamingResponse:
        async def close() -> None:  # also when the client left before the body started
            gen.close()

        return StreamingResponse(
            body, media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(close)
        )

    def stream_context(plan, req, num_logprobs, echo, echo_only: bool = False) -> StreamContext:
        return StreamContext(
            plan.id,
            int(time.time()),
            st.model_name,
            plan.params.n,
            st.tokens,
            num_logprobs,
            req.include_usage,
            req.continuous_usage,
            metrics,
            echo,
            req.return_token_ids,
            echo_only,
            plan.params.skip_special_tokens,
        )

    @app.post(
        "/v1/completions",
        response_model=None,
        openapi_extra=doc(CompletionRequest, CompletionResponse, stream=CompletionChunk),
    )
    async def completions(raw: Request) -> Response | CompletionResponse:
        req = await parse_body(raw, CompletionRequest)
        lora = check_model(req.model)
        check_serving()
        plan = await asyncio.to_thread(prepare_completion, st.ctx, req)  # tokenizes up to 256 prompts
        gen = Generation(engine, plan.prompts, plan.params, plan.engine_id, metrics, plan.priority, lora)
        res = await start(raw, gen, req.stream)
        if res is None:
            return Response(status_code=CLIENT_CLOSED)
        if req.stream:
            ctx = stream_context(plan, req, plan.num_logprobs, plan.echo, plan.echo_only)
            return sse(completion_stream(gen, res[0], res[1], ctx), gen)
        return completion_response(st.ctx, req, plan, res)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=doc(ChatCompletionRequest, ChatCompletionResponse, stream=ChatCompletionChunk),
    )
    async def chat_completions(raw: Request) -> Response | ChatCompletionResponse:
        req = await parse_body(raw, ChatCompletionRequest)
        lora = check_model(req.model)
        check_serving()
        plan = await asyncio.to_thread(prepare_chat, st.ctx, req)
        gen = Generation(engine, [plan.prompt], plan.params, plan.engine_id, metrics, plan.priority, lora)
        res = await start(raw, gen, req.stream)
        if res is None:
            return Response(status_code=CLIENT_CLOSED)
        if req.stream:
            ctx = stream_context(plan, req, plan.num_logprobs, None if plan.echo is None else [plan.echo])
            return sse(chat_stream(gen, res[0], res[1], ctx, plan.output), gen)
        return chat_response(st.ctx, req, plan, res)

    install_responses_routes(
        app, st, parse_body=parse_body, check_serving=check_serving, start=start, sse=sse, client_closed=CLIENT_CLOSED
    )

    @app.post("/v1/embeddings", openapi_extra=doc(EmbeddingRequest, EmbeddingResponse))
    async def embeddings(raw: Request) -> EmbeddingResponse:
        req = await parse_body(raw, EmbeddingRequest)
        check_model(req.model)
        check_serving("embed")
        return await create_embeddings(engine, st.model_name, req)

    # ------------------------------------------------------------------ scoring with the embedding model
    async def scoring_request[M: BaseModel](raw: Request, model: type[M]) -> M:
        req = await parse_body(raw, model)
        check_model(req.model)
        check_task(st.llm, "embed", raw.url.path)  # the 400 naming this route, before check_serving's
        check_serving("embed")
        return req

    @app.post("/v1/score", openapi_extra=doc(ScoreRequest, ScoreResponse))
    @app.post("/score", openapi_extra=doc(ScoreRequest, ScoreResponse))
    async def score(raw: Request) -> ScoreResponse:
        return await create_scores(engine, st.model_name, await scoring_request(raw, ScoreRequest))

    @app.post("/v1/rerank", openapi_extra=doc(RerankRequest, RerankResponse))
    @app.post("/rerank", openapi_extra=doc(RerankRequest, RerankResponse))
    async def rerank(raw: Request) -> RerankResponse:
        return await create_rerank(engine, st.model_name, await scoring_request(raw, RerankRequest))

    @app.post("/v2/rerank", openapi_extra=doc(RerankRequest, RerankV2Response))
    async def rerank_v2(raw: Request) -> RerankV2Response:
        return await create_rerank(engine, st.model_name, await scoring_request(raw, RerankRequest), cohere_v2=True)

    return app
