"""Ray Serve recipe: N replicas of the OpenAI-compatible server (one engine each, one GPU each on GPU clusters)
behind one HTTP route: `serve run netra_jax.serving.ray_serve:build_app model=PATH replicas=N`. Needs netra-jax[ray]."""

from __future__ import annotations

import shlex
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from netra_jax.engine_args import EngineArgs
from netra_jax.engine_config import EngineConfig
from netra_jax.serving.chat_output import ChatOutputConfig
from netra_jax.serving.lora_modules import parse_lora_modules

REPLICA_HEADER = "x-netra-replica"  # on every response: the id of the replica that answered


class ReplicaHeader:
    """Plain ASGI middleware naming the replica in each response's headers (streams untouched)."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.deployment(max_ongoing_requests=256)
@serve.ingress()
class NetraServer:
    """One replica: builds (and by default warms up) its engine, then serves the app of netra_jax.serving.app."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        api_key: str | None = None,
        chat_template: str | None = None,
        chat_output: ChatOutputConfig | None = None,
        lora_modules: list | None = None,
    ):
        from netra_jax.engine.async_engine import AsyncEngine
        from netra_jax.engine.factory import build_engine
        from netra_jax.serving.lora_modules import ServedAdapters

        engine = build_engine(config)
        self.adapters = ServedAdapters.loaded(engine, lora_modules)  # a bad adapter fails the replica's start
        self.engine = AsyncEngine(engine)  # the replica reports healthy once this returns
        self.model_name, self.api_key = model_name, api_key
        self.chat_template, self.chat_output = chat_template, chat_output

    def __serve_build_asgi_app__(self):
        from netra_jax.serving.app import create_app

        app = create_app(
            self.engine,
            self.model_name,
            self.api_key,
            ready=lambda: True,
            chat_template=self.chat_template,
            chat_output=self.chat_output,
            adapters=self.adapters,
        )
        app.add_middleware(ReplicaHeader, replica_id=serve.get_replica_context().replica_id.unique_id)
        return app

    def __del__(self):
        self.engine.shutdown()


# build_app's keys that configure the deployment and the HTTP server rather than the engine
_SERVER_KEYS = frozenset(
    (
        "api_key",
        "replicas",
        "num_gpus",
        "num_cpus",
        "chat_template",
        "enable_auto_tool_choice",
        "tool_call_parser",
        "reasoning_parser",
        "lora_modules",
    )
)


def build_app(args: dict[str, Any]) -> Any:
    """Application builder for `serve run` / `serve.run`. Keys (strings on the command line): every engine option
    of `EngineArgs` under its name (model, dtype, kv_cache_dtype, max_num_seqs, kv_cache_memory in bytes, ...; the
    command line's defaults, warmup on), and the deployment's own: api_key, replicas (default 1), num_gpus per
    replica (default 1 when the cluster has GPUs, else 0), num_cpus per replica (default 1), and the server's chat
    flags: chat_template (a file or the Jinja source), enable_auto_tool_choice, tool_call_parser, reasoning_parser,
    and lora_modules (with enable_lora: serve's --lora-modules entries, a list or one string of them separated by
    spaces; every replica loads them; the runtime load and unload routes stay off, since a request reaches one
    replica). An unknown key is a ValueError naming it."""
    import ray

    from netra_jax.serving.batch import served_model_name
    from netra_jax.serving.cli import load_chat_template

    def opt(key: str, kind, default=None):
        return kind(args[key]) if args.get(key) not in (None, "") else default

    def flag(key: str, default: bool) -> bool:
        return str(args.get(key, default)).lower() not in ("0", "false", "no")

    chat_output = ChatOutputConfig(  # ValueError for a combination the server refuses too
        enable_auto_tool_choice=flag("enable_auto_tool_choice", False),
        tool_call_parser=opt("tool_call_parser", str),
        reasoning_parser=opt("reasoning_parser", str),
    )

    engine_options = {k: v for k, v in args.items() if k not in _SERVER_KEYS}
    config = EngineArgs.from_strings(engine_options).create_engine_config()
    modules = args.get("lora_modules") or []
    lora_modules = parse_lora_modules(shlex.split(modules) if isinstance(modules, str) else list(modules))
    if lora_modules and config.lora is None:
        raise ValueError("lora_modules needs enable_lora")
    if not ray.is_initialized():
        ray.init()
    gpus = opt("num_gpus", float, 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0)
    resources = {"num_gpus": gpus, "num_cpus": opt("num_cpus", float, 1.0)}
    return NetraServer.options(num_replicas=opt("replicas", int, 1), ray_actor_options=resources).bind(
        config,
        served_model_name(config),
        opt("api_key", str),
        load_chat_template(opt("chat_template", str)),
        chat_output,
        lora_modules,
    )
