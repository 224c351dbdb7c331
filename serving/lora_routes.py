"""vLLM's runtime adapter routes, served with --allow-runtime-lora-updating: POST /v1/load_lora_adapter reads and
checks an adapter in the engine thread (400 naming the problem, the server keeps serving) and then lets requests name
it; POST /v1/unload_lora_adapter forgets one (404 unknown, 400 while requests still use it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from netra_jax.models.lora import LoRAError
from netra_jax.serving.errors import APIError, bad
from netra_jax.serving.lora_modules import LoRAModule
from netra_jax.serving.openapi import doc
from netra_jax.serving.state import ServerState

__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "install_lora_routes"]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, st: ServerState, parse_body: Callable[..., Awaitable[Any]]) -> None:
    @app.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        openapi_extra=doc(LoadLoRAAdapterRequest, media_type="text/plain"),
    )
    async def load_lora_adapter(raw: Request) -> PlainTextResponse:
        req = await parse_body(raw, LoadLoRAAdapterRequest)
        if not req.lora_name or not req.lora_path:
            raise bad("lora_name and lora_path must be non-empty", "lora_name" if not req.lora_name else "lora_path")
        if req.lora_name == st.model_name or st.ctx.adapters.get(req.lora_name) is not None:
            raise bad(f"the name {req.lora_name!r} is already served", "lora_name")
        module = LoRAModule(req.lora_name, req.lora_path)
        try:  # read in the engine thread, between steps
            await st.engine.call(lambda e: st.ctx.adapters.load(e, module))
        except LoRAError as e:  # the directory, a refused setting or a tensor, named
            raise bad(str(e), "lora_path") from None
        except ValueError as e:  # the name, loaded by a concurrent call meanwhile
            raise bad(str(e), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        openapi_extra=doc(UnloadLoRAAdapterRequest, media_type="text/plain"),
    )
    async def unload_lora_adapter(raw: Request) -> PlainTextResponse:
        req = await parse_body(raw, UnloadLoRAAdapterRequest)
        lora = st.ctx.adapters.get(req.lora_name)
        if lora is None:
            raise APIError(404, f"no LoRA adapter named {req.lora_name!r}", param="lora_name", code="model_not_found")
        try:
            await st.engine.call(lambda e: e.remove_lora(lora.lora_int_id))
        except ValueError as e:
            raise bad(str(e), "lora_name") from None
        st.ctx.adapters.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
