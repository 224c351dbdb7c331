"""Ray Serve recipe: N replicas of the OpenAI-compatible server (one engine each, one GPU each on GPU clusters)
behind one HTTP route: `serve run netra_jax.serving.ray_serve:build_app model=PATH replicas=N`. Needs netra-jax[ray]."""

from __future__ import annotations

from typing import Any

from ray import serve

from netra_jax.config import CacheConfig, EngineConfig, SchedulerConfig


@serve.deployment(max_ongoing_requests=256)
@serve.ingress()
class NetraServer:
    """One replica: builds (and by default warms up) its engine, then serves the app of netra_jax.serving.app."""

    def __init__(self, config: EngineConfig, model_name: str, api_key: str | None = None):
        from netra_jax.api import build_engine
        from netra_jax.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(build_engine(config))  # the replica reports healthy once this returns
        self.model_name, self.api_key = model_name, api_key

    def __serve_build_asgi_app__(self):
        from netra_jax.serving.app import create_app

        return create_app(self.engine, self.model_name, self.api_key, ready=lambda: True)

    def __del__(self):
        self.engine.shutdown()


def build_app(args: dict[str, Any]) -> Any:
    """Application builder for `serve run` / `serve.run`. Keys (strings on the command line): model, dtype,
    served_model_name, max_model_len, max_num_seqs, max_num_batched_tokens, warmup (default true), api_key,
    replicas (default 1), num_gpus per replica (default 1 when the cluster has GPUs, else 0)."""
    import ray

    from netra_jax.serving.batch import served_model_name

    def opt(key: str, kind, default=None):
        return kind(args[key]) if args.get(key) not in (None, "") else default

    config = EngineConfig(
        model=opt("model", str, ""),
        dtype=opt("dtype", str, "auto"),
        max_model_len=opt("max_model_len", int),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(
            max_num_seqs=opt("max_num_seqs", int, 64), max_num_batched_tokens=opt("max_num_batched_tokens", int, 2048)
        ),
        served_model_name=opt("served_model_name", str),
        warmup=str(args.get("warmup", "true")).lower() not in ("0", "false", "no"),
    )
    if not ray.is_initialized():
        ray.init()
    gpus = opt("num_gpus", float, 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0)
    return NetraServer.options(num_replicas=opt("replicas", int, 1), ray_actor_options={"num_gpus": gpus}).bind(
        config, served_model_name(config), opt("api_key", str)
    )
