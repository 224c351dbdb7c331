"""The Responses API routes: POST /v1/responses (OpenAI's Responses API as vLLM serves it without a response store), and
the retrieval routes, which answer 404 since nothing is stored. Installed into the app by serving/app.py.

Stateless, as vLLM unless VLLM_ENABLE_RESPONSES_API_STORE is set: `store: true` (OpenAI's default) is answered
normally but nothing is kept, and the response says `store: false`; previous_response_id, conversation and background
mode are 400s naming the field (vLLM answers previous_response_id with a 404 once its empty store has no such id)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from netra_jax.serving import preprocess as pre
from netra_jax.serving.errors import APIError
from netra_jax.serving.generation import Generation
from netra_jax.serving.openapi import doc
from netra_jax.serving.protocol_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    OutputItemEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    TextDeltaEvent,
    TextDoneEvent,
)
from netra_jax.serving.responses_input import STATELESS, prepare_responses
from netra_jax.serving.responses_output import responses_response, responses_stream

if TYPE_CHECKING:
    from netra_jax.serving.state import ServerState

EVENTS = (
    ResponseLifecycleEvent,
    OutputItemEvent,
    ContentPartEvent,
    TextDeltaEvent,
    TextDoneEvent,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
)


def install_responses_routes(
    app: FastAPI,
    st: ServerState,
    *,
    parse_body: Callable[[Request, type[ResponsesRequest]], Awaitable[ResponsesRequest]],
    check_serving: Callable[[], None],
    start: Callable[[Request, Generation, bool], Awaitable[Any]],
    sse: Callable[[Any, Generation], Response],
    client_closed: int,
) -> None:
    """The callables are the app's (serving/app.py): body parsing, the serving check, a Generation's start (None:
    the client left; streaming: its first event and the rest) and SSE wrapping (closing the Generation)."""

    @app.post("/v1/responses", response_model=None, openapi_extra=doc(ResponsesRequest, ResponseObject, stream=EVENTS))
    async def create_response(raw: Request) -> Response | ResponseObject:
        req = await parse_body(raw, ResponsesRequest)
        lora = pre.check_model(st.ctx, req.model)
        check_serving()
        plan = await asyncio.to_thread(prepare_responses, st.ctx, req)
        chat = plan.chat
        gen = Generation(st.engine, [chat.prompt], chat.params, chat.engine_id, st.metrics, chat.priority, lora)
        res = await start(raw, gen, req.stream)
        if res is None:
            return Response(status_code=client_closed)
        if req.stream:
            return sse(responses_stream(st.ctx, plan, gen, res[0], res[1]), gen)
        return responses_response(st.ctx, plan, res)

    async def not_stored(response_id: str) -> Response:
        what = f"the response {response_id!r} cannot be retrieved, deleted or cancelled"
        raise APIError(404, STATELESS.format(what=what), param="response_id", code="response_not_found")

    app.get("/v1/responses/{response_id}", include_in_schema=False)(not_stored)
    app.delete("/v1/responses/{response_id}", include_in_schema=False)(not_stored)
    app.post("/v1/responses/{response_id}/cancel", include_in_schema=False)(not_stored)
    app.get("/v1/responses/{response_id}/input_items", include_in_schema=False)(not_stored)
