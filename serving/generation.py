"""Running one API request on the AsyncEngine: one engine request per prompt merged into one event stream, aborted
(KV blocks freed) when closed early, and a race against the client's disconnect while the server waits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request

from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.engine.engine import PromptType
from netra_jax.engine.outputs import RequestOutput
from netra_jax.lora_request import LoRARequest
from netra_jax.sampling_params import SamplingParams
from netra_jax.serving.metrics import ServerMetrics


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class Generation:
    """Engine requests for `prompts` (ids `<request_id>-<i>`), started at once. `events()` yields (prompt index,
    RequestOutput) as they arrive and raises the first engine error. `close()` is synchronous, so it also works from
    a cancelled task: it aborts every unfinished engine request, which frees its KV blocks within a step.
    The engine puts each output straight into the one queue `events()` reads (no task per prompt in between)."""

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: list[PromptType],
        params: SamplingParams,
        request_id: str,
        metrics: ServerMetrics | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.engine = engine
        self.params = params
        self.priority = priority
        self.lora_request = lora_request
        self.metrics = metrics
        self.rids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.last: list[RequestOutput | None] = [None] * len(prompts)
        self.done = [False] * len(prompts)  # finished, or failed before it was added
        self._q: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._tasks = [asyncio.create_task(self._admit(i, p)) for i, p in enumerate(prompts)]

    async def _admit(self, i: int, prompt: PromptType) -> None:
        put = self._q.put_nowait

        def sink(item: RequestOutput | BaseException) -> None:
            put((i, item))

        try:
            await self.engine.submit(prompt, self.params, self.rids[i], sink, self.priority, self.lora_request)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((i, e))

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        pending = len(self.rids)
        while pending:
            i, item = await self._q.get()
            if isinstance(item, BaseException):
                if self.last[i] is None:
                    self.done[i] = True  # never produced anything: refused at admission, nothing to abort
                raise item
            self.last[i] = item
            if item.finished:
                self.done[i] = True
                pending -= 1
                if self.metrics is not None:
                    self.metrics.record(item)
            yield i, item

    async def collect(self) -> list[RequestOutput]:
        async for _ in self.events():
            pass
        return [o for o in self.last if o is not None]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i, task in enumerate(self._tasks):
            task.cancel()
            if not self.done[i]:
                self.engine.abort(self.rids[i])
                if self.metrics is not None:
                    last = self.last[i]
                    if last is not None:
                        self.metrics.record(last, aborted=True)
                    else:
                        self.metrics.aborted.inc()


async def wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read, so the next message is the
    disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def race_disconnect[T](request: Request, aw: Awaitable[T]) -> T:
    """Await `aw` unless the client disconnects first: then cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()
