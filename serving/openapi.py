"""The served OpenAPI document: every pydantic schema under components/schemas (valid `$ref`s), request bodies and
responses from each route's `doc(...)`, and the error envelope documented for every error status on every route."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from netra_jax.serving.protocol import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
ERRORS = {
    400: "invalid request: malformed JSON, an unknown field, a bad value (`param` names the field)",
    401: "missing or wrong API key (`--api-key`; every route but /health)",
    404: "unknown model (`param: model`) or route",
    413: "request body over `--max-body-bytes`",
    429: "the engine's waiting queue is full (`--max-waiting`); retry after `Retry-After` seconds",
    500: "internal error",
    503: "warming up (`Retry-After`), shutting down, or the engine has died",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")  # FastAPI's 422 body; this server answers 400
Mode = Literal["validation", "serialization"]


class OperationDoc(dict):
    """What `doc(...)` returns, passed as a route's `openapi_extra`: the models of one operation. It is an empty
    dict to FastAPI (nothing merged); `install_openapi` reads the models when it builds the document."""

    def __init__(
        self,
        request: type[BaseModel] | None,
        response: type[BaseModel] | None,
        stream: tuple[type[BaseModel], ...],
        media_type: str | None,
    ) -> None:
        super().__init__()
        self.request, self.response, self.stream, self.media_type = request, response, stream, media_type

    def models(self) -> list[tuple[type[BaseModel], Mode]]:
        out: list[tuple[type[BaseModel], Mode]] = []
        if self.request is not None:
            out.append((self.request, "validation"))
        out += [(m, "serialization") for m in (self.response, *self.stream) if m is not None]
        return out


def doc(
    request: type[BaseModel] | None = None,
    response: type[BaseModel] | None = None,
    *,
    stream: type[BaseModel] | Sequence[type[BaseModel]] = (),
    media_type: str | None = None,
) -> OperationDoc:
    """A route's OpenAPI description: `request` the JSON body it parses itself (parse_body), `response` its 200
    JSON answer, `stream` the model (or models) of the events of its `stream: true` answer (text/event-stream),
    `media_type` a non-JSON 200 (e.g. Prometheus text). Use as `@app.post(path, openapi_extra=doc(Req, Resp))`."""
    events = (stream,) if isinstance(stream, type) else tuple(stream)
    return OperationDoc(request, response, events, media_type)


def _error_responses(error_ref: dict[str, str]) -> dict[str, Any]:
    out = {}
    for status, why in ERRORS.items():
        entry: dict[str, Any] = {"description": why, "content": {"application/json": {"schema": dict(error_ref)}}}
        if status in (429, 503):
            entry["headers"] = copy.deepcopy(RETRY_AFTER)
        out[str(status)] = entry
    return out


def _event_schema(events: tuple[type[BaseModel], ...], refs: dict) -> dict[str, Any]:
    """One server-sent event of a `stream: true` answer (before OpenAPI 3.2 a stream's `schema` describes each
    event): `data` is an event model's JSON, an error envelope's (a failure after the stream started), or `[DONE]`."""
    event_refs = [dict(refs[(m, "serialization")]) for m in (*events, ErrorResponse)]
    names = " | ".join(r["$ref"].rsplit("/", 1)[-1] for r in event_refs[:-1])
    payload = {"contentMediaType": "application/json", "contentSchema": {"anyOf": event_refs}}
    return {
        "type": "object",
        "description": f"with `stream: true`: events `data: <{names}>` (an error envelope on a failure), then "
        "`data: [DONE]`",
        "properties": {"data": {"type": "string", "anyOf": [{"const": "[DONE]"}, payload]}},
        "required": ["data"],
    }


def _ok_response(d: OperationDoc, refs: dict[tuple[type[BaseModel], Mode], dict[str, str]]) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if d.response is not None:
        content["application/json"] = {"schema": dict(refs[(d.response, "serialization")])}
    if d.stream:
        content["text/event-stream"] = {"schema": _event_schema(d.stream, refs)}
    if d.media_type is not None:
        content[d.media_type] = {"schema": {"type": "string"}}
    return {"description": "OK", "content": content} if content else {"description": "OK"}


def _documented(routes: Iterable[Any]) -> list[tuple[APIRoute, OperationDoc]]:
    return [
        (r, r.openapi_extra) for r in routes if isinstance(r, APIRoute) and isinstance(r.openapi_extra, OperationDoc)
    ]


def _refs_in(value: Any) -> set[str]:
    if isinstance(value, dict):
        found = {value["$ref"]} if isinstance(value.get("$ref"), str) else set()
        return found.union(*(_refs_in(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_refs_in(v) for v in value))
    return set()


def complete(schema: dict[str, Any], routes: Sequence[Any]) -> dict[str, Any]:
    """FastAPI's document with the models of every `doc(...)` under components/schemas, each such operation's
    requestBody and 200 from them, and the error envelope on every status of ERRORS on every operation (FastAPI's
    422, never sent, dropped)."""
    documented = _documented(routes)
    pairs: list[tuple[type[BaseModel], Mode]] = [(ErrorResponse, "serialization")]
    for _, d in documented:
        pairs += [p for p in d.models() if p not in pairs]
    refs, top = models_json_schema(pairs, ref_template=REF_TEMPLATE)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(top.get("$defs", {}))
    errors = _error_responses(refs[(ErrorResponse, "serialization")])
    for route, d in documented:
        for method in route.methods:
            op = schema["paths"][route.path_format][method.lower()]
            if d.request is not None:
                body = {"schema": dict(refs[(d.request, "validation")])}
                op["requestBody"] = {"required": True, "content": {"application/json": body}}
            op.setdefault("responses", {})["200"] = _ok_response(d, refs)
    for ops in schema["paths"].values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status, entry in errors.items():
                responses.setdefault(status, copy.deepcopy(entry))
    used = _refs_in(schema["paths"]) | _refs_in({k: v for k, v in schemas.items() if k not in FASTAPI_VALIDATION})
    for name in FASTAPI_VALIDATION:
        if REF_TEMPLATE.format(model=name) not in used:
            schemas.pop(name, None)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve `complete(...)` of FastAPI's document at /openapi.json (rebuilt when routes are added)."""
    cache: dict[str, Any] = {}
    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        key = tuple(map(id, app.routes))
        if cache.get("key") != key:
            app.openapi_schema = None
            cache["key"], cache["schema"] = key, complete(copy.deepcopy(fastapi_openapi()), app.routes)
        app.openapi_schema = cache["schema"]
        return cache["schema"]

    app.openapi = openapi
