"""What every route of the server reads: the engine, the serving context (model name, tokenizer, chat template), the
metrics and the readiness flags, one object per app (`serving.app.create_app` makes it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.serving.context import ServingContext
from netra_jax.serving.metrics import ServerMetrics

__all__ = ["ServerState"]


@dataclass
class ServerState:
    engine: AsyncEngine
    ctx: ServingContext
    metrics: ServerMetrics
    ready: Callable[[], bool]
    retry_after: int = 1
    draining: bool = False
    created: int = 0

    @property
    def llm(self):
        return self.engine.engine

    @property
    def model_name(self) -> str:
        return self.ctx.model_name

    @property
    def tokens(self):
        return self.ctx.tokens

    @property
    def chat_template(self) -> str | None:
        return self.ctx.chat_template
